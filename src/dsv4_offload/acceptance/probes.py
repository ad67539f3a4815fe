"""Acceptance probes: an HTTP client for sglang's native API and OpenAI-compatible servers,
the degeneration detector, determinism, log markers and decode throughput with a chart.

The checks are pure functions over texts and timings; only ``ServerClient`` talks HTTP.
"""

from __future__ import annotations

import json
import re
import time
import unicodedata
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.acceptance import transport
from dsv4_offload.core.results import Check

if TYPE_CHECKING:

    from dsv4_offload.recipe import Degeneration, LogMarker, Probe

# one token per CJK character, word or punctuation mark: good enough to spot repetition
_TOKEN = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]|\w+|[^\w\s]")
_NAN = re.compile(r"(?<![\w])nan(?![\w])", re.I)
REPLACEMENT_CHAR = "\ufffd"
def api_key_headers(api_key_file: str | Path | None) -> dict[str, str]:
    """The Authorization header for a server started with ``serve --api-key-file FILE``.

    sglang checks ``Authorization: Bearer <key>``; the key is read from the file on each call
    and lives only in the returned dict (never in reports, records or logs).
    """
    if not api_key_file:
        return {}
    from dsv4_offload.serving.rules import read_api_key

    return {"Authorization": f"Bearer {read_api_key(Path(api_key_file))}"}


# the server did not answer, or not in time or in bounds; later requests are pointless
ServerUnreachable = transport.RequestFailed


@dataclass
class Reply:
    text: str
    status: int
    seconds: float
    ttft: float | None = None  # seconds to the first streamed token
    tokens: int = 0  # completion tokens: the server's count when it gives one
    decode_seconds: float | None = None  # first to last streamed token
    prompt_tokens: int | None = None  # the server's count of the prompt
    error: str = ""  # an error the server reported inside an HTTP 200 stream

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def decode_tok_s(self) -> float | None:
        # the delivery's rate: (n - 1) / (t_last - t_first) over streamed tokens
        # (decode_throughput_test.sh L224-227)
        if self.tokens < 2 or not self.decode_seconds:
            return None
        return (self.tokens - 1) / self.decode_seconds


# --- HTTP -------------------------------------------------------------------------------------


