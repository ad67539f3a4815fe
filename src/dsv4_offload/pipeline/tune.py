"""`tune`: a search over the knobs of decode speed, one server start per trial.

Optuna (TPE, seeded) proposes a setting of the space (pipeline/tunespace.py). A setting the
serve rules forbid is pruned with the rule's reason and never started; one measured before
is answered from its record, never run again, and the next trial is queued one knob away
from the best measured setting (TPE on a small grid keeps proposing its best). Otherwise the
trial stops any server of the workspace, starts one through the serve stage (supervisor,
launch plan, ladder; detached) with the setting as `--set` items, runs the accept stage (a
failed check discards the trial with that reason; the throughput probe at `tune.buckets`,
median of `tune.repeats`), stops the server and records the mean of the buckets' medians,
with the per-bucket figures, report and log as user attributes. The study is Optuna's
SQLite storage under the workspace's tune/; a killed `tune` resumes it: a trial it left
RUNNING is marked failed ("interrupted") and its setting queued again, measured once whole.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core import events
from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.results import Severity
from dsv4_offload.pipeline.serial import dispatch_stage
from dsv4_offload.pipeline.tunespace import (
    Knob,
    forbidden,
    full,
    grid,
    key_of,
    knobs,
    set_items,
)

if TYPE_CHECKING:
    import optuna

    from dsv4_offload.core.host import HostFacts
    from dsv4_offload.recipe import Recipe
    from dsv4_offload.workspace.context import StageContext
    from dsv4_offload.workspace.store import Workspace

STUDY_DB = "study.db"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smh])$")


@dataclass(frozen=True)
class Budget:
    """How long `tune` goes on: measured trials of the study, or seconds of this run."""

    trials: int | None = None
    seconds: float | None = None

    def shown(self) -> str:
        return f"{self.trials} trials" if self.trials is not None else f"{self.seconds:g} s"


def parse_budget(text: str) -> Budget:
    """``20`` (trials) or ``30m`` / ``90s`` / ``2h`` (time); InputError with the fix."""
    raw = text.strip().lower()
    if raw.isdigit() and int(raw) > 0:
        return Budget(trials=int(raw))
    found = _DURATION.match(raw)
    if found and float(found.group(1)) > 0:
        return Budget(seconds=float(found.group(1)) * {"s": 1, "m": 60, "h": 3600}[found.group(2)])
    raise InputError(f"--budget {text}: give a number of trials (20) or a time (90s, 30m, 2h)")


@dataclass
class TuneRequest:
    budget: Budget
    knob_names: tuple[str, ...] = ()
    device: int | None = None
    seed: int | None = None


@dataclass
class TuneOutcome:
    study: str
    measured: int  # trials of the study that started a server
    best: dict[str, Any] | None
    stopped_by: str
    trials: list[dict[str, Any]] = field(default_factory=list)


def study_path(ws: Workspace) -> Path:
    return ws.tune_dir / STUDY_DB


def storage_url(ws: Workspace) -> str:
    return f"sqlite:///{study_path(ws)}"


def study_name(recipe: Recipe, space: Sequence[Knob]) -> str:
    """The study of this space: its knobs, their values and the probe (another space is
    another study, since Optuna keeps each parameter's values fixed within one)."""
    tune = recipe.tune
    doc = {"knobs": [[k.name, list(k.choices)] for k in space], "buckets": tune.buckets,
           "repeats": tune.repeats, "new_tokens": tune.new_tokens}
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:8]
    return f"{recipe.name}-{digest}"


def _optuna() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


def open_study(ws: Workspace, name: str, seed: int) -> optuna.Study:
    optuna = _optuna()
    ws.tune_dir.mkdir(parents=True, exist_ok=True)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
    return optuna.create_study(study_name=name, storage=storage_url(ws), sampler=sampler,
                               direction="maximize", load_if_exists=True)


def latest_study(ws: Workspace, name: str | None = None) -> optuna.Study:
    """The study `tune show` and `tune apply` read: ``name``, else the last one started."""
    optuna = _optuna()
    if not study_path(ws).is_file():
        raise InputError(f"{study_path(ws)}: no tune study in this workspace; run "
                         "`dsv4-offload tune` first")
    summaries = optuna.get_all_study_summaries(storage_url(ws))
    names = [s.study_name for s in summaries]
    if name is not None and name not in names:
        raise InputError(f"--study {name}: not a study of {study_path(ws)}; use one of {names}")
    if name is None:
        if not summaries:
            raise InputError(f"{study_path(ws)}: holds no study; run `dsv4-offload tune`")
        dated = [s for s in summaries if s.datetime_start is not None]
        name = max(dated, key=lambda s: s.datetime_start).study_name if dated else names[-1]
    return optuna.load_study(study_name=name, storage=storage_url(ws))


