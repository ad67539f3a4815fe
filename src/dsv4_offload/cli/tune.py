"""`tune`, `tune show` and `tune apply`: the search over the knobs of decode speed.

Only typer and cli.kit at import time; Optuna, rich and the pipeline load inside commands.
"""

from __future__ import annotations

from typing import Any

import typer

from dsv4_offload.cli import kit
from dsv4_offload.core.errors import ExitCode

tune_app = typer.Typer()  # its help is the callback's docstring


def register(app: typer.Typer) -> None:
    app.add_typer(tune_app, name="tune")


@tune_app.callback(invoke_without_command=True)
def tune(
    ctx: typer.Context,
    budget: str | None = typer.Option(
        None, "--budget", metavar="N|TIME", help="Trials of the study (20) or time of this run "
        "(90s, 30m, 2h); default tune.budget."),
    knob: list[str] = typer.Option(
        [], "--knob", metavar="NAME", help="Search only this knob (repeatable): experts, "
        "mem_fraction, threadpools, cpuinfer, hot_tail; the others stay at the recipe's."),
    device: int | None = typer.Option(None, "--device", metavar="N",
                                      help="NPU id for every trial's server."),
    seed: int | None = typer.Option(None, "--seed", metavar="N",
                                    help="The sampler's seed (tune.seed)."),
) -> None:
    """Search the knobs of decode speed: one server start per trial, the best kept.

    1. The space: tune.* values of each knob (resident experts, --mem-fraction-static,
       kt-kernel subpools, CPU-infer threads, KT_HOT_TAIL_TOKENS) and the recipe's own.
    2. Optuna (TPE, seeded) proposes a setting; one the serve rules forbid (the HBM ceiling
       of resident experts, the MEM_FRACTION rule, subpools per NUMA node, threads per core,
       DRAM per pool count) is pruned with the rule's reason and never started; one measured
       before is answered from its record.
    3. A trial starts the server with the setting (`serve --detach` with --set items), runs
       `accept` (a failed check discards the trial with its reason; the throughput probe at
       tune.buckets, median of tune.repeats), stops the server and records the mean tok/s.
    4. The study is Optuna's SQLite file tune/study.db in the workspace: a killed tune
       resumes; a trial it was running is marked interrupted and measured again.
    `tune show` lists the trials and plots them; `tune apply` makes the best the overlay
    every later `serve` starts with.
    """
    if ctx.invoked_subcommand is not None:
        return
    from dsv4_offload.pipeline import tune as tn
    from dsv4_offload.workspace.context import StageContext

    g = kit.options_of(ctx)
    base = kit.load_context(ctx, "tune")
    _tune_inside(ctx, base, budget, knob, device, seed)
    request = tn.TuneRequest(tn.parse_budget(budget or base.recipe.tune.budget),
                             tuple(knob), device, seed)
    from dsv4_offload.core.host import probe_host

    facts = probe_host(base.workspace.root, toolchain=False)  # serve's plan, each trial's
    base.host_facts = facts

    def context_for(items: list[str]) -> StageContext:
        return StageContext.open(g.recipe, [*g.overrides, *items], g.workspace,
                                 progress=base.progress, verbose=g.verbose)

    view = _view(g)
    with base.workspace.lock("tune"):
        outcome = tn.run_tune(base, context_for, request, facts, view)
    if g.json:
        raise typer.Exit(int(ExitCode.OK if outcome.best else ExitCode.FAILED))
    best = outcome.best
    line = (f"tune: {outcome.measured} trial(s) measured in study {outcome.study} "
            f"({outcome.stopped_by}); "
            + (f"best trial {best['trial']}: {best['tok_s']:g} tok/s with "
               f"{_setting_text(best['setting'])}; `dsv4-offload tune apply` makes it the "
               "serve default" if best else "no trial passed accept"))
    kit.emit(ctx, command="tune", status="ok" if best else "failed",
             data={"study": outcome.study, "best": best}, lines=[line])
    kit.exit_with(ExitCode.OK if best else ExitCode.FAILED)


def _tune_inside(ctx: typer.Context, base: Any, budget: str | None, knob: list[str],
                 device: int | None, seed: int | None) -> None:
    """With serve in the recipe's container, the whole search runs there: each trial's
    server, its accept and its stop are the container's processes (its pids are not the
    host's to signal). Returns when serve runs on this host."""
    from dsv4_offload.workspace.placement import runs_in_container

    if not runs_in_container(base.recipe, "serve"):
        return
    from dsv4_offload.serving.container import (
        crossing_names,
        exec_argv,
        exec_attached,
        find_container,
        plan_container,
    )

    plan = plan_container(base.recipe, base.workspace)
    found = find_container(plan.name)
    if found is None or found.state != "running":
        kit.emit(ctx, command="tune", status="failed", data={"container": plan.name},
                 lines=[f"error: serve runs in container {plan.name}, which is not running; "
                        "`dsv4-offload container up`, then tune again"])
        kit.exit_with(ExitCode.FAILED)
    g = kit.options_of(ctx)
    inner = [*(["--json"] if g.json else []), "tune"]
    for flag, value in (("--budget", budget), ("--device", device), ("--seed", seed)):
        if value is not None:
            inner += [flag, str(value)]
    inner += [w for k in knob for w in ("--knob", k)]
    path = base.recipe.file
    kit.exit_with(exec_attached(exec_argv(plan, base.workspace, str(path) if path else None,
                                          g.overrides, inner, crossing_names(base.recipe))))


def _view(g: Any) -> Any:
    """--json: each event a JSON line on stdout, as `run` streams them; else a plain line."""
    import sys

    from dsv4_offload.cli import live

    if g.json:
        lines = live.JsonLines()

        def as_json(doc: dict[str, Any]) -> None:
            lines.event(doc)
        return as_json

    def plain(doc: dict[str, Any]) -> None:
        if g.quiet:
            return
        text = _event_line(doc)
        if text:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
    return plain


