"""Who a process is: pid plus its start time (and command line), read from ``/proc``.

A pid alone is no identity: once a process is gone its pid goes to the next one. Every
record that names a process (a running stage, the workspace lock, the server and its
supervisor) keeps the start time too, and liveness checks both. Off Linux (no ``/proc``)
the start time is unknown and the checks fall back to the pid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROC = Path("/proc")
_STARTTIME_INDEX = 19  # field 22 of /proc/<pid>/stat, counted after the ')' of the name
_PGRP_INDEX = 2  # field 5


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, ...),
    or None when the process is gone or the file is unreadable."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int | None) -> int | None:
    """The process's start time in clock ticks since boot, or None (gone, or no /proc)."""
    if not pid:
        return None
    fields = stat_fields(pid)
    if not fields or len(fields) <= _STARTTIME_INDEX:
        return None
    try:
        return int(fields[_STARTTIME_INDEX])
    except ValueError:
        return None


def cmdline(pid: int | None) -> list[str]:
    """The process's command line, [] when unknown."""
    if not pid:
        return []
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, ValueError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def alive(pid: Any, started: Any = None) -> bool:
    """Is process ``pid`` running (not a zombie) and, when ``started`` is given, the very
    process that started then (not a newcomer that got its pid)?"""
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return False
    if pid <= 0 or not _exists(pid):
        return False
    fields = stat_fields(pid)
    if fields is None:
        return not PROC.is_dir()  # no /proc: the pid is all we can go by
    if fields[0] in ("Z", "X"):
        return False
    if started is None:
        return True
    try:
        return int(fields[_STARTTIME_INDEX]) == int(started)
    except (IndexError, ValueError, TypeError):
        return False


@dataclass(frozen=True)
class Identity:
    """A process as records keep it."""

    pid: int
    start_time: int | None
    cmdline: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "cmdline": list(self.cmdline)}

    def alive(self) -> bool:
        return alive(self.pid, self.start_time)


def identity(pid: int | None = None) -> Identity:
    """``pid``'s identity (this process's by default)."""
    pid = os.getpid() if pid is None else pid
    return Identity(pid, start_time(pid), tuple(cmdline(pid)))


def group_members(pgid: int, since: int | None = None) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``; with ``since``, only those
    started at or after that tick (a reused group id holds only newer processes than its
    recorded leader: older ones are not ours)."""
    if not PROC.is_dir():
        return []
    found = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(entry.name)
        if not fields or len(fields) <= _STARTTIME_INDEX or fields[0] in ("Z", "X"):
            continue
        try:
            if int(fields[_PGRP_INDEX]) != pgid:
                continue
            if since is not None and int(fields[_STARTTIME_INDEX]) < int(since):
                continue
        except ValueError:
            continue
        found.append(int(entry.name))
    return found
