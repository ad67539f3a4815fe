"""Acceptance probes: an HTTP client for sglang's native API and OpenAI-compatible servers,
the degeneration detector, determinism, log markers and decode throughput with a chart.

The checks are pure functions over texts and timings; only ``ServerClient`` talks HTTP.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import requests

    from dsv4_offload.recipe import Degeneration, Probe, Throughput

# one token per CJK character, word or punctuation mark: good enough to spot repetition
_TOKEN = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]|\w+|[^\w\s]")
_NAN = re.compile(r"(?<![\w])nan(?![\w])", re.I)
REPLACEMENT_CHAR = "\ufffd"
# common words: a filler prompt of N of them is close to N tokens for any BPE vocabulary
_FILLER = (
    "the", "report", "shows", "that", "each", "team", "in", "the", "city", "made", "a", "plan",
    "for", "the", "new", "year", "and", "wrote", "down", "what", "they", "would", "change", "in",
    "the", "way", "they", "work", "with", "one", "another",
)


def api_key_headers(api_key_file: str | Path | None) -> dict[str, str]:
    """The Authorization header for a server started with ``serve --api-key-file FILE``.

    sglang checks ``Authorization: Bearer <key>``; the key is read from the file on each call
    and lives only in the returned dict (never in reports, records or logs).
    """
    if not api_key_file:
        return {}
    from dsv4_offload.serveplan import read_api_key

    return {"Authorization": f"Bearer {read_api_key(Path(api_key_file))}"}


class ServerUnreachable(Exception):
    """The server did not answer (refused, reset, timed out); later requests are pointless."""


@dataclass
class Reply:
    text: str
    status: int
    seconds: float
    ttft: float | None = None  # seconds to the first streamed token
    tokens: int = 0
    decode_seconds: float | None = None  # first to last streamed token

    @property
    def decode_tok_s(self) -> float | None:
        if self.tokens < 2 or not self.decode_seconds:
            return None
        return (self.tokens - 1) / self.decode_seconds


@dataclass
class Check:
    name: str
    ok: bool | None  # None: skipped
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    required: str = ""

    @property
    def status(self) -> str:
        return {True: "pass", False: "fail", None: "skipped"}[self.ok]

    def as_dict(self) -> dict[str, Any]:
        """The row the renderer shows (name, status, observed, required) plus the details."""
        return {"name": self.name, "status": self.status, "ok": self.ok,
                "observed": self.detail, "required": self.required, "detail": self.detail,
                "fix": self.fix, **({"data": self.data} if self.data else {})}


# --- HTTP -------------------------------------------------------------------------------------


class ServerClient:
    """Greedy and streamed generation over sglang's `/generate` or the OpenAI endpoints."""

    def __init__(self, url: str, api: str = "native", model: str | None = None,
                 timeout: float = 300) -> None:
        import requests

        self.url = url.rstrip("/")
        self.api = api
        self.model = model or "default"
        self.timeout = timeout
        self.session = requests.Session()
        self.session.trust_env = False  # proxies never apply to the server under test

    def get(self, path: str) -> tuple[int, float]:
        t0 = time.monotonic()
        resp = self._request("GET", path)
        return resp.status_code, time.monotonic() - t0

    def generate(self, prompt: str, max_tokens: int, chat: bool = False) -> Reply:
        t0 = time.monotonic()
        path, body = self._body(prompt, max_tokens, chat, stream=False)
        resp = self._request("POST", path, body)
        seconds = time.monotonic() - t0
        if resp.status_code != 200:
            return Reply(f"HTTP {resp.status_code}: {resp.text[:200]}", resp.status_code, seconds)
        try:
            doc = resp.json()
            text = self._text(doc, chat)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"{self.url}{path}: unexpected answer ({exc!r}): "
                             f"{resp.text[:200]}") from None
        return Reply(text, 200, seconds)

    def stream(self, prompt: str, max_tokens: int, chat: bool = False,
               ignore_eos: bool = True) -> Reply:
        """Streamed generation, timing the first and the last token."""
        path, body = self._body(prompt, max_tokens, chat, stream=True, ignore_eos=ignore_eos)
        t0 = time.monotonic()
        resp = self._request("POST", path, body, stream=True)
        if resp.status_code != 200:
            return Reply(f"HTTP {resp.status_code}", resp.status_code, time.monotonic() - t0)
        text, tokens = "", 0
        first: float | None = None
        last = 0.0
        counted: int | None = None
        try:
            for event in _sse_events(resp):
                piece, total = self._stream_piece(event, chat, text)
                if total is not None:
                    counted = total
                if not piece:
                    continue
                now = time.monotonic()
                first = first if first is not None else now
                last = now
                tokens += 1
                text += piece
        except _REQUEST_ERRORS() as exc:
            raise ServerUnreachable(f"{self.url}{path}: stream broke ({type(exc).__name__})"
                                    ) from None
        finally:
            resp.close()
        ntok = counted if counted else tokens
        return Reply(text, 200, time.monotonic() - t0, ttft=None if first is None else first - t0,
                     tokens=ntok, decode_seconds=None if first is None else last - first)

    def _body(self, prompt: str, max_tokens: int, chat: bool, stream: bool,
              ignore_eos: bool = False) -> tuple[str, dict[str, Any]]:
        if self.api == "native":
            params: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": 0}
            if ignore_eos:
                params["ignore_eos"] = True  # fixed-length decode for throughput
            return "/generate", {"text": prompt, "sampling_params": params, "stream": stream}
        common = {"model": self.model, "max_tokens": max_tokens, "temperature": 0,
                  "stream": stream}
        if chat:
            return "/v1/chat/completions", {
                "messages": [{"role": "user", "content": prompt}], **common}
        return "/v1/completions", {"prompt": prompt, **common}

    def _text(self, doc: Any, chat: bool) -> str:
        if self.api == "native":
            doc = doc[0] if isinstance(doc, list) else doc
            return str(doc["text"])
        choice = doc["choices"][0]
        return str(choice["message"]["content"] if chat else choice["text"]) or ""

    def _stream_piece(self, event: dict[str, Any], chat: bool, so_far: str
                      ) -> tuple[str, int | None]:
        """The new text of one event and, when the server says, the tokens so far."""
        if self.api == "native":
            text = str(event.get("text", ""))
            meta = event.get("meta_info") or {}
            # sglang streams the whole text so far in each event
            piece = text[len(so_far):] if text.startswith(so_far) else text
            return piece, meta.get("completion_tokens")
        usage = event.get("usage") or {}
        choices = event.get("choices") or [{}]
        choice = choices[0] if choices else {}
        content = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        return str(content or ""), usage.get("completion_tokens")

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 stream: bool = False) -> requests.Response:
        try:
            return self.session.request(method, self.url + path, json=body,
                                        timeout=self.timeout, stream=stream)
        except _REQUEST_ERRORS() as exc:
            import requests

            why = (f"no answer within {self.timeout:.0f}s" if isinstance(exc, requests.Timeout)
                   else f"{type(exc).__name__} (is the server up?)")
            raise ServerUnreachable(f"{method} {self.url}{path}: {why}") from None


