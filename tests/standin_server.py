"""A stand-in for sglang's HTTP server, started by the real launcher through `serve.command`.

Speaks /health, /health_generate, /generate (native, with streaming) and the OpenAI
/v1/completions and /v1/chat/completions (with streaming). It accepts and ignores sglang's
launch flags, except --host, --port and --kt-num-gpu-experts. Behaviour by --mode:

good, garbage, repeat-char, empty-200, slow-start, crash-after-N (--crash-after N), hang,
nondeterministic, fatal (--fatal KEY: print that known fatal log line and keep running),
kv-ladder (fail KV setup while --kt-num-gpu-experts > --kv-max-experts).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# the texts real servers print (sglang, kt-kernel, the delivery's op loader)
FATAL_LINES = {
    "kv-cache": "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
    "hbm-oom": "RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB",
    "llamafile": "terminate called after throwing an instance of 'std::runtime_error'\n"
                 "  what():  llamafile not supported",
    "numa": "NUMA node 7 not found",
    "libmxfp4fused": "OSError: libmxfp4fused.so: cannot open shared object file: "
                     "No such file or directory",
    "quant-type": "terminate called after throwing an instance of 'std::runtime_error'\n"
                  "  what():  intermediate_size * hidden_size must be a multiple of up_type "
                  "blck size",
    "gguf-missing": "FileNotFoundError: GGUF path not found: /w/gguf/dsv4_layer0_mxfp4.gguf",
}
GOOD_ANSWERS = {
    "中国": "北京。北京是中华人民共和国的首都，也是全国的政治和文化中心。",
    "france": " Paris. Paris is the capital and the largest city of France.",
}
GENERIC = ("The report describes how the system was measured over several weeks, which "
           "parts were slow, and what the team changed to make each step faster.")
GARBAGE_WORDS = ("zorp", "quib", "flandle", "mek", "trosk", "vuu", "plinth", "gadro", "ixel",
                 "nebbo", "sarf", "clum", "wix", "dorrel", "yant", "hesk")


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.requests = 0
        self.lock = threading.Lock()
        self.counter = itertools.count()


def answer(state: State, prompt: str, max_tokens: int) -> str:
    mode = state.args.mode
    if mode == "empty-200":
        return ""
    if mode == "garbage":
        words = [GARBAGE_WORDS[(i * 7 + len(prompt)) % len(GARBAGE_WORDS)] for i in range(24)]
        return " " + " ".join(words)
    key = next((k for k in GOOD_ANSWERS if k in prompt.lower()), None)
    text = GOOD_ANSWERS[key] if key else " " + GENERIC
    if mode == "repeat-char":
        text = text[:12] + "!" * 60
    if mode == "nondeterministic":
        text += f" (variant {next(state.counter)})"
    words = text.split(" ")
    return " ".join(words[: max(1, max_tokens)]) if " " in text else text


def pieces(text: str) -> list[str]:
    """The text as stream chunks of about one token each."""
    if " " not in text.strip():
        return list(text)
    parts = text.split(" ")
    return [parts[0]] + [" " + p for p in parts[1:]]


class Handler(BaseHTTPRequestHandler):
    server_version = "standin/1"
    protocol_version = "HTTP/1.1"

    @property
    def st(self) -> State:
        return self.server.state  # type: ignore[attr-defined]

    def log_message(self, fmt: str, *args: object) -> None:
        print(f"[standin] {self.command} {self.path} " + fmt % args, flush=True)

    def _json(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _loading(self) -> bool:
        return (self.st.args.mode == "slow-start"
                and time.monotonic() - self.st.started < self.st.args.start_delay)

    def _denied(self) -> bool:
        """With --api-key every path wants `Authorization: Bearer KEY` (stricter than sglang
        may be for /health, so serve's readiness check must send it too)."""
        key = self.st.args.api_key
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            self._json(401, {"error": "Unauthorized"})
            return True
        return False

    def do_GET(self) -> None:
        if self._denied():
            return
        if self.path in ("/health", "/health_generate", "/v1/models"):
            if self._loading():
                self._json(503, {"error": "loading"})
            elif self.path == "/v1/models":
                self._json(200, {"data": [{"id": "standin"}]})
            else:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            return
        self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if self._denied():
            self.rfile.read(length)
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self._json(400, {"error": "bad json"})
            return
        if self._loading():
            self._json(503, {"error": "loading"})
            return
        with self.st.lock:
            self.st.requests += 1
            count = self.st.requests
        args = self.st.args
        if args.mode == "crash-after" and count > args.crash_after:
            print(f"[standin] crashing after {args.crash_after} requests", flush=True)
            os._exit(3)
        if args.mode == "hang":
            time.sleep(3600)
        if self.path == "/generate":
            prompt = str(body.get("text", ""))
            params = body.get("sampling_params") or {}
            self._reply(prompt, int(params.get("max_new_tokens", 64)), bool(body.get("stream")),
                        "native")
        elif self.path == "/v1/completions":
            self._reply(str(body.get("prompt", "")), int(body.get("max_tokens", 16)),
                        bool(body.get("stream")), "completion")
        elif self.path == "/v1/chat/completions":
            messages = body.get("messages") or [{}]
            prompt = str(messages[-1].get("content", ""))
            self._reply(prompt, int(body.get("max_tokens", 16)), bool(body.get("stream")),
                        "chat")
        else:
            self._json(404, {"error": "not found"})

    def _reply(self, prompt: str, max_tokens: int, stream: bool, flavour: str) -> None:
        text = answer(self.st, prompt, max_tokens)
        if not stream:
            if flavour == "native":
                self._json(200, {"text": text, "meta_info": {
                    "prompt_tokens": len(prompt.split()), "completion_tokens": len(pieces(text))}})
            elif flavour == "completion":
                self._json(200, {"choices": [{"index": 0, "text": text, "finish_reason": "stop"}]})
            else:
                self._json(200, {"choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "content": text}}]})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        chunks = pieces(text) if text else []
        # throughput probes ask for many tokens: keep streaming filler up to max_tokens
        while len(chunks) < max_tokens and text:
            chunks.append(" more")
        sent = ""
        for i, chunk in enumerate(chunks[:max_tokens]):
            time.sleep(self.st.args.token_delay)
            sent += chunk
            if flavour == "native":
                event = {"text": sent, "meta_info": {"completion_tokens": i + 1}}
            elif flavour == "completion":
                event = {"choices": [{"index": 0, "text": chunk}]}
            else:
                event = {"choices": [{"index": 0, "delta": {"content": chunk}}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="good")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--start-delay", type=float, default=2.0)
    parser.add_argument("--crash-after", type=int, default=2)
    parser.add_argument("--fatal", default="kv-cache")
    parser.add_argument("--kv-max-experts", type=int, default=24)
    parser.add_argument("--kt-num-gpu-experts", type=int, default=32)
    parser.add_argument("--token-delay", type=float, default=0.002)
    parser.add_argument("--exit-after-fatal", action="store_true")
    parser.add_argument("--api-key", default=None)
    args, _sglang_flags = parser.parse_known_args()
    # sglang logs its whole ServerArgs at start-up, the api key among them
    print(f"server_args=ServerArgs(host={args.host!r}, port={args.port}, "
          f"api_key={args.api_key!r})", flush=True)
    print(f"[standin] mode={args.mode} experts={args.kt_num_gpu_experts} pid={os.getpid()}",
          flush=True)
    if args.mode == "fatal" or (args.mode == "kv-ladder"
                                and args.kt_num_gpu_experts > args.kv_max_experts):
        key = args.fatal if args.mode == "fatal" else "kv-cache"
        print("Loading weights ...", flush=True)
        print(FATAL_LINES[key], flush=True)
        if args.exit_after_fatal or args.mode == "kv-ladder":
            return 1
        time.sleep(3600)  # like a wedged server: the supervisor must act on the line alone
        return 1
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.state = State(args)  # type: ignore[attr-defined]
    print("KV Cache is allocated. #tokens: 131072, KV size: 3.41 GB", flush=True)
    print("Capture npu graph end. Time elapsed: 0.01 s. mem usage=0.27 GB.", flush=True)
    print("The server is fired up and ready to roll!", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        print("[standin] interrupted, shutting down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
