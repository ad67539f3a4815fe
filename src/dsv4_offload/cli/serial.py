"""`run --serial`: the stages in order in this process, and a stage process's command line.

``run_serial`` is the body of `run --serial`. Each stage a pipelined run starts (and each
stage a container crossing sends in) is a process of this tool running ``run --serial`` on
that one stage: ``core/childrun.tool_argv`` + ``stage_argv``, i.e. ``python -m dsv4_offload
--workspace W [--recipe R] [--set K=V]... [--verbose] --json run --serial --from S --to S
--force S [--device N]``. ``stage_call`` reads exactly that command line and ``stage_main``
runs it without typer, whose import and command tree were ~0.08 of the 0.44 CPU-s a quick
stage's process took on the development VM; any other command line goes to the typer application
(cli/app.py), which runs the same ``run_serial`` for it. Nothing here imports typer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from dsv4_offload.cli.kit import (
    GlobalOptions,
    interrupted,
    open_context,
    report_denied,
    report_error,
    set_runtime,
    show_result,
    write_document,
)
from dsv4_offload.core.errors import Dsv4Error

COMMAND = "run"


def run_serial(g: GlobalOptions, start: str | None, stop: str | None, force: tuple[str, ...],
               *, mirrors: tuple[str, ...] = (), device: int | None = None,
               on_stage: Callable[[str, str], None] | None = None,
               on_stopped: Callable[[str], None] | None = None) -> int:
    """`run --serial` on the global options: the stages from ``start`` to ``stop`` in order,
    stopping at the first failure, each result shown (``on_stage(stage, action)`` before
    each, ``on_stopped(line)`` after a failure); its exit code."""
    from dsv4_offload import pipeline
    from dsv4_offload.core.options import RunOptions

    pctx = open_context(g, "", RunOptions(mirrors=mirrors, device=device))
    with pctx.workspace.lock("run"):
        outcome = pipeline.run_pipeline(pctx, start, stop, force, on_stage=on_stage)
    if g.json:
        write_document(COMMAND, "ok" if outcome.exit_code == 0 else "failed", {
            "skipped": outcome.skipped, "stopped_at": outcome.stopped_at,
            "stages": {name: r.as_dict() for name, r in outcome.results},
        })
    else:
        for name, result in outcome.results:
            show_result(g, name, result)
        if outcome.stopped_at and on_stopped is not None:
            on_stopped(f"run stopped at {outcome.stopped_at}; fix it and rerun `run`")
    return int(outcome.exit_code)


@dataclass(frozen=True)
class StageCall:
    """A stage process's command line, read."""

    options: GlobalOptions
    stage: str
    device: int | None


def stage_call(args: Sequence[str]) -> StageCall | None:
    """The stage process's command line (the module docstring's) read; None for any other,
    which the typer application reads (and refuses where it must). Read for every command:
    nothing is imported before the line is known to be a stage's."""
    g = GlobalOptions()
    words = list(args)
    try:
        run_at = words.index(COMMAND)
    except ValueError:
        return None
    before, after = words[:run_at], words[run_at + 1:]
    i = 0
    while i < len(before):
        word = before[i]
        if word in ("--workspace", "-w", "--recipe", "-r", "--set") and i + 1 < len(before):
            value = before[i + 1]
            if word in ("--workspace", "-w"):
                g.workspace = value
            elif word in ("--recipe", "-r"):
                g.recipe = value
            else:
                g.overrides.append(value)
            i += 2
            continue
        if word == "--json":
            g.json = True
        elif word in ("--verbose", "-v"):
            g.verbose = True
        else:
            return None
        i += 1
    if not g.json or len(after) not in (7, 9) or after[0] != "--serial":
        return None
    flags = dict(zip(after[1::2], after[2::2], strict=True))
    stage = flags.get("--from")
    if stage is None or set(flags) - {"--from", "--to", "--force", "--device"} or \
            flags.get("--to") != stage or flags.get("--force") != stage:
        return None
    device = flags.get("--device")
    if device is not None and not device.isdigit():
        return None  # typer says what is wrong with it
    if g.workspace is None:  # --workspace's variable, as typer's option reads it (cli/app.py)
        from dsv4_offload.workspace.store import WORKSPACE_ENV

        g.workspace = os.environ.get(WORKSPACE_ENV) or None
    return StageCall(g, stage, int(device) if device is not None else None)


def stage_main(call: StageCall) -> NoReturn:
    """Run ``call`` as the typer application runs `run --serial` (cli/app.main): an expected
    failure is its --json document and one line, an interruption the signal's exit code."""
    from dsv4_offload.core.runner import signals_as_interrupt
    from dsv4_offload.workspace.placement import RUNTIME_ENV  # --runtime's variable

    g = call.options
    try:
        with signals_as_interrupt():
            set_runtime(os.environ.get(RUNTIME_ENV))
            code = run_serial(g, call.stage, call.stage, (call.stage,), device=call.device)
    except Dsv4Error as exc:
        sys.exit(report_error(exc, g.json, COMMAND))
    except (PermissionError, NotADirectoryError) as exc:
        sys.exit(report_denied(exc, g.workspace, g.json, COMMAND))
    except KeyboardInterrupt:
        sys.exit(interrupted(g.json, COMMAND))
    sys.exit(code)
