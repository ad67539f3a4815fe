"""Doctor's rows that belong to the recipe's image (the build's toolchain, CANN, the
server's interpreter): shown as such on the host, and judged inside the image when its
container runs."""

from __future__ import annotations

import os
import subprocess
from typing import TYPE_CHECKING

from dsv4_offload.build.bringup import KT_KERNEL_STEP
from dsv4_offload.core.childrun import HANDOFF_ENV, stage_env
from dsv4_offload.core.envelope import Envelope
from dsv4_offload.core.host import parse_version, version_at_least
from dsv4_offload.core.results import SKIP, Check, Problem
from dsv4_offload.recipe import Recipe
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.placement import CONTAINER, placement_of

if TYPE_CHECKING:
    from dsv4_offload.serving.container import ContainerPlan

# kt-kernel is C++20 (CMakeLists.txt:124) and includes <barrier> (cpu_backend/worker_pool.h:17,
# ktransformers @ d7b5b49a), which libstdc++ ships from GCC 11
BARRIER_GCC = "11"


def image_side(recipe: Recipe, inside: bool) -> str | None:
    """The image whose toolchain the build uses, when that is not this machine's: the
    recipe builds in its container (workspace/placement.py) and this process is outside."""
    if placement_of(recipe, "build") != CONTAINER or inside:
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
            proc = capture(argv, env=stage_env(os.environ, token), timeout=300)
        inner = {c["name"]: c for c in Envelope.parse(proc.stdout).data["data"]["checks"]}
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


def compiler_in_image(recipe: Recipe, plan: ContainerPlan, steps: list[str] | None
                      ) -> Problem | None:
    """The kt-kernel step's C++ compiler (its env's CXX, else ``platform.cxx``, else g++),
    asked for its version in the running container with one ``docker exec`` before the build
    is handed over; older than the recipe's gcc minimum (``host.tools``, at least GCC 11 for
    ``<barrier>``) or absent, the problem with the fix. None when the build does not compile
    kt-kernel (``steps`` names others) or the compiler is new enough."""
    from dsv4_offload.serving import container as ct

    step = next((s for s in recipe.build.steps if s.name == KT_KERNEL_STEP), None)
    if step is None or (steps and KT_KERNEL_STEP not in steps):
        return None
    cxx = step.env.get("CXX") or recipe.platform.cxx or "g++"
    minimum = recipe.host.tools.get("g++") or recipe.host.tools.get("gcc") or BARRIER_GCC
    if not version_at_least(minimum, BARRIER_GCC):
        minimum = BARRIER_GCC
    code, out = ct.docker_query(["exec", plan.name, cxx, "--version"])
    version = parse_version(out) if code == 0 else None
    if version is not None and version_at_least(version, minimum):
        return None
    major = minimum.removesuffix(".0")
    fix = (f"build in an image whose compiler is GCC {major} or newer (runtime.image), or "
           f"install g++-{major} or later in container {plan.name} (lost when it is recreated) "
           f"and name it: --set build.steps[{KT_KERNEL_STEP}].env.CXX=g++-{major} --set "
           f"build.steps[{KT_KERNEL_STEP}].env.CC=gcc-{major}")
    said = f"{cxx} {version}" if version else f"no {cxx} (exit {code})"
    return Problem("error", f"{said} in image {plan.image}: kt-kernel needs GCC >= {major} "
                   "(<barrier>, cpu_backend/worker_pool.h:17)", fix=fix,
                   check="image-compiler")
