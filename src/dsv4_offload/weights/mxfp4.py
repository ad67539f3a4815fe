"""MXFP4 facts and the lossless repack from the checkpoint's layout to GGUF blocks.

The native checkpoint stores, per row, K/2 bytes of E2M1 codes in *consecutive* order
(byte i: low nibble = element 2i, high nibble = element 2i+1) and K/32 E8M0 exponents.
A GGUF MXFP4 block (type 39) is 17 bytes: the E8M0 byte verbatim, then 16 bytes in
*half-block* order (byte j: low nibble = element j, high nibble = element j+16).
The repack is vectorized numpy on uint8/uint64 views, or the same algebra as a small C
loop when a compiler is at hand (see below); nothing is quantized.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

GGML_TYPE_MXFP4 = 39  # llama.cpp upstream id; the delivery's patched b3173 uses the same
BLOCK_ELEMENTS = 32  # elements per MXFP4 block (= one E8M0 scale group)
BLOCK_CODE_BYTES = BLOCK_ELEMENTS // 2
BLOCK_BYTES = 1 + BLOCK_CODE_BYTES  # E8M0 byte + 16 code bytes
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# OCP MX v1.0 E2M1 values by 4-bit code (sign in bit 3)
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

KERNEL_SOURCE = Path(__file__).parent / "native" / "mxfp4_repack.c"
KERNEL_ENV = "DSV4_MXFP4_KERNEL"  # "numpy" skips the compiled loop

# blocks per step of the numpy repack: few enough that its scratch buffers stay in L2
CHUNK_BLOCKS = 16384

_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_FOUR = np.uint64(4)


def block_row_bytes(k: int) -> int:
    """Bytes of one GGUF row of K elements (K/32 blocks of 17 bytes)."""
    return k // BLOCK_ELEMENTS * BLOCK_BYTES


# --- the compiled loop (optional) ----------------------------------------------------------
# numpy needs ~10 passes over the data for the repack (~1 GB/s on one core here); the same
# algebra as one C loop runs ~4x faster, which takes the conversion from CPU-bound to
# I/O-bound. It is built locally with the system C compiler on first use (no network) and
# cached; without a compiler, numpy does the work and the output is the same bytes.

_kernel_lock = threading.Lock()
_kernel: dict[str, object] = {}


def kernel_status() -> str:
    """'native (<path>)' or 'numpy (<why>)': which repack implementation is in use."""
    native_repack()
    return str(_kernel.get("status", "numpy"))


def native_repack() -> Callable[[np.ndarray, np.ndarray, np.ndarray, int], None] | None:
    """The compiled repack, built and loaded once per process; None if unavailable."""
    with _kernel_lock:
        if "fn" not in _kernel:
            _kernel["fn"], _kernel["status"] = _load_kernel()
        return _kernel["fn"]  # type: ignore[return-value]


def _load_kernel() -> tuple[Callable[..., None] | None, str]:
    if os.environ.get(KERNEL_ENV, "").lower() == "numpy":
        return None, f"numpy ({KERNEL_ENV}=numpy)"
    from dsv4_offload.core.runner import capture
    from dsv4_offload.workspace.store import cache_root

    source = KERNEL_SOURCE.read_bytes()
    tag = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:16]
    library = cache_root() / "kernels" / f"mxfp4_repack-{tag}.so"
    if not library.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            return None, "numpy (no C compiler found)"
        try:
            library.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
        except OSError as exc:  # the cache, not the GGUF directory: say which
            return None, (f"numpy (the kernel cache {library.parent} is not writable: "
                          f"{exc.strerror}; set DSV4_CACHE to a writable directory for the "
                          "C kernel)")
        os.close(fd)
        try:
            built = capture([compiler, "-O3", "-shared", "-fPIC", "-o", tmp,
                             str(KERNEL_SOURCE)], timeout=120)
            if built.returncode != 0:
                return None, f"numpy ({compiler} failed: {built.stderr.strip()[:200]})"
            os.replace(tmp, library)  # atomic: concurrent first uses race harmlessly
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"numpy (building the kernel failed: {exc})"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as exc:
        return None, f"numpy (loading {library} failed: {exc})"
    fn = lib.dsv4_mxfp4_repack
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = None

    def repack(codes: np.ndarray, scales: np.ndarray, out: np.ndarray, nblocks: int) -> None:
        fn(codes.ctypes.data, scales.ctypes.data, out.ctypes.data, nblocks)  # drops the GIL

    if not _kernel_agrees(repack):
        return None, f"numpy ({library} disagrees with the numpy reference)"
    return repack, f"native ({library})"


def _kernel_agrees(repack: Callable[..., None]) -> bool:
    """A compiled loop must match the numpy reference before it is trusted with data."""
    rng = np.random.default_rng(0)
    weight = rng.integers(0, 256, (4, 64), dtype=np.uint8)
    scale = rng.integers(0, 256, (4, 4), dtype=np.uint8)
    want = np.empty(16 * BLOCK_BYTES, np.uint8)
    Repacker(native=False).repack_into(weight, scale, want)
    got = np.empty_like(want)
    repack(weight, scale, got, scale.size)
    return bool(np.array_equal(got, want))


class Repacker:
    """Consecutive-order codes + scales -> GGUF blocks, with reused scratch buffers.

    For output bytes 2i and 2i+1 of a block, with a = source byte i and b = source byte
    8+i: out[2i] = lo(a) | lo(b) << 4 and out[2i+1] = hi(a) | hi(b) << 4. The nibble
    algebra runs on the two uint64 halves of each 16-byte group (8 bytes per element),
    then two strided byte copies interleave the results into the 17-byte blocks. Work goes
    in chunks that stay in L2 with preallocated scratch, so a call allocates nothing:
    ~5x a per-nibble formulation. One instance per thread.
    """

    def __init__(self, chunk_blocks: int = CHUNK_BLOCKS, native: bool = True) -> None:
        self.chunk = chunk_blocks
        self._native = native_repack() if native else None
        self._even = np.empty(chunk_blocks, np.uint64)
        self._odd = np.empty(chunk_blocks, np.uint64)
        self._scratch = np.empty(chunk_blocks, np.uint64)
        self._codes = np.empty((chunk_blocks, BLOCK_CODE_BYTES), np.uint8)

    def repack_into(self, weight: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
        """Write GGUF MXFP4 blocks of `weight` [N, K/2] and `scale` [N, K/32] into `out`.

        `out` is a C-contiguous uint8 array of N * K/32 * 17 bytes (any shape).
        """
        if not out.flags.c_contiguous:
            raise ValueError("the output buffer must be C-contiguous")
        blocks = out.reshape(-1, BLOCK_BYTES)
        if blocks.shape[0] != scale.size or weight.size != scale.size * BLOCK_CODE_BYTES:
            raise ValueError(
                f"weight {weight.shape}, scale {scale.shape} and output {out.shape} disagree"
            )
        if self._native is not None:
            self._native(np.ascontiguousarray(weight), np.ascontiguousarray(scale), out,
                         scale.size)
            return
        blocks[:, 0] = scale.reshape(-1)
        groups = np.ascontiguousarray(weight).reshape(-1, 2, 8).view(np.uint64)[..., 0]
        for lo in range(0, groups.shape[0], self.chunk):
            hi = min(groups.shape[0], lo + self.chunk)
            self._codes_into(groups[lo:hi], blocks[lo:hi, 1:])

    def _codes_into(self, groups: np.ndarray, dest: np.ndarray) -> None:
        n = groups.shape[0]
        first, second = groups[:, 0], groups[:, 1]
        even, odd, scratch = self._even[:n], self._odd[:n], self._scratch[:n]
        np.bitwise_and(second, _LOW_NIBBLES, out=even)
        np.left_shift(even, _FOUR, out=even)
        np.bitwise_and(first, _LOW_NIBBLES, out=scratch)
        np.bitwise_or(even, scratch, out=even)
        np.right_shift(first, _FOUR, out=odd)
        np.bitwise_and(odd, _LOW_NIBBLES, out=odd)
        np.bitwise_and(second, _HIGH_NIBBLES, out=scratch)
        np.bitwise_or(odd, scratch, out=odd)
        # interleave in a contiguous scratch first: a 16-byte row copy into the 17-byte
        # blocks is faster than two 1-byte-strided copies straight into them
        codes = self._codes[:n].reshape(n, 8, 2)
        codes[..., 0] = even.view(np.uint8).reshape(n, 8)
        codes[..., 1] = odd.view(np.uint8).reshape(n, 8)
        dest[...] = self._codes[:n]


def halfblock_codes(weight: np.ndarray) -> np.ndarray:
    """Consecutive-order code bytes [..., K/2] -> half-block order, as a [G, 16] uint8 array."""
    groups = weight.size // BLOCK_CODE_BYTES
    blocks = np.empty((groups, BLOCK_BYTES), np.uint8)
    repacker = Repacker(min(groups, CHUNK_BLOCKS), native=False)
    repacker.repack_into(weight, np.zeros(groups, np.uint8), blocks)
    return blocks[:, 1:]


def repack_into(weight: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """Write GGUF MXFP4 blocks of `weight` [N, K/2] and `scale` [N, K/32] into `out`."""
    Repacker(min(max(scale.size, 1), CHUNK_BLOCKS)).repack_into(weight, scale, out)


def repack(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """GGUF MXFP4 rows [N, K/32*17] of one native weight [N, K/2] and scale [N, K/32]."""
    n = weight.shape[0]
    out = np.empty((n, scale.shape[-1] * BLOCK_BYTES), dtype=np.uint8)
    repack_into(weight, scale, out)
    return out


def consecutive_codes(blocks: np.ndarray) -> np.ndarray:
    """The inverse of the repack's code part: GGUF blocks [..., 17] -> native code bytes."""
    qs = blocks.reshape(-1, BLOCK_BYTES)[:, 1:]
    low, high = qs & 0x0F, qs >> 4  # elements 0..15 and 16..31 of each block
    elements = np.concatenate([low, high], axis=1)  # [G, 32], element order
    return (elements[:, 0::2] | (elements[:, 1::2] << 4)).astype(np.uint8)


