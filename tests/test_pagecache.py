"""Page-cache residency (mincore) and the warm-up serve runs before loading, on real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsv4_offload.serving import pagecache

MIB = 1 << 20


def cold_files(tmp_path: Path, sizes: list[int]) -> list[Path]:
    """Files written, synced and dropped from the page cache (skip where it cannot drop)."""
    paths = []
    for i, size in enumerate(sizes):
        p = tmp_path / f"dsv4_layer{i}_mxfp4.gguf"
        with open(p, "wb") as fh:
            fh.write(os.urandom(size))
            fh.flush()
            os.fsync(fh.fileno())
        pagecache.drop_from_cache(p)
        paths.append(p)
    if any(pagecache.resident_bytes(p)[0] for p in paths):
        pytest.skip(f"{tmp_path}: this filesystem keeps pages resident (tmpfs?)")
    return paths


def test_resident_bytes_reads_mincore_like_fincore(tmp_path: Path):
    (path,) = cold_files(tmp_path, [6 * MIB + 123])
    assert pagecache.resident_bytes(path) == (0, 6 * MIB + 123)
    with open(path, "rb") as fh:
        fh.read(2 * MIB)  # the first pages only
    resident, size = pagecache.resident_bytes(path)
    assert 2 * MIB <= resident < size
    empty = tmp_path / "empty"
    empty.touch()
    assert pagecache.resident_bytes(empty) == (0, 0)


def test_warm_up_reads_what_is_cold_and_skips_what_is_resident(tmp_path: Path):
    paths = cold_files(tmp_path, [5 * MIB, 3 * MIB, 4 * MIB + 7])
    with open(paths[1], "rb") as fh:
        fh.read()  # one file already in the cache
    seen: list[tuple[int, int]] = []
    report = pagecache.warm(paths, workers=2, mem_available=1 << 40,
                            on_progress=lambda done, total: seen.append((done, total)))
    assert report.skipped_reason == ""
    assert report.total == 12 * MIB + 7
    assert report.resident_before == 3 * MIB
    assert abs(report.resident_share - 3 / 12) < 0.01
    assert report.read == 9 * MIB + 7  # the resident file was not read again
    assert [f.read for f in report.files] == [5 * MIB, 0, 4 * MIB + 7]
    assert seen[-1] == (9 * MIB + 7, 9 * MIB + 7)
    for p in paths:
        assert pagecache.resident_bytes(p) == (p.stat().st_size, p.stat().st_size)
    again = pagecache.warm(paths, mem_available=1 << 40)
    assert again.read == 0 and again.resident_share == 1.0


def test_warm_up_is_skipped_when_memory_cannot_hold_the_set(tmp_path: Path):
    paths = cold_files(tmp_path, [4 * MIB, 4 * MIB])
    report = pagecache.warm(paths, mem_available=5 * MIB)
    assert report.read == 0
    assert report.skipped_reason.startswith("0.0 GiB not yet cached, MemAvailable 0.0 GiB")
    assert all(pagecache.resident_bytes(p)[0] == 0 for p in paths)
    assert pagecache.fits(report.files, 8 * MIB) == (True, 8 * MIB)


def test_mem_available_is_read_from_meminfo(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1056540612 kB\nMemAvailable:   941572360 kB\n")
    assert pagecache.mem_available_bytes(meminfo) == 941572360 * 1024
    assert pagecache.mem_available_bytes(tmp_path / "absent") is None
