"""What a pipelined `run` shows while it runs, one of three, chosen by the CLI:

- :class:`JsonLines` (``--json``): every event of the run, one JSON object per line on
  stdout, the last one ``run.finished``;
- :class:`PlainLines` (no terminal, or ``--quiet``): one line per stage started, ended,
  failed, skipped or blocked (nothing with ``--quiet``: only the result line at the end);
- :class:`LiveView` (a terminal): one rich panel of every branch, redrawn four times a
  second: bytes, rate and ETA per weight set, layers converted and verified, the build step
  running, each stage's elapsed time, and a projected ready time.

Each is a context manager with ``event(doc)``; the scheduler calls it in file order.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from dsv4_offload.cli.render import console, styled
from dsv4_offload.core import registry
from dsv4_offload.core.inflight import InFlight, human_seconds
from dsv4_offload.core.registry import Cpu

GIB = 1024**3


def branches(flight: InFlight) -> dict[str, list[str]]:
    """The branches of the stage graph, as the view groups them: each row's ``branch`` in
    registry order; a stage of no branch, or of no row, is a group of its own."""
    out: dict[str, list[str]] = {}
    for s in registry.STAGES:
        out.setdefault(s.branch or s.name, []).append(s.name)
    placed = {n for names in out.values() for n in names}
    for name in flight.stages:
        if name not in placed:
            out.setdefault(name, []).append(name)
    return out


class JsonLines:
    def __enter__(self) -> JsonLines:
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()

    def event(self, doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc, separators=(",", ":"), ensure_ascii=False,
                                    default=str) + "\n")
        sys.stdout.flush()


class PlainLines:
    def __init__(self, quiet: bool = False, results_follow: bool = False) -> None:
        self.quiet = quiet
        self.results_follow = results_follow  # a failure's result is rendered as it ends
        self.flight = InFlight()

    def __enter__(self) -> PlainLines:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def event(self, doc: dict[str, Any]) -> None:
        self.flight.feed(doc)
        if self.quiet or (self.results_follow and doc.get("event") == "stage.failed"):
            return
        line = plain_line(doc, self.flight)
        if line:
            console().print(line, soft_wrap=True)


def plain_line(doc: dict[str, Any], flight: InFlight) -> str | None:
    """The one line an event makes without a terminal (None: it makes none)."""
    kind, name = doc.get("event"), escape(str(doc.get("stage", "")))
    if kind == "run.started":
        plan = doc.get("plan") or {}
        todo = [s for s, a in plan.items() if a == "run"]
        return f"run: pipelined, {len(todo)} to run ({escape(', '.join(todo))})"
    if kind == "stage.started":
        opts = doc.get("options") or {}
        words = [k if v is True else f"{k} {v}" for k, v in opts.items()] \
            if isinstance(opts, dict) else []
        more = f", {escape(', '.join(words))}" if words else ""
        return f"[bold]{name}[/bold]: started (pid {doc.get('pid')}{more})"
    if kind == "stage.done":
        seconds = doc.get("seconds")
        took = f" in {human_seconds(seconds)}" if isinstance(seconds, (int, float)) else ""
        summary = escape(str(doc.get("summary", "")))
        return f"[bold]{name}[/bold]: {styled('done')}{took} — {summary}"
    if kind == "stage.failed":
        log = f" (log: {escape(str(doc['log']))})" if doc.get("log") else ""
        error = escape(str(doc.get("error", "")))
        return f"[bold]{name}[/bold]: {styled('failed')} — {error}{log}"
    if kind == "stage.interrupted":
        how = escape(str(doc.get("signal", "")))
        return f"[bold]{name}[/bold]: {styled('interrupted')} ({how})"
    if kind == "stage.skipped":
        reason = str(doc.get("reason", ""))
        word = ("not applicable to this recipe" if reason.startswith("not applicable") else
                "skip (done)" if reason == "done, inputs unchanged" else f"skip ({reason})")
        return f"[bold]{name}[/bold]: {escape(word)}"
    if kind == "stage.blocked":
        return f"[bold]{name}[/bold]: blocked — {escape(str(doc.get('reason', '')))}"
    return None


class LiveView:
    """The rich panel of a pipelined run on a terminal."""

    def __init__(self, layers: int | None = None) -> None:
        from rich.live import Live

        self.flight = InFlight()
        self.layers = layers
        self._lock = threading.Lock()
        self._live = Live(get_renderable=self.renderable, console=console(),
                          refresh_per_second=4, transient=False)

    def __enter__(self) -> LiveView:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._live.__exit__(*exc)

    def event(self, doc: dict[str, Any]) -> None:
        with self._lock:
            self.flight.feed(doc)

    def renderable(self) -> Any:
        with self._lock:
            return render_flight(self.flight, time.time(), self.layers)


def render_flight(flight: InFlight, now: float, layers: int | None = None) -> Any:
    """Every branch of the run: its stages, their state, elapsed time and progress; then the
    run's elapsed time and the projected ready time."""
    table = Table(show_header=True, pad_edge=False, box=None)
    for col in ("branch", "stage", "state", "elapsed", "progress"):
        table.add_column(col, overflow="fold")
    for label, names in branches(flight).items():
        first = True
        for name in names:
            if name not in flight.stages and name not in flight.plan:
                continue
            st = flight.stage(name)
            state = st.state if name in flight.stages else (
                "waiting" if flight.plan.get(name) == "run" else "skip")
            detail = st.progress_text(layers) or st.error or st.reason or st.summary
            table.add_row(str(label) if first else "", name, styled(state),
                          human_seconds(st.elapsed(now)) if st.started else "",
                          escape(detail))
            first = False
    started = flight.run_started
    lines = [f"elapsed {human_seconds(now - started) if started else '?'}"]
    ready = flight.projected_ready(now, layers)
    if ready is not None:
        clock = time.strftime("%H:%M", time.localtime(ready))
        lines.append(f"projected ready ~{clock} (in {human_seconds(ready - now)})")
    return Group(table, Text("  ".join(lines), style="bold"))


