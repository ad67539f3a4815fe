"""The process groups of a running stage, noted so a killed run's leftovers are found.

Each child a stage starts leads its own process group (core/runner). They are noted in
run/groups-<stage> (core/procs.GroupNotes) while the stage runs; a sentinel process, started
before the stage's first child, outlives us and stops them if we die without cleaning up
(SIGKILL), and the next run sweeps whatever is left all the same.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from dsv4_offload.core import procs
from dsv4_offload.core.runner import KILL_GRACE_S, Sentinel, start_sentinel, watch_groups


def _groups_file(ws: Any, name: str) -> Any:
    return ws.run_dir / f"groups-{name}"


@contextlib.contextmanager
def groups_noted(ws: Any, name: str, owner: procs.Identity) -> Iterator[None]:
    notes = procs.GroupNotes(_groups_file(ws, name))
    notes.begin(owner)
    sentinels: list[Sentinel | None] = []  # started at most once, armed or not

    def arm() -> None:
        """Before the stage's first child: a stage that starts none has nothing for a
        sentinel to stop (and saves a process start, a tenth of a second, per stage)."""
        if not sentinels:
            sentinels.append(start_sentinel([sys.executable, "-m", "dsv4_offload.core.procs",
                                             "sweep", str(notes.path)]))

    try:
        with watch_groups(notes.note, before=arm):
            yield
    finally:  # every group was stopped on the way out (the runner's rule)
        notes.path.unlink(missing_ok=True)
        for sentinel in sentinels:
            if sentinel is not None:
                sentinel.release()
        with contextlib.suppress(OSError):
            notes.path.parent.rmdir()  # only when empty: nothing of ours is left


def _noted(ws: Any, name: str = "*") -> list[Any]:
    """The stages' group notes in the run directory. Each stage process removes that
    directory when it leaves it empty (here and in GroupNotes.begin's retry), so it may go
    between glob's look and its listing (a FileNotFoundError from pathlib): gone is none."""
    try:
        return sorted(ws.run_dir.glob(f"groups-{name}"))
    except FileNotFoundError:
        return []


def leftover_processes(ws: Any, name: str | None = None) -> list[int]:
    """Processes still running from stages whose run was killed outright."""
    found: list[int] = []
    for path in _noted(ws, name or "*"):
        found += procs.GroupNotes(path).leftovers()
    return found


def sweep_leftovers(ws: Any) -> list[int]:
    """Stop what is left of stages whose run was killed outright (TERM, then KILL)."""
    stopped: list[int] = []
    for path in _noted(ws):
        stopped += procs.GroupNotes(path).sweep(KILL_GRACE_S)
    with contextlib.suppress(OSError):
        ws.run_dir.rmdir()  # only when empty
    return sorted(set(stopped))
