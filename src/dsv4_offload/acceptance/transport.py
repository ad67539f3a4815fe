"""One HTTP exchange with a server under test, bounded in time and in size.

A server that streams forever, drips a byte every few seconds, sends one endless line or
never ends its stream must not hold accept: every request has a connect deadline, a
first-byte deadline and a total deadline, and the body and each line have a size cap. The
request runs in a worker thread the caller waits on for the total deadline; past it, the
socket is shut down (ending the worker's read) and the caller gets :class:`RequestFailed`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import requests

CONNECT_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 16 << 20  # a JSON answer; sglang's longest is a few hundred KiB
MAX_STREAM_BYTES = 64 << 20  # a streamed answer of a few thousand tokens is ~1 MiB
MAX_LINE_BYTES = 1 << 20  # one server-sent event
READ_CHUNK = 64 << 10
DONE_LINE = b"data: [DONE]"


class RequestFailed(Exception):
    """The server did not answer in time or in bounds (refused, reset, too slow, too big)."""


@dataclass
class Exchange:
    """What came back: the status, and the body (plain) or the timed lines (streamed)."""

    status: int
    started: float  # time.monotonic() when the request was sent
    body: bytes = b""
    lines: list[tuple[float, bytes]] = field(default_factory=list)  # (monotonic, line)
    done: bool = False  # a streamed answer ended with "data: [DONE]"

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


def exchange(session: requests.Session, method: str, url: str, *, json_body: Any,
             headers: dict[str, str], deadline_s: float, stream: bool) -> Exchange:
    """``method url`` within ``deadline_s`` seconds in all; streamed answers come as lines."""
    box: dict[str, Any] = {}
    holder: dict[str, Any] = {}
    started = time.monotonic()

    def work() -> None:
        try:
            box["ok"] = _exchange(session, method, url, json_body, headers, deadline_s, stream,
                                  holder, started)
        except BaseException as exc:  # handed to the waiting caller
            box["error"] = exc

    worker = threading.Thread(target=work, daemon=True, name="accept-http")
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        holder["expired"] = True
        _cut(holder.get("resp"))
        worker.join(1.0)
        got = holder.get("count", 0)
        if stream and got:
            raise RequestFailed(f"{method} {url}: the stream broke after {got} bytes: no [DONE] "
                                f"within {deadline_s:.0f}s (the request's deadline)")
        raise RequestFailed(f"{method} {url}: no answer within {deadline_s:.0f}s (the "
                            f"request's deadline; {got} bytes received)")
    if "error" in box:
        raise box["error"]
    result: Exchange = box["ok"]
    return result


def _cut(resp: Any) -> None:
    """Shut the response's socket down so a read blocked in the worker returns."""
    if resp is None:
        return
    with contextlib.suppress(Exception):
        resp.raw.shutdown()
    with contextlib.suppress(Exception):
        resp.close()


def _exchange(session: requests.Session, method: str, url: str, json_body: Any,
              headers: dict[str, str], deadline_s: float, stream: bool,
              holder: dict[str, Any], started: float) -> Exchange:
    import requests
    import urllib3

    timeouts = (min(CONNECT_TIMEOUT_S, deadline_s), deadline_s)  # connect, first byte
    try:
        resp = session.request(method, url, json=json_body, headers=headers, timeout=timeouts,
                               stream=True)
    except (requests.ConnectionError, requests.Timeout) as exc:
        why = (f"no answer within {deadline_s:.0f}s" if isinstance(exc, requests.Timeout)
               else f"{type(exc).__name__} (is the server up?)")
        raise RequestFailed(f"{method} {url}: {why}") from None
    holder["resp"] = resp
    result = Exchange(resp.status_code, started)
    try:
        if stream and resp.status_code == 200:
            _read_lines(resp, result, holder)
        else:
            result.body = _read_body(resp, holder, url)
    except (urllib3.exceptions.HTTPError, requests.RequestException, OSError, ValueError) as exc:
        if holder.get("expired"):
            raise RequestFailed(f"{method} {url}: past the deadline") from None
        raise RequestFailed(f"{method} {url}: the answer broke off after "
                            f"{holder.get('count', 0)} bytes ({type(exc).__name__})") from None
    finally:
        resp.close()
    return result


def _read_body(resp: Any, holder: dict[str, Any], url: str) -> bytes:
    parts: list[bytes] = []
    count = 0
    while chunk := resp.raw.read1(READ_CHUNK):
        count += len(chunk)
        holder["count"] = count
        if count > MAX_BODY_BYTES:
            raise RequestFailed(f"{url}: the answer is over {MAX_BODY_BYTES >> 20} MiB "
                                "(the cap on a JSON answer); is this the server under test?")
        parts.append(chunk)
    return b"".join(parts)


def _read_lines(resp: Any, result: Exchange, holder: dict[str, Any]) -> None:
    pending = b""
    count = 0
    while chunk := resp.raw.read1(READ_CHUNK):
        now = time.monotonic()
        count += len(chunk)
        holder["count"] = count
        if count > MAX_STREAM_BYTES:
            raise RequestFailed(f"{resp.url}: the stream went past {MAX_STREAM_BYTES >> 20} MiB "
                                "without [DONE] (the cap on a streamed answer)")
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            line = line.strip()
            if line == DONE_LINE or line == b"data:[DONE]":
                result.done = True
                return
            if line:
                result.lines.append((now, line))
        if len(pending) > MAX_LINE_BYTES:
            raise RequestFailed(f"{resp.url}: one line of the stream is over "
                                f"{MAX_LINE_BYTES >> 20} MiB (the cap on an event)")
    if pending.strip():
        result.lines.append((time.monotonic(), pending.strip()))
