"""Where each stage and build step runs, its placement: host or container (the one decision).

The recipe says it: a stage named in ``runtime.stages`` of a ``runtime.kind: container``
recipe runs in the recipe's image, every other stage on the host; a build step runs where the
build stage runs. ``placement_of`` reads that and nothing else; ``runs_in_container`` adds what
this process knows (already inside, or told ``--runtime host``) and is what `run` and the
stand-alone stage commands both ask before running a stage.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dsv4_offload.core import childrun

if TYPE_CHECKING:
    from dsv4_offload.core.options import StageOptions
    from dsv4_offload.recipe import Recipe

Placement = Literal["host", "container"]
HOST: Placement = "host"
CONTAINER: Placement = "container"
# `--runtime host` spelled in the environment: every stage here, whatever the recipe says
RUNTIME_ENV = "DSV4_RUNTIME"
RUNTIME_CHOICES = ("recipe", "host")
BUILD_STAGE = "build"

_warned: set[str] = set()


def forget_warnings() -> None:
    """Say the `--runtime host` warning again (an in-process caller's next command)."""
    _warned.clear()


def placement_of(recipe: Recipe, stage: str) -> Placement:
    """Where the recipe puts ``stage``: 'container' or 'host'."""
    runtime = recipe.runtime
    if runtime.kind == "container" and stage in runtime.stages:
        return CONTAINER
    return HOST


def step_placement(recipe: Recipe, step: str) -> Placement:
    """Where the recipe puts build step ``step``: where its build stage runs."""
    names = [s.name for s in recipe.build.steps]
    if step not in names:
        raise KeyError(f"recipe {recipe.name} has no build step {step!r} ({', '.join(names)})")
    return placement_of(recipe, BUILD_STAGE)


def forced_host() -> bool:
    """``--runtime host`` (or DSV4_RUNTIME=host): the escape hatch, everything here."""
    return os.environ.get(RUNTIME_ENV, "") == "host"


def runs_in_container(recipe: Recipe, stage: str, options: StageOptions | None = None,
                      announce: bool = False) -> bool:
    """Whether this process sends ``stage`` into the recipe's container.

    Not when the command's work needs nothing of the image (``options.needs_image()``: an
    HTTP check of a given URL), nor from a process our `docker exec` started (it is inside),
    nor with ``--runtime host`` (said once on stderr when the stage is about to run,
    ``announce``), nor from inside some container without a docker client (the operator
    entered the image by hand, as the guide does): there the stage runs where it is.
    """
    if placement_of(recipe, stage) != CONTAINER:
        return False
    if options is not None and not options.needs_image():
        return False
    if childrun.container_name():
        return False
    if forced_host():
        if announce and stage not in _warned:
            _warned.add(stage)
            sys.stderr.write(f"warning: running {stage} on the host although the recipe puts "
                             f"it in container {recipe.runtime.image}\n")
            sys.stderr.flush()
        return False
    return not (Path("/.dockerenv").exists() and shutil.which("docker") is None)