class ServerClient:
    """Greedy and streamed generation over sglang's `/generate` or the OpenAI endpoints."""

    def __init__(self, url: str, api: str = "native", model: str | None = None,
                 timeout: float = 300, headers: dict[str, str] | None = None) -> None:
        import requests

        self.url = url.rstrip("/")
        self.api = api
        self.model = model or "default"
        self.timeout = timeout
        self.session = requests.Session()
        self.session.trust_env = False  # proxies never apply to the server under test
        self._extra_headers = dict(headers or {})

    def headers(self) -> dict[str, str]:
        """Every request's headers: the one place an API key (serve --api-key-file) goes."""
        return {"Content-Type": "application/json", **self._extra_headers}

    def get(self, path: str) -> tuple[int, float]:
        t0 = time.monotonic()
        resp = self._request("GET", path)
        return resp.status, time.monotonic() - t0

    def get_json(self, path: str) -> dict[str, Any] | None:
        """A GET answered with a JSON object, or None (404, not JSON: another server)."""
        resp = self._request("GET", path)
        if resp.status != 200:
            return None
        try:
            doc = json.loads(resp.body)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    def generate(self, prompt: str, max_tokens: int, chat: bool = False,
                 ignore_eos: bool = False) -> Reply:
        t0 = time.monotonic()
        path, body = self._body(prompt, max_tokens, chat, stream=False, ignore_eos=ignore_eos)
        resp = self._request("POST", path, body)
        seconds = time.monotonic() - t0
        if resp.status != 200:
            return Reply(f"HTTP {resp.status}: {resp.text[:200]}", resp.status, seconds,
                         error=_error_text(resp.text))
        try:
            doc = json.loads(resp.body)
            text = self._text(doc, chat)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"{self.url}{path}: unexpected answer ({exc!r}): "
                             f"{resp.text[:200]}") from None
        prompt_tokens, completion = self._counts(doc)
        return Reply(text, 200, seconds, tokens=completion or 0, prompt_tokens=prompt_tokens)

    def stream(self, prompt: str, max_tokens: int, chat: bool = False,
               ignore_eos: bool = True) -> Reply:
        """Streamed generation, timing the first and the last token as the delivery does."""
        path, body = self._body(prompt, max_tokens, chat, stream=True, ignore_eos=ignore_eos)
        resp = self._request("POST", path, body, stream=True)
        t0 = resp.started
        if resp.status != 200:
            text = resp.text[:200]
            return Reply(f"HTTP {resp.status}: {text}", resp.status,
                         time.monotonic() - t0, error=_error_text(text))
        text, pieces, error = "", 0, ""
        first: float | None = None
        last = 0.0
        counted: int | None = None
        prompt_tokens: int | None = None
        for now, event in _sse_events(resp.lines):
            if event.get("error"):
                # sglang reports a failed streamed request as an error event inside the
                # HTTP 200 stream (http_server.py generate_request, stream_results)
                error = _error_text(json.dumps(event["error"]))
                break
            piece, total = self._stream_piece(event, chat, text)
            p_tok, _ = self._counts(event)
            prompt_tokens = p_tok or prompt_tokens
            if total is not None:
                counted = total
            if not piece:
                continue
            first = first if first is not None else now
            last = now
            pieces += 1
            text += piece
        if not resp.done and not error:
            # sglang and OpenAI servers end every stream with "data: [DONE]"
            # (http_server.py stream_results): without it the server went away
            raise ServerUnreachable(f"{self.url}{path}: the stream ended after {pieces} "
                                    "tokens without [DONE] (is the server up?)")
        return Reply(text, 200, time.monotonic() - t0, ttft=None if first is None else first - t0,
                     tokens=counted if counted else pieces,
                     decode_seconds=None if first is None else last - first,
                     prompt_tokens=prompt_tokens, error=error)

    def _body(self, prompt: str, max_tokens: int, chat: bool, stream: bool,
              ignore_eos: bool = False) -> tuple[str, dict[str, Any]]:
        if self.api == "native":
            params: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": 0}
            if ignore_eos:
                params["ignore_eos"] = True  # fixed-length decode for throughput
            return "/generate", {"text": prompt, "sampling_params": params, "stream": stream}
        common: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens,
                                  "temperature": 0, "stream": stream}
        if stream:
            # OpenAI servers count tokens in a last usage chunk only when asked
            common["stream_options"] = {"include_usage": True}
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

    def _counts(self, doc: Any) -> tuple[int | None, int | None]:
        """(prompt tokens, completion tokens) as the server counted them, when it says."""
        doc = doc[0] if isinstance(doc, list) and doc else doc
        if not isinstance(doc, dict):
            return None, None
        # sglang: meta_info.prompt_tokens / completion_tokens (decode_throughput_test.sh
        # L210-214); OpenAI: usage.prompt_tokens / completion_tokens
        meta = doc.get("meta_info") if self.api == "native" else doc.get("usage")
        if not isinstance(meta, dict):
            return None, None
        p, c = meta.get("prompt_tokens"), meta.get("completion_tokens")
        return (p if isinstance(p, int) else None), (c if isinstance(c, int) else None)

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
                 stream: bool = False) -> transport.Exchange:
        """One exchange within ``timeout`` seconds in all, body and lines capped."""
        return transport.exchange(self.session, method, self.url + path, json_body=body,
                                  headers=self.headers(), deadline_s=self.timeout,
                                  stream=stream)


def _error_text(raw: str) -> str:
    """The message of a server's error body ({"error": {"message": ...}} or plain text)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return " ".join(raw.split())[:200] or "error"
    if isinstance(doc, dict):
        inner = doc.get("error", doc)
        if isinstance(inner, dict):
            return str(inner.get("message") or inner)[:200]
        return str(inner)[:200]
    return str(doc)[:200]


def _sse_events(lines: Sequence[tuple[float, bytes]]) -> Iterator[tuple[float, dict[str, Any]]]:
    """The JSON events of a server-sent stream's lines, with the time each arrived."""
    for when, raw in lines:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        try:
            event = json.loads(line[5:].strip())
        except ValueError:
            continue
        if isinstance(event, dict):
            yield when, event


# --- checks (pure) ---------------------------------------------------------------------------


def tokens_of(text: str) -> list[str]:
    return _TOKEN.findall(text)


@dataclass
class Loop:
    """A stretch where the text repeats a unit of ``period`` tokens ``repeats`` times."""

    period: int
    repeats: float
    start: int  # token index
    unit: list[str]

    @property
    def shown(self) -> str:
        return _short(" ".join(self.unit), 60)


