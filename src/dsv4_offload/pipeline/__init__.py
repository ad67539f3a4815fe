"""Stage order, fingerprints, state records and the serial run/resume/force/dry-run
(`run --serial`; the pipelined run on the stage graph is schedule.py, beside this module).

A stage is *done* when its record says so and the fingerprint of its inputs still matches.
The fingerprint is a flat map ``input name -> short digest``: recipe fields (flattened to
leaves, so ``status`` can name the one that changed), extra inputs the stage module
declares, and the fingerprint and outputs of the stages it needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel

from dsv4_offload.core import events, procs
from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import Dsv4Error, ExitCode, InputError, NotImplementedStage
from dsv4_offload.core.registry import STAGE_NAMES, STAGES, StageSpec, spec
from dsv4_offload.core.results import StageResult
from dsv4_offload.core.runner import (
    KILL_GRACE_S,
    interrupt_name,
    start_sentinel,
    watch_groups,
)
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.contexts import IN_CONTAINER_ENV, STAGE_OPTIONS_ENV, runs_in_container

# --- fingerprints --------------------------------------------------------------------------


def _digest(value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _flatten(prefix: str, value: Any, out: dict[str, str], exclude: tuple[str, ...]) -> None:
    if any(prefix == e or prefix.startswith(e + ".") for e in exclude):
        return
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            _flatten(f"{prefix}.{key}", sub, out, exclude)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, sub in enumerate(value):
            # name list items by their 'name' when they have one: stable under reordering
            label = sub.get("name", i) if isinstance(sub, dict) else i
            _flatten(f"{prefix}[{label}]", sub, out, exclude)
    else:
        out[prefix] = _digest(value)


def recipe_inputs(ctx: StageContext, stage: StageSpec) -> dict[str, str]:
    dumped = ctx.recipe.model_dump(mode="json", by_alias=True)
    out: dict[str, str] = {}
    for dotted in stage.recipe_fields:
        if dotted == "series":
            _flatten("series", ctx.series.model_dump(mode="json", by_alias=True), out, ())
            continue
        node: Any = dumped
        for part in dotted.split("."):
            node = node[part]
        _flatten("recipe." + dotted, node, out, tuple("recipe." + e for e in stage.exclude))
    return out


def _load_module(stage: StageSpec) -> Any | None:
    try:
        return importlib.import_module(stage.module)
    except ModuleNotFoundError as exc:
        if exc.name == stage.module:
            return None
        raise


def fingerprint(ctx: StageContext, stage: StageSpec, state: dict[str, Any],
                _memo: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    memo = {} if _memo is None else _memo
    if stage.name in memo:
        return memo[stage.name]
    fp = recipe_inputs(ctx, stage)
    module = _load_module(stage)
    extra = getattr(module, "fingerprint_inputs", None) if module else None
    if extra is not None and _runs_in_container(ctx, stage.name):
        # its tool versions are the container's: the host takes those the container recorded
        # (the container's own run computes them afresh when it runs the stage)
        recorded = state.get("stages", {}).get(stage.name, {}).get("fingerprint") or {}
        fp.update({k: v for k, v in recorded.items() if k.startswith("input.")})
    elif extra is not None:
        sub_ctx = ctx.for_stage(stage.name)
        for key, value in extra(sub_ctx).items():
            fp[f"input.{key}"] = str(value)
    for need in stage.needs:
        upstream = fingerprint(ctx, spec(need), state, memo)
        record = state.get("stages", {}).get(need, {})
        fp[f"stage.{need}"] = _digest([upstream, record.get("outputs")])
    memo[stage.name] = fp
    return fp


def _runs_in_container(ctx: StageContext, stage: str) -> bool:
    return runs_in_container(ctx.recipe, stage)


def changed_inputs(old: dict[str, str], new: dict[str, str]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


# --- status --------------------------------------------------------------------------------


@dataclass
class StageStatus:
    name: str
    state: str  # done | stale | failed | interrupted | running | pending
    reason: str = ""
    started: str | None = None
    ended: str | None = None
    log: str | None = None
    summary: str = ""
    pid: int | None = None  # running: the process that runs it (the record's)

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


NOT_APPLICABLE = "n/a"


def not_applicable_reason(ctx: StageContext, name: str) -> str | None:
    """Why the recipe leaves this stage out (its ``not_applicable`` list), or None."""
    if name not in ctx.recipe.not_applicable:
        return None
    last = next((s for s in reversed(STAGE_NAMES) if s not in ctx.recipe.not_applicable),
                STAGE_NAMES[0])
    return f"not applicable to recipe {ctx.recipe.name}, which ends at {last}"


def stage_status(ctx: StageContext, stage: StageSpec, state: dict[str, Any],
                 memo: dict[str, dict[str, str]] | None = None) -> StageStatus:
    why_not = not_applicable_reason(ctx, stage.name)
    if why_not:
        return StageStatus(stage.name, NOT_APPLICABLE, why_not, summary=stage.summary)
    record = state.get("stages", {}).get(stage.name)
    if not record:
        return StageStatus(stage.name, "pending", summary=stage.summary)
    base = StageStatus(
        stage.name, record.get("status", "pending"), started=record.get("started"),
        ended=record.get("ended"), log=record.get("log"), summary=record.get("summary", ""),
    )
    if base.state == "running":
        # by pid and start time: a pid since reused by another process is not our run
        if procs.alive(record.get("pid"), record.get("pid_start_time")):
            base.reason = f"running (pid {record.get('pid')})"
            base.pid = record.get("pid")
            return base
        base.state, base.reason = "interrupted", "the process running it was killed; rerun it"
        left = leftover_processes(ctx.workspace, name=stage.name)
        if left:
            base.reason += (f" ({len(left)} of its processes still run: pids "
                            f"{', '.join(map(str, left[:5]))}; the next run stops them)")
        return base
    if base.state in ("failed", "interrupted"):
        base.reason = record.get("error", "")
        return base
    current = fingerprint(ctx, stage, state, memo)
    changed = changed_inputs(record.get("fingerprint", {}), current)
    if changed:
        base.state = "stale"
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        shown = ", ".join(changed[:3]) + more
        base.reason = f"changed: {shown}"
    return base


def pipeline_status(ctx: StageContext) -> list[StageStatus]:
    state = ctx.workspace.read_state()
    memo: dict[str, dict[str, str]] = {}
    rows = [stage_status(ctx, s, state, memo) for s in STAGES]
    running = [r for r in rows if r.state == "running"]
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


# --- running -------------------------------------------------------------------------------


def run_stage(ctx: StageContext, name: str, options: dict[str, Any] | None = None) -> StageResult:
    """Run one stage now (the caller holds the lock) and record the outcome."""
    stage = spec(name)
    why_not = not_applicable_reason(ctx, name)
    if why_not:
        raise InputError(f"stage '{name}' is {why_not} (its not_applicable list); stop "
                         "there with `run --to` that stage, or use a recipe that has it")
    module = _load_module(stage)
    if module is None or not hasattr(module, "run"):
        raise NotImplementedStage(
            f"stage '{name}' is not implemented in this version of dsv4-offload; "
            f"stop before it with `run --to {_previous(name)}`"
        )
    sub = ctx.for_stage(name, options)
    if events.events_file() is not None:  # a stage process of a pipelined run
        sub = replace(sub, progress=events.EventProgress(name, sub.progress))
    ws = ctx.workspace
    sweep_leftovers(ws)
    started = now_iso()
    t0 = time.monotonic()
    me = procs.identity()
    # a running record replaces any earlier 'done': a killed rerun must not look finished
    ws.write_stage_record(name, {"status": "running", "pid": me.pid,
                                 "pid_start_time": me.start_time, "started": started,
                                 "log": str(sub.log_dir)})
    events.emit("stage.started", stage=name, log=str(sub.log_dir),
                options={k: v for k, v in (options or {}).items()
                         if v and isinstance(v, (bool, int, float, str))})
    try:
        with _groups_noted(ws, name, me):
            result: StageResult = module.run(sub)
    except KeyboardInterrupt as exc:
        how = interrupt_name(exc) + _orphaned()
        ws.write_stage_record(name, {
            "status": "interrupted", "signal": interrupt_name(exc), "started": started,
            "ended": now_iso(), "seconds": round(time.monotonic() - t0, 3),
            "error": f"interrupted by {how}", "log": str(sub.log_dir)})
        events.emit("stage.interrupted", stage=name, signal=interrupt_name(exc))
        raise
    except Dsv4Error as exc:
        _record_failure(ws, name, started, t0, exc.one_line(), exc.log or str(sub.log_dir))
        raise
    except Exception as exc:
        _record_failure(ws, name, started, t0, f"internal error: {exc!r}", str(sub.log_dir))
        raise
    if result.log is None:
        result.log = str(sub.log_dir)
    if not result.ok:
        first = next((p for p in result.problems if p.severity == "error"), None)
        error = result.summary + (f": {first.message}" if first else "")
        _record_failure(ws, name, started, t0, error, result.log)
        return result
    if sub.option("follow"):
        _await_streams(ws, stage)
    # taken after the run: a stage may declare inputs that its own work settles (the
    # serve stage's "is the server up"); recipe fields and upstream records cannot change
    fp = fingerprint(sub, stage, ws.read_state())
    record = {
        "status": "done", "started": started, "ended": now_iso(),
        "seconds": round(time.monotonic() - t0, 3), "fingerprint": fp,
        "outputs": result.outputs, "summary": result.summary, "result": result.status.value,
        "log": result.log,
    }
    inside = os.environ.get(IN_CONTAINER_ENV)
    if inside:
        record["container"] = inside  # where its processes live (serve stop/status go there)
    ws.write_stage_record(name, record)
    events.emit("stage.done", stage=name, summary=result.summary, seconds=record["seconds"],
                result=result.status.value)
    if result.outputs:
        ws.update_provenance(name, result.outputs)

    ws.update_provenance("recipe", {
        "name": ctx.recipe.name, "file": str(ctx.recipe.file or ""),
        "digest": model_digest(ctx.recipe), "series": ctx.series.name,
        "series_digest": model_digest(ctx.series),
    })
    return result


# --- the process groups of a running stage --------------------------------------------------
# Each child a stage starts leads its own process group (core/runner). They are noted in
# run/groups-<stage> (core/procs.GroupNotes) while the stage runs; a sentinel process that
# outlives us stops them if we die without cleaning up (SIGKILL), and the next run sweeps
# whatever is left all the same.


def _groups_file(ws: Any, name: str) -> Any:
    return ws.run_dir / f"groups-{name}"


@contextlib.contextmanager
def _groups_noted(ws: Any, name: str, owner: procs.Identity) -> Iterator[None]:
    notes = procs.GroupNotes(_groups_file(ws, name))
    notes.begin(owner)
    sentinel = start_sentinel([sys.executable, "-m", "dsv4_offload.core.procs", "sweep",
                               str(notes.path)])
    try:
        with watch_groups(notes.note):
            yield
    finally:  # every group was stopped on the way out (the runner's rule)
        notes.path.unlink(missing_ok=True)
        if sentinel is not None:
            sentinel.release()
        with contextlib.suppress(OSError):
            notes.path.parent.rmdir()  # only when empty: nothing of ours is left


def leftover_processes(ws: Any, name: str | None = None) -> list[int]:
    """Processes still running from stages whose run was killed outright."""
    found: list[int] = []
    for path in sorted(ws.run_dir.glob(f"groups-{name or '*'}")):
        found += procs.GroupNotes(path).leftovers()
    return found


def sweep_leftovers(ws: Any) -> list[int]:
    """Stop what is left of stages whose run was killed outright (TERM, then KILL)."""
    stopped: list[int] = []
    for path in sorted(ws.run_dir.glob("groups-*")):
        stopped += procs.GroupNotes(path).sweep(KILL_GRACE_S)
    with contextlib.suppress(OSError):
        ws.run_dir.rmdir()  # only when empty
    return sorted(set(stopped))


def _await_streams(ws: Any, stage: StageSpec, poll: float = 0.2) -> None:
    """A stage that followed its streams (convert beside download) records its fingerprint
    only once they are over: it takes in their final records, so the next run finds it done.
    A followed stage whose process is gone while its record says running is over too."""
    while True:
        records = ws.read_state().get("stages", {})
        running = [records.get(n) or {} for n in stage.streams]
        if not any(r.get("status") == "running" and procs.alive(r.get("pid"),
                                                                r.get("pid_start_time"))
                   for r in running):
            return
        time.sleep(poll)


def _record_failure(ws: Any, name: str, started: str, t0: float, error: str, log: str | None
                    ) -> None:
    ws.write_stage_record(name, {
        "status": "failed", "started": started, "ended": now_iso(),
        "seconds": round(time.monotonic() - t0, 3), "error": error, "log": log,
    })
    events.emit("stage.failed", stage=name, error=error, log=log)


# a pipelined run names itself to the stage processes it starts: one whose parent is no
# longer that run (killed outright: its children got the parent-death signal) says so
SCHEDULER_PID_ENV = "DSV4_SCHEDULER_PID"


def _orphaned() -> str:
    """' (the run that started it, pid N, was killed)' for a stage process whose run died."""
    raw = os.environ.get(SCHEDULER_PID_ENV, "")
    if raw.isdigit() and os.getppid() != int(raw):
        return f" (the run that started it, pid {raw}, was killed)"
    return ""


def _previous(name: str) -> str:
    idx = STAGE_NAMES.index(name)
    return STAGE_NAMES[idx - 1] if idx else name


@dataclass
class PlanItem:
    stage: str
    action: str  # run | skip
    reason: str
    steps: list[str] = field(default_factory=list)  # build: its steps, in order


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
    state = ctx.workspace.read_state()
    memo: dict[str, dict[str, str]] = {}
    items = []
    for s in stages:
        steps = [b.name for b in ctx.recipe.build.steps] if s.name == "build" else []
        if s.name in force:
            items.append(PlanItem(s.name, "run", "forced", steps))
            continue
        st = stage_status(ctx, s, state, memo)
        where = (f" (in container {ctx.recipe.runtime.name})"
                 if _runs_in_container(ctx, s.name) else "")
        if st.state == NOT_APPLICABLE:
            items.append(PlanItem(s.name, "skip", st.reason, steps))
        elif st.state == "done":
            items.append(PlanItem(s.name, "skip", "done, inputs unchanged", steps))
        else:
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
    handed = _handed_options()
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
        options = dict(ctx.options)
        options.update(stage.run_options)
        options.update(handed)
        # handed options (a scheduler's: follow, jobs) go on into the container too
        result = dispatch_stage(ctx, stage.name, options, standalone=bool(handed))
        results.append((stage.name, result))
        if not result.ok:
            return RunOutcome(results, skipped, ExitCode.FAILED, stopped_at=stage.name)
    return RunOutcome(results, skipped, ExitCode.OK)


def dispatch_stage(ctx: StageContext, name: str, options: dict[str, Any],
                   standalone: bool = False) -> StageResult:
    """Run one stage where the recipe puts it (workspace/contexts.py): here, or in the
    recipe's container. `run` and the stand-alone stage commands both come through here;
    ``standalone`` hands the command's own options to the `run` inside."""
    if _runs_in_container(ctx, name):
        from dsv4_offload.serving.container import run_stage_inside

        # the stage's own check of the container, before the hand-over (build: its compiler)
        before = getattr(_load_module(spec(name)), "before_container", None)
        # the container's own `run` records the stage in the shared state file
        return run_stage_inside(ctx, name, options, options if standalone else None, before)
    return run_stage(ctx, name, options)


def _handed_options() -> dict[str, Any]:
    """The options handed to this `run` with its one stage: by the stand-alone command that
    sent its stage into the container, or by the pipelined run that started this stage
    process (mirrors, device, follow, jobs). Read once and taken out of the environment, so
    the processes the stage starts do not take them for their own."""
    raw = os.environ.pop(STAGE_OPTIONS_ENV, None)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        raise InputError(f"{STAGE_OPTIONS_ENV} is not JSON: {raw[:80]!r}; it is set by "
                         "dsv4-offload for its own stage processes: unset it") from None
    if not isinstance(value, dict):
        raise InputError(f"{STAGE_OPTIONS_ENV} is not a JSON object: {raw[:80]!r}; it is set "
                         "by dsv4-offload for its own stage processes: unset it")
    return value


def model_digest(value: BaseModel) -> str:
    return _digest(value.model_dump(mode="json", by_alias=True))
