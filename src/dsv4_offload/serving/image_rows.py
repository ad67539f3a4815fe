"""Doctor's rows that belong to the recipe's image (the build's toolchain, CANN, the
server's interpreter): shown as such on the host, and judged inside the image when its
container runs."""

from __future__ import annotations

import json
import os
import subprocess

from dsv4_offload.core.results import SKIP, Check
from dsv4_offload.recipe import Recipe
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.contexts import CONTAINER, context_of
from dsv4_offload.workspace.store import HANDOFF_ENV


def image_side(recipe: Recipe, inside: bool) -> str | None:
    """The image whose toolchain the build uses, when that is not this machine's: the
    recipe builds in its container (workspace/contexts.py) and this process is outside."""
    if context_of(recipe, "build") != CONTAINER or inside:
        return None
    return recipe.runtime.image


def in_image(check: Check, image: str) -> Check:
    """A toolchain row the build needs inside ``image``, shown on the host as such: not
    judged against this machine (a bare 910B host has no cmake and an old python)."""
    return Check(check.name, SKIP, f"checked in the image {image}, where the build runs",
                 check.required, "`dsv4-offload container up`, then `dsv4-offload container "
                 "exec -- doctor` checks it there")


def judged_in_the_image(ctx: StageContext, checks: list[Check]) -> list[Check]:
    """The image-side rows judged where they belong: when the recipe's container runs, doctor
    runs there too (this tool from its venv, the knobs crossing by name) and each row shown
    as ``checked in the image`` takes the verdict it got inside, marked ``in NAME:``. With no
    container up the rows stay as they are (their fix says how to check them)."""
    from dsv4_offload.core.errors import Dsv4Error
    from dsv4_offload.core.runner import capture
    from dsv4_offload.serving import container as ct

    try:
        plan = ct.plan_container(ctx.recipe, ctx.workspace)
        found = ct.find_container(plan.name)
    except Dsv4Error:
        return checks
    if found is None or found.state != "running":
        return checks
    path = ctx.recipe.file
    argv = ct.exec_argv(plan, ctx.workspace, str(path) if path else None,
                        list(ctx.recipe.overrides), ["--json", "doctor"],
                        [HANDOFF_ENV, *ct.crossing_names(ctx.recipe)])
    try:
        # the doctor inside works under this process's workspace lock, lent to it
        with ctx.workspace.lend_lock() as token:
            proc = capture(argv, env={**os.environ, HANDOFF_ENV: token}, timeout=300)
        inner = {c["name"]: c for c in json.loads(proc.stdout)["data"]["data"]["checks"]}
    except (OSError, RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError, TypeError):
        return checks  # the rows keep saying how to check them by hand
    out = []
    for c in checks:
        row = inner.get(c.name)
        if c.status == SKIP and c.observed.startswith("checked in the image") and row:
            c = Check(c.name, row["status"], f"in {plan.name}: {row['observed']}",
                      row.get("required", c.required), row.get("fix", ""))
        out.append(c)
    return out
