"""What a pipelined run is doing, folded from its event stream (core/events).

One :class:`InFlight` takes the events in file order (``feed``) and keeps, per stage, what
the live view and `status` show: its state and pid, the build step running, bytes and rate
per disk set (``stage.progress`` of the tasks ``<stage> <set>``), files verified, layers
converted and verified (``layer.*``), the latest progress of any other task, and when it
started and ended. Which stage reports what is its registry row's ``view``. Pure: no
terminal, no files.
"""

from __future__ import annotations

import datetime as dt
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dsv4_offload.core import registry
from dsv4_offload.core.registry import View

RATE_WINDOW = 20  # progress samples a rate is taken over (about 20 s: one per second)
FINAL = ("done", "failed", "interrupted", "skipped", "blocked")


def epoch(stamp: Any) -> float | None:
    """An event's ``t`` (ISO 8601) as seconds since the epoch; None when unreadable."""
    if not isinstance(stamp, str):
        return None
    try:
        return dt.datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def view_of(stage: str) -> View:
    """The stage's progress as its registry row has it (a stage of no row: its tasks)."""
    return next((s.view for s in registry.STAGES if s.name == stage), View.TASK)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float | None) -> str:
    if s is None or s < 0:
        return "?"
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


@dataclass
class SetFlight:
    """One weight set's download: bytes so far of the bytes this run fetches, and the rate."""

    name: str
    completed: float = 0.0
    total: float | None = None
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    verified_files: int = 0
    verified_bytes: int = 0

    @property
    def rate(self) -> float | None:
        """Bytes per second over the last samples; None until two are apart in time."""
        if len(self.samples) < 2:
            return None
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 and c1 >= c0 else None

    @property
    def eta(self) -> float | None:
        rate = self.rate
        if self.total is None or not rate:
            return None
        return max(0.0, self.total - self.completed) / rate

    def describe(self) -> str:
        text = f"{self.name} {human_bytes(self.completed)}"
        if self.total:
            text += f"/{human_bytes(self.total)}"
        if self.rate:
            text += f" at {human_bytes(self.rate)}/s, ETA {human_seconds(self.eta)}"
        if self.verified_files:
            text += f", {self.verified_files} files verified"
        return text


@dataclass
class StageFlight:
    stage: str
    state: str = "waiting"
    pid: int | None = None
    started: float | None = None
    ended: float | None = None
    step: str | None = None  # the step running (step.started, as build says)
    steps_done: list[str] = field(default_factory=list)
    task: str | None = None  # the latest progress of any task
    completed: float = 0.0
    total: float | None = None
    unit: str = ""
    sets: dict[str, SetFlight] = field(default_factory=dict)
    layers_converted: set[int] = field(default_factory=set)
    layers_verified: set[int] = field(default_factory=set)
    layers_failed: dict[int, str] = field(default_factory=dict)
    summary: str = ""
    error: str = ""
    log: str = ""
    reason: str = ""  # blocked / skipped: why

    def elapsed(self, now: float) -> float | None:
        if self.started is None:
            return None
        return (self.ended or now) - self.started

    def progress_text(self, layers_total: int | None = None) -> str:
        """The stage's progress in a few words (empty when it reported none)."""
        parts = []
        if self.sets:
            parts.append("; ".join(s.describe() for s in self.sets.values()))
        if self.layers_converted or self.layers_verified or self.layers_failed:
            of = f"/{layers_total}" if layers_total else ""
            text = f"{len(self.layers_converted)}{of} layers converted"
            if self.layers_verified:
                text += f", {len(self.layers_verified)} verified"
            if self.layers_failed:
                text += f", {len(self.layers_failed)} failed"
            parts.append(text)
        if self.step:
            parts.append(f"step {self.step}" + (f" ({len(self.steps_done)} done)"
                                                 if self.steps_done else ""))
        if not parts and self.task:
            text = self.task
            if self.total:
                value = (f"{human_bytes(self.completed)}/{human_bytes(self.total)}"
                         if self.unit in ("B", "bytes") else f"{self.completed:g}/{self.total:g}")
                text += f" {value}"
            parts.append(text)
        return "; ".join(parts)


