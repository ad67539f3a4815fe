"""Shared-memory segments a killed server leaves in /dev/shm, counted and cleared safely.

A server stopped with SIGINT removes its segments; one killed otherwise (the OOM killer, a
user's `kill -9`, a lost container) leaves them, and after thousands of them streaming
prefill segfaults now and then (sglang/0003 kt_stream_prefill.py:230, the concurrent mmap to
pinned copy; a second team counted 2,621 after a day against 60-100 normally). A segment is
*stale* here when this user owns it, it is older than the last server start, and no running
process holds it (an open descriptor or a mapping, read from /proc). Nothing else is ever
removed, and a segment is checked again right before it goes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dsv4_offload.core.results import Check, CheckStatus

SHM_DIR = Path("/dev/shm")
# where the segments live, for a test or a host whose tmpfs is elsewhere
SHM_DIR_ENV = "DSV4_SHM_DIR"
PROC = Path("/proc")


def shm_dir(root: Path = Path("/")) -> Path:
    """The segments' directory: DSV4_SHM_DIR, else /dev/shm under the host's root (a
    captured host's, for doctor on DSV4_HOST_ROOT)."""
    given = os.environ.get(SHM_DIR_ENV)
    return Path(given) if given else root / SHM_DIR.relative_to("/")


@dataclass(frozen=True)
class Segment:
    path: Path
    size: int
    mtime: float


def held_paths(proc: Path = PROC) -> set[str]:
    """Every file some process we can see holds open or mapped (its path as /proc shows it)."""
    held: set[str] = set()
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    held.add(os.readlink(fd))
        with contextlib.suppress(OSError):
            for line in (entry / "maps").read_text(errors="replace").splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    held.add(parts[5].removesuffix(" (deleted)"))
    return held


def stale_segments(before: float, directory: Path | None = None, uid: int | None = None,
                   proc: Path = PROC) -> list[Segment]:
    """This user's segments last written before ``before`` (a server's start, epoch seconds)
    that no running process holds."""
    where = directory or shm_dir()
    me = os.geteuid() if uid is None else uid
    held = held_paths(proc)
    found = []
    try:
        entries = list(where.iterdir())
    except OSError:
        return []
    for path in entries:
        try:
            st = path.lstat()
        except OSError:
            continue
        if (st.st_uid == me and path.is_file() and not path.is_symlink()
                and st.st_mtime < before and str(path) not in held):
            found.append(Segment(path, st.st_size, st.st_mtime))
    return sorted(found, key=lambda s: s.path.name)


def clear(segments: list[Segment], proc: Path = PROC) -> tuple[list[Segment], list[str]]:
    """Remove the given segments, each checked again as not held just before; (removed,
    one line per segment left and why)."""
    held = held_paths(proc)
    removed, left = [], []
    for seg in segments:
        if str(seg.path) in held:
            left.append(f"{seg.path}: held by a running process now; left alone")
            continue
        try:
            seg.path.unlink()
            removed.append(seg)
        except FileNotFoundError:
            continue
        except OSError as exc:
            left.append(f"{seg.path}: {exc.strerror}")
    return removed, left


def summary(segments: list[Segment], directory: Path | None = None) -> str:
    """'N stale segments (X MiB) in DIR' for a warning or a doctor row."""
    total = sum(s.size for s in segments)
    return (f"{len(segments)} stale shared-memory segment{'s' if len(segments) != 1 else ''} "
            f"({total / 2**20:.1f} MiB) in {directory or shm_dir()}")


FIX = ("`dsv4-offload serve --clean-shm` removes them (never one a process holds); stop "
       "servers with `serve stop` (SIGINT), which lets them remove their own")
WHY = ("left by servers killed without SIGINT (the OOM killer, kill -9, a lost container); "
       "thousands of them make streaming prefill segfault now and then "
       "(kt_stream_prefill.py:230)")


def last_start(record: object | None) -> float:
    """When the workspace's server last started (epoch seconds; now when none runs): a
    segment older than that belongs to no server of ours that still runs."""
    from dsv4_offload.serving import supervisor as sv

    if isinstance(record, sv.ServeRecord) and sv.record_alive(record):
        with contextlib.suppress(ValueError):
            return dt.datetime.fromisoformat(record.started).timestamp()
    return time.time()


def check(before: float, directory: Path | None = None) -> Check:
    """doctor's row: this user's stale segments, counted."""
    found = stale_segments(before, directory)
    required = "no stale segments of this user"
    if not found:
        return Check("shm", CheckStatus.OK, f"none in {directory or shm_dir()}", required, "")
    return Check("shm", CheckStatus.WARN, f"{summary(found, directory)}, {WHY}", required, FIX)
