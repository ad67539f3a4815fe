"""The `dsv4-offload` command line: parse arguments, call the library, render results.

Commands of each area (sources, builds, GGUF, serving) live in their own ``cli_*`` module
and register themselves here. Nothing heavy is imported at start-up so that ``--help``
stays fast.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer

from dsv4_offload import __version__
from dsv4_offload.clikit import (
    GlobalOptions,
    emit,
    emit_result,
    exit_with,
    load_context,
    options_of,
    report_error,
    run_stage,
)
from dsv4_offload.errors import Dsv4Error, ExitCode

app = typer.Typer(
    name="dsv4-offload",
    help=(
        "From a bare Kunpeng-920 + Ascend NPU host to a verified DeepSeek-V4-Flash server.\n\n"
        "Stages, in order: doctor, fetch, patch, build, download, convert, verify-gguf, "
        "serve, accept. `run` goes through them, skipping what is done; `status` tells "
        "what is done, stale (and why), failed or pending."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
recipe_app = typer.Typer(help="List, show and validate recipes and patch series.",
                         no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")

AREA_MODULES = ("cli_doctor", "cli_sources", "cli_build", "cli_gguf", "cli_serve")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dsv4-offload {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    workspace: str | None = typer.Option(
        None, "--workspace", "-w", envvar="DSV4_WORKSPACE",
        help="Workspace directory (default ./dsv4-work).", show_envvar=True,
    ),
    recipe: str | None = typer.Option(
        None, "--recipe", "-r", help="Bundled recipe name or YAML file (default dsv4-flash-910b)."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE",
        help="Override a recipe field: dotted.key=value (repeatable).",
    ),
    json_out: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="More detail."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the result line."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version."),
) -> None:
    ctx.obj = GlobalOptions(workspace=workspace, recipe=recipe, overrides=list(overrides),
                            json=json_out, verbose=verbose, quiet=quiet)


# --- pipeline ------------------------------------------------------------------------------


@app.command()
def run(
    ctx: typer.Context,
    start: str | None = typer.Option(None, "--from", help="First stage to consider."),
    stop: str | None = typer.Option(None, "--to", help="Last stage to consider."),
    force: list[str] = typer.Option([], "--force", metavar="STAGE",
                                    help="Rerun this stage even if done."),
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
    from dsv4_offload.render import console, styled

    options: dict[str, Any] = {"mirrors": list(mirror), "device": device}
    pctx = load_context(ctx, "", options)
    g = options_of(ctx)
    if dry_run:
        items = pipeline.plan(pctx, start, stop, tuple(force))
        data = [{"stage": i.stage, "action": i.action, "reason": i.reason} for i in items]
        if g.json:
            emit(ctx, command="run", status="ok", data={"dry_run": True, "plan": data})
        else:
            for i in items:
                console().print(f"{i.stage:12} {styled(i.action):>4}  {escape(i.reason)}")
        exit_with(ExitCode.OK)

    def announce(stage: str, action: str) -> None:
        if not g.json and not g.quiet:
            verb = "skip (done)" if action == "skip" else "run"
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


@app.command()
def status(ctx: typer.Context) -> None:
    """Every stage: done / stale (which input changed) / failed (log) / pending."""
    from dsv4_offload import pipeline
    from dsv4_offload.render import simple_table

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


@app.command()
def doctor(
    ctx: typer.Context,
    device: int | None = typer.Option(None, "--device", help="NPU id to check (default: idlest)."),
) -> None:
    """Host preflight: CPU, NUMA, memory, disk, NPU, CANN, toolchain; exit 1 on a failure."""
    run_stage(ctx, "doctor", {"device": device})


# --- recipes -------------------------------------------------------------------------------


@recipe_app.command("list")
def recipe_list(ctx: typer.Context) -> None:
    """The bundled recipes."""
    from dsv4_offload.recipe import bundled_recipe_names, load_recipe

    data = []
    for name in bundled_recipe_names():
        r = load_recipe(name)
        data.append({"name": name, "npu": r.platform.npu, "cann": r.platform.cann,
                     "description": r.description})
    emit(ctx, command="recipe list", status="ok", data=data,
         lines=[f"{d['name']:20} {d['npu']:5} CANN {d['cann']:7} {d['description'][:60]}"
                for d in data])


@recipe_app.command("show")
def recipe_show(ctx: typer.Context) -> None:
    """The resolved recipe (with --set overrides applied), as YAML or JSON."""
    import yaml

    pctx = load_context(ctx)
    data = pctx.recipe.model_dump(mode="json", by_alias=True)
    emit(ctx, command="recipe show", status="ok", data=data,
         lines=[yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip()])


@recipe_app.command("validate")
def recipe_validate(
    ctx: typer.Context,
    file: str | None = typer.Argument(None, help="Recipe or series YAML (default: --recipe)."),
) -> None:
    """Validate a recipe and its series, or a series file; exit 2 with one line when invalid."""
    from dsv4_offload.recipe import (
        load_recipe_and_series,
        load_series,
        looks_like_series,
        recipe_path,
    )

    g = options_of(ctx)
    if file and looks_like_series(file):
        series = load_series(__import__("pathlib").Path(file))
        data = {"series": series.name, "patches": len(series.patches), "file": file}
        line = f"{file}: valid series '{series.name}' ({len(series.patches)} patches)"
    else:
        recipe, series = load_recipe_and_series(file or g.recipe, g.overrides)
        data = {"recipe": recipe.name, "file": str(recipe_path(recipe)), "series": series.name,
                "sources": len(recipe.sources), "patches": len(series.patches)}
        line = (f"{recipe_path(recipe)}: valid recipe '{recipe.name}' "
                f"({len(recipe.sources)} sources, series '{series.name}' with "
                f"{len(series.patches)} patches)")
    emit(ctx, command="recipe validate", status="ok", data=data, lines=[line])


# --- entry point ---------------------------------------------------------------------------


def _register_areas() -> None:
    for name in AREA_MODULES:
        try:
            module = importlib.import_module(f"dsv4_offload.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"dsv4_offload.{name}":
                continue  # that area is not part of this build
            raise
        module.register(app)


_register_areas()


def _command_name(args: list[str]) -> str:
    """The subcommand words in argv (for error documents), skipping option values."""
    import typer.main

    group = typer.main.get_command(app)
    words: list[str] = []
    for arg in args:
        commands = getattr(group, "commands", None)
        if commands is None:
            break
        if arg in commands:
            words.append(arg)
            group = commands[arg]
    return " ".join(words)


_ExcTypes = tuple[type[BaseException], ...]


def _click_exception_types() -> tuple[_ExcTypes, _ExcTypes, _ExcTypes]:
    """Usage-error, abort and exit exception types: click's and typer's bundled copies.

    typer >= 0.20 vendors its own click, whose exceptions are not click's classes.
    """
    import typer.core

    usage: list[type[BaseException]] = []
    aborts: list[type[BaseException]] = [typer.core.Abort]
    exits: list[type[BaseException]] = [typer.core.Exit]
    try:
        from typer._click import exceptions as vendored

        usage.append(vendored.ClickException)
    except ImportError:  # pragma: no cover - older typer
        pass
    try:
        import click

        usage.append(click.exceptions.ClickException)
        aborts.append(click.exceptions.Abort)
        exits.append(click.exceptions.Exit)
    except ImportError:  # pragma: no cover
        pass
    return tuple(usage), tuple(aborts), tuple(exits)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: expected failures print one line and exit with their code."""
    usage_errors, aborts, exits = _click_exception_types()

    args = sys.argv[1:] if argv is None else argv
    as_json = "--json" in args
    command = _command_name(args)
    try:
        rv = app(args=args, prog_name="dsv4-offload", standalone_mode=False)
    except Dsv4Error as exc:
        sys.exit(report_error(exc, as_json, command))
    except (*aborts, KeyboardInterrupt):  # type: ignore[misc]  # mypy can't type a starred tuple
        sys.stderr.write("interrupted\n")
        sys.exit(int(ExitCode.INTERRUPTED))
    except usage_errors as exc:
        exc.show()  # type: ignore[attr-defined]
        sys.exit(int(ExitCode.INVALID_INPUT))
    except exits as exc:
        sys.exit(exc.exit_code)  # type: ignore[attr-defined]
    if rv == ExitCode.INTERRUPTED:
        # typer turns Ctrl-C into a plain exit code 130; still say what happened
        sys.stderr.write("interrupted\n")
    sys.exit(rv if isinstance(rv, int) else 0)
