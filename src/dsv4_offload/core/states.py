"""The words a stage's state is told in: one vocabulary for its record, `status` and a run.

Each is a ``str`` enum that prints and serialises as its word, so JSON and text output
read the same as the plain words did.
"""

from __future__ import annotations

import enum


class Word(str, enum.Enum):
    """A ``str`` enum whose ``str()`` and f-string form are its value (as StrEnum's)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class StageState(Word):
    """Where a stage is: in its record, in `status`, in a pipelined run."""

    PENDING = "pending"  # never ran (no record)
    WAITING = "waiting"  # a run's: for the stages it needs
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    BLOCKED = "blocked"  # a run's: a stage it needs failed
    SKIPPED = "skipped"  # a run's: done, inputs unchanged
    STALE = "stale"  # done, but an input changed since
    NOT_APPLICABLE = "n/a"  # the recipe leaves it out

    @property
    def stopped(self) -> bool:
        """Ended without doing its work: what it blocks in a run, what `status` explains."""
        return self in (StageState.FAILED, StageState.INTERRUPTED)
