"""Commands for builds and weights: ``build`` and ``download``.

Only typer and cli.kit at import time; the stages (and the hub clients) load inside commands.
"""

from __future__ import annotations

from pathlib import Path

import typer

from dsv4_offload.cli import complete, kit
from dsv4_offload.cli.helptext import RecipeHelpCommand
from dsv4_offload.core.errors import InputError


def register(app: typer.Typer) -> None:
    app.command("build", cls=RecipeHelpCommand)(build)
    app.command("download")(download)


def build(
    ctx: typer.Context,
    steps: list[str] = typer.Argument(
        None, metavar="[STEP]...",
        help="Steps of the recipe's build.steps to run (default all): {steps}.",
        autocompletion=complete.steps),
    python: str | None = typer.Option(
        None, "--python", metavar="PATH",
        help="The interpreter to build with and for (default: the recipe's build.python); "
        "it must be the recipe's host.python version."),
    clean: bool = typer.Option(
        False, "--clean", help="Remove each step's build/ dir first (a fresh CMake configure); "
        "done anyway when a step's command, env or python changed since its last build."),
) -> None:
    """Build the patched stack: the recipe's build steps, in order.

    This recipe's steps (build.steps): {steps}.

    \b
    1. Preflight: the build python and its version; cmake, the C compiler and the
       hwloc/numa headers for kt-kernel; `patch audit` of the steps' markers (a
       required one no file of the patched tree can print refuses the build).
    2. Each step in recipe order, in its workdir, with its env (and CC/CXX of the
       platform); output in <workspace>/logs/build/<step>.log.
    3. The step's log must show every expected marker (regular expressions) and no
       forbidden one; then `import <module>` must work with the server's PYTHONPATH.
    4. An optional step (ascendc-op) that fails, or whose compiler (bisheng) is missing,
       is a warning. Git hooks the kt-kernel configure installed are reported.
    """
    from dsv4_offload.stages.build import BuildOptions

    kit.run_stage(ctx, "build", BuildOptions(steps=tuple(steps or ()), python=python,
                                             clean=clean))


def _endpoints(values: list[str]) -> str | dict[str, str] | None:
    """`URL` (every hub) or `HUB=URL` (repeatable) into the stage's endpoint option."""
    from dsv4_offload.weights.hubs import HUBS

    if not values:
        return None
    per_hub: dict[str, str] = {}
    for value in values:
        hub, sep, url = value.partition("=")
        if sep and hub in HUBS:
            per_hub[hub] = url
        elif len(values) == 1 and not sep:
            return value
        else:
            raise InputError(f"--endpoint '{value}': give one URL, or HUB=URL per hub "
                             f"({', '.join(HUBS)})")
    return per_hub


def download(
    ctx: typer.Context,
    which: str | None = typer.Argument(
        None, metavar="[w8a8|mxfp4]", help="One weight set (default both).",
        autocompletion=complete.weight_sets),
    endpoint: list[str] = typer.Option(
        [], "--endpoint", metavar="[HUB=]URL",
        help="A hub mirror: URL for the chosen set, or huggingface=URL / modelscope=URL "
        "(repeatable). Default: HF_ENDPOINT / MODELSCOPE_ENDPOINT, else the public hubs."),
    local_dir_only: bool = typer.Option(
        False, "--local-dir-only", "--offline",
        help="No network: check the files on disk against the listing recorded by the "
        "last online run."),
    repair: bool = typer.Option(
        False, "--repair", help="Re-hash every file (not only new or changed ones) and "
        "fetch again the ones that do not match."),
    streams: int | None = typer.Option(
        None, "--streams", "--max-workers", min=1, max=16, metavar="N",
        help="Files fetched at once (default: the recipe's weights.streams, 1: files then "
        "arrive in the order the converter needs them)."),
    lock: Path | None = typer.Option(
        None, "--lock", metavar="FILE",
        help="Fetch the commits another host locked: FILE is its weights.lock.json (every "
        "host of a fleet then holds the same weights)."),
    update: str | None = typer.Option(
        None, "--update", metavar="w8a8|mxfp4",
        help="Move this set's lock to what its revision and not_after resolve to today, "
        "saying from what to what; the stages that read it become stale."),
) -> None:
    """Download the W8A8 (ModelScope) and MXFP4 (Hugging Face) weights, verified.

    \b
    1. Resolve each set's revision to one commit through the hub's commit history (a
       branch as of weights.*.not_after; the lock's commit when it holds one, or --lock
       FILE's), and ask the hub for that commit's file listing.
    2. Check what is on disk: sizes, and sha256 (or git blob id) of files not verified
       before; check the disk can take the rest.
    3. Fetch the missing files with the hub's client (finished files are kept;
       ModelScope partial files resume by range, Hugging Face Xet files by chunk): MXFP4
       first, config and index before the shards, the shards in layer order.
    4. Check each file against the listing as soon as it is complete, and record it; a
       corrupt one is named and removed, and the next run fetches it again.
    """
    from dsv4_offload.stages.download import WEIGHT_SETS

    if which is not None and which not in WEIGHT_SETS:
        raise InputError(f"download: '{which}' is not a weight set; use "
                         f"{' or '.join(WEIGHT_SETS)} (or nothing for both)")
    endpoints = _endpoints(endpoint)
    if isinstance(endpoints, str) and which is None:
        # the two sets live on different hubs: one mirror URL cannot serve both
        raise InputError(f"--endpoint {endpoints}: name the set (download mxfp4 --endpoint URL) "
                         "or the hub (--endpoint huggingface=URL / modelscope=URL)")
    from dsv4_offload.stages.download import DownloadOptions

    kit.run_stage(ctx, "download", DownloadOptions(
        which=which, endpoint=endpoints, local_dir_only=local_dir_only, repair=repair,
        streams=streams, lock=str(lock.resolve()) if lock else None, update=update))
