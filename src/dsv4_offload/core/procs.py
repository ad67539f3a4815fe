"""Who a process is: pid plus its start time (and command line), read from ``/proc``.

A pid alone is no identity: once a process is gone its pid goes to the next one. Every
record that names a process (a running stage, the workspace lock, the server and its
supervisor) keeps the start time too, and liveness checks both. Off Linux (no ``/proc``)
the start time is unknown and the checks fall back to the pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_offload.core.childrun import GROUP_MARK_ENV

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


_FLAGS_INDEX = 6  # field 9: the kernel's task flags
_PF_EXITING = 0x4  # include/linux/sched.h: the task is being torn down
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)  # in the hex masks of /proc/<pid>/status


def exiting(pid: int) -> bool:
    """Is the process being torn down: its main thread past exit (a zombie, or marked
    exiting) or a SIGKILL queued for it (a fatal signal queues one for every thread)?

    A parent-death signal comes when the *thread* that started the child leaves: killing a
    parent with threads, the first of them out signals the child while the others still
    hold the pid, so for a moment the child's getppid() names a parent already dying."""
    fields = stat_fields(pid)
    if not fields or len(fields) <= _FLAGS_INDEX:
        return False
    if fields[0] in ("Z", "X", "x"):
        return True
    with contextlib.suppress(ValueError):
        if int(fields[_FLAGS_INDEX]) & _PF_EXITING:
            return True
    try:
        status = (PROC / str(pid) / "status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("SigPnd", "ShdPnd"):
            with contextlib.suppress(ValueError):
                if int(value.strip(), 16) & _SIGKILL_BIT:
                    return True
    return False


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


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``, whoever they are."""
    if not PROC.is_dir():
        return []
    found = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(entry.name)
        if not fields or len(fields) <= _STARTTIME_INDEX or fields[0] in ("Z", "X"):
            continue
        with contextlib.suppress(ValueError):
            if int(fields[_PGRP_INDEX]) == pgid:
                found.append(int(entry.name))
    return found


_own_mark: tuple[int, str] | None = None


def own_mark() -> str:
    """This process's mark (pid and start time), which every child it starts carries in its
    environment (``GROUP_MARK_ENV``, set by core/runner)."""
    global _own_mark
    pid = os.getpid()
    if _own_mark is None or _own_mark[0] != pid:  # a forked child is another process
        _own_mark = (pid, f"{pid}-{start_time(pid)}")
    return _own_mark[1]


def carries_mark(pid: int | str, mark: str) -> bool:
    """Does ``/proc/<pid>/environ`` hold our ``mark``? False when unreadable (another user's
    process is never proven ours)."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return False
    return f"{GROUP_MARK_ENV}={mark}".encode() in raw.split(b"\0")


def leader_state(pgid: int, leader_start: int | None) -> str | None:
    """The group ``pgid`` whose leader started at ``leader_start``: "here" (its leader runs,
    or is a zombie not yet reaped: the group is ours), "gone" (the pid is another process's:
    the kernel hands out no pid still naming a group, so ours is over), None (the leader
    exited; what is left of the group must prove itself)."""
    if leader_start is None:
        return "gone"  # nothing to prove it by
    fields = stat_fields(pgid)
    if fields is None or len(fields) <= _STARTTIME_INDEX:
        return None
    try:
        return "here" if int(fields[_STARTTIME_INDEX]) == int(leader_start) else "gone"
    except ValueError:
        return "gone"


def owned_members(pgid: int, leader_start: int | None, mark: str | None = None) -> list[int]:
    """Live members of the process group we started (leader ``pgid``, started at
    ``leader_start``), proven ours: the whole group while its leader is the recorded one;
    once the leader is gone, only members started after it that carry ``mark`` in their
    environment. Never a process merely started later: a reused id leads another's group."""
    if not PROC.is_dir():
        return []
    state = leader_state(pgid, leader_start)
    if state == "gone":
        return []
    members = group_members(pgid)
    if state == "here":
        return members
    if mark is None:
        return []
    return [pid for pid in members
            if (start_time(pid) or 0) >= int(leader_start or 0) and carries_mark(pid, mark)]


def signal_owned(pgid: int, leader_start: int | None, mark: str | None, sig: int) -> list[int]:
    """Send ``sig`` to the members of our group proven by :func:`owned_members` (the whole
    group at once while its leader is the recorded one); the pids it went to."""
    members = owned_members(pgid, leader_start, mark)
    if members and leader_state(pgid, leader_start) == "here":
        with contextlib.suppress(OSError):
            os.killpg(pgid, sig)
        return members
    for pid in members:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
    return members


# --- memory of a process tree -----------------------------------------------------------------

_PPID_INDEX = 1  # field 4


def status_kib(text: str, name: str) -> int | None:
    """The value of a ``kB`` line (``RssAnon:\t  123456 kB``) of a ``/proc/<pid>/status``
    text, or None when the line is absent (kernel threads have no Rss lines)."""
    prefix = f"{name}:"
    for line in text.splitlines():
        if line.startswith(prefix):
            parts = line[len(prefix):].split()
            if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                return int(parts[0])
            return None
    return None


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (children, their children, ...), by the ppid of
    every ``/proc/<pid>/stat``; [] without /proc."""
    if not PROC.is_dir():
        return []
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(entry.name)
        if not fields or len(fields) <= _PPID_INDEX or fields[0] in ("Z", "X"):
            continue
        with contextlib.suppress(ValueError):
            children.setdefault(int(fields[_PPID_INDEX]), []).append(int(entry.name))
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child not in found:
            found.append(child)
            todo += children.get(child, [])
    return sorted(found)


def tree_kib(pid: int, name: str = "RssAnon") -> tuple[int, int] | None:
    """(the sum of ``name`` over ``pid`` and its descendants in kB, how many processes had
    it), or None when ``pid`` itself cannot be read."""
    total, counted = 0, 0
    for index, member in enumerate([pid, *descendants(pid)]):
        try:
            text = (PROC / str(member) / "status").read_text()
        except OSError:
            if index == 0:
                return None
            continue  # a child that exited meanwhile
        value = status_kib(text, name)
        if value is not None:
            total += value
            counted += 1
    return total, counted


# --- the process groups of a running stage ----------------------------------------------------


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").replace(" ", "")
    except OSError:
        return "-"


@dataclass(frozen=True)
class GroupNotes:
    """A file naming its owner (pid, start time, pid namespace) and the process groups it
    started (leader pid, start time), so that what a killed owner left behind can be found
    and stopped: by the owner's sentinel, or by the next run."""

    path: Path

    def begin(self, owner: Identity) -> None:
        text = f"owner {owner.pid} {owner.start_time} {_pid_namespace()}\n"
        for attempt in range(5):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.path.write_text(text)
                return
            except FileNotFoundError:
                # another stage process of the same run removed the directory when it found
                # it empty (its own notes done), between our mkdir and our write: again
                if attempt == 4:
                    raise

    def note(self, pgid: int) -> None:
        """Note group ``pgid``, started by this process (its members carry our mark)."""
        with open(self.path, "a") as fh:
            fh.write(f"group {pgid} {start_time(pgid)} {own_mark()}\n")

    def read(self) -> tuple[tuple[int, int | None], list[tuple[int, int, str | None]]] | None:
        """((owner pid, start), [(pgid, leader start, mark)]), or None: no file, or an owner
        in another pid namespace (the container: its pids mean nothing here)."""
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            return None
        owner: tuple[int, int | None] = (0, None)
        groups = []
        for line in lines:
            parts = line.split()
            if len(parts) < 3 or not parts[1].isdigit():
                continue
            when = int(parts[2]) if parts[2].isdigit() else None
            if parts[0] == "owner":
                if parts[3:] != [_pid_namespace()]:
                    return None
                owner = (int(parts[1]), when)
            elif when is not None:  # a group whose leader's start is unknown is not ours
                groups.append((int(parts[1]), when, parts[3] if len(parts) > 3 else None))
        return owner, groups

    def leftovers(self) -> list[int]:
        """Live processes of the noted groups, once the owner is gone."""
        read = self.read()
        if read is None or alive(*read[0]):
            return []
        return [pid for pgid, since, mark in read[1]
                for pid in owned_members(pgid, since, mark)]

    def sweep(self, grace: float) -> list[int]:
        """Once the owner is gone: SIGTERM the noted groups' members, SIGKILL after
        ``grace`` seconds, and remove the file. The pids signalled."""
        read = self.read()
        if read is None or alive(*read[0]):
            return []
        stopped: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            stopped += [pid for pgid, since, mark in read[1]
                        for pid in signal_owned(pgid, since, mark, sig)]
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(
                    owned_members(pgid, since, mark) for pgid, since, mark in read[1]):
                time.sleep(0.05)
        self.path.unlink(missing_ok=True)
        return sorted(set(stopped))


def _sentinel(path: str) -> int:
    """``python -m dsv4_offload.core.procs sweep FILE``, its stdin a pipe from the owner:
    at EOF (the owner exited, however it did) sweep what the owner left (nothing when it
    cleaned up: the file is gone)."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # the owner's group may be signalled: not us
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    notes = GroupNotes(Path(path))
    read = notes.read()
    if read is not None:
        deadline = time.monotonic() + 5  # the owner, just dead, may be a zombie a moment
        while alive(*read[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        notes.sweep(5.0)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["sweep"] and len(sys.argv) == 3:
        sys.exit(_sentinel(sys.argv[2]))
    sys.stderr.write("usage: python -m dsv4_offload.core.procs sweep FILE\n")
    sys.exit(2)
