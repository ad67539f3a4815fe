"""The server's flags, in the order of the delivery's launcher, and the command around them.

Line numbers are cann-recipes-infer @ 1a7fbd34,
integration/sglang/dsv4-flash-single-npu-moe-offload/scripts/tools/launch_ds4flash_npu.sh,
whose exec line (L306-331) this reproduces; the values come from the plan (serving.plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv4_offload.recipe import Serve

SGLANG_MODULE = "sglang.launch_server"
# `--api-key` goes into argv only when the server starts (supervisor.ServerProcess reads the
# file): plans, specs, records and logs carry this placeholder instead.
API_KEY_PLACEHOLDER = "<api-key from file>"
# The recipe field behind each flag, to tell `--set serve.X=` from the recipe's own value.
FLAG_FIELDS: dict[str, str] = {
    "--device": "device_type", "--page-size": "page_size",
    "--attention-backend": "attention_backend", "--quantization": "quantization",
    "--dtype": "dtype", "--mem-fraction-static": "mem_fraction_static",
    "--max-prefill-tokens": "max_prefill_tokens", "--context-length": "context_length",
    "--watchdog-timeout": "watchdog_timeout", "--kt-method": "kt_method",
    "--kt-num-gpu-experts": "kt_num_gpu_experts",
    "--max-running-requests": "max_running_requests",
    "--chunked-prefill-size": "chunked_prefill_size", "--host": "host", "--port": "port",
}


def fixed_flags(s: Serve, model_path: str, quantization: str, mem_fraction: float) -> list[str]:
    """L307-320: the model, device and attention flags, fixed apart from three launcher knobs.

    QUANTIZATION (L119, L312) and MEM_FRACTION (L316) come from the plan, as does the
    model path (L307).
    """
    return [
        "--model-path", model_path,
        "--device", s.device_type,
        "--tensor-parallel-size", "1",
        "--page-size", str(s.page_size),
        "--attention-backend", s.attention_backend,
        "--quantization", quantization,
        "--disable-shared-experts-fusion",
        "--dtype", s.dtype,
        "--trust-remote-code",
        "--mem-fraction-static", f"{mem_fraction:g}",
        "--disable-radix-cache",
        "--max-prefill-tokens", str(s.max_prefill_tokens),
        "--context-length", str(s.context_length),
        "--watchdog-timeout", str(s.watchdog_timeout),
    ]


def kt_flags(s: Serve, *, gpu_experts: int, weight_path: str, pools: int,
             threads: int) -> list[str]:
    """L322-326: kt-kernel's method, resident experts, GGUF template, subpools and threads."""
    return [
        "--kt-method", s.kt_method,
        "--kt-num-gpu-experts", str(gpu_experts),
        "--kt-weight-path", weight_path,
        "--kt-threadpool-count", str(pools),
        "--kt-cpuinfer", str(threads),
    ]


def run_flags(s: Serve, *, chunk: int, port: int) -> list[str]:
    """L327-330: the run-shaping flags: one request at a time, the chunk, the bind address."""
    return [
        "--max-running-requests", str(s.max_running_requests),
        "--chunked-prefill-size", str(chunk),
        "--host", s.host,
        "--port", str(port),
    ]


def sglang_flags(s: Serve, *, model_path: str, weight_path: str, gpu_experts: int, pools: int,
                 threads: int, chunk: int, mem_fraction: float, port: int, quantization: str,
                 skip_warmup: bool, api_key: bool, extra: Sequence[str]) -> list[str]:
    """The launch flags, in the launcher's order (L306-331), then the extra arguments."""
    flags = fixed_flags(s, model_path, quantization, mem_fraction)
    if skip_warmup:
        flags.append("--skip-server-warmup")  # L321, WARMUP_ARGS (L288-296)
    flags += kt_flags(s, gpu_experts=gpu_experts, weight_path=weight_path, pools=pools,
                      threads=threads)
    flags += run_flags(s, chunk=chunk, port=port)
    if api_key:
        # sglang's --api-key; the real key replaces the placeholder only at exec time
        flags += ["--api-key", API_KEY_PLACEHOLDER]
    return flags + list(extra)


def command(serve: Serve, flags: list[str], model_path: str, python: str) -> list[str]:
    """The argv: ``python -m sglang.launch_server`` and the flags, or serve.command's template.

    serve.command's ``{python}``, ``{host}``, ``{port}`` and ``{model_path}`` are filled in and
    ``{flags}`` stands for the flags (appended at the end when absent), if serve.pass_flags.
    """
    if serve.command is None:
        return [python, "-m", SGLANG_MODULE, *flags]
    values = {"{python}": python, "{host}": serve.host, "{port}": str(serve.port),
              "{model_path}": model_path}
    argv: list[str] = []
    placed = False
    for part in serve.command:
        if part == "{flags}":
            placed = True
            if serve.pass_flags:
                argv += flags
            continue
        for key, value in values.items():
            part = part.replace(key, value)
        argv.append(part)
    if serve.pass_flags and not placed:
        argv += flags
    return argv