def e8m0_to_float(exponents: np.ndarray) -> np.ndarray:
    """2^(e-127) as float32 (e = 255 is NaN, per OCP MX); exact for every e in 0..254."""
    e = exponents.astype(np.int32)
    with np.errstate(over="ignore"):  # e = 255 overflows to inf before it becomes NaN
        out = np.ldexp(np.float32(1.0), e - E8M0_BIAS).astype(np.float32)
    out[e == E8M0_NAN] = np.nan
    return out


def dequantize_native(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """OCP MX reference: value = E2M1[code] x 2^(e-127), from the checkpoint's own layout.

    weight [N, K/2] uint8/int8 (consecutive nibbles), scale [N, K/32] -> float32 [N, K].
    """
    w = weight.view(np.uint8)
    n = w.shape[0]
    codes = np.empty((n, w.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = w & 0x0F
    codes[:, 1::2] = w >> 4
    values = E2M1_VALUES[codes].reshape(n, -1, BLOCK_ELEMENTS)
    with np.errstate(over="ignore"):  # 6 x 2^127 is inf in float32, as in ggml
        return (values * e8m0_to_float(scale.view(np.uint8))[..., None]).reshape(n, -1)


def dequantize_blocks(blocks: np.ndarray) -> np.ndarray:
    """Our reading of GGUF MXFP4 blocks [..., 17] -> float32 [..., 32] (half-block order)."""
    b = blocks.reshape(-1, BLOCK_BYTES)
    qs = b[:, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    with np.errstate(over="ignore"):
        return E2M1_VALUES[codes] * e8m0_to_float(b[:, 0])[:, None]
