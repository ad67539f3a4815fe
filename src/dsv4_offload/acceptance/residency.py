"""Do the answers survive dynamic residency? Greedy probes before and after a prompt that
streams, compared; the switches the server ran with, read from its own environment.

With streaming prefill, depool and dynamic residency on (the launcher's defaults), a prompt of
``KT_PREFILL_STREAM_THRESHOLD`` tokens or more streams its prefill, and sglang/0003 then moves
the decode hot-expert slots to the experts that prompt used most. Where that write leaves the
slots' weights as they were (torch_npu's ``index_select(out=)`` into FRACTAL_NZ) while their
scales and masks move, every later answer is computed with the wrong weights until restart.
Greedy decoding (temperature 0) of an unchanged model gives the same text for the same prompt,
so the same probes sent before and after such a prompt must agree.

The measure: difflib's ``SequenceMatcher.ratio`` over the characters of the two answers
(2·M/T, M matched characters, T both lengths; 1.0 for identical text), averaged over the
probes. A late divergence (one NPU reduction order against another flips a late token) keeps
most of the text and scores high; wrong weights change the hidden states from the first
decoded token and the answers part early. The gate, ``acceptance.residency.min_similarity``
(0.75 by default), lies between the two cases a second team measured on an A3 with their own
similarity score: 0.36 with the broken write, 0.91 with it fixed (published write-up, Aug
2026). The same team saw ``</think>`` leak into 60 % of non-thinking answers after the
write; a leak that starts after the streamed prompt is counted as drift too.
"""

from __future__ import annotations

import difflib
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_offload.acceptance import throughput as tp
from dsv4_offload.acceptance.probes import ServerClient
from dsv4_offload.core.results import Check

# the knobs that decide whether a prompt streams and residency moves (launch_ds4flash_npu.sh
# L86-98): what the report states, since accuracy and speed figures depend on them
SWITCHES = ("KT_PREFILL_STREAM", "KT_PREFILL_STREAM_THRESHOLD", "KT_DYNAMIC_RESIDENT",
            "KT_MXFP4_DEPOOL", "KT_MXFP4_GGUF_DEDUP", "KT_SIDE_STREAM")
# the three switches under which sglang/0003 folds residency into a streamed prefill
RESIDENCY_ON = {"KT_PREFILL_STREAM": "1", "KT_DYNAMIC_RESIDENT": "1", "KT_MXFP4_DEPOOL": "1"}
DEFAULT_THRESHOLD = 512  # KT_PREFILL_STREAM_THRESHOLD, launch_ds4flash_npu.sh L98
THINK_CLOSE = "</think>"
FIX_PATCH = "sglang-resident-write-through"  # the series patch of ours that fixes the write


def similarity(a: str, b: str) -> float:
    """difflib's ratio of two answers: 1.0 identical, 0.0 nothing in common."""
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


@dataclass
class Switches:
    """The residency switches the server ran with, and where they were read."""

    values: dict[str, str]
    source: str

    @property
    def residency_on(self) -> bool | None:
        """Whether a streamed prompt moves the resident experts (None: not known)."""
        if not self.values:
            return None
        return all(self.values.get(k) == v for k, v in RESIDENCY_ON.items())

    @property
    def threshold(self) -> int:
        raw = self.values.get("KT_PREFILL_STREAM_THRESHOLD", "")
        return int(raw) if raw.isdigit() and int(raw) > 0 else DEFAULT_THRESHOLD

    def shown(self) -> str:
        if not self.values:
            return f"not known ({self.source})"
        return ", ".join(f"{k}={self.values[k]}" for k in SWITCHES if k in self.values) + \
            f" (from {self.source})"


def parse_environ(raw: bytes) -> dict[str, str]:
    """A /proc/<pid>/environ blob (NUL-separated KEY=VALUE) as a mapping."""
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def server_switches(pid: int | None, recorded: Mapping[str, str] | None,
                    proc: Path = Path("/proc")) -> Switches:
    """The switches from the running server's own environment where this process can read
    it, else from the environment this workspace launched it with, else not known."""
    if pid:
        try:
            env = parse_environ((proc / str(pid) / "environ").read_bytes())
        except OSError:
            env = None
        if env is not None:
            return Switches({k: env[k] for k in SWITCHES if k in env},
                            f"the server's environment, /proc/{pid}/environ")
    if recorded:
        return Switches({k: str(recorded[k]) for k in SWITCHES if k in recorded},
                        "the environment this workspace launches it with (serve.env, an "
                        "exported knob winning)")
    return Switches({}, "a server not started by this workspace: its environment is not "
                    "readable here")


