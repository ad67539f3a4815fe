"""Seeded damaged GGUF layer files and safetensors shards, for the reader fuzz test and bench.

Each case starts from a valid file and breaks it the ways a bad disk, a truncated copy or a
hostile source would: flipped and inserted bytes, truncation, absurd counts and lengths, and
(for safetensors) headers that are lists, nested, carry inf/NaN, overlap or lie about sizes.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

from dsv4_offload.weights.checkpoint import MoeDims
from dsv4_offload.weights.gguf_io import LayerLayout

DIMS = MoeDims(layers=2, experts=4, experts_per_token=2, hidden=64, intermediate=32)
LAYOUT = LayerLayout(0, DIMS, "deepseek4", "fuzz-layer-0", 32)


def valid_gguf() -> bytes:
    return LAYOUT.header + bytes(LAYOUT.file_bytes - len(LAYOUT.header))


def valid_safetensors() -> bytes:
    header = {"a": {"dtype": "I8", "shape": [4, 8], "data_offsets": [0, 32]},
              "b": {"dtype": "F32", "shape": [2, 2], "data_offsets": [32, 48]},
              "__metadata__": {"format": "pt"}}
    return _safetensors(header, 48)


def _safetensors(header: object, data: int, raw: bytes | None = None) -> bytes:
    blob = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + bytes(data)


def _byte_damage(rng: random.Random, data: bytes, head: int) -> bytes:
    buf = bytearray(data)
    kind = rng.randrange(6)
    at = rng.randrange(max(1, min(head, len(buf))))
    if kind == 0:  # flip a few bytes in the header
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(max(1, min(head, len(buf))))
            buf[i] ^= rng.randrange(1, 256)
    elif kind == 1:  # truncate
        del buf[rng.randrange(len(buf)):]
    elif kind == 2:  # insert junk
        buf[at:at] = rng.randbytes(rng.randint(1, 16))
    elif kind == 3:  # an absurd 64-bit count or length somewhere in the header
        value = rng.choice([2**63 - 1, 2**64 - 1, 10**12, 2**31, 0])
        buf[at:at + 8] = struct.pack("<Q", value)
    elif kind == 4:  # a 32-bit type id or string length gone wrong
        buf[at:at + 4] = struct.pack("<I", rng.choice([0xFFFFFFFF, 13, 99, 2**31]))
    else:  # non-UTF-8 inside a string
        buf[at:at + 2] = b"\xff\xfe"
    return bytes(buf)


def _safetensors_damage(rng: random.Random) -> bytes:
    kind = rng.randrange(12)
    big = 2**64 - 1
    if kind == 0:
        return _safetensors([1, 2, 3], 16)
    if kind == 1:
        return _safetensors({"a": {"dtype": "I8", "shape": [[4], [8]],
                                   "data_offsets": [0, 32]}}, 32)
    if kind == 2:
        return _safetensors(None, 16, b'{"a": {"dtype": "F32", "shape": [Infinity], '
                                      b'"data_offsets": [0, NaN]}}')
    if kind == 3:  # overlapping
        return _safetensors({"a": {"dtype": "I8", "shape": [32], "data_offsets": [0, 32]},
                             "b": {"dtype": "I8", "shape": [32], "data_offsets": [16, 48]}}, 48)
    if kind == 4:  # offsets past the file
        return _safetensors({"a": {"dtype": "I8", "shape": [10**6],
                                   "data_offsets": [0, 10**6]}}, 8)
    if kind == 5:  # dtype and shape disagree with the byte length
        return _safetensors({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, 8)
    if kind == 6:  # a header length of several GiB
        return struct.pack("<Q", 5 << 30) + b"{}"
    if kind == 7:
        return _safetensors({"a": {"dtype": 7, "shape": "x", "data_offsets": {}}}, 8)
    if kind == 8:
        return _safetensors({"a": {"dtype": "I8", "shape": [big, big],
                                   "data_offsets": [-5, big]}}, 8)
    if kind == 9:  # deep nesting
        return _safetensors(None, 0, b"[" * 100000 + b"]" * 100000)
    if kind == 10:
        return _safetensors(None, 0, rng.randbytes(rng.randint(1, 64)))
    return _byte_damage(rng, valid_safetensors(), 8 + len(json.dumps({})) + 200)


def cases(kind: str, count: int, seed: int = 18) -> Iterator[bytes]:
    """``count`` damaged files of ``kind`` ('gguf' or 'safetensors'), the same for a seed."""
    rng = random.Random(f"{kind}-{seed}")
    make: Callable[[], bytes]
    if kind == "gguf":
        good = valid_gguf()
        make = lambda: _byte_damage(rng, good, len(LAYOUT.header))  # noqa: E731
    else:
        make = lambda: _safetensors_damage(rng)  # noqa: E731
    for _ in range(count):
        yield make()


def run_reader(kind: str, path: Path) -> object:
    """Read ``path`` as a user's command would; returns what the reader returned."""
    if kind == "gguf":
        from dsv4_offload.weights.gguf_io import structural_problems

        return structural_problems(path, LAYOUT)
    from dsv4_offload.weights.checkpoint import read_safetensors_header

    return read_safetensors_header(path)
