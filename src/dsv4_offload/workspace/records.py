"""The state file's records, typed: `StageRecord` per stage, `State` for the file.

On disk (``.dsv4/state.json``) they are `RawState` and `RawRecord`; `load_state` checks a
file, brings an older one to ``STATE_SCHEMA`` (`MIGRATIONS`) and types it. A record that
cannot be read is one line naming the stage, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import Status
from dsv4_offload.core.states import StageState

# the version this tool writes; a file of an older one is migrated when read
STATE_SCHEMA = 1


# what a record may say; the other states are told by `status` or a run, never recorded
RECORDED = (StageState.PENDING, StageState.RUNNING, StageState.DONE, StageState.FAILED,
            StageState.INTERRUPTED)


class RawRecord(TypedDict, total=False):
    """A stage record as the state file holds it (every key optional)."""

    status: str
    pid: int
    pid_start_time: int | None
    started: str
    ended: str
    seconds: float
    log: str | None
    summary: str
    error: str
    signal: str
    fingerprint: dict[str, str]
    outputs: dict[str, Any]
    result: str
    container: str
    recipe: str


class RawState(TypedDict, total=False):
    """The state file as it is on disk."""

    schema: int
    stages: dict[str, RawRecord]


class StageRecord(BaseModel):
    """What the last run of a stage left: how it went, when, its log and what it made.

    Keys it does not know (a newer tool's, a hand edit's) are kept on rewrite."""

    model_config = ConfigDict(extra="allow", frozen=True)

    status: StageState = StageState.PENDING
    pid: int | None = None  # running: the process that runs it, with its start time
    pid_start_time: int | None = None
    started: str | None = None
    ended: str | None = None
    seconds: float | None = None
    log: str | None = None
    summary: str | None = None
    error: str | None = None  # failed or interrupted: why
    signal: str | None = None  # interrupted: by which signal
    fingerprint: dict[str, str] | None = None  # done: its inputs (pipeline/fingerprint)
    outputs: dict[str, Any] | None = None  # done: what the stage result recorded
    result: Status | None = None  # done: the result's status (ok, warn, skipped)
    container: str | None = None  # run in this container: its processes live there
    recipe: str | None = None  # the name of the recipe it ran under (a shared workspace)

    @field_validator("status")
    @classmethod
    def _a_record_word(cls, value: StageState) -> StageState:
        if value not in RECORDED:
            raise ValueError(f"'{value}' is a run's state, not a record's")
        return value

    @classmethod
    def from_raw(cls, raw: Any) -> StageRecord:
        """The record from its raw form; ValueError says why it cannot be read."""
        why = record_problem(raw)
        if why:
            raise ValueError(why)
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            key = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"'{key}': {first['msg'].removeprefix('Value error, ')}") from None

    def as_raw(self) -> RawRecord:
        """The record as the file holds it: only the keys its writer set (its words are
        ``str``; an output JSON cannot hold is written as its text, as before)."""
        raw: RawRecord = self.model_dump(exclude_unset=True)  # type: ignore[assignment]
        return raw

    def changed(self, **fields: Any) -> StageRecord:
        """This record with ``fields`` set (and written out, as its other set keys)."""
        return self.model_validate({**self.model_dump(exclude_unset=True), **fields})


def record_problem(raw: Any) -> str | None:
    """Why a raw stage record cannot be read, or None (the types its readers rely on)."""
    if not isinstance(raw, dict):
        return f"a {type(raw).__name__}, not an object"
    for key in ("status", "started", "ended", "log", "summary"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            return f"'{key}' is not text"
    for key in ("fingerprint", "outputs"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            return f"'{key}' is not an object"
    return None


@dataclass(frozen=True)
class State:
    """The whole state file: each stage's last record, by stage name."""

    stages: Mapping[str, StageRecord] = field(default_factory=dict)

    def record(self, stage: str) -> StageRecord | None:
        return self.stages.get(stage)

    def outputs(self, stage: str) -> dict[str, Any]:
        """What the stage's last run recorded as its outputs ({} when none)."""
        record = self.stages.get(stage)
        return dict(record.outputs or {}) if record is not None else {}

    def with_record(self, stage: str, record: StageRecord) -> State:
        return State({**self.stages, stage: record})

    def as_raw(self) -> RawState:
        return {"schema": STATE_SCHEMA,
                "stages": {name: r.as_raw() for name, r in self.stages.items()}}


def _from_unversioned(raw: dict[str, Any]) -> dict[str, Any]:
    """A file without ``schema`` (made by hand or by another tool) has version 1's shape."""
    return {**raw, "schema": 1}


# version -> the step to the next one; load_state walks them up to STATE_SCHEMA
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {0: _from_unversioned}


def load_state(doc: Any, where: Path) -> State:
    """The state file's content (``doc``, parsed JSON, from ``where``) typed; an older
    version migrated. InputError (one line) for a file or record that cannot be read."""
    if not isinstance(doc, dict):
        raise _not_a_state(where)
    version = doc.get("schema", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise _not_a_state(where)
    if version > STATE_SCHEMA:
        raise InputError(f"{where}: written by a newer dsv4-offload (state schema {version}; "
                         f"this one reads up to {STATE_SCHEMA}); use that version, or move "
                         "the file aside and rerun")
    while version < STATE_SCHEMA:
        doc = MIGRATIONS[version](doc)
        version += 1
    stages = doc.get("stages")
    if not isinstance(stages, dict):
        raise _not_a_state(where)
    typed = {}
    for name, raw in stages.items():
        try:
            typed[name] = StageRecord.from_raw(raw)
        except ValueError as exc:
            raise InputError(f"{where}: the record of stage '{name}' is malformed ({exc}); "
                             "delete that entry (or move the file aside) and rerun: the "
                             "stage runs again") from None
    return State(typed)


def _not_a_state(where: Path) -> InputError:
    return InputError(f"{where}: not a dsv4-offload state file; move it aside and rerun")
