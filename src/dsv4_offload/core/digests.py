"""File digests: the one reader that hashes a file, for downloads, layers and wheels."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

# large reads: hashlib releases the GIL on them, so several files hash in parallel threads
HASH_CHUNK = 16 << 20


def hash_file(hasher: Any, path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """Feed ``path`` to ``hasher`` (a hashlib object) once; ``on_bytes`` hears each chunk."""
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            hasher.update(view[:n])
            if on_bytes is not None:
                on_bytes(n)
    return str(hasher.hexdigest())


def file_sha256(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """The sha256 of a file, hex."""
    return hash_file(hashlib.sha256(), path, on_bytes)
