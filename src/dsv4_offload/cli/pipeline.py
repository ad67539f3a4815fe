"""Pipeline commands: ``run``, ``status`` and ``doctor``.

Only typer and cli.kit at import time; the pipeline, stages and rich load inside commands.
"""

from __future__ import annotations

from typing import Any

import typer

from dsv4_offload.cli import complete
from dsv4_offload.cli.kit import emit, emit_result, exit_with, load_context, options_of, run_stage
from dsv4_offload.core.errors import ExitCode


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("status")(status)
    app.command("doctor")(doctor)
    app.command("selftest")(selftest)


def run(
    ctx: typer.Context,
    start: str | None = typer.Option(None, "--from", help="First stage to consider.",
                                      autocompletion=complete.stages),
    stop: str | None = typer.Option(None, "--to", help="Last stage to consider.",
                                     autocompletion=complete.stages),
    force: list[str] = typer.Option([], "--force", metavar="STAGE",
                                    help="Rerun this stage even if done.",
                                    autocompletion=complete.stages),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan; change nothing."),
    mirror: list[str] = typer.Option([], "--mirror", metavar="NAME=URL",
                                     help="A mirror for source NAME, tried first."),
    device: int | None = typer.Option(None, "--device", help="NPU id to serve on."),
) -> None:
    """Run the pipeline, resuming where it stopped.

    1. Plan: every stage between --from and --to is skipped when its record is done and
       its inputs (recipe fields, upstream outputs, files) are unchanged.
    2. Run the others in order; each writes its record only when it has finished.
    3. Stop at the first failure, with its record, message and log path.
    """
    from rich.markup import escape

    from dsv4_offload import pipeline
    from dsv4_offload.cli.render import console, styled

    options: dict[str, Any] = {"mirrors": list(mirror), "device": device}
    pctx = load_context(ctx, "", options)
    g = options_of(ctx)
    if dry_run:
        items = pipeline.plan(pctx, start, stop, tuple(force))
        data = [{"stage": i.stage, "action": i.action, "reason": i.reason, "steps": i.steps}
                for i in items]
        if g.json:
            emit(ctx, command="run", status="ok", data={"dry_run": True, "plan": data})
        else:
            for i in items:
                console().print(f"{i.stage:12} {styled(i.action):>4}  {escape(i.reason)}")
                if i.steps:
                    console().print(f"{'':12}       steps: {escape(', '.join(i.steps))}")
        exit_with(ExitCode.OK)

    def announce(stage: str, action: str) -> None:
        if not g.json and not g.quiet:
            verb = {"skip": "skip (done)", "n/a": "not applicable to this recipe"}.get(
                action, "run")
            console().print(f"[bold]{stage}[/bold]: {verb}")

    with pctx.workspace.lock("run"):
        outcome = pipeline.run_pipeline(pctx, start, stop, tuple(force), on_stage=announce)
    if g.json:
        emit(ctx, command="run", status="ok" if outcome.exit_code == 0 else "failed", data={
            "skipped": outcome.skipped, "stopped_at": outcome.stopped_at,
            "stages": {name: r.as_dict() for name, r in outcome.results},
        })
    else:
        for name, result in outcome.results:
            emit_result(ctx, name, result)
        if outcome.stopped_at:
            console().print(f"run stopped at {outcome.stopped_at}; fix it and rerun `run`")
    exit_with(outcome.exit_code)


def status(ctx: typer.Context) -> None:
    """Every stage: done / stale (which input changed) / failed (log) / pending."""
    from dsv4_offload import pipeline
    from dsv4_offload.cli.render import simple_table

    pctx = load_context(ctx)
    rows = pipeline.pipeline_status(pctx)
    lines = []
    for r in rows:
        why = r.reason or r.summary
        if r.state in ("failed", "interrupted") and r.log:
            why += f" (see the log: {r.log})"
        lines.append((r.name, r.state, why, r.started or "", r.ended or ""))
    table = simple_table(("stage", "state", "why", "started", "ended"), lines)
    emit(ctx, command="status", status="ok",
         data={"workspace": str(pctx.workspace.root), "stages": [r.as_dict() for r in rows]},
         table=table)


def doctor(
    ctx: typer.Context,
    device: int | None = typer.Option(None, "--device", help="NPU id to check (default: idlest)."),
) -> None:
    """Host preflight: CPU, NUMA, memory, disk, NPU, CANN, toolchain; exit 1 on a failure."""
    run_stage(ctx, "doctor", {"device": device})


def selftest(ctx: typer.Context) -> None:
    """kt-kernel's MXFP4 MoE on a tiny synthetic layer, checked against numpy.

    1. Write a small MXFP4 layer with this tool's converter (recipe `selftest:` dims).
    2. For each token count (<10: forward_one, >=10: forward_many) run one forward of the
       built kt-kernel in a child process with a timeout (emulated when the recipe says so).
    3. Pass only if cosine and rel-L2 against the numpy reference hold; a crash, a hang or
       all zeros fails with the reason and the fix.
    """
    run_stage(ctx, "selftest", {})
