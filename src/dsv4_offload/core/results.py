"""What every stage returns and reports: the result, its findings, progress.

A stage module (``dsv4_offload.stages.<name>``) exposes ``run(ctx: StageContext) ->
StageResult`` (the context is ``dsv4_offload.workspace.context``). Stages never print: they
report progress through ``ctx.progress`` and return data; the CLI renders.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"  # done, with warnings the user should read
    FAILED = "failed"
    SKIPPED = "skipped"  # nothing to do (already done, or not applicable)


@dataclass
class Problem:
    """One finding: what is wrong and how to fix it."""

    severity: str  # "error" | "warning" | "info"
    message: str
    fix: str = ""
    check: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"severity": self.severity, "check": self.check, "message": self.message,
                "fix": self.fix}


@dataclass
class StageResult:
    status: Status
    summary: str
    data: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)  # recorded in the state file
    log: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in (Status.OK, Status.WARN, Status.SKIPPED)

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "summary": self.summary,
            "data": self.data,
            "problems": [p.as_dict() for p in self.problems],
            "outputs": self.outputs,
            "log": self.log,
        }


class Progress:
    """Progress reporting without a dependency on a terminal; the CLI plugs in rich."""

    def task(self, description: str, total: float | None = None, unit: str = "") -> Task:
        return Task(description, total, unit, self)

    def on_update(self, task: Task) -> None:  # overridden by renderers
        pass

    def on_close(self, task: Task) -> None:
        pass

    def message(self, text: str) -> None:
        pass


@dataclass
class Task:
    description: str
    total: float | None
    unit: str
    owner: Progress
    completed: float = 0.0
    handle: Any = None

    def advance(self, amount: float = 1.0) -> None:
        self.completed += amount
        self.owner.on_update(self)

    def update(self, completed: float | None = None, total: float | None = None,
               description: str | None = None) -> None:
        if completed is not None:
            self.completed = completed
        if total is not None:
            self.total = total
        if description is not None:
            self.description = description
        self.owner.on_update(self)

    def close(self) -> None:
        self.owner.on_close(self)

    def __enter__(self) -> Task:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
