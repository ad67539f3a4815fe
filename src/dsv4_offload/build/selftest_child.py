"""The selftest's child: one MXFP4 MoE forward through kt-kernel, in its own process.

Run as a script by the `selftest` stage (``python selftest_child.py SPEC.json``), possibly by
an emulated aarch64 CPython: it imports only the stdlib, numpy and ``kt_kernel_ext`` (or, on
the target where torch_npu is present, ``kt_kernel.KTMoEWrapper``). It reads the GGUF layer
file itself, runs one forward of ``tokens`` tokens and saves the bf16 output as ``.npy``.
Lines it prints for the parent start with ``SELFTEST``; a crash, a hang or wrong numbers are
judged by the parent, never here.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import struct
import sys
import time
from typing import Any, BinaryIO

AT_HWCAP, AT_HWCAP2 = 16, 26
GGML_TYPE_BF16 = 30  # ggml.h enum ggml_type
GROUP_MIN_LEN = 10  # kt-kernel utils/llamafile.py: "Use forward_one when qlen < 10"
M_BLOCK = 32  # kt-kernel utils/llamafile.py: moe_config.m_block


def emit(kind: str, **fields: object) -> None:
    print(f"SELFTEST {kind} " + json.dumps(fields, sort_keys=True), flush=True)


def auxv_hwcaps(path: str = "/proc/self/auxv") -> dict[int, int]:
    """AT_HWCAP and AT_HWCAP2 from the auxiliary vector (64-bit little-endian pairs)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError:
        return {}
    out: dict[int, int] = {}
    for i in range(0, len(raw) - 15, 16):
        key, value = struct.unpack_from("<QQ", raw, i)
        if key in (AT_HWCAP, AT_HWCAP2):
            out[key] = value
    return out


