"""Pipeline commands: ``run``, ``status`` and ``doctor``.

Only typer and cli.kit at import time; the pipeline, stages and rich load inside commands.
"""

from __future__ import annotations

from typing import Any, NoReturn

import typer

from dsv4_offload.cli import complete
from dsv4_offload.cli.kit import emit, exit_with, load_context, options_of, run_stage
from dsv4_offload.core.errors import ExitCode


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("status")(status)
    app.command("doctor")(doctor)
    app.command("selftest")(selftest)


def run(
    ctx: typer.Context,
    start: str | None = typer.Option(None, "--from", metavar="STAGE",
                                     help="First stage to consider.",
                                      autocompletion=complete.stages),
    stop: str | None = typer.Option(None, "--to", metavar="STAGE", help="Last stage to consider.",
                                     autocompletion=complete.stages),
    force: list[str] = typer.Option([], "--force", metavar="STAGE",
                                    help="Rerun this stage even if done.",
                                    autocompletion=complete.stages),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan; change nothing."),
    mirror: list[str] = typer.Option([], "--mirror", metavar="NAME=URL",
                                     help="A mirror for source NAME, tried first."),
    device: int | None = typer.Option(None, "--device", metavar="N", help="NPU id to serve on."),
    serial: bool = typer.Option(False, "--serial",
                                help="One stage at a time, in order, stopping at the first "
                                "failure (the run before the stage graph)."),
) -> None:
    """Run the pipeline, resuming where it stopped.

    1. Plan: every stage between --from and --to is skipped when its record is done and
       its inputs (recipe fields, upstream outputs, files) are unchanged.
    2. Run the others on the stage graph, each in a process of its own: a stage starts once
       the stages it needs are done (convert starts with the download and follows it), so
       the build runs while the weights arrive. Each writes its record when it has finished.
    3. A failure stops the stages that need it; the others go on. The end names each branch
       that stopped, with its error and log. `--serial`: in order, stopping at the first.
    """
    from dsv4_offload import pipeline
    from dsv4_offload.core.options import RunOptions

    # rich is imported where text is shown: a stage process of a pipelined run (`--json run
    # --serial`, one a stage) shows none, and is started hundreds of times in the tests
    def console() -> Any:
        from dsv4_offload.cli.render import console as shown

        return shown()

    g = options_of(ctx)
    if serial and not dry_run:
        from dsv4_offload.cli.serial import run_serial

        def announce(stage: str, action: str) -> None:
            if not g.json and not g.quiet:
                verb = {"skip": "skip (done)", "n/a": "not applicable to this recipe"}.get(
                    action, "run")
                console().print(f"[bold]{stage}[/bold]: {verb}")

        exit_with(run_serial(g, start, stop, tuple(force), mirrors=tuple(mirror), device=device,
                             on_stage=announce, on_stopped=lambda line: console().print(line)))
    pctx = load_context(ctx, "", RunOptions(mirrors=tuple(mirror), device=device))
    if not serial:
        _run_pipelined(ctx, pctx, start, stop, tuple(force), dry_run)
    if dry_run:
        items = pipeline.plan(pctx, start, stop, tuple(force))
        data = [{"stage": i.stage, "action": i.action, "reason": i.reason, "steps": i.steps}
                for i in items]
        if g.json:
            emit(ctx, command="run", status="ok", data={"dry_run": True, "plan": data})
        elif g.quiet:
            from rich.markup import escape

            console().print(escape(_quiet_plan(items)), soft_wrap=True)
        else:
            from rich.markup import escape

            from dsv4_offload.cli.render import styled

            for i in items:
                console().print(f"{i.stage:12} {styled(i.action):>4}  {escape(i.reason)}")
                if i.steps:
                    console().print(f"{'':12}       steps: {escape(', '.join(i.steps))}")
        exit_with(ExitCode.OK)


