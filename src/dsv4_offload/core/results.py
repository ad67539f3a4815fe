"""What every stage returns and reports: the result, its findings, progress.

A stage module (``dsv4_offload.stages.<name>``) exposes ``run(ctx: StageContext) ->
StageResult`` (the context is ``dsv4_offload.workspace.context``). Stages never print: they
report progress through ``ctx.progress`` and return data; the CLI renders.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal

from dsv4_offload.core.states import Word


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"  # done, with warnings the user should read
    FAILED = "failed"
    SKIPPED = "skipped"  # nothing to do (already done, or not applicable)


class CheckStatus(Word):
    """How a check row came out. Host rows (doctor's, the image's) say ok, warn, fail or
    skip; verdicts (accept's) say pass, warn, fail or skipped: the words each report has
    always printed."""

    OK = "ok"
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    SKIPPED = "skipped"


# the words of a host check row (doctor's, and the image's rows judged for it)
OK, WARN, FAIL, SKIP = CheckStatus.OK, CheckStatus.WARN, CheckStatus.FAIL, CheckStatus.SKIP


class Severity(Word):
    """How much a finding weighs: an error fails the stage, a warning is read by the user."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


SeverityWord = Literal["error", "warning", "info"]


@dataclass(init=False)
class Problem:
    """One finding: what is wrong and how to fix it."""

    severity: Severity
    message: str
    fix: str = ""
    check: str = ""

    def __init__(self, severity: Severity | SeverityWord, message: str, fix: str = "",
                 check: str = "") -> None:
        self.severity = Severity(severity)
        self.message, self.fix, self.check = message, fix, check

    def as_dict(self) -> dict[str, str]:
        return {"severity": self.severity.value, "check": self.check, "message": self.message,
                "fix": self.fix}


@dataclass
class Check:
    """One row of a check report: what was observed against what is required, and the fix.

    Doctor's host rows carry their status word (ok, warn, fail, skip). Accept's rows are
    verdicts, made by :meth:`verdict`: ``ok`` True, False or None (skipped); ``gate`` False
    reports a failure as a warning, ``warning`` a pass the user must read. Their words are
    pass, warn, fail, skipped, and their JSON row adds ``ok``, ``detail`` (the observed
    text, under its first name) and ``data``: both reports keep the keys they were read with.
    """

    name: str
    status: CheckStatus
    observed: str
    required: str = ""
    fix: str = ""
    ok: bool | None = None
    gate: bool = True
    data: dict[str, Any] = field(default_factory=dict)
    is_verdict: bool = False

    @classmethod
    def verdict(cls, name: str, ok: bool | None, observed: str, fix: str = "",
                data: dict[str, Any] | None = None, required: str = "", gate: bool = True,
                warning: bool = False) -> Check:
        if (ok is False and not gate) or (ok and warning):
            status = CheckStatus.WARN
        else:
            status = {True: CheckStatus.PASS, False: CheckStatus.FAIL,
                      None: CheckStatus.SKIPPED}[ok]
        return cls(name, status, observed, required, fix, ok=ok, gate=gate, data=data or {},
                   is_verdict=True)

    def as_dict(self) -> dict[str, Any]:
        """The row the renderer shows (name, status, observed, required) and the fix; a
        verdict's also has its ``ok``, ``detail`` and ``data``."""
        if not self.is_verdict:
            return {"name": self.name, "status": self.status, "observed": self.observed,
                    "required": self.required, "fix": self.fix}
        return {"name": self.name, "status": self.status, "ok": self.ok,
                "observed": self.observed, "required": self.required, "detail": self.observed,
                "fix": self.fix, **({"data": self.data} if self.data else {})}


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

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> StageResult:
        """The result back from its :meth:`as_dict` (another process's JSON)."""
        return cls(
            Status(doc.get("status", "failed")), str(doc.get("summary", "")),
            data=doc.get("data") or {},
            problems=[Problem(p.get("severity", "error"), p.get("message", ""),
                              p.get("fix", ""), p.get("check", ""))
                      for p in doc.get("problems") or [] if isinstance(p, dict)],
            outputs=doc.get("outputs") or {}, log=doc.get("log"))

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
