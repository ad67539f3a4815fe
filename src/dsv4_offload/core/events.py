"""The event stream of a pipelined `run`: one JSON object per line, appended to one file.

`run` (the scheduler) names the file in ``DSV4_EVENTS_FILE`` (core/childrun) for every
stage process it starts; each stage process appends its events there and the scheduler
tails the file for its live view and for `run --json`. With the variable unset (a stage run
on its own) ``emit`` does nothing, so stages call it freely.

Every event has ``v`` (the schema, 1), ``t`` (UTC, milliseconds), ``event`` and ``pid``;
most have ``stage``. The kinds, and the fields beside them:

- ``run.started``                                mode, plan (stage -> action), cpu
- ``run.finished``                               exit, failed (branches), stages (status),
                                                 signal (when interrupted)
- ``stage.started``                              stage, log, options (pid: the stage's)
- ``stage.progress``                             stage, task, completed, total, unit
- ``stage.done`` / ``stage.skipped``             stage, summary (done: seconds)
- ``stage.failed``                               stage, error, log
- ``stage.interrupted``                          stage, signal
- ``stage.blocked``                              stage, reason (a need failed)
- ``step.started`` / ``step.done``               stage, step (done: status, seconds)
- ``file.verified`` / ``file.failed``            stage, set, path, bytes (failed: error)
- ``layer.started`` / ``layer.converted`` / ``layer.verified`` / ``layer.failed``
                                                 stage, layer (failed: error, fix)

`tune --json` prints its own events in the same form, each with ``study``: ``tune.started``
(knobs, budget, allowed, measured, requeued), ``trial.started`` / ``trial.done`` /
``trial.failed`` / ``trial.pruned`` / ``trial.repeat`` / ``trial.requeued`` (trial,
setting; done: tok_s, buckets; failed and pruned: reason; repeat: same_as), and last
``tune.finished`` (measured, stopped_by, best).

One write per line with O_APPEND: lines of concurrent writers (stage processes, threads)
never interleave for the sizes written here (regular files take an appending write whole).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsv4_offload.core.childrun import EVENTS_ENV
from dsv4_offload.core.results import Progress, Task

SCHEMA = 1
PROGRESS_EVERY_S = 1.0  # one progress event per task per second at most
_write_lock = threading.Lock()


def events_file() -> Path | None:
    raw = os.environ.get(EVENTS_ENV)
    return Path(raw) if raw else None


def stamp() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def make(event: str, **fields: Any) -> dict[str, Any]:
    return {"v": SCHEMA, "t": stamp(), "event": event, "pid": os.getpid(), **fields}


def emit(event: str, **fields: Any) -> None:
    """Append one event to $DSV4_EVENTS_FILE; nothing when it is unset."""
    path = events_file()
    if path is None:
        return
    write(path, make(event, **fields))


def write(path: Path, doc: dict[str, Any]) -> None:
    line = (json.dumps(doc, separators=(",", ":"), default=str) + "\n").encode()
    with _write_lock:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def read_new(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Complete lines after ``offset``: the events and the offset after the last one read.
    A line still being written (no newline yet) waits for the next call; a line that is not
    a JSON object is skipped (an event file is ours, but a torn disk must not stop a run)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    out = []
    for raw in data[: end + 1].splitlines():
        try:
            doc = json.loads(raw)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("event"), str):
            out.append(doc)
    return out, offset + end + 1


def iter_file(path: Path) -> Iterator[dict[str, Any]]:
    events, _ = read_new(path, 0)
    yield from events


class EventProgress(Progress):
    """A stage's progress as ``stage.progress`` events (throttled), passed on to ``inner``."""

    def __init__(self, stage: str, inner: Progress | None = None) -> None:
        self.stage = stage
        self.inner = inner or Progress()
        self._last: dict[int, float] = {}

    def task(self, description: str, total: float | None = None, unit: str = "") -> Task:
        inner = self.inner.task(description, total, unit)
        t = Task(description, total, unit, self, handle=inner)
        self._send(t, force=True)
        return t

    def on_update(self, task: Task) -> None:
        inner = task.handle
        if isinstance(inner, Task):
            inner.update(completed=task.completed, total=task.total,
                         description=task.description)
        self._send(task)

    def on_close(self, task: Task) -> None:
        self._send(task, force=True)
        self._last.pop(id(task), None)
        if isinstance(task.handle, Task):
            task.handle.close()

    def message(self, text: str) -> None:
        self.inner.message(text)

    def _send(self, task: Task, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last.get(id(task), 0.0) < PROGRESS_EVERY_S:
            return
        self._last[id(task)] = now
        emit("stage.progress", stage=self.stage, task=task.description,
             completed=task.completed, total=task.total, unit=task.unit)
