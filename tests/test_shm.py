"""Stale /dev/shm segments: a scratch directory stands in for it; the holders are live
processes, found through the real /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4_offload.serving import shm

# a process that holds one file open and another mapped (its descriptor closed), then waits
HOLDER = ("import mmap, sys, time\n"
          "kept = open(sys.argv[1], 'rb')\n"
          "with open(sys.argv[2], 'r+b') as fh:\n"
          "    mapped = mmap.mmap(fh.fileno(), 0)\n"
          "print('holding', flush=True)\n"
          "time.sleep(60)\n")


@pytest.fixture
def segments(tmp_path: Path):
    d = tmp_path / "shm"
    d.mkdir()
    old = time.time() - 3600
    for name in ("stale-a", "stale-b", "open-by-live", "mapped-by-live"):
        (d / name).write_bytes(b"x" * 4096)
        os.utime(d / name, (old, old))
    (d / "newer").write_bytes(b"y" * 10)  # written after the server started: its own
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(d / "open-by-live"),
                               str(d / "mapped-by-live")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        yield d
    finally:
        holder.kill()
        holder.wait()


def test_only_old_unheld_segments_of_this_user_are_stale_and_cleared(segments: Path) -> None:
    started = time.time() - 60  # the last server start
    found = shm.stale_segments(started, segments)
    assert [s.path.name for s in found] == ["stale-a", "stale-b"]
    assert shm.summary(found, segments) == (f"2 stale shared-memory segments (0.0 MiB) in "
                                            f"{segments}")
    # another user's segments are not ours to count
    assert shm.stale_segments(started, segments, uid=os.geteuid() + 1) == []
    # a segment taken by a process between the count and the clearing is left alone
    taker = subprocess.Popen([sys.executable, "-c", HOLDER, str(found[1].path),
                              str(segments / "newer")], stdout=subprocess.PIPE, text=True)
    try:
        assert taker.stdout is not None and taker.stdout.readline() == "holding\n"
        removed, left = shm.clear(found)
    finally:
        taker.kill()
        taker.wait()
    assert [s.path.name for s in removed] == ["stale-a"]
    assert left == [f"{found[1].path}: held by a running process now; left alone"]
    assert sorted(p.name for p in segments.iterdir()) == [
        "mapped-by-live", "newer", "open-by-live", "stale-b"]


def test_serve_clean_shm_removes_the_stale_and_leaves_the_held(segments: Path, tmp_path: Path,
                                                               cli) -> None:
    env = {"DSV4_SHM_DIR": str(segments)}
    res = cli("-w", str(tmp_path / "ws"), "serve", "--clean-shm", env=env)
    assert res.code == 0, res
    # no server runs in this workspace: every segment of ours held by no process is stale,
    # the one written just now included
    assert res.out.strip().splitlines()[-1] == (
        f"serve --clean-shm: removed 3 stale segments (0.0 MiB) from {segments}")
    assert sorted(p.name for p in segments.iterdir()) == ["mapped-by-live", "open-by-live"]
    res = cli("-w", str(tmp_path / "ws"), "--json", "serve", "--clean-shm", env=env)
    assert res.code == 0 and res.json()["data"]["removed"] == [], res


def test_doctor_counts_the_stale_segments_with_the_way_to_clear_them(
        segments: Path, tmp_path: Path) -> None:
    started = time.time() - 60
    row = shm.check(started, segments)
    assert row.name == "shm" and row.status == "warn"
    assert row.observed.startswith(f"2 stale shared-memory segments (0.0 MiB) in {segments}, "
                                   "left by servers killed without SIGINT")
    assert row.fix.startswith("`dsv4-offload serve --clean-shm` removes them")
    assert shm.check(started, tmp_path / "empty").status == "ok"
