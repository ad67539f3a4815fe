"""A stand-in for kt-kernel's ``kt_kernel_ext``: the API surface the selftest child uses.

Tests copy this file as ``kt_kernel_ext.py`` where the build puts the real module. What it
does is chosen by ``KT_STANDIN_MODE``:
- ``right``: computes the MoE itself (its own MXFP4 decoding, numpy), so the verdict passes;
- ``zeros``: leaves the output untouched (zeros);
- ``delivered-x86``: what the delivered code does on x86 (tests/.. ktkernel-x86-notes §5.2):
  fewer than 10 tokens abort with "llamafile not supported", 10 or more return zeros;
- ``sigill``: the process dies of SIGILL at import (instructions the CPU lacks);
- ``hang``: the forward never returns;
- ``noisy``: the right result plus 20 % noise (a low cosine);
- ``decode-zeros``: right, but a forward of one token (a decode) leaves zeros;
- ``needs-sync``: zeros unless ``KT_FORCE_SYNC_SUBMIT=1`` (the delivery's appendix D script
  sets it: an isolated call's output stays zero without it), else ``right``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import types

import numpy as np

MODE = os.environ.get("KT_STANDIN_MODE", "right")
if MODE == "sigill":
    os.kill(os.getpid(), signal.SIGILL)

# OCP MX E2M1 values by code, written out again here: the stand-in must not share the
# project's decoding with the reference it is compared against
_FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _bytes_at(address: int, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * count).from_address(address))


def _decode(address: int, expert: int, rows: int, k: int) -> np.ndarray:
    """One expert's [rows, k] matrix of a ggml [E, rows, k/32*17] MXFP4 tensor."""
    size = rows * (k // 32) * 17
    blocks = _bytes_at(address + expert * size, size).reshape(-1, 17)
    scale = np.exp2(blocks[:, 0].astype(np.float32) - 127)
    low, high = blocks[:, 1:] & 0x0F, blocks[:, 1:] >> 4
    values = _FP4[np.concatenate([low, high], axis=1)] * scale[:, None]
    return values.reshape(rows, k)


class WorkerPoolConfig:
    subpool_count = 0
    subpool_numa_map: list[int] = []
    subpool_thread_count: list[int] = []


class CPUInfer:
    def __init__(self, config: WorkerPoolConfig) -> None:
        self.backend_ = object()
        self._queue: list = []  # type: ignore[type-arg]

    def submit(self, task) -> None:  # type: ignore[no-untyped-def]
        self._queue.append(task)

    def sync(self) -> None:
        while self._queue:
            self._queue.pop(0)()


class MOEConfig:
    def __init__(self, experts: int, top_k: int, hidden: int, inter: int, mask: int) -> None:
        self.expert_num, self.num_experts_per_tok = experts, top_k
        self.hidden_size, self.intermediate_size = hidden, inter


class MOE:
    def __init__(self, cfg: MOEConfig) -> None:
        self.cfg = cfg

    def load_weights_task(self, p2l: int):  # type: ignore[no-untyped-def]
        def load() -> None:
            # as kt-kernel's single-NUMA path: keep the pointers, read an expert when routed
            self.cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        return load

    def expert(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if e not in self.cache:
            c = self.cfg
            h, i = c.hidden_size, c.intermediate_size
            self.cache[e] = (_decode(c.gate_proj, e, i, h), _decode(c.up_proj, e, i, h),
                             _decode(c.down_proj, e, h, i))
        return self.cache[e]

    def forward_task(self, bsz: int, top_k: int, ids: int, weights: int, x: int, out: int,
                     incremental: bool = False):  # type: ignore[no-untyped-def]
        def forward() -> None:
            c = self.cfg
            tokens = int(np.frombuffer(_bytes_at(bsz, 4).tobytes(), np.int32)[0])
            h = c.hidden_size
            result = np.ctypeslib.as_array(
                (ctypes.c_uint16 * (tokens * h)).from_address(out)).reshape(tokens, h)
            if MODE == "hang":
                time.sleep(3600)
            if MODE == "delivered-x86" and tokens < 10:
                sys.stderr.write("terminate called after throwing an instance of "
                                 "'std::runtime_error'\n  what():  llamafile not supported\n")
                sys.stderr.flush()
                os.abort()
            unsynced = MODE == "needs-sync" and os.environ.get("KT_FORCE_SYNC_SUBMIT") != "1"
            if MODE in ("zeros", "delivered-x86") or unsynced or (
                    MODE == "decode-zeros" and tokens == 1):
                return
            xs = (np.frombuffer(_bytes_at(x, tokens * h * 2).tobytes(), np.uint16)
                  .astype(np.uint32) << 16).view(np.float32).reshape(tokens, h)
            sel = np.frombuffer(_bytes_at(ids, tokens * top_k * 8).tobytes(), np.int64)
            wts = np.frombuffer(_bytes_at(weights, tokens * top_k * 4).tobytes(), np.float32)
            sel, wts = sel.reshape(tokens, top_k), wts.reshape(tokens, top_k)
            y = np.zeros((tokens, h), np.float32)
            for t in range(tokens):
                for j in range(top_k):
                    gate, up, down = self.expert(int(sel[t, j]))
                    g, u = gate @ xs[t], up @ xs[t]
                    y[t] += wts[t, j] * (down @ (g / (1 + np.exp(-g)) * u))
            if MODE == "noisy":
                y += np.random.default_rng(0).standard_normal(y.shape).astype(np.float32) \
                    * 0.2 * np.abs(y).mean()
            result[...] = (y.view(np.uint32) + 0x8000 >> 16).astype(np.uint16)
        return forward


moe = types.ModuleType("kt_kernel_ext.moe")
moe.MOEConfig = MOEConfig  # type: ignore[attr-defined]
moe.MOE = MOE  # type: ignore[attr-defined]
sys.modules["kt_kernel_ext.moe"] = moe