# --- a minimal GGUF reader (v3): tensor name -> (ggml type, absolute offset, n_bytes) --------

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(fh: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    return struct.unpack(fmt, fh.read(size))[0]


def _skip_value(fh: BinaryIO, kind: int) -> None:
    if kind == _STRING:
        fh.seek(_read(fh, "<Q"), 1)
    elif kind == _ARRAY:
        inner, count = _read(fh, "<I"), _read(fh, "<Q")
        for _ in range(count):
            _skip_value(fh, inner)
    else:
        fh.seek(struct.calcsize(_SCALAR[kind]), 1)


def gguf_tensors(path: str) -> dict[str, tuple[int, int, list[int]]]:
    """name -> (ggml type, absolute data offset, dims) of every tensor of a GGUF v3 file."""
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        _read(fh, "<I")  # version
        n_tensors, n_kv = _read(fh, "<Q"), _read(fh, "<Q")
        alignment = 32
        for _ in range(n_kv):
            key = fh.read(_read(fh, "<Q")).decode()
            kind = _read(fh, "<I")
            if key == "general.alignment" and kind == 4:
                alignment = _read(fh, "<I")
            else:
                _skip_value(fh, kind)
        infos = []
        for _ in range(n_tensors):
            name = fh.read(_read(fh, "<Q")).decode()
            dims = [_read(fh, "<Q") for _ in range(_read(fh, "<I"))]
            infos.append((name, _read(fh, "<I"), _read(fh, "<Q"), dims))
        base = -(-fh.tell() // alignment) * alignment
    return {name: (kind, base + offset, dims) for name, kind, offset, dims in infos}


# --- the two ways in ------------------------------------------------------------------------


def forward_low_level(spec: dict[str, Any], arrays: dict[str, Any]) -> Any:
    """WorkerPoolConfig, CPUInfer, moe.MOEConfig/MOE with numpy buffers (no torch)."""
    import numpy as np

    cpu_infer, moe, _keep = load_low_level(spec, [spec["threads"]])
    hidden, top_k = spec["hidden"], spec["top_k"]
    tokens = spec["tokens"]
    x = np.ascontiguousarray(arrays["x"])  # uint16 bf16 bits [T, H]
    ids = np.ascontiguousarray(arrays["ids"].astype(np.int64))
    w = np.ascontiguousarray(arrays["weights"].astype(np.float32))
    out = np.zeros((tokens, hidden), dtype=np.uint16)
    bsz = np.array([tokens], dtype=np.int32)
    t0 = time.monotonic()
    cpu_infer.submit(moe.forward_task(bsz.ctypes.data, top_k, ids.ctypes.data, w.ctypes.data,
                                      x.ctypes.data, out.ctypes.data, False))
    cpu_infer.sync()
    emit("forward", seconds=round(time.monotonic() - t0, 4), api="low-level")
    return out


def bench_low_level(spec: dict[str, Any]) -> dict[str, Any]:
    """Decode forwards (one token, top_k distinct random experts each, fresh every time) with
    the serve plan's pools, timed one by one: what `selftest --bench` reports."""
    import numpy as np

    bench = spec["bench"]
    cpu_infer, moe, _keep = load_low_level(spec, [bench["threads_per_pool"]] * bench["pools"])
    experts, top_k, hidden = spec["experts"], spec["top_k"], spec["hidden"]
    rng = np.random.default_rng(bench["seed"])
    bits = rng.standard_normal(hidden).astype(np.float32).view(np.uint32) >> 16
    x = np.ascontiguousarray(bits.astype(np.uint16).reshape(1, hidden))
    w = np.full((1, top_k), 1.0 / top_k, dtype=np.float32)
    out = np.zeros((1, hidden), dtype=np.uint16)
    bsz = np.array([1], dtype=np.int32)
    seconds = []
    for i in range(bench["warmup"] + bench["repeats"]):
        ids = np.ascontiguousarray(rng.permutation(experts)[:top_k].astype(np.int64)[None, :])
        t0 = time.perf_counter()
        cpu_infer.submit(moe.forward_task(bsz.ctypes.data, top_k, ids.ctypes.data,
                                          w.ctypes.data, x.ctypes.data, out.ctypes.data, False))
        cpu_infer.sync()
        if i >= bench["warmup"]:
            seconds.append(time.perf_counter() - t0)
    emit("bench", seconds=[round(t, 6) for t in seconds])
    return {"seconds": seconds, "output_nonzero": bool(out.any())}


def load_low_level(spec: dict[str, Any], threads: list[int]) -> tuple[Any, Any, Any]:
    """(cpu_infer, moe, what must outlive them) of the layer, one subpool per entry of
    ``threads`` (subpool i on NUMA node i, as kt-kernel's wrapper lays them out): kt-kernel
    keeps pointers into the mapped file and the mask, so the caller holds them."""
    import numpy as np

    t0 = time.monotonic()
    import kt_kernel_ext as kt

    emit("imported", seconds=round(time.monotonic() - t0, 3),
         module=getattr(kt, "__file__", "?"))
    experts, top_k = spec["experts"], spec["top_k"]
    hidden, inter = spec["hidden"], spec["intermediate"]
    layer = spec["layer"]
    tensors = gguf_tensors(spec["gguf"])
    mapped = np.memmap(spec["gguf"], dtype=np.uint8, mode="r")
    weights = {}
    types = {}
    for role in ("gate", "up", "down"):
        kind, offset, dims = tensors[f"blk.{layer}.ffn_{role}_exps.weight"]
        n_bytes = dims[0] // 32 * 17 * dims[1] * dims[2]  # MXFP4: 17-byte blocks of 32
        # the mapped file itself, no copy: with one subpool kt-kernel aliases the weights and
        # only reads them (kt-kernel/operators/llamafile/moe.hpp:393, "Single-NUMA fast
        # path", d7b5b49 + main_repo/0002), so a real 3.4 GB layer loads at once and only
        # the routed experts' pages are read
        weights[role] = mapped[offset:offset + n_bytes]
        types[role] = kind
    emit("gguf", types=types)
    pool = kt.WorkerPoolConfig()
    pool.subpool_count = len(threads)
    pool.subpool_numa_map = list(range(len(threads)))
    pool.subpool_thread_count = list(threads)
    cpu_infer = kt.CPUInfer(pool)
    gpu_mask = np.zeros(experts, dtype=np.uint8)  # every expert on the CPU
    cfg = kt.moe.MOEConfig(experts, top_k, hidden, inter, gpu_mask.ctypes.data)
    cfg.layer_idx = layer
    cfg.pool = cpu_infer.backend_
    cfg.m_block = M_BLOCK
    cfg.group_min_len = GROUP_MIN_LEN
    cfg.max_len = cfg.group_max_len = max(spec["tokens"], GROUP_MIN_LEN)
    cfg.gate_proj = weights["gate"].ctypes.data
    cfg.up_proj = weights["up"].ctypes.data
    cfg.down_proj = weights["down"].ctypes.data
    cfg.gate_type, cfg.up_type, cfg.down_type = types["gate"], types["up"], types["down"]
    cfg.hidden_type = GGML_TYPE_BF16
    moe = kt.moe.MOE(cfg)
    p2l = np.arange(experts, dtype=np.int32)
    t0 = time.monotonic()
    cpu_infer.submit(moe.load_weights_task(p2l.ctypes.data))
    cpu_infer.sync()
    emit("loaded", seconds=round(time.monotonic() - t0, 3))
    return cpu_infer, moe, (mapped, weights, gpu_mask, cfg, pool)


def forward_wrapper(spec: dict[str, Any], arrays: dict[str, Any]) -> Any:
    """kt_kernel.KTMoEWrapper, as the patched sglang KT wrapper builds it (target only)."""
    import numpy as np
    import torch

    t0 = time.monotonic()
    from kt_kernel import KTMoEWrapper

    emit("imported", seconds=round(time.monotonic() - t0, 3), module="kt_kernel")
    wrapper = KTMoEWrapper(
        layer_idx=spec["layer"], num_experts=spec["experts"],
        num_experts_per_tok=spec["top_k"], hidden_size=spec["hidden"],
        moe_intermediate_size=spec["intermediate"], gpu_experts_mask=None,
        cpuinfer_threads=spec["threads"], threadpool_count=1,
        weight_path=os.path.dirname(spec["gguf"]),
        chunked_prefill_size=max(spec["tokens"], GROUP_MIN_LEN), method="LLAMAFILE")
    t0 = time.monotonic()
    wrapper.load_weights()
    emit("loaded", seconds=round(time.monotonic() - t0, 3))
    x = torch.from_numpy(arrays["x"].astype(np.int16)).view(torch.bfloat16)
    ids = torch.from_numpy(arrays["ids"].astype(np.int64))
    w = torch.from_numpy(arrays["weights"].astype(np.float32))
    t0 = time.monotonic()
    out = wrapper.forward(x, ids, w, None)
    emit("forward", seconds=round(time.monotonic() - t0, 4), api="wrapper")
    return out.detach().to("cpu").contiguous().view(torch.int16).numpy().view(np.uint16)


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as fh:
        spec = json.load(fh)
    machine = platform.machine()
    hwcaps = auxv_hwcaps()
    # before the extension loads: if it dies of SIGILL, the parent still knows this CPU
    emit("cpu", machine=machine, hwcap=hwcaps.get(AT_HWCAP), hwcap2=hwcaps.get(AT_HWCAP2))
    if spec.get("bench"):
        result = bench_low_level(spec)
        with open(spec["out"] + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(result, fh)
        os.replace(spec["out"] + ".tmp", spec["out"])
        emit("done", out=spec["out"])
        return 0
    import numpy as np

    arrays = {k: np.load(spec["arrays"][k]) for k in ("x", "ids", "weights")}
    api = spec.get("api", "auto")
    if api == "auto":
        import importlib.util

        api = "wrapper" if importlib.util.find_spec("torch_npu") is not None else "low-level"
    out = forward_wrapper(spec, arrays) if api == "wrapper" else forward_low_level(spec, arrays)
    tmp = spec["out"] + ".tmp.npy"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    with open(tmp, "xb") as fh:  # exclusive: a symlink planted there is not followed
        np.save(fh, out)
    os.replace(tmp, spec["out"])
    emit("done", out=spec["out"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