def _REQUEST_ERRORS() -> tuple[type[BaseException], ...]:
    import requests

    return (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


def _sse_events(resp: requests.Response) -> Iterator[dict[str, Any]]:
    for raw in resp.iter_lines(decode_unicode=False):
        line = raw.decode("utf-8", errors="replace").strip() if raw else ""
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


# --- checks (pure) ---------------------------------------------------------------------------


def tokens_of(text: str) -> list[str]:
    return _TOKEN.findall(text)


def degeneration(text: str, cfg: Degeneration) -> list[str]:
    """What is wrong with a generated text: empty, NaN, U+FFFD, runs, repeated n-grams."""
    found: list[str] = []
    if not text.strip():
        return ["empty text with HTTP 200 (usually a weight path that resolved to nothing)"]
    if _NAN.search(text):
        found.append("'nan' in the output (NaN logits)")
    if REPLACEMENT_CHAR in text:
        found.append("U+FFFD replacement characters (broken token bytes)")
    run = re.search(rf"(\S)\1{{{cfg.max_char_run},}}", text)
    if run:
        found.append(f"one character repeated: {run.group(0)[:20]!r} "
                     f"(> {cfg.max_char_run} in a row)")
    toks = tokens_of(text)
    longest, current, prev = 1, 1, None
    for tok in toks:
        current = current + 1 if tok == prev else 1
        longest = max(longest, current)
        prev = tok
    if longest > cfg.max_token_run:
        found.append(f"one token repeated {longest} times in a row (> {cfg.max_token_run})")
    grams = Counter(tuple(toks[i:i + cfg.ngram]) for i in range(len(toks) - cfg.ngram + 1))
    if grams:
        gram, count = grams.most_common(1)[0]
        if count > cfg.max_ngram_repeats:
            found.append(f"{cfg.ngram}-gram {' '.join(gram)!r} repeated {count} times "
                         f"(> {cfg.max_ngram_repeats})")
    return found


def check_probe(probe: Probe, reply: Reply, cfg: Degeneration) -> Check:
    name = f"probe {probe.name}"
    shown = _short(reply.text)
    if reply.status != 200:
        return Check(name, False, f"HTTP {reply.status}: {shown}", "read the server log")
    problems = degeneration(reply.text, cfg)
    if problems:
        return Check(name, False, f"{'; '.join(problems)}: {shown}",
                     "incoherent output: check the GGUF (verify-gguf), that the W8A8 is the "
                     "official one, and KT_NSA_COMPRESSOR_MODE for this CANN",
                     {"text": reply.text})
    if not any(e.lower() in reply.text.lower() for e in probe.expect_any):
        return Check(name, False, f"does not mention {' or '.join(probe.expect_any)}: {shown}",
                     "the model answers but wrongly: check the GGUF digests (verify-gguf) and "
                     "that the W8A8 shares the MXFP4 rotation base", {"text": reply.text})
    return Check(name, True, f"{shown} ({reply.seconds:.1f}s)", data={"text": reply.text},
                 required=f"mentions {' or '.join(probe.expect_any)}, not degenerate")


def check_determinism(name: str, first: str, second: str) -> Check:
    if first == second:
        return Check("determinism", True, f"probe {name}: the same text twice",
                     required="same greedy text twice")
    return Check("determinism", False,
                 f"probe {name}: greedy answers differ: {_short(first)} / {_short(second)}",
                 "greedy decoding must be reproducible: look for a race in the CPU MoE "
                 "(KT_SIDE_STREAM) or uninitialised buffers")


def check_log_markers(log_text: str | None, required: Sequence[str], forbidden: Sequence[str],
                      source: str) -> list[Check]:
    if log_text is None:
        return [Check("log markers", None, "no server log (the server was not started by this "
                      "workspace); skipped")]
    checks = []
    for pattern in required:
        hit = re.search(pattern, log_text)
        checks.append(Check(f"log has {pattern!r}", hit is not None,
                            _short(_line_at(log_text, hit.start())) if hit else
                            f"missing from {source}",
                            "" if hit else _MARKER_FIX.get(pattern, "read the server log"),
                            required="present"))
    for pattern in forbidden:
        hit = re.search(pattern, log_text)
        checks.append(Check(f"log without {pattern!r}", hit is None,
                            _short(_line_at(log_text, hit.start())) if hit else "absent",
                            "keep serve.mem_fraction_static 0.81 and the chunked prefill at or "
                            "above the longest prompt" if hit else "", required="absent"))
    return checks


_MARKER_FIX = {
    "Capture .*graph end": "no NPU graph capture: decode is ~5x slower; drop "
                           "--disable-cuda-graph from serve.extra_args",
    "KV Cache is allocated": "the KV pool was not set up: read the log",
}


def _line_at(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start:end if end >= 0 else None]


def _short(text: str, limit: int = 80) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[:limit] + "...")


