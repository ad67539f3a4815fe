"""MXFP4 facts and the lossless repack from the checkpoint's layout to GGUF blocks.

The native checkpoint stores, per row, K/2 bytes of E2M1 codes in *consecutive* order
(byte i: low nibble = element 2i, high nibble = element 2i+1) and K/32 E8M0 exponents.
A GGUF MXFP4 block (type 39) is 17 bytes: the E8M0 byte verbatim, then 16 bytes in
*half-block* order (byte j: low nibble = element j, high nibble = element j+16).
Everything here is vectorized numpy on uint8/uint64 views; nothing is quantized.
"""

from __future__ import annotations

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

_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_FOUR = np.uint64(4)


def block_row_bytes(k: int) -> int:
    """Bytes of one GGUF row of K elements (K/32 blocks of 17 bytes)."""
    return k // BLOCK_ELEMENTS * BLOCK_BYTES


def check_row_length(k: int, what: str) -> None:
    if k <= 0 or k % BLOCK_ELEMENTS:
        raise ValueError(f"{what}: K = {k} is not a positive multiple of {BLOCK_ELEMENTS}")


def halfblock_codes(weight: np.ndarray) -> np.ndarray:
    """Consecutive-order code bytes [..., K/2] -> half-block order, as a [G, 16] uint8 array.

    For output bytes 2i and 2i+1 of a block, with a = source byte i and b = source byte
    8+i: out[2i] = lo(a) | lo(b) << 4 and out[2i+1] = hi(a) | hi(b) << 4. The nibble
    algebra runs on the two uint64 halves of each 16-byte group (8 bytes at a time); one
    strided byte copy then interleaves the two results. ~5x a per-nibble formulation.
    """
    groups = np.ascontiguousarray(weight).reshape(-1, 2, 8).view(np.uint64)[..., 0]
    first, second = groups[:, 0], groups[:, 1]
    even = second & _LOW_NIBBLES
    even <<= _FOUR
    even |= first & _LOW_NIBBLES
    odd = first >> _FOUR
    odd &= _LOW_NIBBLES
    odd |= second & _HIGH_NIBBLES
    out = np.empty((groups.shape[0], 8, 2), dtype=np.uint8)
    out[..., 0] = even.view(np.uint8).reshape(-1, 8)
    out[..., 1] = odd.view(np.uint8).reshape(-1, 8)
    return out.reshape(-1, BLOCK_CODE_BYTES)


def repack_into(weight: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    """Write GGUF MXFP4 blocks of `weight` [N, K/2] and `scale` [N, K/32] into `out`.

    `out` is a C-contiguous uint8 array of N * K/32 * 17 bytes (any shape).
    """
    blocks = out.reshape(-1, BLOCK_BYTES)
    if blocks.shape[0] != scale.size or weight.size != scale.size * BLOCK_CODE_BYTES:
        raise ValueError(
            f"weight {weight.shape}, scale {scale.shape} and output {out.shape} disagree"
        )
    blocks[:, 0] = scale.reshape(-1)
    blocks[:, 1:] = halfblock_codes(weight)


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