def _event_line(doc: dict[str, Any]) -> str:
    kind = doc.get("event")
    n = doc.get("trial")
    setting = _setting_text(doc.get("setting") or {})
    if kind == "tune.started":
        stopped = (f"; stopped the workspace's server (pid {doc['stopped_server']}) first"
                   if doc.get("stopped_server") else "")
        return (f"tune: study {doc['study']}, {doc['allowed']} allowed setting(s), "
                f"{doc['measured']} measured before, budget {doc['budget']}{stopped}")
    if kind == "trial.started":
        return f"trial {n}: {setting}: starting the server"
    if kind == "trial.done":
        return f"trial {n}: {doc['tok_s']:g} tok/s ({doc['seconds']:g}s)"
    if kind == "trial.failed":
        return f"trial {n}: discarded: {doc['reason']}"
    if kind == "trial.pruned":
        return f"trial {n}: {setting}: not started: {doc['reason']}"
    if kind == "trial.repeat":
        return f"trial {n}: {setting}: measured already as trial {doc['same_as']}"
    if kind == "trial.requeued":
        return f"trial {n}: interrupted by a stop; its setting is queued again"
    return ""


def _setting_text(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in setting.items())


@tune_app.command("show")
def show(
    ctx: typer.Context,
    study: str | None = typer.Option(None, "--study", metavar="NAME",
                                      help="Study name (default: the last)."),
) -> None:
    """The trials of the study as a table (tok/s, setting, why a trial was discarded or
    not started) and a PNG of them (tune/<study>.png)."""
    from dsv4_offload.pipeline import tune as tn

    ws = kit.load_context(ctx, "tune").workspace  # -w and -r as every command takes them
    found = tn.latest_study(ws, study)
    docs = tn.trial_docs(found)
    best = tn.best_trial(found)
    png, why_not = _plot(found, ws.tune_dir / f"{found.study_name}.png")
    data = {"study": found.study_name, "trials": docs, "best": best.number if best else None,
            "png": str(png) if png else None}
    lines = [f"best: trial {best.number}, {best.value:g} tok/s" if best else
             "no trial passed accept yet"]
    if best is not None:
        lines.append(tn.placed(next(d for d in docs if d["trial"] == best.number)))
    lines.append(f"plot: {png}" if png else f"no plot: {why_not}")
    kit.emit(ctx, command="tune show", status="ok", data=data,
             table=_table(docs, best.number if best else None), lines=lines)


def _table(docs: list[dict[str, Any]], best: int | None) -> Any:
    from rich.table import Table

    names = sorted({k for d in docs for k in d["setting"]})
    table = Table(title="tune trials", pad_edge=False)
    for column in ("#", "state", *names, "tok/s", "of roofline", "why"):
        table.add_column(column)
    for d in docs:
        why = d["reason"] or (f"same as trial {d['same_as']}" if d["same_as"] is not None
                              else "baseline (the recipe's)" if d["baseline"] else "")
        mark = " *" if d["trial"] == best else ""
        table.add_row(f"{d['trial']}{mark}", d["state"],
                      *[str(d["setting"].get(n, "")) for n in names],
                      f"{d['tok_s']:g}" if d["tok_s"] is not None else "-",
                      _of_roofline(d), why)
    return table


def _of_roofline(doc: dict[str, Any]) -> str:
    """accept's measured decode as a share of the trial's memory roofline; '-' unknown."""
    fraction = (doc.get("ceilings") or {}).get("roofline_fraction")
    return f"{fraction:.0%}" if fraction is not None else "-"


def _plot(study: Any, path: Any) -> tuple[Any, str]:
    """Optuna's optimization history and per-knob slices, in one PNG (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from optuna.visualization import matplotlib as ovm
    except ImportError as exc:
        return None, f"{exc.name} is not installed (pip install matplotlib)"
    complete = [t for t in study.get_trials(deepcopy=False) if t.value is not None]
    if not complete:
        return None, "no trial has a value yet"
    axes = ovm.plot_optimization_history(study, target_name="tok/s")
    figure: Any = axes.get_figure()
    figure.set_size_inches(9, 5)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    tmp.replace(path)
    return path, ""


@tune_app.command("apply")
def apply(
    ctx: typer.Context,
    trial: int | None = typer.Option(None, "--trial", metavar="N",
                                     help="This trial (default: the best)."),
    study: str | None = typer.Option(None, "--study", metavar="NAME",
                                      help="Study name (default: the last)."),
    clear: bool = typer.Option(False, "--clear", help="Remove the overlay: the recipe's own "
                               "values again."),
) -> None:
    """Write the best trial's setting as the workspace's recipe overlay (tune/overlay.yaml),
    which every later command lays on the recipe; `serve --print` names it as the origin."""
    from dsv4_offload.pipeline import tune as tn

    ws = kit.load_context(ctx, "tune").workspace
    if clear:
        existed = ws.tune_overlay.is_file()
        ws.tune_overlay.unlink(missing_ok=True)
        kit.emit(ctx, command="tune apply", status="ok", data={"overlay": None,
                 "removed": existed}, lines=[f"tune apply: {ws.tune_overlay} "
                                             + ("removed" if existed else "was not there")])
        return
    found = tn.latest_study(ws, study)
    written = tn.apply_trial(ws, found, trial)
    kit.emit(ctx, command="tune apply", status="ok", data=written,
             lines=[f"tune apply: trial {written['trial']} ({written['tok_s']:g} tok/s) written "
                    f"to {written['overlay']}: {', '.join(written['set'])}; `serve` starts "
                    "with it (`serve --print` shows each value's origin)"])
