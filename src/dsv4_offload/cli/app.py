"""The typer application, its global options and the console entry point.

Commands of each area (pipeline, recipes, sources, builds, GGUF, serving) live in their own
module of this package and register themselves here. Nothing heavy is imported at start-up
so that ``--help`` stays fast.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, NoReturn

import typer

from dsv4_offload import __version__
from dsv4_offload.cli import complete, kit
from dsv4_offload.cli.argv import GlobalOptionsGroup, hoist_globals
from dsv4_offload.cli.kit import (
    GlobalOptions,
    report_error,
)
from dsv4_offload.core.errors import Dsv4Error, ExitCode

app = typer.Typer(
    name="dsv4-offload",
    help=(
        "From a bare Kunpeng-920 + Ascend NPU host to a verified DeepSeek-V4-Flash server.\n\n"
        "Stages, in order: doctor, fetch, patch, build, selftest, download, convert, verify-gguf, "
        "serve, accept. `run` goes through them, skipping what is done; `status` tells "
        "what is done, stale (and why), failed or pending.\n\n"
        "The options below may also follow any command: `dsv4-offload status --json`."
    ),
    cls=GlobalOptionsGroup,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

AREA_MODULES = ("pipeline", "recipes", "sources", "build", "gguf", "serve", "container",
                "report", "tune")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dsv4-offload {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    workspace: str | None = typer.Option(
        None, "--workspace", "-w", envvar="DSV4_WORKSPACE", metavar="PATH",
        help="Workspace directory (default ./dsv4-work).", show_envvar=True,
    ),
    recipe: str | None = typer.Option(
        None, "--recipe", "-r", metavar="NAME|PATH",
        help="Bundled recipe name or YAML file (default dsv4-flash-910b).",
        autocompletion=complete.recipes,
    ),
    overrides: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE",
        help="Override a recipe field: dotted.key=value (repeatable).",
    ),
    runtime: str | None = typer.Option(
        None, "--runtime", metavar="recipe|host", envvar="DSV4_RUNTIME", show_envvar=True,
        help="Where stages run: 'recipe' (default: the host or the recipe's container, as its "
        "runtime says) or 'host' (every stage here, with a warning for each the recipe puts "
        "in its container)."),
    json_out: bool = typer.Option(False, "--json", help="One JSON document on stdout."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="More detail."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the result line."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version."),
) -> None:
    kit.set_runtime(runtime)
    ctx.obj = GlobalOptions(workspace=workspace, recipe=recipe, overrides=list(overrides),
                            json=json_out, verbose=verbose, quiet=quiet)


# --- entry point ---------------------------------------------------------------------------


def _register_areas() -> None:
    for name in AREA_MODULES:
        try:
            module = importlib.import_module(f"dsv4_offload.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"dsv4_offload.cli.{name}":
                continue  # that area is not part of this build
            raise
        module.register(app)


def _plain_stage_command(name: str, summary: str) -> Any:
    def command(ctx: typer.Context) -> None:
        from dsv4_offload.pipeline import stage_options

        kit.run_stage(ctx, name, stage_options(name))

    command.__doc__ = f"The {name} stage: {summary}." if summary else f"The {name} stage."
    return command


def _register_plain_stages() -> None:
    """A stage of the registry with no command of its own gets a plain one (``dsv4-offload
    NAME``, no options), so a new stage is its registry row, its module and its test."""
    from dsv4_offload.core.registry import STAGES

    taken = {c.name or (c.callback.__name__.replace("_", "-") if c.callback else "")
             for c in app.registered_commands}
    for stage in STAGES:
        if stage.name not in taken:
            app.command(stage.name)(_plain_stage_command(stage.name, stage.summary))


_register_areas()
_register_plain_stages()


def _command_name(args: list[str], group: Any) -> str:
    """The subcommand words in argv (for error documents), skipping option values."""
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
    click = sys.modules.get("click")  # raised only by code that imported it (not imported
    if click is not None:             # here: 15 ms of every start-up, stage processes' too)
        usage.append(click.exceptions.ClickException)
        aborts.append(click.exceptions.Abort)
        exits.append(click.exceptions.Exit)
    return tuple(usage), tuple(aborts), tuple(exits)


def main(argv: list[str] | None = None) -> NoReturn:
    """Console entry point: expected failures print one line and exit with their code."""
    usage_errors, aborts, exits = _click_exception_types()

    import typer.main

    args = sys.argv[1:] if argv is None else argv
    # built once: typer rebuilds the click tree (every signature) on each call
    click_app = typer.main.get_command(app)
    hoisted, found = hoist_globals(click_app, args)
    as_json = "--json" in found
    command = _command_name(hoisted, click_app)
    from dsv4_offload.core.runner import signals_as_interrupt

    try:
        # what app(...) does, without rebuilding the tree (pretty exceptions are off);
        # SIGTERM and SIGHUP take the way of Ctrl-C: children stopped, records written
        with signals_as_interrupt():
            rv = click_app(args=args, prog_name="dsv4-offload", standalone_mode=False)
    except Dsv4Error as exc:
        sys.exit(report_error(exc, as_json, command))
    except (PermissionError, NotADirectoryError) as exc:
        sys.exit(kit.report_denied(exc, _workspace_given(found), as_json, command))
    except (*aborts, KeyboardInterrupt):  # type: ignore[misc]  # mypy can't type a starred tuple
        sys.exit(kit.interrupted(as_json, command))
    except usage_errors as exc:
        if as_json:  # --json was asked: the usage error is a document too
            sys.stdout.write(kit.usage_error_document(exc, command))
        exc.show()  # type: ignore[attr-defined]
        sys.exit(int(ExitCode.INVALID_INPUT))
    except exits as exc:
        sys.exit(exc.exit_code)  # type: ignore[attr-defined]
    if rv == ExitCode.INTERRUPTED:
        # typer turns Ctrl-C into a plain exit code 130; still say what happened
        sys.exit(kit.interrupted(as_json, command))
    sys.exit(rv if isinstance(rv, int) else 0)


def forget_call_state() -> None:
    """Forget what one call of :func:`main` leaves in this process (consoles, signals noted,
    warnings given, the hub client's open connections), so that an in-process caller's calls
    are independent, as processes are."""
    from dsv4_offload.cli import render
    from dsv4_offload.core.runner import forget_signals
    from dsv4_offload.workspace.placement import forget_warnings

    render.forget_consoles()
    forget_signals()
    forget_warnings()
    hub_client = sys.modules.get("huggingface_hub")
    if hub_client is not None:  # its shared client keeps connections alive across calls
        hub_client.close_session()


def _workspace_given(found: list[str]) -> str | None:
    """The value of -w/--workspace among the global option tokens, or None."""
    for index, token in enumerate(found):
        if token.startswith("--workspace="):
            return token.split("=", 1)[1]
        if token in ("-w", "--workspace") and index + 1 < len(found):
            return found[index + 1]
    return None