def find_loops(tokens: Sequence[str], max_period: int = 64) -> list[Loop]:
    """Each period's longest adjacent repetition (a unit followed by itself at least once)."""
    loops = []
    n = len(tokens)
    for period in range(1, min(max_period, n // 2) + 1):
        best_run, best_end, run = 0, 0, 0
        for i in range(n - period):
            run = run + 1 if tokens[i] == tokens[i + period] else 0
            if run > best_run:
                best_run, best_end = run, i
        if best_run < period:  # not even one full repetition of the unit
            continue
        start = best_end - best_run + 1
        unit = list(tokens[start:start + period])
        if _smallest_period(unit) < period:
            continue  # the same loop as a shorter period, judged there
        loops.append(Loop(period, (best_run + period) / period, start, unit))
    return loops


def _smallest_period(unit: Sequence[str]) -> int:
    n = len(unit)
    for d in range(1, n):
        if n % d == 0 and all(unit[i] == unit[i % d] for i in range(n)):
            return d
    return n


_SCRIPTS = (  # (name, first, last code point): enough to tell real text from token soup
    ("Latin", 0x0041, 0x024F), ("Greek", 0x0370, 0x03FF), ("Cyrillic", 0x0400, 0x04FF),
    ("Armenian", 0x0530, 0x058F), ("Hebrew", 0x0590, 0x05FF), ("Arabic", 0x0600, 0x06FF),
    ("Devanagari", 0x0900, 0x097F), ("Bengali", 0x0980, 0x09FF), ("Tamil", 0x0B80, 0x0BFF),
    ("Thai", 0x0E00, 0x0E7F), ("Georgian", 0x10A0, 0x10FF), ("Hangul", 0xAC00, 0xD7AF),
    ("Kana", 0x3040, 0x30FF), ("Han", 0x3400, 0x9FFF),
)
# symbols ordinary prose and code use; anything else that is not a letter, digit or space
# counts towards "garbled"
_COMMON_SYMBOLS = set(".,;:!?'\"()[]{}<>-–—_/\\|*&^%$#@~`+=…“”‘’«»·•°×÷"
                      "、，。：；！？（）《》「」【】")


def _script(ch: str) -> str | None:
    cp = ord(ch)
    for name, lo, hi in _SCRIPTS:
        if lo <= cp <= hi:
            return name
    return None


def garbled(text: str, cfg: Degeneration) -> str | None:
    """Why a text looks like token soup (many scripts mixed, odd symbols), or None."""
    letters = [c for c in text if c.isalpha()]
    scripts: dict[str, int] = {}
    for c in letters:
        name = _script(c)
        if name:
            scripts[name] = scripts.get(name, 0) + 1
    # Kana and Han belong together in Japanese; Han and Latin mix in Chinese answers
    major = sorted(n for n, k in scripts.items()
                   if k >= max(2, cfg.min_script_share * len(letters)))
    if len({"Kana" if n == "Han" else n for n in major}) >= cfg.max_scripts + 1:
        return f"{len(major)} writing systems mixed ({', '.join(major)})"
    visible = [c for c in text if not c.isspace()]
    odd = [c for c in visible if not (c.isalnum() or c in _COMMON_SYMBOLS)]
    if len(visible) >= 20 and len(odd) > cfg.max_symbol_share * len(visible):
        return (f"{len(odd)} of {len(visible)} characters are unusual symbols "
                f"({''.join(sorted(set(odd))[:12])!r})")
    control = [c for c in text if unicodedata.category(c) == "Cc" and c not in "\n\t\r"]
    if control:
        return f"{len(control)} control characters"
    return None


def degeneration(text: str, cfg: Degeneration) -> list[str]:
    """What is wrong with a generated text, as the guide defines it (§8, G345): empty, NaN,
    garbled, one character or token repeated, or a short loop of 2 to
    ``min_sentence_period - 1`` tokens."""
    found: list[str] = []
    if not text.strip():
        return ["empty text with HTTP 200 (usually a weight path that resolved to nothing)"]
    if _NAN.search(text):
        found.append("'nan' in the output (NaN logits)")
    if REPLACEMENT_CHAR in text:
        found.append("U+FFFD replacement characters (broken token bytes)")
    soup = garbled(text, cfg)
    if soup:
        found.append(f"garbled text: {soup}")
    run = re.search(rf"(\S)\1{{{cfg.max_char_run},}}", text)
    if run:
        found.append(f"one character repeated: {run.group(0)[:20]!r} "
                     f"(> {cfg.max_char_run} in a row)")
    for loop in find_loops(tokens_of(text), cfg.min_sentence_period - 1):
        if loop.period == 1 and loop.repeats > cfg.max_token_run:
            found.append(f"one token repeated {loop.repeats:g} times in a row "
                         f"(> {cfg.max_token_run}): {loop.shown}")
        elif loop.period > 1 and loop.repeats > cfg.max_loop_repeats:
            found.append(f"a {loop.period}-token loop repeated {loop.repeats:.1f} times "
                         f"(> {cfg.max_loop_repeats}): {loop.shown}")
    return found


def sentence_cycle(text: str, cfg: Degeneration) -> str | None:
    """A note when a greedy answer cycles through one sentence of min_sentence_period or
    more tokens: normal for greedy decoding of a long answer, so it passes."""
    loops = [lp for lp in find_loops(tokens_of(text), 4 * cfg.min_sentence_period + 64)
             if lp.period >= cfg.min_sentence_period and lp.repeats >= 2]
    if not loops:
        return None
    loop = max(loops, key=lambda lp: lp.period * lp.repeats)
    return (f"cycles through a {loop.period}-token sentence {loop.repeats:.1f} times "
            f"(coherent; greedy decoding does this): {loop.shown}")


def check_probe(probe: Probe, reply: Reply, cfg: Degeneration) -> Check:
    name = f"probe {probe.name}"
    shown = _short(reply.text)
    if not reply.ok:
        return Check.verdict(name, False, f"HTTP {reply.status}: {reply.error or shown}",
                             "read the server log")
    problems = degeneration(reply.text, cfg)
    if problems:
        return Check.verdict(name, False, f"{'; '.join(problems)}: {shown}",
                             "incoherent output: check the GGUF (verify-gguf), that the W8A8 is "
                             "the official one, and KT_NSA_COMPRESSOR_MODE for this CANN",
                             {"text": reply.text})
    if not any(e.lower() in reply.text.lower() for e in probe.expect_any):
        wanted = " or ".join(probe.expect_any)
        return Check.verdict(name, False, f"does not mention {wanted}: {shown}",
                             "the model answers but wrongly: check the GGUF digests (verify-gguf) "
                             "and that the W8A8 shares the MXFP4 rotation base",
                             {"text": reply.text})
    note = sentence_cycle(reply.text, cfg)
    data: dict[str, Any] = {"text": reply.text, **({"note": note} if note else {})}
    return Check.verdict(name, True, f"{shown} ({reply.seconds:.1f}s)"
                         + (f"; note: {note}" if note else ""), data=data,
                         required=f"mentions {' or '.join(probe.expect_any)}, not degenerate")


def check_determinism(name: str, first: str, second: str) -> Check:
    if first == second:
        return Check.verdict("determinism", True, f"probe {name}: the same text twice",
                             required="same greedy text twice")
    return Check.verdict("determinism", False,
                         f"probe {name}: greedy answers differ: {_short(first)} / {_short(second)}",
                         "greedy decoding must be reproducible: look for a race in the CPU MoE "
                         "(KT_SIDE_STREAM) or uninitialised buffers")


def markers_that_apply(markers: Sequence[LogMarker], env: dict[str, str],
                       longest_prompt: int | None = 0,
                       applied: Collection[str] | None = None) -> list[LogMarker]:
    """The markers whose ``when_env`` holds for the server's environment, whose
    ``when_patch`` is among the ``applied`` patches (None: not known, every marker) and,
    unless ``longest_prompt`` is None (not known yet), whose ``after_prompt_tokens`` it
    reaches."""
    return [m for m in markers if all(env.get(k) == v for k, v in m.when_env.items())
            and (applied is None or m.when_patch is None or m.when_patch in applied)
            and (longest_prompt is None or longest_prompt >= m.after_prompt_tokens)]


def check_log_markers(log_text: str | None, required: Sequence[LogMarker],
                      forbidden: Sequence[LogMarker], source: str) -> list[Check]:
    if log_text is None:
        return [Check.verdict("log markers", None, "no server log (the server was not started "
                              "by this workspace); skipped: give it with --server-log FILE")]
    checks = []
    for marker in required:
        hit = re.search(marker.pattern, log_text)
        fix = "" if hit else (marker.fix or "read the server log")
        if not hit and not marker.confirmed:
            # a text read from the guide or another tree than the pin: the line may exist
            # under other words, so its absence is a warning, never a failure
            fix += (f" (a warning: the text is not confirmed in the pinned source; "
                    f"{marker.source or 'no source recorded'})")
        checks.append(Check.verdict(f"log has {marker.label}", hit is not None,
                                    _short(_line_at(log_text, hit.start()), 200) if hit else
                                    f"missing from {source}", fix,
                                    {"pattern": marker.pattern, "source": marker.source,
                                     "confirmed": marker.confirmed},
                                    required="present", gate=marker.confirmed))
    for marker in forbidden:
        hits = list(re.finditer(marker.pattern, log_text))
        checks.append(Check.verdict(f"log without {marker.label}", not hits,
                                    f"{len(hits)}x, first: "
                                    f"{_short(_line_at(log_text, hits[0].start()), 200)}"
                                    if hits else "absent",
                                    (marker.fix or "read the server log") if hits else "",
                                    {"pattern": marker.pattern}, required="absent"))
    return checks


def log_tail(path: Path | None, lines: int = 8) -> list[str]:
    """The last lines of the server log (for a failure's context), or nothing."""
    if path is None:
        return []
    try:
        every = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    return [line[:200] for line in every[-lines:]]


def _line_at(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start:end if end >= 0 else None]


def _short(text: str, limit: int = 80) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[:limit] + "...")