def recover_interrupted(ws: Workspace, study: optuna.Study, emit: Callable[..., None]
                        ) -> list[int]:
    """Trials a killed `tune` left RUNNING: marked failed ("interrupted") and their setting
    queued again, so the next trial measures it whole. Returns their numbers."""
    optuna = _optuna()
    # a dead process's trial takes its attributes through the storage, not a Trial object
    storage = optuna.storages.RDBStorage(storage_url(ws))
    study_id = storage.get_study_id_from_name(study.study_name)
    numbers = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, "reason", "interrupted: tune was stopped during "
                                    "this trial; its setting is measured again")
        storage.set_trial_user_attr(trial_id, "interrupted", True)
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        if t.params:
            study.enqueue_trial(dict(t.params), user_attrs={"requeued_from": t.number})
        numbers.append(t.number)
        emit("trial.requeued", trial=t.number, setting=dict(t.params))
    return numbers


def measured_trials(study: optuna.Study) -> list[Any]:
    """Trials that started a server and ended (passed or discarded), not interrupted."""
    return [t for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("ran") and not t.user_attrs.get("interrupted")
            and t.state.is_finished()]


def best_trial(study: optuna.Study) -> Any | None:
    optuna = _optuna()
    done = [t for t in measured_trials(study) if t.state == optuna.trial.TrialState.COMPLETE
            and t.value is not None]
    return max(done, key=lambda t: (t.value, -t.number)) if done else None


def run_tune(base: StageContext, context_for: Callable[[list[str]], StageContext],
             request: TuneRequest, facts: HostFacts,
             on_event: Callable[[dict[str, Any]], None]) -> TuneOutcome:
    """Search until the budget is spent or every allowed setting is measured; no server is
    left running. ``context_for(items)`` is the command's context with more `--set` items."""
    optuna = _optuna()
    recipe, ws = base.recipe, base.workspace
    space = knobs(recipe, facts, request.knob_names)
    seed = recipe.tune.seed if request.seed is None else request.seed
    name = study_name(recipe, space)
    study = open_study(ws, name, seed)

    def emit(event: str, **fields: Any) -> None:
        on_event(events.make(event, study=name, **fields))

    # a server of the workspace from before (or one a killed tune left): each trial starts
    # its own
    stopped = _stop_server(base)
    requeued = recover_interrupted(ws, study, emit)
    allowed = [s for s in grid(space) if forbidden(recipe, facts, s, request.device) is None]
    if not study.get_trials(deepcopy=False):
        # the recipe's setting first: what every other trial is measured against
        study.enqueue_trial(full({}, space), user_attrs={"baseline": True})
    emit("tune.started", knobs={k.name: list(k.choices) for k in space},
         budget=request.budget.shown(), allowed=len(allowed),
         measured=len(measured_trials(study)), requeued=requeued, db=str(study_path(ws)),
         stopped_server=stopped)
    order = allowed[:]
    random.Random(seed).shuffle(order)
    started = time.monotonic()
    stopped_by = "budget"
    while True:
        done = measured_trials(study)
        seen = {key_of(t.params) for t in done}
        if not allowed:
            stopped_by = ("no setting of the space is allowed; the recipe's own: "
                          f"{forbidden(recipe, facts, {}, request.device)}")
            break
        if len(seen) >= len(allowed):
            stopped_by = "every allowed setting measured"
            break
        if request.budget.trials is not None and len(done) >= request.budget.trials:
            break
        if request.budget.seconds is not None and \
                time.monotonic() - started >= request.budget.seconds:
            break
        trial = study.ask()
        setting = {k.name: trial.suggest_categorical(k.name, list(k.choices)) for k in space}
        why = forbidden(recipe, facts, setting, request.device)
        if why is not None:
            trial.set_user_attr("reason", why)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            emit("trial.pruned", trial=trial.number, setting=setting, reason=why)
            _queue_next(study, done, space, order, seen)
            continue
        twin = next((t for t in done if key_of(t.params) == key_of(setting)), None)
        if twin is not None:  # measured already: answered from its record, not run again
            trial.set_user_attr("same_as", twin.number)
            if twin.state == optuna.trial.TrialState.COMPLETE:
                study.tell(trial, twin.value)
            else:
                trial.set_user_attr("reason", twin.user_attrs.get("reason", "failed"))
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            emit("trial.repeat", trial=trial.number, setting=setting, same_as=twin.number)
            _queue_next(study, done, space, order, seen)
            continue
        _measure(base, context_for, study, trial, setting, space, request, emit)
    _stop_server(base)
    best = best_trial(study)
    best_doc = _trial_doc(best) if best is not None else None
    emit("tune.finished", measured=len(measured_trials(study)), stopped_by=stopped_by,
         best=best_doc)
    return TuneOutcome(name, len(measured_trials(study)), best_doc, stopped_by,
                       [_trial_doc(t) for t in study.get_trials(deepcopy=False)])


