"""A hostile OpenAI-style server: accept ends within its deadline and names the probe.

The server streams forever, drips a byte at a time, sends one endless line, or ends its
stream without ``[DONE]``; memory stays bounded by the caps and no run outlives its
request deadline (plus a little slack for process start-up).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import HOST_RECIPE
from conftest import run_cli_inproc as run_cli  # the commands in process: not the process

from dsv4_offload.acceptance import transport
from dsv4_offload.acceptance.probes import ServerClient, ServerUnreachable

DEADLINE_S = 2


class Hostile(ThreadingHTTPServer):
    daemon_threads = True
    mode = "endless"

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the client hangs up on us: that is the point


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # /v1/models: healthy, so accept goes on to the probes
        body = json.dumps({"data": [{"id": "m"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        mode = self.server.mode  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        event = b'data: {"choices": [{"text": "la"}]}\n\n'
        stop = time.monotonic() + 30  # bounded: the server gives up long after the client
        try:
            if mode == "endless":
                while time.monotonic() < stop:
                    self.wfile.write(event * 256)
            elif mode == "drip":
                for byte in (event * 1000):
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.2)
                    if time.monotonic() > stop:
                        break
            elif mode == "huge-line":
                self.wfile.write(b"data: ")
                while time.monotonic() < stop:
                    self.wfile.write(b"x" * 65536)
            elif mode == "no-done":
                self.wfile.write(event * 5)
        except OSError:
            pass


@pytest.fixture
def server() -> Iterator[Hostile]:
    srv = Hostile(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv: Hostile) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.parametrize("mode", ["endless", "drip", "huge-line", "no-done"])
def test_a_stream_ends_within_the_deadline(server: Hostile, mode: str) -> None:
    server.mode = mode
    client = ServerClient(_url(server), "openai", "m", timeout=DEADLINE_S)
    t0 = time.monotonic()
    with pytest.raises(ServerUnreachable) as err:
        client.stream("hello", 16)
    assert time.monotonic() - t0 < DEADLINE_S + 2
    text = str(err.value)
    assert "\n" not in text and "/v1/completions" in text
    if mode == "huge-line":
        assert "one line of the stream is over" in text or "deadline" in text
    if mode == "no-done":
        assert "without [DONE]" in text


@pytest.mark.parametrize("mode", ["endless", "drip", "huge-line"])
def test_a_plain_answer_is_capped_and_timed(server: Hostile, mode: str) -> None:
    server.mode = mode
    client = ServerClient(_url(server), "openai", "m", timeout=DEADLINE_S)
    t0 = time.monotonic()
    with pytest.raises(ServerUnreachable) as err:
        client.generate("hello", 16)
    assert time.monotonic() - t0 < DEADLINE_S + 2
    assert "over 16 MiB" in str(err.value) or "deadline" in str(err.value)


def test_the_caps_hold_without_the_deadline(server: Hostile) -> None:
    """An endless body at full speed hits the size cap, long before a generous deadline."""
    server.mode = "endless"
    client = ServerClient(_url(server), "openai", "m", timeout=60)
    t0 = time.monotonic()
    with pytest.raises(ServerUnreachable, match="went past 64 MiB"):
        client.stream("hello", 16)
    assert time.monotonic() - t0 < 30
    assert transport.MAX_STREAM_BYTES == 64 << 20


@pytest.mark.parametrize("mode", ["endless", "drip"])
def test_accept_fails_naming_the_probe(server: Hostile, mode: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    server.mode = mode
    t0 = time.monotonic()
    res = run_cli("--workspace", str(tmp_path / "ws"), "--recipe", str(HOST_RECIPE), "--json",
                  "--set", f"acceptance.request_timeout_s={DEADLINE_S}", "accept",
                  "--url", _url(server), "--api", "openai", "--model", "m", timeout=60)
    elapsed = time.monotonic() - t0
    assert res.code == 1, res
    assert "Traceback" not in res.err
    checks = {c["name"]: c for c in res.json()["data"]["data"]["checks"]}
    detail = checks["server answers"]["detail"]
    assert detail.startswith("probe '"), detail
    # one probe's deadline, plus process start-up; never a second probe's
    assert elapsed < DEADLINE_S + 15, elapsed


def test_serve_print_warns_that_the_api_key_is_visible_in_ps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pathlib import Path

    from serve_helpers import make_workspace

    ws = make_workspace(tmp_path / "ws")
    root = Path(__file__).parent / "fixtures" / "hosts" / "kunpeng920-910b"
    host = {"DSV4_HOST_ROOT": str(root), "DSV4_NPU_SMI": f"cat {root / 'npu-smi-info.txt'}"}
    key = tmp_path / "key"
    key.write_text("s3cr3t-key-for-this-test\n")
    key.chmod(0o600)
    res = run_cli("--workspace", str(ws.root), "--json", "serve", "--print", "--api-key-file",
                  str(key), env=host)
    assert res.code == 0, res
    assert "s3cr3t-key-for-this-test" not in res.out
    assert any("`ps`" in w for w in res.json()["data"]["warnings"]), res.out