def _run_pipelined(ctx: typer.Context, pctx: Any, start: str | None, stop: str | None,
                   force: tuple[str, ...], dry_run: bool) -> NoReturn:
    """`run` on the stage graph (schedule.py); what it shows is cli/live.py's."""
    import sys

    from rich.markup import escape

    from dsv4_offload.cli import live
    from dsv4_offload.cli.render import console, err_console
    from dsv4_offload.pipeline import schedule

    g = options_of(ctx)
    if dry_run:
        items, cpu = schedule.overlapped_plan(pctx, start, stop, force)
        disk = schedule.disk_needs(pctx, items)
        if g.json:
            emit(ctx, command="run", status="ok", data={
                "dry_run": True, "mode": "pipelined", "plan": [i.as_dict() for i in items],
                "cpu": cpu.as_dict(), "disk": [fs.as_dict() for fs in disk]})
        elif g.quiet:
            console().print(escape(_quiet_plan(items)), soft_wrap=True)
        else:
            for line in live.plan_lines(items, cpu, disk):
                console().print(line, soft_wrap=True)
        exit_with(ExitCode.OK)
    view: Any
    shown = not (g.json or g.quiet)  # each stage's result is rendered the moment it ends
    if g.json:
        view = live.JsonLines()
    elif g.quiet or not console().is_terminal:
        view = live.PlainLines(quiet=g.quiet, results_follow=shown)
    else:
        view = live.LiveView(pctx.recipe.conversion.layers)
    rendered: set[str] = set()
    on_finish = _result_renderer(g, schedule, rendered) if shown else None
    items, _ = schedule.overlapped_plan(pctx, start, stop, force)
    short = schedule.diskplan.shortfall(schedule.disk_needs(pctx, items))
    if short:  # the preflight first: doctor's table, every failing row, then the refusal
        with pctx.workspace.lock("run"), view:
            outcome = schedule.Scheduler(pctx, "doctor", "doctor", ("doctor",),
                                         on_event=view.event, verbose=g.verbose,
                                         on_finish=on_finish).run(check_disk=False)
        if outcome.failed:  # its disk row says what this run says: the one figure, once
            short = ("run stopped before any work: doctor failed (see its table); fix those "
                     "rows and rerun `run`")
        if g.json:
            from dsv4_offload.core import events

            view.event(events.make("run.refused", error=short, exit=int(ExitCode.FAILED)))
        else:
            err_console().print(escape(f"error: {short}"), soft_wrap=True)
        exit_with(ExitCode.FAILED)
    with pctx.workspace.lock("run"), view:
        outcome = schedule.Scheduler(pctx, start, stop, force, on_event=view.event,
                                     verbose=g.verbose, on_finish=on_finish).run()
    if not g.json:
        said = {s.name: "on the error line below" for s in outcome.failed if s.cli_error}
        said.update(dict.fromkeys(rendered, "shown above"))
        for line in live.outcome_lines(outcome, said)[-1 if g.quiet else 0:]:
            console().print(line, soft_wrap=True)
    for s in outcome.failed:  # on stderr in every mode, --json too (as `run --serial` does)
        if s.cli_error:  # the one line the stage's own command would have printed
            err_console().print(escape(f"error: {s.cli_error}"), soft_wrap=True)
    if outcome.interrupted:
        sys.stderr.write(f"interrupted by {outcome.interrupted}\n"
                         if outcome.interrupted != "Ctrl-C" else "interrupted\n")
    exit_with(outcome.exit_code)


def _result_renderer(g: Any, schedule: Any, rendered: set[str]) -> Any:
    """What a stage's own command shows, printed as the stage ends: a failure's problems and
    fixes (said once: the progress line and the end of the run refer to it), doctor's table
    of checks. A stage done without checks or problems said all in its progress line; one
    that stopped on an error of its command has that line on stderr at the end."""
    from dsv4_offload.cli.render import render_result

    def show(s: Any) -> None:
        result = schedule.stage_result(s)
        if result is None or s.state == "interrupted" or (s.result is None and s.cli_error):
            return
        checks = result.data.get("checks") if isinstance(result.data, dict) else None
        if s.state == "done" and not checks and not result.problems:
            return
        render_result(s.name, result, verbose=g.verbose)
        rendered.add(s.name)
    return show


def status(ctx: typer.Context) -> None:
    """Every stage: done / stale (which input changed) / failed (log) / pending.

    It starts with the workspace, recipe and lock it read. A workspace that does not exist
    is a warning (every stage pending), not an error: the exit code stays 0.
    """
    from collections import Counter

    from dsv4_offload import pipeline
    from dsv4_offload.cli.render import err_console, simple_table

    pctx = load_context(ctx)
    g = options_of(ctx)
    ws = pctx.workspace
    read = read_from(pctx)
    warnings = []
    if not ws.root.is_dir():
        warnings.append(f"workspace {ws.root} does not exist: every stage is pending "
                        "(mistyped -w / DSV4_WORKSPACE? `run` creates it)")
    rows = pipeline.pipeline_status(pctx)
    moved = _weights_moved(pctx)
    lines = []
    for r in rows:
        why = r.reason or r.summary
        if r.state in ("failed", "interrupted") and r.log:
            why += f" (see the log: {r.log})"
        if r.recipe:
            why += f" [recipe {r.recipe}]"
        lines.append((r.name, r.state, why, r.started or "", r.ended or ""))
    others = sorted({r.recipe for r in rows if r.recipe})
    if others:  # a workspace shared by recipes: say whose records these are
        names = [r.name for r in rows if r.recipe]
        warnings.append(
            f"{', '.join(names)}: recorded under recipe {', '.join(others)}, not "
            f"{pctx.recipe.name}; `-r {others[0]} status` reads them as that recipe does")
    counts = Counter(r.state for r in rows)
    summary = "status: " + ", ".join(f"{n} {state}" for state, n in counts.items())
    summary += f" ({ws.root})"
    if not g.json:
        from rich.markup import escape

        for w in warnings:
            err_console().print(f"[yellow]warning[/yellow]: {escape(w)}", soft_wrap=True)
        if not g.quiet:
            from dsv4_offload.cli.render import console

            for key in ("workspace", "recipe", "lock"):
                console().print(escape(f"{key + ':':10} {read[key]}"), soft_wrap=True)
            for line in moved:
                console().print(escape(f"{'weights:':10} {line}"), soft_wrap=True)
    table = simple_table(("stage", "state", "why", "started", "ended"), lines)
    emit(ctx, command="status", status="warn" if warnings else "ok",
         data={"workspace": str(ws.root), "read": read, "warnings": warnings,
               "weights_moved": moved, "stages": [r.as_dict() for r in rows]},
         table=table, lines=[summary])


