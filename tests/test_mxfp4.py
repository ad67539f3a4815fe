"""The MXFP4 repack and dequantization against references written independently here."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

from dsv4_offload.weights import mxfp4


# OCP MX v1.0, E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0
def e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    magnitude = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return sign * magnitude


def reference_halfblock(weight: np.ndarray) -> np.ndarray:
    """Per-nibble, per-block loop: unpack 32 codes in element order, pack half-block."""
    out = np.empty_like(weight)
    for r in range(weight.shape[0]):
        for b in range(weight.shape[1] // 16):
            src = weight[r, 16 * b: 16 * b + 16]
            codes = []
            for byte in src:
                codes += [int(byte) & 15, int(byte) >> 4]
            for j in range(16):
                out[r, 16 * b + j] = codes[j] | (codes[j + 16] << 4)
    return out


def reference_values(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    n, kh = weight.shape
    out = np.empty((n, kh * 2), np.float32)
    for r in range(n):
        for i in range(kh * 2):
            code = (int(weight[r, i // 2]) >> (4 * (i % 2))) & 15
            e = int(scale[r, i // 32])
            out[r, i] = math.nan if e == 255 else e2m1(code) * math.ldexp(1.0, e - 127)
    return out


@pytest.fixture
def rows() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(42)
    weight = rng.integers(0, 256, (6, 64), dtype=np.uint8)  # K = 128: 4 blocks per row
    scale = rng.integers(100, 150, (6, 4), dtype=np.uint8)
    scale[0, :] = [0, 1, 2, 252]  # subnormal and large exponents (no float32 overflow)
    weight[1, :] = np.arange(64, dtype=np.uint8) * 4 + 1  # a visible ramp of codes
    return weight, scale


def test_e2m1_table_is_the_ocp_one() -> None:
    assert [e2m1(c) for c in range(16)] == mxfp4.E2M1_VALUES.tolist()
    assert mxfp4.BLOCK_BYTES == 17 and int(gguf.GGMLQuantizationType.MXFP4) == mxfp4.GGML_TYPE_MXFP4


def test_halfblock_order_matches_a_per_nibble_loop(rows: tuple[np.ndarray, np.ndarray]) -> None:
    weight, _ = rows
    got = mxfp4.halfblock_codes(weight).reshape(weight.shape)
    np.testing.assert_array_equal(got, reference_halfblock(weight))


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "numpy"])
def test_both_repack_implementations_write_the_same_blocks(native: bool) -> None:
    if native and mxfp4.native_repack() is None:
        pytest.skip(f"no compiled kernel here: {mxfp4.kernel_status()}")
    rng = np.random.default_rng(7)
    weight = rng.integers(0, 256, (40, 96), dtype=np.uint8)  # 240 blocks: several chunks
    scale = rng.integers(0, 256, (40, 6), dtype=np.uint8)
    out = np.empty(40 * 6 * 17, np.uint8)
    mxfp4.Repacker(chunk_blocks=64, native=native).repack_into(weight, scale, out)
    blocks = out.reshape(40, 6, 17)
    np.testing.assert_array_equal(blocks[..., 0], scale)
    np.testing.assert_array_equal(blocks[..., 1:].reshape(40, 96), reference_halfblock(weight))


def test_one_block_by_hand() -> None:
    # element i has code i % 16: consecutive bytes are 0x10, 0x32, ..., half-block j = j | j<<4
    weight = np.array([[(2 * i % 16) | ((2 * i + 1) % 16) << 4 for i in range(16)]], np.uint8)
    scale = np.array([[127]], np.uint8)
    block = mxfp4.repack(weight, scale)[0]
    assert block[0] == 127
    assert block[1:].tolist() == [(j % 16) | ((j + 16) % 16) << 4 for j in range(16)]


def test_block_layout_scale_then_codes(rows: tuple[np.ndarray, np.ndarray]) -> None:
    weight, scale = rows
    blocks = mxfp4.repack(weight, scale).reshape(6, 4, 17)
    np.testing.assert_array_equal(blocks[..., 0], scale)
    np.testing.assert_array_equal(blocks[..., 1:].reshape(6, 64), reference_halfblock(weight))


def test_values_equal_ocp_and_gguf_dequantization(rows: tuple[np.ndarray, np.ndarray]) -> None:
    weight, scale = rows
    ocp = reference_values(weight, scale)
    blocks = mxfp4.repack(weight, scale)
    by_gguf = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(by_gguf, ocp)
    np.testing.assert_array_equal(mxfp4.dequantize_native(weight, scale), ocp)
    np.testing.assert_array_equal(mxfp4.dequantize_blocks(blocks).reshape(6, -1), ocp)


def test_repack_is_lossless(rows: tuple[np.ndarray, np.ndarray]) -> None:
    weight, scale = rows
    blocks = mxfp4.repack(weight, scale)
    np.testing.assert_array_equal(mxfp4.consecutive_codes(blocks).reshape(weight.shape), weight)


def test_nan_exponent_and_mismatched_shapes() -> None:
    weight = np.zeros((1, 16), np.uint8)
    assert np.isnan(mxfp4.dequantize_native(weight, np.array([[255]], np.uint8))).all()
    with pytest.raises(ValueError, match="disagree"):
        mxfp4.repack_into(weight, np.zeros((1, 2), np.uint8), np.empty(34, np.uint8))


CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
REPACK_MAIN = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
void dsv4_mxfp4_repack(const uint8_t *codes, const uint8_t *scales, uint8_t *out, size_t n);
int main(int argc, char **argv) {
    size_t n = (size_t)atol(argv[1]);
    uint8_t *codes = malloc(16 * n), *scales = malloc(n), *out = malloc(17 * n);
    if (fread(codes, 1, 16 * n, stdin) != 16 * n || fread(scales, 1, n, stdin) != n) return 2;
    dsv4_mxfp4_repack(codes, scales, out, n);
    fwrite(out, 1, 17 * n, stdout);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None,
                    reason="needs gcc-aarch64-linux-gnu and qemu-user")
def test_compiled_repack_gives_the_same_bytes_on_aarch64(tmp_path: Path) -> None:
    """The Kunpeng host builds the same C file: check it on an emulated Cortex-A76."""
    main = tmp_path / "main.c"
    main.write_text(REPACK_MAIN)
    binary = tmp_path / "repack"
    subprocess.run([CROSS_CC, "-O3", "-static", "-o", str(binary), str(main),
                    str(mxfp4.KERNEL_SOURCE)], check=True, capture_output=True)
    rng = np.random.default_rng(3)
    weight = rng.integers(0, 256, (12, 48), dtype=np.uint8)
    scale = rng.integers(0, 256, (12, 3), dtype=np.uint8)
    ran = subprocess.run([QEMU, "-cpu", "cortex-a76", str(binary), str(scale.size)],
                         input=weight.tobytes() + scale.tobytes(), capture_output=True,
                         check=True, timeout=60)
    want = np.empty(scale.size * 17, np.uint8)
    mxfp4.Repacker(native=False).repack_into(weight, scale, want)
    assert ran.stdout == want.tobytes()


def test_an_unusable_kernel_cache_falls_back_to_numpy_naming_dsv4_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 21: the cache was reported as 'check the GGUF directory is writable' by convert."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    monkeypatch.setenv("DSV4_CACHE", str(blocker / "cache"))
    monkeypatch.delenv(mxfp4.KERNEL_ENV, raising=False)
    fn, status = mxfp4._load_kernel()
    assert fn is None
    assert status.startswith(f"numpy (the kernel cache {blocker / 'cache' / 'kernels'} is not "
                             "writable")
    assert "set DSV4_CACHE to a writable directory" in status