class InFlight:
    """Every stage of one run, as its events tell it."""

    def __init__(self) -> None:
        self.stages: dict[str, StageFlight] = {}
        self.run_started: float | None = None
        self.finished: dict[str, Any] | None = None
        self.plan: dict[str, str] = {}

    def stage(self, name: str) -> StageFlight:
        if name not in self.stages:
            self.stages[name] = StageFlight(name)
        return self.stages[name]

    def feed(self, doc: dict[str, Any]) -> None:
        kind = doc.get("event")
        when = epoch(doc.get("t"))
        if kind == "run.started":
            self.run_started = when
            plan = doc.get("plan")
            self.plan = dict(plan) if isinstance(plan, dict) else {}
            return
        if kind == "run.finished":
            self.finished = doc
            return
        name = doc.get("stage")
        if not isinstance(name, str):
            return
        st = self.stage(name)
        if kind == "stage.started":
            st.state, st.pid, st.started = "running", _int(doc.get("pid")), when
            st.log = str(doc.get("log") or "")
        elif kind in ("stage.done", "stage.failed", "stage.interrupted"):
            st.state = kind.split(".")[1]
            st.ended = when
            st.summary = str(doc.get("summary") or "")
            st.error = str(doc.get("error") or doc.get("signal") or "")
            st.log = str(doc.get("log") or st.log)
            st.step = None if st.state == "done" else st.step
        elif kind in ("stage.skipped", "stage.blocked"):
            st.state = kind.split(".")[1]
            st.reason = str(doc.get("reason") or doc.get("summary") or "")
        elif kind == "stage.progress":
            self._progress(st, doc, when)
        elif kind == "step.started":
            st.step = str(doc.get("step") or "")
        elif kind == "step.done":
            st.steps_done.append(str(doc.get("step") or ""))
            st.step = None
        elif kind in ("file.verified", "file.failed"):
            which = str(doc.get("set") or "?")
            flight = st.sets.setdefault(which, SetFlight(which))
            if kind == "file.verified":
                flight.verified_files += 1
                flight.verified_bytes += _int(doc.get("bytes")) or 0
        elif kind and kind.startswith("layer."):
            layer = _int(doc.get("layer"))
            if layer is None:
                return
            if kind == "layer.converted":
                st.layers_converted.add(layer)
            elif kind == "layer.verified":
                st.layers_verified.add(layer)
            elif kind == "layer.failed":
                st.layers_failed[layer] = str(doc.get("error") or "")

    def _progress(self, st: StageFlight, doc: dict[str, Any], when: float | None) -> None:
        task = str(doc.get("task") or "")
        completed = _num(doc.get("completed")) or 0.0
        total = _num(doc.get("total"))
        words = task.split()
        # a stage that shows its disk sets reports each one's bytes as the task "<stage> <set>"
        if len(words) == 2 and words[0] == st.stage and view_of(st.stage) is View.SETS:
            flight = st.sets.setdefault(words[1], SetFlight(words[1]))
            flight.completed, flight.total = completed, total
            if when is not None:
                flight.samples.append((when, completed))
            return
        st.task, st.completed, st.total = task, completed, total
        st.unit = str(doc.get("unit") or "")

    def running(self) -> list[StageFlight]:
        return [s for s in self.stages.values() if s.state == "running"]

    def projected_ready(self, now: float, layers_total: int | None = None) -> float | None:
        """When the last byte is in, plus the conversion of what is left after it at the pace
        layers have been converting: a projection, None until there is a rate to go by."""
        etas = [f.eta for s in self.stages.values() for f in s.sets.values()
                if s.state == "running" and f.eta is not None]
        paced = next((self.stages[s.name] for s in registry.STAGES  # the layers stage
                      if s.view is View.LAYERS and s.name in self.stages), None)
        per_layer = None
        if paced and paced.started and paced.layers_converted:
            per_layer = (now - paced.started) / len(paced.layers_converted)
        if etas:
            return now + max(etas) + (per_layer or 0.0)
        if paced and paced.state == "running" and per_layer and layers_total:
            return now + per_layer * max(0, layers_total - len(paced.layers_converted))
        return None


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _num(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
