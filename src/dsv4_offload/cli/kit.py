"""What command modules share: global options, context loading, running a stage, output.

Kept light at import time (not even typer: a stage process, cli/serial.py, reads its command
line without it): recipe models, rich and stage modules load on use.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from dsv4_offload.core.envelope import Envelope
from dsv4_offload.core.errors import Dsv4Error, ExitCode

if TYPE_CHECKING:
    import typer

    from dsv4_offload.core.options import StageOptions
    from dsv4_offload.core.results import StageResult, Status
    from dsv4_offload.workspace.context import StageContext


@dataclass
class GlobalOptions:
    workspace: str | None = None
    recipe: str | None = None
    overrides: list[str] = field(default_factory=list)
    json: bool = False
    verbose: bool = False
    quiet: bool = False


def options_of(typer_ctx: typer.Context) -> GlobalOptions:
    root = typer_ctx.find_root()
    obj = root.obj
    if not isinstance(obj, GlobalOptions):
        obj = GlobalOptions()
        root.obj = obj
    return obj


def load_context(typer_ctx: typer.Context, stage: str = "",
                 options: StageOptions | Mapping[str, Any] | None = None) -> StageContext:
    """Recipe, series and workspace from the global options, as a StageContext with the
    command's options (the stage's typed ones; `run`'s RunOptions)."""
    return open_context(options_of(typer_ctx), stage, options)


def open_context(g: GlobalOptions, stage: str = "",
                 options: StageOptions | Mapping[str, Any] | None = None) -> StageContext:
    """:func:`load_context` from the global options themselves."""
    from dsv4_offload.serving.extra_args import recipe_check
    from dsv4_offload.workspace.context import StageContext
    from dsv4_offload.workspace.store import Workspace

    Workspace.from_option(g.workspace).check_readable()
    ctx = StageContext.open(g.recipe, g.overrides, g.workspace, options=options,
                            progress=make_progress(g), stage=stage, verbose=g.verbose)
    recipe_check(ctx.recipe.serve)  # what serve would refuse, refused before any work
    warn_skipped_patches(ctx.series)
    return ctx


def warn_skipped_patches(series: Any) -> None:
    """On stderr, once per command: each patch of our own the recipe leaves out, and what
    serving without it risks."""
    for line in series.skip_warnings():
        sys.stderr.write(f"warning: {line}\n")
    sys.stderr.flush()


def make_progress(g: GlobalOptions) -> Any:
    from dsv4_offload.core.results import Progress

    if g.quiet or g.json or not sys.stderr.isatty():
        return Progress()
    from dsv4_offload.cli.render import RichProgress  # rich: only where bars are drawn

    return RichProgress()


def exit_with(code: int) -> NoReturn:
    import typer

    raise typer.Exit(int(code))


def emit(typer_ctx: typer.Context, *, command: str, status: Status | str, data: Any,
         table: Any = None, lines: list[str] | None = None, payload: bool = False) -> None:
    """Print one result: a versioned JSON document with --json, else a rich rendering.

    With -q only the result line is printed: no table, the last of `lines` (or `command:
    status`). `payload` lines (a YAML dump, a launch script) are the result and stay.
    """
    g = options_of(typer_ctx)
    status_text = getattr(status, "value", status)
    if g.json:
        write_document(command, status_text, data)
        return
    from dsv4_offload.cli.render import console

    out = console()
    if g.quiet and not payload:
        table = None
        lines = (lines or [f"{command}: {status_text}"])[-1:]
    if table is not None:
        out.print(table)
    from rich.markup import escape

    for line in lines or []:
        out.print(escape(line), soft_wrap=True)  # plain text: '[x]' is data, not markup


def write_document(command: str, status: str, data: Any) -> None:
    """The --json document of one result, on stdout."""
    sys.stdout.write(Envelope(command, status, data).to_json())
    sys.stdout.flush()


def emit_result(typer_ctx: typer.Context, command: str, result: StageResult) -> None:
    show_result(options_of(typer_ctx), command, result)


def show_result(g: GlobalOptions, command: str, result: StageResult) -> None:
    """One stage's result: its --json document, else its rich rendering."""
    if g.json:
        write_document(command, result.status.value, result.as_dict())
    else:
        from dsv4_offload.cli.render import render_result

        render_result(command, result, verbose=g.verbose, quiet=g.quiet)


def result_exit_code(result: StageResult) -> ExitCode:
    return ExitCode.OK if result.ok else ExitCode.FAILED


def run_stage(typer_ctx: typer.Context, stage: str, options: StageOptions) -> NoReturn:
    """Run one stage with its typed options under the workspace lock, render its result,
    exit with its code."""
    from dsv4_offload import pipeline

    ctx = load_context(typer_ctx, stage, options)
    with ctx.workspace.lock(stage):
        result = pipeline.dispatch_stage(ctx, stage, options, standalone=True)
    emit_result(typer_ctx, stage, result)
    exit_with(result_exit_code(result))


def usage_error_document(exc: Any, command: str) -> str:
    """A click usage error (unknown option, missing value...) as the --json document."""
    message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
    cmd_ctx = getattr(exc, "ctx", None)
    usage = cmd_ctx.get_usage() if cmd_ctx is not None else ""
    return Envelope.error(command, message, ExitCode.INVALID_INPUT, usage=usage).to_json()


def report_error(exc: Dsv4Error, as_json: bool, command: str) -> int:
    if as_json:
        sys.stdout.write(Envelope.error(command, exc.one_line(), exc.exit_code).to_json())
    sys.stderr.write(f"error: {exc.one_line()}\n")
    return int(exc.exit_code)


def report_denied(exc: OSError, workspace: str | None, as_json: bool, command: str) -> int:
    """A path of the workspace (``--workspace``'s value) this user may not read, met where no
    check said so first: still the one line (and the --json document), never a traceback."""
    from dsv4_offload.workspace.store import Workspace, denied_error

    return report_error(denied_error(exc, Workspace.from_option(workspace).root), as_json,
                        command)


def set_runtime(value: str | None) -> None:
    """``--runtime``: one spelling for this process, its environment's (DSV4_RUNTIME), which
    workspace/placement.py reads."""
    import os

    from dsv4_offload.core.errors import InputError
    from dsv4_offload.workspace.placement import RUNTIME_CHOICES, RUNTIME_ENV

    if value is None:
        return
    if value not in RUNTIME_CHOICES:
        raise InputError(f"--runtime {value!r} (or {RUNTIME_ENV}): use "
                         f"{' or '.join(RUNTIME_CHOICES)}")
    os.environ[RUNTIME_ENV] = value


def interrupted(as_json: bool = False, command: str = "") -> int:
    """Say how we were interrupted (with --json, also as the command's one document); the
    exit code a shell gives that signal (128 + its number)."""
    import contextlib

    from dsv4_offload.core.envelope import INTERRUPTED
    from dsv4_offload.core.runner import interrupt_name, received_signal

    signum = received_signal()
    code = int(ExitCode.INTERRUPTED) if signum is None else 128 + signum
    with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
        if as_json:
            doc = Envelope(command, INTERRUPTED, {"signal": interrupt_name(), "exit_code": code})
            sys.stdout.write(doc.to_json())
            sys.stdout.flush()
        sys.stderr.write("interrupted\n" if signum is None
                         else f"interrupted by {interrupt_name()}\n")
    return code
