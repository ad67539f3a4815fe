"""Human rendering with rich: results, problem tables, status tables, progress bars."""

from __future__ import annotations

import functools
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.progress import (
    Progress as RichBar,
)
from rich.table import Table

from dsv4_offload.core.results import Progress, StageResult, Status, Task

STATUS_STYLE = {
    "ok": "green", "done": "green", "pass": "green", "clean": "green", "skipped": "dim",
    "skip": "dim", "warn": "yellow", "stale": "yellow", "offset": "yellow", "pending": "dim",
    "running": "cyan", "failed": "red", "fail": "red", "error": "red", "interrupted": "red",
    "found": "green", "missing": "red", "unchecked": "yellow", "no-literal": "yellow",
}


# a pipe or a CI log is not 80 columns wide: keep tables readable there
_PIPE_WIDTH = 120


@functools.lru_cache(maxsize=1)
def console() -> Console:
    probe = Console()
    width = None if probe.is_terminal else max(probe.width, _PIPE_WIDTH)
    return Console(highlight=False, width=width)


@functools.lru_cache(maxsize=1)
def err_console() -> Console:
    return Console(stderr=True, highlight=False)


def forget_consoles() -> None:
    """Build the consoles anew on next use, for the streams and environment then current
    (an in-process caller that runs several commands, such as the tests)."""
    console.cache_clear()
    err_console.cache_clear()


def styled(text: str) -> str:
    style = STATUS_STYLE.get(text.lower(), "")
    return f"[{style}]{text}[/{style}]" if style else text


def simple_table(columns: tuple[str, ...], rows: list[tuple[Any, ...]], status_col: int = 1
                 ) -> Table:
    """A plain table whose status column is coloured by its word."""
    table = Table(show_lines=False, pad_edge=False)
    for col in columns:
        table.add_column(col, overflow="fold")
    # cells are data ("recipe.sources[sglang].commit"), never rich markup
    for row in rows:
        table.add_row(*[styled(str(v)) if i == status_col else escape(str(v))
                        for i, v in enumerate(row)])
    return table


def checks_table(checks: list[dict[str, Any]]) -> Table:
    """Check rows without their fixes: fixes are long and read better below the table."""
    return simple_table(("check", "status", "observed", "required"), [
        (c.get("name", c.get("check", "")), c.get("status", ""), c.get("observed", ""),
         c.get("required", "")) for c in checks])


def print_fixes(checks: list[dict[str, Any]]) -> None:
    out = console()
    for c in checks:
        status = str(c.get("status", ""))
        if status in ("fail", "warn", "failed", "error") and c.get("fix"):
            name = c.get("name", c.get("check", ""))
            out.print(f"{styled(status)} {escape(str(name))}: {escape(str(c['fix']))}",
                      soft_wrap=True)


def problems_table(result: StageResult) -> Table:
    return simple_table(("severity", "problem", "fix"),
                        [(p.severity, p.message, p.fix) for p in result.problems], status_col=0)


def render_result(command: str, result: StageResult, verbose: bool = False,
                  quiet: bool = False) -> None:
    out = console()
    checks = result.data.get("checks") if isinstance(result.data, dict) else None
    if isinstance(checks, list) and checks and not quiet:
        out.print(checks_table(checks))
        print_fixes(checks)
    elif result.problems and not quiet:
        out.print(problems_table(result))
    lines = result.data.get("lines") if isinstance(result.data, dict) else None
    if isinstance(lines, list) and not quiet:  # figures a stage reports beside its rows
        for line in lines:
            out.print(escape(str(line)), soft_wrap=True)
    out.print(f"{command}: {styled(result.status.value)} — {escape(result.summary)}",
              soft_wrap=True)
    if result.log and (result.status == Status.FAILED or verbose):
        out.print(f"see the log: {escape(result.log)}", soft_wrap=True)


class RichProgress(Progress):
    """Progress bars on stderr; bytes get transfer columns, counts get M/N."""

    def __init__(self) -> None:
        self._bar: RichBar | None = None
        self._open = 0

    def _ensure(self) -> RichBar:
        if self._bar is None:
            self._bar = RichBar(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                DownloadColumn(), TransferSpeedColumn(), TimeElapsedColumn(),
                console=err_console(), transient=True,
            )
            self._bar.start()
        return self._bar

    def task(self, description: str, total: float | None = None, unit: str = "") -> Task:
        t = Task(description, total, unit, self)
        t.handle = self._ensure().add_task(description, total=total)
        self._open += 1
        return t

    def on_update(self, task: Task) -> None:
        if self._bar is not None and task.handle is not None:
            self._bar.update(task.handle, completed=task.completed, total=task.total,
                             description=task.description)

    def on_close(self, task: Task) -> None:
        if self._bar is None or task.handle is None:
            return
        self._bar.remove_task(task.handle)
        task.handle = None
        self._open -= 1
        if self._open <= 0:
            self._bar.stop()
            self._bar = None

    def message(self, text: str) -> None:
        err_console().print(escape(text))