# --- before and after ----------------------------------------------------------------------


def plan_lines(items: list[Any], cpu: Any, disk: list[Any]) -> list[str]:
    """The overlapped plan, a line per stage (what it waits for, follows and may run
    beside), then the cores and the disk it counts on."""
    out = []
    for i in items:
        line = f"{i.stage:12} {styled(i.action):>4}  {escape(i.reason)}"
        notes = []
        if i.waits_for:
            notes.append("after " + ", ".join(i.waits_for))
        if i.follows:
            notes.append("follows " + ", ".join(i.follows) + " (starts with it)")
        if i.beside:
            notes.append("beside " + ", ".join(i.beside))
        if i.options.get("jobs"):
            notes.append(_jobs(i.options["jobs"]))
        if notes:
            line += f"\n{'':12}       {escape('; '.join(notes))}"
        if i.steps:
            line += f"\n{'':12}       steps: {escape(', '.join(i.steps))}"
        out.append(line)
    out.append(escape(f"cpu: {cpu.cores} cores: {cpu_words(cpu)}"))
    for fs in disk:
        word = styled("failed") if fs.short else styled("ok")
        out.append(f"disk: {word} "
                   + escape(f"{fs.need / GIB:.1f} GiB to come on the filesystem of {fs.probe} "
                            f"({', '.join(s.name for s in fs.sets)}), "
                            f"{fs.free / GIB:.1f} GiB free"))
    return out


def outcome_lines(outcome: Any, said: dict[str, str] | None = None) -> list[str]:
    """The end of a pipelined run: each branch that stopped (stage, why — or where, for the
    stages in ``said``, whose failure is said elsewhere —, log, what it blocked), then one
    line of counts."""
    said = said or {}
    out = []
    for branch in outcome.branches():
        log = f" (log: {branch['log']})" if branch.get("log") else ""
        why = (f"its error is {said[branch['stage']]}" if branch["stage"] in said
               and branch["state"] == "failed" else branch["error"])
        out.append(escape(f"{branch['stage']} {branch['state']}: {why}{log}"))
        if branch["blocked"]:
            out.append(escape(f"  blocked by it: {', '.join(branch['blocked'])}"))
    counts: dict[str, int] = {}
    for s in outcome.slots:
        counts[s.state] = counts.get(s.state, 0) + 1
    what = ", ".join(f"{n} {state}" for state, n in counts.items())
    went_on = [s.name for s in outcome.slots if s.state == "done"]
    tail = f"; went on to the end: {', '.join(went_on)}" if outcome.failed and went_on else ""
    if outcome.interrupted:
        out.append(escape(f"run interrupted by {outcome.interrupted} after "
                          f"{human_seconds(outcome.seconds)}: {what}; rerun `run` to resume"))
    elif outcome.failed:
        names = ", ".join(b["stage"] for b in outcome.branches())
        out.append(escape(f"run finished with {names} stopped ({what}{tail}); fix it and "
                          "rerun `run` (done stages are skipped)"))
    else:
        out.append(escape(f"run done in {human_seconds(outcome.seconds)}: {what}"))
    return out


def cpu_words(cpu: Any) -> str:
    """The budget by CPU class, naming the stages of each (their registry rows)."""
    def named(cls: Cpu) -> str:
        return ", ".join(s.name for s in registry.STAGES if s.cpu is cls)

    compiling, yielding = named(Cpu.COMPILE), named(Cpu.YIELDS)
    words = [f"{compiling} {_jobs(cpu.build_jobs)}"] if compiling else []
    if yielding:
        beside = f"{cpu.convert_beside_build} beside {compiling}, then " if compiling else ""
        words.append(f"{yielding} {beside}{cpu.convert_alone or 'its default'}")
    return ", ".join(words) or "no stage takes jobs"


def _jobs(n: int) -> str:
    return f"{n} job" + ("" if n == 1 else "s")
