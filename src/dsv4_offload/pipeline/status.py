"""What each stage's record and fingerprint say: done, stale (why), failed, running."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4_offload.core import childrun, events, procs
from dsv4_offload.core.registry import STAGE_NAMES, STAGES, StageSpec
from dsv4_offload.core.states import StageState
from dsv4_offload.pipeline.fingerprint import changed_inputs, fingerprint
from dsv4_offload.pipeline.groups import leftover_processes
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.records import State


@dataclass
class StageStatus:
    name: str
    state: StageState  # done, stale, failed, interrupted, running, pending or n/a
    reason: str = ""
    started: str | None = None
    ended: str | None = None
    log: str | None = None
    summary: str = ""
    pid: int | None = None  # running: the process that runs it (the record's)
    recipe: str | None = None  # the record was made under another recipe than this one

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


NOT_APPLICABLE = StageState.NOT_APPLICABLE


def not_applicable_reason(ctx: StageContext, name: str) -> str | None:
    """Why the recipe leaves this stage out (its ``not_applicable`` list), or None."""
    if name not in ctx.recipe.not_applicable:
        return None
    last = next((s for s in reversed(STAGE_NAMES) if s not in ctx.recipe.not_applicable),
                STAGE_NAMES[0])
    return f"not applicable to recipe {ctx.recipe.name}, which ends at {last}"


def stage_status(ctx: StageContext, stage: StageSpec, state: State,
                 memo: dict[str, dict[str, str]] | None = None) -> StageStatus:
    why_not = not_applicable_reason(ctx, stage.name)
    if why_not:
        return StageStatus(stage.name, NOT_APPLICABLE, why_not, summary=stage.summary)
    record = state.record(stage.name)
    if record is None or not record.model_fields_set:  # none, or an empty one
        return StageStatus(stage.name, StageState.PENDING, summary=stage.summary)
    base = StageStatus(
        stage.name, record.status, started=record.started, ended=record.ended,
        log=record.log, summary=record.summary or "",
        recipe=record.recipe if record.recipe not in (None, ctx.recipe.name) else None,
    )
    if base.state == StageState.RUNNING:
        if record.container and record.container != childrun.container_name():
            # a pid of the container's namespace: this side's /proc cannot tell its truth
            base.reason = (f"running in container {record.container} (pid {record.pid} "
                           "there; not checked from here: `dsv4-offload container status`)")
            return base
        # by pid and start time: a pid since reused by another process is not our run
        if procs.alive(record.pid, record.pid_start_time):
            base.reason = f"running (pid {record.pid})"
            base.pid = record.pid
            return base
        base.state = StageState.INTERRUPTED
        base.reason = "the process running it was killed; rerun it"
        left = leftover_processes(ctx.workspace, name=stage.name)
        if left:
            base.reason += (f" ({len(left)} of its processes still run: pids "
                            f"{', '.join(map(str, left[:5]))}; the next run stops them)")
        return base
    if base.state.stopped:
        base.reason = record.error or ""
        return base
    current = fingerprint(ctx, stage, state, memo)
    changed = changed_inputs(record.fingerprint or {}, current)
    if changed:
        base.state = StageState.STALE
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        shown = ", ".join(changed[:3]) + more
        base.reason = f"changed: {shown}"
    return base


def pipeline_status(ctx: StageContext) -> list[StageStatus]:
    state = ctx.workspace.state()
    memo: dict[str, dict[str, str]] = {}
    rows = [stage_status(ctx, s, state, memo) for s in STAGES]
    running = [r for r in rows if r.state == StageState.RUNNING]
    if running:  # what is in flight: the latest progress each told the run's event stream
        from dsv4_offload.core.inflight import InFlight

        flight = InFlight()
        for doc in events.iter_file(ctx.workspace.events_file):
            flight.feed(doc)
        for r in running:
            got = flight.stages.get(r.name)  # of this very process, not an earlier run
            text = got.progress_text(ctx.recipe.conversion.layers) \
                if got is not None and got.pid == r.pid else ""
            if text:
                r.reason += f"; {r.name}: {text}"
    return rows