@dataclass
class Drift:
    """The same greedy probes answered before and after a streamed prompt."""

    before: dict[str, str]
    after: dict[str, str]
    streamed_tokens: int | None  # the long prompt's size as the server counted it
    ratios: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ratios = {name: round(similarity(self.before[name], self.after[name]), 3)
                       for name in self.before if name in self.after}

    @property
    def mean(self) -> float:
        return round(statistics.fmean(self.ratios.values()), 3) if self.ratios else 1.0

    @property
    def lowest(self) -> tuple[str, float]:
        name = min(self.ratios, key=lambda n: self.ratios[n])
        return name, self.ratios[name]

    def think_leaks(self, which: Mapping[str, str]) -> int:
        """Answers of non-thinking probes that carry a ``</think>``."""
        return sum(1 for text in which.values() if THINK_CLOSE in text)

    def as_dict(self) -> dict[str, Any]:
        return {"streamed_prompt_tokens": self.streamed_tokens, "ratios": self.ratios,
                "mean": self.mean, "think_before": self.think_leaks(self.before),
                "think_after": self.think_leaks(self.after), "before": self.before,
                "after": self.after}


class StreamFailed(Exception):
    """The long prompt got no answer: the server failed under it."""


def stream_once(client: ServerClient, threshold: int, chunk: int, chat: bool) -> int | None:
    """Send one prompt a little over the streaming threshold, sized in the server's own
    tokens and within its chunked prefill (a longer prompt fails there, guide G306-310);
    its size as the server counted it (estimated where it does not say), or None where the
    chunk cannot take such a prompt."""
    target = threshold + max(64, threshold // 4)
    if target > chunk:
        return None
    calibration = tp.calibrate(client, chunk, chat)
    sentences = calibration.sentences_for(target)
    reply = client.generate(tp.natural_prompt(sentences), 8, chat)
    if not reply.ok:
        raise StreamFailed(f"a prompt of ~{target} tokens: HTTP {reply.status} "
                           f"{reply.error}".rstrip())
    return reply.prompt_tokens or round(calibration.tokens(sentences))


def cause(switches: Switches, fix_applied: bool) -> str:
    """What most likely changed the answers, and what to do, from what the server ran with."""
    if switches.residency_on is False:
        return ("dynamic residency is off on this server (" + switches.shown() + "), so the "
                "resident-expert write is not the cause: read the log for errors after the "
                "long prompt (KV cache, streaming fallback) and report it")
    where = ("the dynamic-residency write (sglang/0003 _apply_resident_layer_depool, "
             "kt_stream_prefill.py:979-982) most likely left the hot-expert slots with their "
             "old weights while their scales and masks moved (torch_npu's index_select(out=) "
             "into a FRACTAL_NZ parameter writes nothing)")
    if fix_applied:
        return (where + "; the series carries the fix (" + FIX_PATCH + "), so the server "
                "runs a build without it: `dsv4-offload patch status`, then `build sglang` and "
                "restart; meanwhile serve with KT_DYNAMIC_RESIDENT=0")
    return (where + "; serve with the series' fix " + FIX_PATCH + " (drop it from the "
            "recipe's series_skip, `patch apply`, `build sglang`), or with "
            "KT_DYNAMIC_RESIDENT=0")


def check_drift(drift: Drift, min_similarity: float, threshold: int, switches: Switches,
                fix_applied: bool) -> list[Check]:
    """Two verdicts: do the answers agree across the streamed prompt, and does ``</think>``
    start leaking into non-thinking answers after it."""
    data = {**drift.as_dict(), "min_similarity": min_similarity, "threshold": threshold,
            "switches": switches.values, "switches_source": switches.source}
    if drift.streamed_tokens is not None and drift.streamed_tokens < threshold:
        return [Check.verdict(
            "answers survive a streamed prompt", None,
            f"skipped: the long prompt counted {drift.streamed_tokens} tokens, under the "
            f"streaming threshold {threshold}", data=data)]
    if not drift.ratios:
        return [Check.verdict("answers survive a streamed prompt", None,
                              "skipped: no probe answered both times", data=data)]
    name, low = drift.lowest
    sent = (f"{drift.streamed_tokens}-token" if drift.streamed_tokens is not None
            else "long")
    ok = drift.mean >= min_similarity
    observed = (f"similarity before/after a {sent} streamed prompt: mean {drift.mean:.2f} "
                f"over {len(drift.ratios)} greedy probes (lowest {low:.2f}, '{name}')")
    checks = [Check.verdict("answers survive a streamed prompt", ok, observed,
                            "" if ok else "answers changed after a streamed prefill: "
                            + cause(switches, fix_applied), data,
                            required=f"mean >= {min_similarity:g} (difflib ratio)")]
    before, after = drift.think_leaks(drift.before), drift.think_leaks(drift.after)
    leaked = after > before
    checks.append(Check.verdict(
        "no </think> leak after a streamed prompt", not leaked,
        f"{after} of {len(drift.after)} non-thinking answers carry </think> after it, "
        f"{before} of {len(drift.before)} before",
        "" if not leaked else "non-thinking answers started closing a think block after the "
        "streamed prefill: " + cause(switches, fix_applied),
        required="no more answers with </think> after than before"))
    return checks
