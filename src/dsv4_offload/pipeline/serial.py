"""The serial run (`run --serial`): the stages in order, resume, force, dry-run plan, and
the hand-over of a stage to the container when the recipe says so."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from dsv4_offload.core import childrun, events, procs
from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import Dsv4Error, ExitCode, InputError, NotImplementedStage
from dsv4_offload.core.options import FollowOptions, StageOptions
from dsv4_offload.core.registry import STAGE_NAMES, STAGES, StageSpec, recipe_value, spec
from dsv4_offload.core.results import Severity, StageResult
from dsv4_offload.core.runner import interrupt_name
from dsv4_offload.core.states import StageState
from dsv4_offload.pipeline.fingerprint import fingerprint, load_stage_module, model_digest
from dsv4_offload.pipeline.groups import groups_noted, sweep_leftovers
from dsv4_offload.pipeline.options import stage_options
from dsv4_offload.pipeline.status import NOT_APPLICABLE, not_applicable_reason, stage_status
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.placement import runs_in_container
from dsv4_offload.workspace.records import StageRecord


def run_stage(ctx: StageContext, name: str,
              options: StageOptions | Mapping[str, Any] | None = None) -> StageResult:
    """Run one stage now (the caller holds the lock) and record the outcome; without
    ``options``, those of the context the stage declares."""
    stage = spec(name)
    module = _runnable(ctx, stage)
    sub = ctx.for_stage(name, _typed(name, ctx, options))
    if events.events_file() is not None:  # a stage process of a pipelined run
        sub = replace(sub, progress=events.EventProgress(name, sub.progress))
    ws = ctx.workspace
    sweep_leftovers(ws)
    started = now_iso()
    t0 = time.monotonic()
    me = procs.identity()
    # a running record replaces any earlier 'done': a killed rerun must not look finished
    ws.write_stage_record(name, StageRecord(
        status=StageState.RUNNING, pid=me.pid, pid_start_time=me.start_time, started=started,
        log=str(sub.log_dir), recipe=ctx.recipe.name,
        container=childrun.container_name() or None))  # its pid is that container's
    events.emit("stage.started", stage=name, log=str(sub.log_dir),
                options={k: v for k, v in _given(options).items()
                         if v and isinstance(v, (bool, int, float, str))})
    try:
        with groups_noted(ws, name, me):
            result: StageResult = module.run(sub)
    except KeyboardInterrupt as exc:
        how = interrupt_name(exc) + _orphaned()
        ws.write_stage_record(name, StageRecord(
            status=StageState.INTERRUPTED, signal=interrupt_name(exc), started=started,
            ended=now_iso(), seconds=round(time.monotonic() - t0, 3),
            error=f"interrupted by {how}", log=str(sub.log_dir), recipe=ctx.recipe.name))
        events.emit("stage.interrupted", stage=name, signal=interrupt_name(exc))
        raise
    except Dsv4Error as exc:
        _record_failure(ctx, name, started, t0, exc.one_line(), exc.log or str(sub.log_dir))
        raise
    except Exception as exc:
        _record_failure(ctx, name, started, t0, f"internal error: {exc!r}", str(sub.log_dir))
        raise
    if result.log is None:
        result.log = str(sub.log_dir)
    if not result.ok:
        first = next((p for p in result.problems if p.severity == Severity.ERROR), None)
        error = result.summary + (f": {first.message}" if first else "")
        _record_failure(ctx, name, started, t0, error, result.log)
        return result
    if isinstance(sub.options, FollowOptions) and sub.options.follow:
        _await_streams(ws, stage)
    # taken after the run: a stage may declare inputs that its own work settles (the
    # serve stage's "is the server up"); recipe fields and upstream records cannot change
    fp = fingerprint(sub, stage, ws.state())
    seconds = round(time.monotonic() - t0, 3)
    record = StageRecord(
        status=StageState.DONE, started=started, ended=now_iso(), seconds=seconds,
        fingerprint=fp, outputs=result.outputs, summary=result.summary, result=result.status,
        log=result.log, recipe=ctx.recipe.name)
    inside = childrun.container_name()
    if inside:  # where its processes live (serve stop/status go there)
        record = record.changed(container=inside)
    ws.write_stage_record(name, record)
    events.emit("stage.done", stage=name, summary=result.summary, seconds=seconds,
                result=result.status.value)
    if result.outputs:
        ws.update_provenance(name, result.outputs)

    ws.update_provenance("recipe", {
        "name": ctx.recipe.name, "file": str(ctx.recipe.file or ""),
        "digest": model_digest(ctx.recipe), "series": ctx.series.name,
        "series_digest": model_digest(ctx.series),
        # patches of our own the recipe leaves out (series_skip): what this build lacks
        "series_left_out": [p.name for p in ctx.series.skipped],
    })
    return result


def _await_streams(ws: Any, stage: StageSpec, poll: float = 0.2) -> None:
    """A stage that followed its streams (convert beside download) records its fingerprint
    only once they are over: it takes in their final records, so the next run finds it done.
    A followed stage whose process is gone while its record says running is over too."""
    while True:
        state = ws.state()
        records = [r for r in map(state.record, stage.streams) if r is not None]
        if not any(r.status == StageState.RUNNING and procs.alive(r.pid, r.pid_start_time)
                   for r in records):
            return
        time.sleep(poll)


def _record_failure(ctx: StageContext, name: str, started: str, t0: float, error: str,
                    log: str | None) -> None:
    ctx.workspace.write_stage_record(name, StageRecord(
        status=StageState.FAILED, started=started, ended=now_iso(),
        seconds=round(time.monotonic() - t0, 3), error=error, log=log, recipe=ctx.recipe.name))
    events.emit("stage.failed", stage=name, error=error, log=log)


def _orphaned() -> str:
    """' (the run that started it, pid N, was killed)' for a stage process whose run died."""
    pid = childrun.scheduler_pid()
    # no longer our parent, or still it but dying (procs.exiting: the first of its threads
    # out sends the parent-death signal while the others hold its pid)
    lost = pid is not None and (os.getppid() != pid or procs.exiting(pid))
    return f" (the run that started it, pid {pid}, was killed)" if lost else ""


def _previous(name: str) -> str:
    idx = STAGE_NAMES.index(name)
    return STAGE_NAMES[idx - 1] if idx else name


@dataclass
class PlanItem:
    stage: str
    action: str  # run | skip
    reason: str
    steps: list[str] = field(default_factory=list)  # its row's steps (build's), in order


def stage_range(start: str | None, stop: str | None, force: tuple[str, ...] = ()
                ) -> tuple[StageSpec, ...]:
    """The stages from --from to --to, in order (every name checked, --force's too)."""
    names = list(STAGE_NAMES)
    lo = names.index(spec(start).name) if start else 0
    hi = names.index(spec(stop).name) if stop else len(names) - 1
    if lo > hi:
        raise InputError(f"--from {start} comes after --to {stop}; swap them")
    for f in force:
        spec(f)
    return STAGES[lo : hi + 1]


def plan(ctx: StageContext, start: str | None = None, stop: str | None = None,
         force: tuple[str, ...] = ()) -> list[PlanItem]:
    stages = stage_range(start, stop, force)
    state = ctx.workspace.state()
    memo: dict[str, dict[str, str]] = {}
    items = []
    for s in stages:
        steps = [b.name for b in recipe_value(ctx.recipe, s.steps)] if s.steps else []
        if s.name in force:
            runs_in_container(ctx.recipe, s.name, announce=True)  # --runtime host: said now
            items.append(PlanItem(s.name, "run", "forced", steps))
            continue
        st = stage_status(ctx, s, state, memo)
        if st.state == NOT_APPLICABLE:
            items.append(PlanItem(s.name, "skip", st.reason, steps))
        elif st.state == StageState.DONE:
            items.append(PlanItem(s.name, "skip", "done, inputs unchanged", steps))
        else:  # a warning of --runtime host names only the stages that run
            where = (f" (in container {ctx.recipe.runtime.name})"
                     if runs_in_container(ctx.recipe, s.name, announce=True) else "")
            items.append(PlanItem(s.name, "run", (st.reason or st.state) + where, steps))
    return items


@dataclass
class RunOutcome:
    results: list[tuple[str, StageResult]]
    skipped: list[str]
    exit_code: ExitCode
    stopped_at: str | None = None


def run_pipeline(
    ctx: StageContext,
    start: str | None = None,
    stop: str | None = None,
    force: tuple[str, ...] = (),
    on_stage: Callable[[str, str], None] | None = None,
) -> RunOutcome:
    """Run the stages in order, skipping done ones; stop at the first failure."""
    results: list[tuple[str, StageResult]] = []
    skipped: list[str] = []
    # the options handed to this `run` with its one stage: by the stand-alone command that
    # sent its stage into the container, or by the pipelined run that started this stage
    # process (mirrors, device, follow, jobs)
    handed = childrun.handed_options()
    for stage in stage_range(start, stop, force):
        # each stage is planned at its turn: one that just ran changes its dependents'
        # fingerprints, and planning all of them up front would fingerprint twice
        if not_applicable_reason(ctx, stage.name):
            # a recipe that ends early (x86 development) passes these; `status` says why
            if on_stage:
                on_stage(stage.name, NOT_APPLICABLE)
            continue
        current = plan(ctx, stage.name, stage.name, force)[0]
        if current.action == "skip":
            skipped.append(stage.name)
            if on_stage:
                on_stage(stage.name, "skip")
            continue
        if on_stage:
            on_stage(stage.name, "run")
        # `run`'s own (mirrors, device) where the stage takes them, its registry row's, then
        # the handed ones (a scheduler's: follow, jobs), which go on into the container too
        options = stage_options(stage.name, ctx.options, {**stage.run_options, **handed})
        result = dispatch_stage(ctx, stage.name, options, standalone=bool(handed))
        results.append((stage.name, result))
        if not result.ok:
            return RunOutcome(results, skipped, ExitCode.FAILED, stopped_at=stage.name)
    return RunOutcome(results, skipped, ExitCode.OK)


def dispatch_stage(ctx: StageContext, name: str, options: StageOptions,
                   standalone: bool = False) -> StageResult:
    """Run one stage where the recipe puts it (workspace/placement.py): here, or in the
    recipe's container. `run` and the stand-alone stage commands both come through here;
    ``standalone`` hands the command's own options to the `run` inside."""
    if runs_in_container(ctx.recipe, name, options, announce=True):
        from dsv4_offload.serving.container import EngineUnavailable, run_stage_inside

        # the stage's own check of the container, before the hand-over (build: its compiler)
        before = getattr(load_stage_module(spec(name)), "before_container", None)
        try:
            # the container's own `run` records the stage in the shared state file
            return run_stage_inside(ctx, name, options, options if standalone else None,
                                    before)
        except EngineUnavailable as exc:
            raise EngineUnavailable(
                f"{name} runs in container {ctx.recipe.runtime.image} and {exc.message}; or "
                f"`--runtime host` runs {name} on this host instead, with this host's "
                "compiler, python and libraries rather than the image's") from None
    return run_stage(ctx, name, options)


def _runnable(ctx: StageContext, stage: StageSpec) -> Any:
    """The stage's module, once the recipe has the stage and this version implements it."""
    why_not = not_applicable_reason(ctx, stage.name)
    if why_not:
        raise InputError(f"stage '{stage.name}' is {why_not} (its not_applicable list); stop "
                         "there with `run --to` that stage, or use a recipe that has it")
    module = load_stage_module(stage)
    if module is None or not hasattr(module, "run"):
        raise NotImplementedStage(
            f"stage '{stage.name}' is not implemented in this version of dsv4-offload; "
            f"stop before it with `run --to {_previous(stage.name)}`"
        )
    return module


def evaluate(ctx: StageContext, name: str) -> StageResult:
    """Run a stage that only looks (doctor) for a report: its own options, no record, no
    event, no lock; what it finds is returned, the workspace's state is left as it was."""
    module = _runnable(ctx, spec(name))
    result: StageResult = module.run(ctx.for_stage(name, stage_options(name)))
    return result


def _typed(name: str, ctx: StageContext, options: StageOptions | Mapping[str, Any] | None
           ) -> StageOptions:
    """The stage's typed options: as given, checked name by name, or (none given) those of
    the context it declares."""
    if options is None:
        return stage_options(name, ctx.options)
    return stage_options(name, given=_given(options))


def _given(options: StageOptions | Mapping[str, Any] | None) -> dict[str, Any]:
    if isinstance(options, StageOptions):
        return options.given()
    return dict(options or {})