# --- throughput --------------------------------------------------------------------------------


def filler_prompt(tokens: int) -> str:
    words = [_FILLER[i % len(_FILLER)] for i in range(max(1, tokens - 12))]
    return " ".join(words) + "\n\nWrite a long story about the people in this report."


@dataclass
class Bucket:
    prompt_tokens: int
    tok_s: float | None  # median decode tok/s over the repeats
    ttft_s: float | None  # median time to first token
    runs: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "tok_s": self.tok_s, "ttft_s": self.ttft_s,
                "runs": self.runs}


def measure_throughput(client: ServerClient, cfg: Throughput, chat: bool = False) -> list[Bucket]:
    """Warm up, then per prompt-length bucket the median decode tok/s and TTFT of the repeats."""
    for _ in range(cfg.warmup):
        client.stream(filler_prompt(min(cfg.prompt_buckets)), cfg.new_tokens, chat)
    buckets = []
    for size in cfg.prompt_buckets:
        runs = []
        for _ in range(cfg.repeats):
            reply = client.stream(filler_prompt(size), cfg.new_tokens, chat)
            runs.append({"tokens": reply.tokens, "tok_s": _round(reply.decode_tok_s),
                         "ttft_s": _round(reply.ttft), "seconds": _round(reply.seconds),
                         "status": reply.status})
        rates = [r["tok_s"] for r in runs if r["tok_s"]]
        ttfts = [r["ttft_s"] for r in runs if r["ttft_s"] is not None]
        buckets.append(Bucket(size, _round(statistics.median(rates)) if rates else None,
                              _round(statistics.median(ttfts)) if ttfts else None, runs))
    return buckets