def _queue_next(study: optuna.Study, done: Sequence[Any], space: Sequence[Knob],
                order: Sequence[Mapping[str, Any]], seen: set[Any]) -> None:
    """After a proposal that starts nothing, queue an unmeasured allowed setting: one knob
    away from the best measured ones, best first, else the next of ``order``.

    TPE on a small grid of a few knobs keeps proposing settings it measured (it exploits
    its best); a repeat is answered from the record, and what comes next is the incumbent's
    neighbourhood, one knob at a time, which a knob-by-knob landscape rewards.
    """
    allowed = {key_of(s): s for s in order}
    ranked = sorted((t for t in done if t.value is not None), key=lambda t: -t.value)
    for t in ranked:
        for knob in space:
            for value in knob.choices:
                near = {**t.params, knob.name: value}
                key = key_of(near)
                if key in allowed and key not in seen:
                    study.enqueue_trial(near, user_attrs={"queued": f"near trial {t.number}"},
                                        skip_if_exists=True)
                    return
    fresh = next((s for s in order if key_of(s) not in seen), None)
    if fresh is not None:
        study.enqueue_trial(dict(fresh), user_attrs={"queued": "unmeasured"},
                            skip_if_exists=True)


def _measure(base: StageContext, context_for: Callable[[list[str]], StageContext],
             study: optuna.Study, trial: Any, setting: Mapping[str, Any], space: Sequence[Knob],
             request: TuneRequest, emit: Callable[..., None]) -> None:
    """One trial: the server with ``setting``, accept against it, the result recorded."""
    optuna = _optuna()
    items = [*set_items(setting, space), *probe_items(base.recipe)]
    trial.set_user_attr("ran", True)
    trial.set_user_attr("set", set_items(setting, space))
    emit("trial.started", trial=trial.number, setting=dict(setting))
    t0 = time.monotonic()
    ctx = context_for(items)
    ctx.host_facts = base.host_facts
    try:
        reason, figures = _serve_and_accept(ctx, trial, request)
    except Dsv4Error as exc:  # the plan or a stage refused this setting: this trial's failure
        reason, figures = exc.one_line(), {}
    finally:  # Ctrl-C included: the trial stays RUNNING in the study, resumed as interrupted
        _stop_server(base)
    seconds = round(time.monotonic() - t0, 1)
    trial.set_user_attr("seconds", seconds)
    if reason is not None:
        trial.set_user_attr("reason", reason)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        emit("trial.failed", trial=trial.number, setting=dict(setting), reason=reason,
             seconds=seconds)
        return
    value = round(sum(figures.values()) / len(figures), 3)
    trial.set_user_attr("buckets", {str(k): v for k, v in figures.items()})
    study.tell(trial, value)
    emit("trial.done", trial=trial.number, setting=dict(setting), tok_s=value,
         buckets={str(k): v for k, v in figures.items()}, seconds=seconds)


def _serve_and_accept(ctx: StageContext, trial: Any, request: TuneRequest
                      ) -> tuple[str | None, dict[int, float]]:
    """(why the trial is discarded or None, each bucket's median tok/s)."""
    from dsv4_offload.stages.accept import AcceptOptions
    from dsv4_offload.stages.serve import ServeOptions

    serve = dispatch_stage(ctx, "serve", ServeOptions(
        detach=True, device=request.device, longest_prompt=max(ctx.recipe.tune.buckets)))
    trial.set_user_attr("serve_log", serve.log or "")
    reason = _failure(serve, "serve")
    swa = next((p for p in serve.problems if p.check == "serve.swa-pool"), None)
    if reason is None and swa is not None:
        reason = f"serve: {swa.message}"  # its longest bucket would never be admitted
    figures: dict[int, float] = {}
    if reason is None:
        accept = dispatch_stage(ctx, "accept", AcceptOptions(no_throughput_gate=True))
        trial.set_user_attr("report", str(accept.data.get("report", "")))
        # where this setting's decode stands between its ceilings (the share moves with the
        # resident experts): `tune show` places the best one
        trial.set_user_attr("ceilings", accept.data.get("ceilings"))
        reason = _failure(accept, "accept")
        figures = _bucket_medians(accept.data.get("throughput") or [])
        if reason is None and not figures:
            reason = "accept: no bucket measured a decode rate"
    return reason, figures


def probe_items(recipe: Recipe) -> list[str]:
    """accept's throughput probe at tune's buckets: `--set` items of the acceptance section."""
    tune = recipe.tune
    return [f"acceptance.throughput.prompt_buckets=[{', '.join(map(str, tune.buckets))}]",
            f"acceptance.throughput.repeats={tune.repeats}",
            f"acceptance.throughput.new_tokens={tune.new_tokens}"]