def _weights_moved(pctx: Any) -> list[str]:
    """The weight sets whose branch moved past the lock. The heads are cached in the lock
    (each download records them); one older than weightlock.HEAD_TTL_S is asked again, with
    a short timeout, only while no run holds the workspace."""
    from dsv4_offload.core.errors import LockedError
    from dsv4_offload.weights import weightlock

    weights = pctx.recipe.weights
    sets = {name: (spec.hub, spec.repo_id, spec.revision)
            for name in ("w8a8", "mxfp4") if (spec := getattr(weights, name, None)) is not None}
    path = weightlock.lock_path(pctx.workspace.root)
    failed: list[str] = []
    if path.is_file():
        try:
            with pctx.workspace.lock("status (weights heads)"):
                failed = weightlock.refresh_heads(path, sets)
        except LockedError:
            pass  # a run holds the workspace: the heads it cached are shown
    return weightlock.moved_past(weightlock.read_lock(path), sets) + failed


def read_from(pctx: Any) -> dict[str, str]:
    """What `status` read: the workspace (and whether it exists), the recipe (name, file,
    chain, --set items) and the sources lock (or that there is none)."""
    ws = pctx.workspace
    recipe = pctx.recipe
    origin = recipe.origin
    where = str(recipe.file) if recipe.file else "(bundled)"
    extra = ""
    if origin is not None and len(origin.chain) > 1:
        extra += " extends " + " <- ".join(str(p) for p in origin.chain[1:])
    if origin is not None and origin.overrides:
        extra += " with --set " + " ".join(origin.overrides)
    lock = ws.sources_lock_file
    return {
        "workspace": f"{ws.root}" + ("" if ws.root.is_dir() else " (does not exist)"),
        "recipe": f"{recipe.name} ({where}){extra}",
        "lock": str(lock) if lock.is_file() else f"{lock} (none yet: `fetch` writes it)",
    }


def doctor(
    ctx: typer.Context,
    device: int | None = typer.Option(None, "--device", metavar="N",
                                      help="NPU id to check (default: idlest)."),
    bandwidth: bool = typer.Option(
        False, "--bandwidth",
        help="Measure the memory bandwidth again (sysbench under numactl, per NUMA node); "
        "else the figure cached in the workspace."),
) -> None:
    """Host preflight: CPU, NUMA, memory, disk, NPU, CANN, toolchain; exit 1 on a failure."""
    from dsv4_offload.stages.doctor import DoctorOptions

    run_stage(ctx, "doctor", DoctorOptions(device=device, bandwidth=bandwidth))


def selftest(
    ctx: typer.Context,
    real_layer: bool = typer.Option(
        False, "--real-layer",
        help="Then a synthetic layer of the real layout and dims through kt-kernel, as "
        "verify-gguf's level 4 (on by default in the rehearsal recipes)."),
    bench: bool = typer.Option(
        False, "--bench",
        help="Then time kt-kernel's MoE on a full-size synthetic layer with the serve plan's "
        "pools: GB/s read beside this host's bandwidth, and the decode it projects."),
    share: float = typer.Option(
        0.5, "--share", metavar="S", min=0.0, max=0.99,
        help="The resident share (0..1) the bench's projection is stated at."),
    repeats: int = typer.Option(16, "--repeats", metavar="N", min=1,
                                help="Timed decode forwards of the bench."),
) -> None:
    """kt-kernel's MXFP4 MoE on a tiny synthetic layer, checked against numpy.

    1. Write a small MXFP4 layer with this tool's converter (recipe `selftest:` dims).
    2. For each token count (<10: forward_one, >=10: forward_many) run one forward of the
       built kt-kernel in a child process with a timeout (emulated when the recipe says so).
    3. Pass only if cosine and rel-L2 against the numpy reference hold; a crash, a hang or
       all zeros fails with the reason and the fix.
    4. With --real-layer (or selftest.real_layer.rehearse): the same on a converted
       synthetic layer of the real layout, cosine >= 0.9999 (guide appendix D).
    5. With --bench: decode forwards of a full-size synthetic layer timed, with the serve
       plan's pools; bytes read per second beside this host's bandwidth (doctor's), cached
       for accept's ceilings.
    """
    from dsv4_offload.stages.selftest import SelftestOptions

    run_stage(ctx, "selftest", SelftestOptions(real_layer=real_layer, bench=bench, share=share,
                                               repeats=repeats))


def _quiet_plan(items: Any) -> str:
    """`run --dry-run -q`: one line, the stages to run and how many not."""
    todo = [i.stage for i in items if i.action == "run"]
    return (f"run --dry-run: {len(todo)} to run" + (f" ({', '.join(todo)})" if todo else "")
            + f", {len(items) - len(todo)} not")