def check_throughput(buckets: Sequence[Bucket], cfg: Throughput) -> Check:
    measured = [b for b in buckets if b.tok_s]
    if not measured:
        return Check("decode throughput", False, "no bucket produced two streamed tokens",
                     "read the server log")
    short = measured[0]
    shown = ", ".join(f"{b.prompt_tokens} tok: {b.tok_s} tok/s (TTFT {b.ttft_s}s)"
                      for b in measured)
    low, high = cfg.reference_range
    if short.tok_s is not None and short.tok_s < cfg.reference_tok_s:
        return Check("decode throughput", False, f"{shown}; below the reference "
                     f"{cfg.reference_tok_s} tok/s ({low}-{high})",
                     "check the NPU graph capture in the log, KT_CPUINFER/threadpool against "
                     "the NUMA layout, and that the GGUF sits in the page cache",
                     {"reference": cfg.reference_tok_s})
    return Check("decode throughput", True, shown, data={"reference": cfg.reference_tok_s},
                 required=f">= {cfg.reference_tok_s:g} tok/s ({low:g}-{high:g})")


def write_chart(buckets: Sequence[Bucket], path: Path, reference: float, title: str) -> Path:
    """A PNG of decode tok/s (and TTFT) against prompt length, with the reference line."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    points = [b for b in buckets if b.tok_s is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot([b.prompt_tokens for b in points], [b.tok_s or 0.0 for b in points], marker="o",
            label="decode tok/s (median)")
    ax.axhline(reference, color="grey", linestyle="--", label=f"reference {reference:g} tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    ttft = [b for b in points if b.ttft_s is not None]
    if ttft:
        ax2 = ax.twinx()
        ax2.plot([b.prompt_tokens for b in ttft], [b.ttft_s or 0.0 for b in ttft], marker="s",
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
