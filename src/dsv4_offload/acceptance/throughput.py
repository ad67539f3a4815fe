"""Decode throughput, the delivery's way (decode_throughput_test.sh): natural prompts of our
own at the guide's token counts, calibrated in the server's tokens, a warm-up per bucket,
streamed repeats, and the verdict against the delivery's own table with its tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.acceptance.probes import Reply, ServerClient, ServerUnreachable
from dsv4_offload.core.results import Check

if TYPE_CHECKING:
    from dsv4_offload.recipe import Throughput

# Natural prose of our own (the delivery's script sends natural text for its short buckets and
# synthetic text for the long ones; we send prose for all of them). Sentence i is chosen from
# these parts by a fixed linear congruential sequence: deterministic across runs and hosts,
# varied enough that no short cycle repeats (a repeated block would let a prefix cache or a
# repetition-prone model behave unlike real traffic).
_WHO = ("The survey team", "A farmer from the upper valley", "The county engineer",
        "Our guide", "The youngest of the students", "An old ferryman", "The parish council",
        "A visiting botanist", "The schoolteacher", "Two volunteers from the museum",
        "The miller's daughter", "A retired surveyor")
_DID = ("walked along", "measured", "photographed", "described", "mapped", "cleaned",
        "inspected", "wrote a short account of", "sketched", "repaired part of",
        "asked about the history of", "counted the visitors at")
_WHAT = ("the stone bridge", "the flooded meadow below the mill", "the old canal locks",
         "the chapel roof", "the towpath near the harbour", "the orchard wall",
         "the weir above the village", "the narrow lane to the quarry", "the ruined granary",
         "the footbridge by the school", "the drainage ditches", "the lighthouse steps")
_WHEN = ("at dawn", "after the spring rain", "during the long dry summer",
         "on a cold morning in March", "late in the afternoon", "before the autumn fair",
         "in the first week of June", "while the tide was low", "on the day of the election",
         "just after the harvest")
_WHY = ("and noted that the water had risen since the last visit.",
        "because the path had become unsafe for walkers.",
        "while the children counted the birds on the far bank.",
        "so that the council could decide what to repair first.",
        "and found that two of the gates no longer closed properly.",
        "although most of the work had been done by hand a century earlier.",
        "and compared the result with the drawings kept in the library.",
        "before the heavy lorries were allowed to cross again.",
        "and wrote down the names carved into the older stones.",
        "since nobody had recorded its condition for many years.")
_QUESTION = ("\n\nQuestion: summarise the passage above in several detailed paragraphs, then "
             "list the repairs in the order the people in it proposed.\nAnswer:")
# sentences per calibration unit: the unit the server's token counts are taken over
CYCLE = 5


def sentence(i: int) -> str:
    """The ``i``-th sentence of the passage: the same text for the same ``i``, always."""
    x = (1103515245 * (i + 12345) + 12345) % 2**31  # one LCG step from i: no shared state
    parts = (_WHO, _DID, _WHAT, _WHEN, _WHY)
    picks = []
    for options in parts:
        picks.append(options[x % len(options)])
        x //= len(options)
    who, did, what, when, why = picks
    return f"{who} {did} {what} {when}, {why}"


def natural_prompt(sentences: int) -> str:
    """A passage of ``sentences`` sentences in paragraphs of six, and a closing question."""
    n = max(1, sentences)
    paragraphs = [" ".join(sentence(i) for i in range(start, min(start + 6, n)))
                  for start in range(0, n, 6)]
    return "\n\n".join(paragraphs) + _QUESTION


# --- throughput --------------------------------------------------------------------------------


class BucketFailed(Exception):
    """A throughput request failed: the bucket, what happened, what the server said."""

    def __init__(self, target: int, what: str) -> None:
        super().__init__(f"bucket {target} tokens: {what}" if target else what)
        self.target = target


@dataclass
class Calibration:
    """Prompt tokens = base + per_char * characters of the prompt, measured on the server.

    The passage's vocabulary is fixed, so its tokens per character hardly vary along it: the
    ratio over two lengths predicts a long prompt's count closer than a per-sentence average.
    """

    base: float
    per_char: float
    measured: bool  # False: the server gave no token counts; sizes are a guess

    def tokens(self, sentences: int) -> float:
        return self.base + self.per_char * len(natural_prompt(sentences))

    def sentences_for(self, target: int) -> int:
        """The most sentences whose prompt stays at or below ``target`` server tokens."""
        room = target - 8 - 0.005 * target  # slack for the ratio's own error
        low, high = 1, 2
        while self.tokens(high) <= room:
            low, high = high, high * 2
        while high - low > 1:  # tokens(low) <= room < tokens(high), or low == 1
            mid = (low + high) // 2
            low, high = (mid, high) if self.tokens(mid) <= room else (low, mid)
        return low


def calibrate(client: ServerClient, chunk: int, chat: bool = False) -> Calibration:
    """Count one and two cycles of the passage in the server's own tokens (1 new token each),
    never sending more than ``chunk`` tokens. Both stay short of the streaming-prefill
    threshold (512 tokens, launcher L98), so calibrating costs no streamed prefill; the
    ratio errs short (about 3 % under a long bucket), never over it."""
    counts: list[int | None] = []
    sizes: list[int] = []
    for cycles in (1, 2):
        if cycles == 2 and (counts[0] is None or 2 * counts[0] > chunk):
            break
        prompt = natural_prompt(cycles * CYCLE)
        reply = client.generate(prompt, 1, chat)
        if not reply.ok:
            raise BucketFailed(0, f"calibrating the prompt size: HTTP {reply.status} "
                               f"{reply.error}".rstrip())
        counts.append(reply.prompt_tokens)
        sizes.append(len(prompt))
    if counts[0] is None:
        # ~1.35 tokens per English word for BPE vocabularies: used only when the server
        # does not report token counts
        words = len(natural_prompt(CYCLE).split())
        return Calibration(base=0.0, per_char=1.35 * words / sizes[0], measured=False)
    if len(counts) == 1 or counts[1] is None:
        return Calibration(base=0.0, per_char=counts[0] / sizes[0], measured=True)
    per_char = (counts[1] - counts[0]) / (sizes[1] - sizes[0])
    return Calibration(base=counts[0] - per_char * sizes[0], per_char=per_char, measured=True)


@dataclass
class Bucket:
    target: int  # the delivery's bucket (TARGET_TOKENS_LIST)
    prompt_tokens: int | None  # what the server counted for our prompt
    runs: list[dict[str, Any]]
    skipped: str = ""  # why the bucket was not measured

    @property
    def rates(self) -> list[float]:
        return [r["tok_s"] for r in self.runs if r.get("tok_s")]

    def stats(self) -> dict[str, float | None]:
        """mean / median / min / max decode tok/s and mean prefill seconds, the delivery's
        way (decode_throughput_test.sh L245-246: median = sorted[n // 2])."""
        xs = sorted(self.rates)
        pf = [r["ttft_s"] for r in self.runs if r.get("ttft_s") is not None]
        if not xs:
            return {"mean": None, "median": None, "min": None, "max": None,
                    "prefill_s": _round(sum(pf) / len(pf)) if pf else None}
        return {"mean": _round(sum(xs) / len(xs)), "median": _round(xs[len(xs) // 2]),
                "min": _round(xs[0]), "max": _round(xs[-1]),
                "prefill_s": _round(sum(pf) / len(pf)) if pf else None}

    @property
    def tok_s(self) -> float | None:
        return self.stats()["median"]

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "prompt_tokens": self.prompt_tokens,
                **({"skipped": self.skipped} if self.skipped else {}),
                **self.stats(), "tok_s": self.tok_s, "runs": self.runs}


@dataclass
class Plan:
    """What the throughput phase will send: its sizes and the limits they respect."""

    new_tokens: int
    repeats: int
    warmup: int
    chunk: int
    chunk_source: str
    context_length: int

    def skip_reason(self, target: int) -> str:
        if target > self.chunk:
            return (f"longer than the server's chunked prefill {self.chunk} ({self.chunk_source})"
                    f"; a longer prompt fails (guide G306-310). To measure it, restart the "
                    f"server with CHUNKED_PREFILL_SIZE=32768 (`dsv4-offload serve "
                    f"--longest-prompt {target}`), as the delivery's throughput script requires")
        if target + self.new_tokens > self.context_length:
            return (f"prompt + {self.new_tokens} new tokens exceed the context length "
                    f"{self.context_length}")
        return ""


def measure_throughput(client: ServerClient, plan: Plan, targets: Sequence[int],
                       calibration: Calibration, chat: bool = False,
                       on_step: Callable[[str], None] | None = None) -> list[Bucket]:
    """Per bucket, as decode_throughput_test.sh does: ``warmup`` full generations discarded
    (L176-181), then ``repeats`` streamed ones timed token by token (L183-237)."""
    step = on_step or (lambda _msg: None)
    # sglang honours ignore_eos, so fewer tokens means the request broke off; OpenAI
    # servers may ignore the field and stop at EOS
    exact = client.api == "native"
    buckets = []
    for target in targets:
        why = plan.skip_reason(target)
        if why:
            buckets.append(Bucket(target, None, [], skipped=why))
            continue
        prompt = natural_prompt(calibration.sentences_for(min(target, plan.chunk)))
        prompt_tokens: int | None = None
        runs = []
        which = ""
        try:
            for i in range(plan.warmup):
                which = f"warm-up {i + 1}"
                step(f"bucket {target}: {which}/{plan.warmup}")
                # streamed, unlike the script's curl (L179): the same load on the server,
                # and a hung server is caught by the per-read timeout, not after an hour
                warm = client.stream(prompt, plan.new_tokens, chat, ignore_eos=True)
                _require(warm, target, plan, which, exact)
                prompt_tokens = warm.prompt_tokens or prompt_tokens
            if prompt_tokens is None:
                # a server that does not count tokens in its streams (an OpenAI server
                # without stream usage): ask once, with one new token
                which = "counting the prompt"
                counted = client.generate(prompt, 1, chat)
                _require(counted, target, plan, which, exact=False)
                prompt_tokens = counted.prompt_tokens
            for i in range(plan.repeats):
                which = f"run {i + 1}"
                step(f"bucket {target}: {which}/{plan.repeats}")
                reply = client.stream(prompt, plan.new_tokens, chat, ignore_eos=True)
                _require(reply, target, plan, which, exact)
                prompt_tokens = reply.prompt_tokens or prompt_tokens
                runs.append({"tokens": reply.tokens, "tok_s": _round(reply.decode_tok_s),
                             "ttft_s": _round(reply.ttft), "seconds": _round(reply.seconds)})
        except ServerUnreachable as exc:
            raise BucketFailed(target, f"{which}: {exc}") from None
        buckets.append(Bucket(target, prompt_tokens, runs))
    return buckets


def _require(reply: Reply, target: int, plan: Plan, which: str, exact: bool) -> None:
    if not reply.ok:
        raise BucketFailed(target, f"{which} failed: HTTP {reply.status}"
                           + (f": {reply.error}" if reply.error else ""))
    if reply.prompt_tokens and reply.prompt_tokens > plan.chunk:
        # calibration keeps prompts under the chunk; a server that counts otherwise is a bug
        raise BucketFailed(target, f"{which}: the server counted {reply.prompt_tokens} prompt "
                           f"tokens, above its chunk {plan.chunk}")
    if exact and reply.tokens < plan.new_tokens:
        raise BucketFailed(target, f"{which}: {reply.tokens} of {plan.new_tokens} tokens with "
                           "ignore_eos (the generation stopped early)")


def reference_for(cfg: Throughput, target: int) -> float:
    """The delivery's median for this bucket (its table), else the recipe's headline."""
    return cfg.reference_by_bucket.get(target, cfg.reference_tok_s)


def check_throughput(buckets: Sequence[Bucket], cfg: Throughput, gate: bool = True) -> Check:
    """Each bucket's median against its reference: below ``pass_ratio`` x fails, below
    ``warn_ratio`` x warns (the spread of the delivery's own table, recipe); a report-only
    reference never fails."""
    measured = [b for b in buckets if b.tok_s]
    skipped = [b for b in buckets if b.skipped]
    low, high = cfg.reference_range
    gate = gate and not cfg.report_only
    source = f" ({cfg.reference_source})" if cfg.reference_source else ""
    required = (f"median >= {cfg.pass_ratio:g} x the reference in every bucket "
                f"(warn below {cfg.warn_ratio:g} x; reference {cfg.reference_tok_s:g}, "
                f"{low:g}-{high:g} tok/s{source})"
                + ("; report only" if cfg.report_only else ""))
    if not measured:
        why = skipped[0].skipped if skipped else "no bucket produced two streamed tokens"
        return Check.verdict("decode throughput", False, f"nothing measured: {why}",
                             "read the server log", required=required, gate=gate)
    shown = "; ".join(f"{b.target} ({b.prompt_tokens or '?'} tok): median {b.tok_s} "
                      f"[{b.stats()['min']}-{b.stats()['max']}] tok/s" for b in measured)
    if skipped:
        shown += "; skipped: " + ", ".join(f"{b.target} ({b.skipped.split(';')[0]})"
                                            for b in skipped)
    refs = {b.target: reference_for(cfg, b.target) for b in buckets}
    data = {"reference": cfg.reference_tok_s, "reference_by_bucket": refs,
            "pass_ratio": cfg.pass_ratio, "warn_ratio": cfg.warn_ratio,
            "reference_source": cfg.reference_source, "report_only": cfg.report_only,
            "skipped": {b.target: b.skipped for b in skipped}}
    slow = [b for b in measured if (b.tok_s or 0) < cfg.pass_ratio * refs[b.target]]
    if slow:
        worst = min(slow, key=lambda b: (b.tok_s or 0) / refs[b.target])
        ref = refs[worst.target]
        return Check.verdict("decode throughput", False,
                             f"bucket {worst.target}: median {worst.tok_s} tok/s, below the "
                             f"reference {ref:g} x {cfg.pass_ratio:g} = "
                             f"{cfg.pass_ratio * ref:.3g} ({low:g}-{high:g}{source}); {shown}",
                             "check the NPU graph capture in the log, KT_CPUINFER/threadpool "
                             "against the NUMA layout, that nothing else uses the card, that the "
                             "GGUF sits in the page cache, and that no other heavy process "
                             "shares the NUMA nodes' memory bandwidth (the CPU MoE is bound by "
                             "it: `numastat -p`, `top`)", data, required=required, gate=gate)
    under = [b for b in measured if (b.tok_s or 0) < cfg.warn_ratio * refs[b.target]]
    notes = [f"bucket {b.target}: median {b.tok_s} tok/s is within the tolerance but below "
             f"the reference {refs[b.target]:g}" for b in under]
    notes += [f"bucket {b.target} skipped: {b.skipped}" for b in skipped]
    data["below_reference"] = [b.target for b in under]
    return Check.verdict("decode throughput", True, shown, "; ".join(notes), data=data,
                         required=required, gate=gate, warning=bool(skipped or under))


def write_chart(buckets: Sequence[Bucket], path: Path, reference: float, title: str) -> Path:
    """A PNG of decode tok/s (and TTFT) against prompt length, with the reference line."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    points = [b for b in buckets if b.tok_s is not None]
    xs = [b.prompt_tokens or b.target for b in points]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(xs, [b.tok_s or 0.0 for b in points], marker="o",
            label="decode tok/s (median)")
    ax.axhline(reference, color="grey", linestyle="--", label=f"reference {reference:g} tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    prefill = [(x, b.stats()["prefill_s"]) for x, b in zip(xs, points, strict=True)
               if b.stats()["prefill_s"] is not None]
    if prefill:
        ax2 = ax.twinx()
        ax2.plot([x for x, _ in prefill], [p or 0.0 for _, p in prefill], marker="s",
                 color="tab:orange", label="TTFT (s)")
        ax2.set_ylabel("time to first token (s)")
        ax2.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend(loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    try:
        fig.savefig(tmp, dpi=100)
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)  # only there when saving failed
    return path


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
