"""A stand-in for sglang's HTTP server, started by the real launcher through `serve.command`.

Speaks /health, /health_generate, /generate (native, with streaming) and the OpenAI
/v1/completions and /v1/chat/completions (with streaming). It accepts and ignores sglang's
launch flags, except --host, --port and --kt-num-gpu-experts. Behaviour by --mode:

good, garbage, garbled, repeat-char, sentence-loop, empty-200, slow-start, crash-after-N
(--crash-after N), hang, nondeterministic, fatal (--fatal KEY: print that known fatal log line
and keep running), kv-ladder (fail KV setup while --kt-num-gpu-experts > --kv-max-experts).

Like sglang it answers /get_server_info (ServerArgs fields at the top level, http_server.py)
and counts prompt tokens in meta_info / usage. Its token is a word or punctuation mark. In
every mode: a prompt longer than the chunked prefill (--chunk, else --chunked-prefill-size)
kills it, as the guide says such prompts fail (G306-310); --fallback-over N logs sglang/0003's
streaming fallback line for prompts of N tokens or more; --die-in-stream K exits halfway
through the K-th streamed answer, --hang-in-stream K stops sending there. --swa-size N: a
prompt above N tokens is never admitted (no prefill line, no answer); --slow-prefill-over N:
a prompt of N tokens or more logs its prefill and never answers. --anon-mib N holds N MiB of
touched anonymous memory before it is ready (as kt-kernel's copied experts are held), and
--child-anon-mib N starts a child that holds N MiB (sglang's scheduler is a child process);
the child exits when its parent does.

Dynamic residency (sglang/0003): a prompt of KT_PREFILL_STREAM_THRESHOLD tokens (512 unless
the environment says otherwise) or more streams, and with KT_PREFILL_STREAM,
KT_DYNAMIC_RESIDENT and KT_MXFP4_DEPOOL on (the launcher's defaults when unset) it moves the
resident experts and logs 0003's `inline resident` line. --resident-write says how that
write goes: `fixed` (the default, the bundled series carries our fix) also logs the fix's
`resident write verified` line; `broken` (the delivery's series unmodified on torch_npu)
logs nothing more, and from then on every answer comes from stale expert weights: a
different text that leaks `</think>`, until the server restarts.

Performance model (--perf-model, for `tune`): the decode rate follows the knobs the launch
plan gives it, read from its flags --kt-num-gpu-experts E, --kt-threadpool-count P,
--kt-cpuinfer T and the environment's KT_HOT_TAIL_TOKENS H (0 when unset). A decoded token
costs a fixed NPU part plus the CPU MoE's reads of the experts not resident on the NPU:

    tok/s           = hot_tail(H) / (NPU_S + CPU_S * (1 - share(E)) / bandwidth(P, T))
    share(E)        = 0.612 * E / 32    (the `inline resident` line's share at top-32,
                                         taken as linear in E)
    bandwidth(P, T) = P/8 * min(1, t/12) / (1 + 0.08 * max(0, t - 12)),  t = T / P
                      (each NUMA node's pool saturates its memory at 12 threads; more
                      threads contend for it; the guide's 8 pools x 16 threads is past that)
    hot_tail(H)     = {0: 1.00, 32: 0.96, 64: 1.08, 128: 0.96}[H]  (the guide calls the
                      knob worth -4 %..+8 %: both ends, +8 % at the guide's 64)
    NPU_S, CPU_S    = 20 ms, 50 ms

and the stand-in sleeps 1/rate/--perf-scale per token (the scale keeps tests quick). On the
8-node fixture host the defaults (E=32, P=8, T=128, H=0) are not the optimum: T=96 and H=64
are faster. --swa-per-expert N shrinks the SWA pool by N tokens per resident expert above
32 (more experts leave less HBM for the KV pools), and --degenerate-hot-tail H makes every
answer degenerate (a repeated character) while KT_HOT_TAIL_TOKENS=H.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
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
# what a known prompt gets once the resident slots hold stale weights: still on topic (a
# keyword probe passes), but another text than the greedy answer before, with the think
# block's closing tag leaking into a non-thinking answer (the second team's 60 %)
DRIFTED_ANSWERS = {
    "中国": "北京</think>城市的历史很长，人口众多，交通方便，有很多公园和博物馆。",
    "france": " Paris</think> is where the river bends twice and the old bridges hold museums.",
}
GENERIC = ("The report describes how the system was measured over several weeks, which "
           "parts were slow, and what the team changed to make each step faster.")
# mixed writing systems and symbols, the way a model with broken weights emits token pieces
GARBLED = " ilesatur Добро ⸮ظبط 기억 ŧrans ▒▒ Ψηφ ктив ‡ 역사 ملك ∰ tionsен ◊ δεί"
SENTENCE = (" Paris is the capital of France, and it is also the largest city in the "
            "country.")
GARBAGE_WORDS = ("zorp", "quib", "flandle", "mek", "trosk", "vuu", "plinth", "gadro", "ixel",
                 "nebbo", "sarf", "clum", "wix", "dorrel", "yant", "hesk")


# a child holding touched anonymous memory until its parent is gone
CHILD = ("import os, sys, time\n"
         "held = bytearray(int(sys.argv[1]) << 20)\n"
         "held[::4096] = b'\\x01' * len(range(0, len(held), 4096))\n"
         "print('held', flush=True)\n"
         "parent = os.getppid()\n"
         "while os.getppid() == parent:\n"
         "    time.sleep(0.2)\n")


def hold_anonymous(mib: int) -> bytearray:
    """``mib`` MiB of anonymous memory, every page touched (RssAnon counts touched pages)."""
    held = bytearray(mib << 20)
    held[::4096] = b"\x01" * len(range(0, len(held), 4096))
    return held


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.requests = 0
        self.streams = 0
        self.lock = threading.Lock()
        self.counter = itertools.count()
        self.stale_experts = False  # a broken resident write has happened (until restart)


NPU_S, CPU_S = 0.020, 0.050
HOT_TAIL = {0: 1.00, 32: 0.96, 64: 1.08, 128: 0.96}


def hot_tail_tokens() -> int:
    raw = os.environ.get("KT_HOT_TAIL_TOKENS", "")
    return int(raw) if raw.isdigit() else 0


def model_rate(experts: int, pools: int, threads: int, hot_tail: int) -> float:
    """Decoded tokens per second under the performance model (module docstring)."""
    share = min(0.95, 0.612 * experts / 32)
    per_pool = threads / max(1, pools)
    bandwidth = pools / 8 * min(1.0, per_pool / 12) / (1 + 0.08 * max(0.0, per_pool - 12))
    cpu = CPU_S * (1 - share) / max(bandwidth, 1e-3)
    return HOT_TAIL.get(hot_tail, 1.0) / (NPU_S + cpu)


def count_tokens(text: str) -> int:
    return len(re.findall(r"\w+|[^\w\s]", text))


def answer(state: State, prompt: str, max_tokens: int) -> str:
    mode = state.args.mode
    if state.args.degenerate_hot_tail and hot_tail_tokens() == state.args.degenerate_hot_tail:
        mode = "repeat-char"
    if mode == "empty-200":
        return ""
    if mode == "garbled":
        return GARBLED
    if mode == "sentence-loop":  # a coherent answer that cycles one sentence, as greedy does
        if "中国" in prompt:
            return "北京。" + "北京是中华人民共和国的首都，也是全国的政治和文化中心。" * 5
        return SENTENCE * 6
    if mode == "garbage":
        words = [GARBAGE_WORDS[(i * 7 + len(prompt)) % len(GARBAGE_WORDS)] for i in range(24)]
        return " " + " ".join(words)
    key = next((k for k in GOOD_ANSWERS if k in prompt.lower()), None)
    text = GOOD_ANSWERS[key] if key else " " + GENERIC
    if state.stale_experts and key:
        text = DRIFTED_ANSWERS[key]
    if mode == "repeat-char":
        text = text[:12] + "!" * 60
    if mode == "nondeterministic":
        text += f" (variant {next(state.counter)})"
    words = text.split(" ")
    return " ".join(words[: max(1, max_tokens)]) if " " in text else text


def stream_threshold() -> int:
    raw = os.environ.get("KT_PREFILL_STREAM_THRESHOLD", "")
    return int(raw) if raw.isdigit() else 512  # launch_ds4flash_npu.sh L98


def residency_on() -> bool:
    """Streaming prefill, dynamic residency and depool all on: the launcher's defaults."""
    return all(os.environ.get(k, "1") == "1"
               for k in ("KT_PREFILL_STREAM", "KT_DYNAMIC_RESIDENT", "KT_MXFP4_DEPOOL"))


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
        if self.path == "/get_server_info" and not self.st.args.no_server_info:
            args = self.st.args
            # the shape of sglang's answer: ServerArgs fields, scheduler info, internal
            # states, version (http_server.py get_server_info)
            self._json(200, {"model_path": "standin", "tokenizer_path": "standin",
                             "host": args.host, "port": args.port,
                             "chunked_prefill_size": args.chunk,
                             "context_length": args.context_length,
                             "max_running_requests": 1, "mem_fraction_static": 0.81,
                             "page_size": 128, "max_total_num_tokens": 131072,
                             "internal_states": [{"last_gen_throughput": 0.0}],
                             "version": "standin"})
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
                        "native", bool(params.get("ignore_eos")))
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

    def _prefill(self, prompt: str) -> int:
        """The prompt's tokens; too long for the chunk kills the server, long ones log."""
        args = self.st.args
        n = count_tokens(prompt)
        if n > args.chunk:
            print(f"[standin] prompt of {n} tokens is longer than the chunked prefill "
                  f"{args.chunk}: the NSA compressor cannot cross a chunk; exiting", flush=True)
            os._exit(4)
        if n > args.swa_size:
            # not admitted: it waits in sglang's queue for SWA slots that never come, and
            # logs no prefill (issue 24: a prompt the SWA pool cannot hold never starts)
            time.sleep(3600)
        # sglang scheduler's line for each prefill it starts (fork main @ 7b7e357f
        # scheduler_metrics_mixin.py:174-181)
        print(f"Prefill batch, #new-seq: 1, #new-token: {n}, #cached-token: 0, token usage: "
              "0.00, #running-req: 0, #queue-req: 0, ", flush=True)
        if args.slow_prefill_over and n >= args.slow_prefill_over:
            time.sleep(3600)  # a prefill far slower than the client's read timeout
        if n >= stream_threshold() and residency_on():
            # sglang/0003's line once residency folds into a streamed prefill (patch L997);
            # the first layer's write comes before it, and our fix's check with it
            if args.resident_write == "fixed":
                print(f"[KT_STREAM] resident write verified: layer 0 slot 0 holds expert "
                      f"{17 + n % 200}", flush=True)
            else:
                self.st.stale_experts = True
            print("[KT_STREAM] inline resident: top-32 x 43 layers folded into prefill, "
                  "share=0.612", flush=True)
        if args.fallback_over and n >= args.fallback_over:
            # the message sglang/0003 logs (kt_stream_prefill.py, patch line 1131)
            print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] [KT_STREAM] streaming failed "
                  "(RuntimeError('NPU out of memory. Tried to allocate 1.00 GiB')) -> hybrid "
                  "fallback", flush=True)
        return n

    def _reply(self, prompt: str, max_tokens: int, stream: bool, flavour: str,
               ignore_eos: bool = False) -> None:
        prompt_tokens = self._prefill(prompt)
        text = answer(self.st, prompt, max_tokens)
        chunks = pieces(text) if text else []
        # ignore_eos: generate exactly max_tokens, as sglang does
        while ignore_eos and text and len(chunks) < max_tokens:
            chunks.append(" more")
        chunks = chunks[:max_tokens]
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(chunks)}
        if not stream:
            text = "".join(chunks)
            if flavour == "native":
                self._json(200, {"text": text, "meta_info": usage})
            elif flavour == "completion":
                self._json(200, {"choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                                 "usage": usage})
            else:
                self._json(200, {"choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "content": text}}], "usage": usage})
            return
        with self.st.lock:
            self.st.streams += 1
            nth = self.st.streams
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        sent = ""
        # under the performance model each token is due at a fixed pace from the stream's
        # start, as a steady decode is: a late wake-up of a loaded host is made up by the
        # next tokens instead of adding up (never closer than half the pace: a burst read in
        # one piece has no decode time); otherwise a plain pause between tokens
        start = last = time.monotonic()
        delay = self.st.args.token_delay
        for i, chunk in enumerate(chunks):
            if nth == self.st.args.die_in_stream and i == len(chunks) // 2:
                print(f"[standin] dying in the middle of streamed answer {nth}", flush=True)
                os._exit(5)
            if nth == self.st.args.hang_in_stream and i == len(chunks) // 2:
                print(f"[standin] hanging in the middle of streamed answer {nth}", flush=True)
                time.sleep(3600)
            due = (max(start + (i + 1) * delay, last + delay / 2) if self.st.args.perf_model
                   else time.monotonic() + delay)
            time.sleep(max(0.0, due - time.monotonic()))
            last = time.monotonic()
            sent += chunk
            if flavour == "native":
                event = {"text": sent, "meta_info": {"prompt_tokens": prompt_tokens,
                                                     "completion_tokens": i + 1}}
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
    parser.add_argument("--kt-threadpool-count", type=int, default=1)  # sglang's flag
    parser.add_argument("--kt-cpuinfer", type=int, default=32)  # sglang's flag
    parser.add_argument("--perf-model", action="store_true")
    parser.add_argument("--perf-scale", type=float, default=2.0)
    parser.add_argument("--swa-per-expert", type=int, default=0)
    parser.add_argument("--degenerate-hot-tail", type=int, default=0)
    parser.add_argument("--token-delay", type=float, default=0.002)
    parser.add_argument("--exit-after-fatal", action="store_true")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--chunked-prefill-size", type=int, default=8192)  # sglang's flag
    parser.add_argument("--context-length", type=int, default=65536)  # sglang's flag
    parser.add_argument("--chunk", type=int, default=None, help="overrides the flag above")
    parser.add_argument("--swa-size", type=int, default=131072,
                        help="the SWA pool's tokens: a longer prompt is never admitted")
    parser.add_argument("--slow-prefill-over", type=int, default=0,
                        help="a prompt this long starts its prefill and never ends it")
    parser.add_argument("--fallback-over", type=int, default=0)
    parser.add_argument("--die-in-stream", type=int, default=0)
    parser.add_argument("--hang-in-stream", type=int, default=0)
    parser.add_argument("--no-server-info", action="store_true")
    parser.add_argument("--no-startup-lines", action="store_true")
    parser.add_argument("--anon-mib", type=int, default=0)
    parser.add_argument("--child-anon-mib", type=int, default=0)
    parser.add_argument("--resident-write", choices=("fixed", "broken"), default="fixed")
    parser.add_argument("--tag", default="")
    parser.add_argument("--report", default=None,
                        help="write the argv and environment this process got (JSON) there")
    args, _sglang_flags = parser.parse_known_args()
    if args.report:
        # what a test cannot see from outside a container: the argv and environment as the
        # server process received them
        tmp = f"{args.report}.tmp"
        with open(tmp, "w") as fh:
            json.dump({"argv": sys.argv, "env": dict(os.environ),
                       "dockerenv": os.path.exists("/.dockerenv")}, fh)
        os.replace(tmp, args.report)
    args.chunk = args.chunk or args.chunked_prefill_size
    if args.perf_model:
        rate = model_rate(args.kt_num_gpu_experts, args.kt_threadpool_count, args.kt_cpuinfer,
                          hot_tail_tokens())
        args.token_delay = 1.0 / rate / args.perf_scale
        print(f"[standin] perf model: {rate:.2f} tok/s (x{args.perf_scale:g})", flush=True)
    if args.swa_per_expert:
        args.swa_size -= max(0, args.kt_num_gpu_experts - 32) * args.swa_per_expert
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
    held = hold_anonymous(args.anon_mib) if args.anon_mib else None
    child = None
    if args.child_anon_mib:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(args.child_anon_mib),
                                  args.tag], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.held = (held, child)  # type: ignore[attr-defined]
    server.daemon_threads = True
    server.state = State(args)  # type: ignore[attr-defined]
    if not args.no_startup_lines:
        # the lines the guide quotes for this server (G639-643); the depool one in the
        # format of sglang/0003's print (tuples as Python prints them)
        print("Load weight end. elapsed=1.00 s, type=DeepseekV4ForCausalLM, avail mem=13.0 GB, "
              "mem usage=48.32 GB.", flush=True)
        print("[KT_STREAM][depool] reserved ND streaming slot (256, 4096, 4096)+"
              "(256, 2048, 4096) (6.44GB) at model-load time", flush=True)
        # the DSv4 NPU pool's two lines in upstream's formats (hybrid_swa_c4_c128_memory_pool.py
        # @ c00daab0, not the pin: the pinned fork is not stored)
        print(f"[SWAC4C128KVPool] size=131072, size_swa={args.swa_size}, size_c4=32768, "
              "size_c128=1024, size_c4_state=1024, size_c128_state=1024", flush=True)
        print("SWAC4C128KVPool mem usage: 3.41 GB. page_size: 128", flush=True)
        print("KV Cache is allocated. #tokens: 131072, KV size: 3.41 GB", flush=True)
        print("Capture npu graph end. Time elapsed: 0.01 s. mem usage=0.27 GB. "
              "avail mem=8.75 GB.", flush=True)
        # sglang scheduler's start-up line (fork main @ 7b7e357f scheduler.py:593-600)
        print(f"max_total_num_tokens=131072, chunked_prefill_size={args.chunk}, "
              "max_prefill_tokens=65535, max_running_requests=1, context_len=65536, "
              "available_gpu_mem=8.75 GB", flush=True)
    print("The server is fired up and ready to roll!", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        print("[standin] interrupted, shutting down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