def _failure(result: Any, stage: str) -> str | None:
    if result.ok:
        return None
    first = next((p for p in result.problems if p.severity == Severity.ERROR), None)
    return f"{stage}: {first.message if first else result.summary}"


def _bucket_medians(buckets: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Each measured bucket's median tok/s (accept's as_dict of a Bucket)."""
    out = {}
    for b in buckets:
        median = b.get("median")
        if isinstance(median, (int, float)) and median > 0:
            out[int(b["target"])] = float(median)
    return out


def _stop_server(ctx: StageContext) -> int | None:
    """Stop the workspace's server if one runs (the supervisor's checks: ours only); its pid."""
    from dsv4_offload.serving import supervisor as sv

    record = sv.read_record(ctx.workspace.serve_record)
    if not sv.record_alive(record):
        return None
    sv.stop_recorded(ctx.workspace.serve_record, ctx.recipe.serve.stop_timeout_s)
    return record.server_pid or record.supervisor_pid


def _trial_doc(t: Any) -> dict[str, Any]:
    attrs = t.user_attrs
    return {"trial": t.number, "state": t.state.name.lower(), "setting": dict(t.params),
            "tok_s": t.value, "buckets": attrs.get("buckets"), "reason": attrs.get("reason"),
            "same_as": attrs.get("same_as"), "ran": bool(attrs.get("ran")),
            "baseline": bool(attrs.get("baseline")), "set": attrs.get("set"),
            "seconds": attrs.get("seconds"), "report": attrs.get("report"),
            "ceilings": attrs.get("ceilings")}


def placed(doc: Mapping[str, Any]) -> str:
    """Where a trial's decode stands between its ceilings, from accept's figures for it
    (acceptance/ceilings.py as_dict): one line, naming what is not known."""
    c = doc.get("ceilings") or {}
    if not c:
        return f"trial {doc['trial']}: its ceilings were not recorded (a tune before they were)"
    share = "unknown" if c.get("share") is None else f"{c['share']:.3f}"
    head = (f"trial {doc['trial']} at resident share {share}: accept measured "
            f"{c.get('measured_tok_s')} tok/s")
    known = [f"{c[f'{key}_fraction']:.0%} of the {name} ({c[f'{key}_tok_s']:g} tok/s)"
             for name, key in (("memory roofline", "roofline"),
                               ("CPU kernel's projection", "kernel"))
             if c.get(f"{key}_tok_s") and c.get(f"{key}_fraction") is not None]
    missing = "; ".join(c.get("missing") or [])
    if not known:
        return f"{head}; its ceilings are not known: {missing or 'no figure'}"
    return (f"{head}, {', '.join(known)}" + (f" (not known: {missing})" if missing else "")
            + f"; {c.get('where')}")


def trial_docs(study: optuna.Study) -> list[dict[str, Any]]:
    return [_trial_doc(t) for t in study.get_trials(deepcopy=False)]


def apply_trial(ws: Workspace, study: optuna.Study, number: int | None = None
                ) -> dict[str, Any]:
    """Write trial ``number`` (default: the best) as the workspace's overlay; what was
    written. InputError when the trial did not pass accept."""
    from dsv4_offload.core.clock import now_iso
    from dsv4_offload.recipe.overlay import overlay_text
    from dsv4_offload.workspace.store import atomic_write_bytes

    optuna = _optuna()
    if number is None:
        chosen = best_trial(study)
        if chosen is None:
            raise InputError(f"study {study.study_name}: no trial passed accept; nothing to "
                             "apply (`dsv4-offload tune show` says why each failed)")
    else:
        chosen = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
        if chosen is None or chosen.state != optuna.trial.TrialState.COMPLETE \
                or not chosen.user_attrs.get("set"):
            raise InputError(f"--trial {number}: not a measured trial that passed accept in "
                             f"study {study.study_name}; pick one of `dsv4-offload tune show`")
    items = list(chosen.user_attrs["set"])
    setting: dict[str, Any] = {}
    for item in items:
        key, raw = item.split("=", 1)
        setting[key] = raw if key.startswith("serve.env.") else json.loads(raw)
    header = (f"written by `dsv4-offload tune apply` on {now_iso()}: study "
              f"{study.study_name}, trial {chosen.number}, {chosen.value:g} tok/s\n"
              "(mean of the buckets' median decode rates); `tune apply --clear` removes it")
    atomic_write_bytes(ws.tune_overlay, overlay_text(setting, header).encode())
    return {"overlay": str(ws.tune_overlay), "study": study.study_name,
            "trial": chosen.number, "tok_s": chosen.value, "set": items}
