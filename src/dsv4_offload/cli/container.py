"""The runtime container: ``container up|exec|status|down``.

Only typer and cli.kit at import time; the container module loads inside commands.
"""

from __future__ import annotations

from typing import Any

import typer

from dsv4_offload.cli.kit import emit, exit_with, load_context, options_of
from dsv4_offload.core.errors import ExitCode

container_app = typer.Typer(
    help="The recipe's runtime container (the 910B image): up, exec, status, down.",
    no_args_is_help=True, rich_markup_mode=None)


def register(app: typer.Typer) -> None:
    app.add_typer(container_app, name="container")


_DEVICES = typer.Option(
    None, "--devices", metavar="auto|IDS",
    help="NPUs to pass in: 'auto' (every /dev/davinciN) or ids such as '0' or '0,3' "
         "(default: the recipe's runtime.devices).")


def _plan(ctx: typer.Context, devices: str | None) -> tuple[Any, Any]:
    import os
    from pathlib import Path

    from dsv4_offload.core.host import HOST_ROOT_ENV
    from dsv4_offload.serving.container import plan_container

    pctx = load_context(ctx, "container")
    root = os.environ.get(HOST_ROOT_ENV)
    plan = plan_container(pctx.recipe, pctx.workspace, devices=devices,
                          host_root=Path(root) if root else None)
    return pctx, plan


def _plan_rows(plan: Any) -> list[tuple[str, str]]:
    return [("name", plan.name), ("image", plan.image), ("devices", " ".join(plan.devices)),
            *[("mount", m) for m in plan.mounts], ("port", str(plan.port)),
            ("shm size", plan.shm_size)]


@container_app.command("up")
def up(ctx: typer.Context, devices: str | None = _DEVICES) -> None:
    """Start (or reuse) the container and make it ready to run stages.

    \b
    1. The `docker run` of the delivery's launch_dsv4_singleCard_cann8.5.0_910b.sh: the
       device nodes, driver mounts, --ipc=host --privileged, ulimits, shm size and port;
       the workspace mounted at its own path; detached and labelled.
    2. A container of that name with the same image, mounts and devices is reused; one
       with others is replaced (the message says why). A missing image is pulled.
    3. hwloc and pkg-config (lost when the container is recreated) and this tool (a wheel
       of the running install) are checked inside and installed when missing.
    """
    from dsv4_offload.cli.render import simple_table
    from dsv4_offload.serving.container import container_up

    pctx, plan = _plan(ctx, devices)
    with pctx.task(f"container {plan.name}") as task:
        report = container_up(plan, pctx.workspace, task=task)
    rows = [("action", report.action), *_plan_rows(plan), ("packages", report.packages),
            ("tool", f"{report.tool} ({report.tool_digest[:12]})")]
    emit(ctx, command="container up", status="ok", data=report.as_dict(),
         table=simple_table(("what", "value"), rows, status_col=-1), lines=report.messages)


@container_app.command(
    "exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exec_(
    ctx: typer.Context,
    args: list[str] = typer.Argument(None, metavar="-- ARGS...",
                                     help="dsv4-offload arguments, e.g. `-- build kt-kernel`."),
    devices: str | None = _DEVICES,
) -> None:
    """Run `dsv4-offload ARGS` in the container, on this workspace and recipe.

    \b
    The container is brought up first (as `container up`). The inner command shares the
    workspace (mounted at its own path), so its stage records land in the same state file
    and `status` on the host shows them.
    """
    from dsv4_offload.serving.container import (
        container_up,
        crossing_names,
        exec_argv,
        exec_attached,
    )

    pctx, plan = _plan(ctx, devices)
    with pctx.task(f"container {plan.name}") as task:
        container_up(plan, pctx.workspace, task=task)
    g = options_of(ctx)
    inner = list(args or [])
    if g.json and "--json" not in inner:
        inner = ["--json", *inner]
    path = pctx.recipe.file
    argv = exec_argv(plan, pctx.workspace, str(path) if path else None, g.overrides, inner,
                     crossing_names(pctx.recipe))
    exit_with(exec_attached(argv))


@container_app.command("status")
def status(ctx: typer.Context, devices: str | None = _DEVICES) -> None:
    """Which container, its image and mounts, whether it matches the recipe, the tool in it."""
    from dsv4_offload.cli.render import simple_table
    from dsv4_offload.serving.container import container_status

    pctx, plan = _plan(ctx, devices)
    st = container_status(plan, pctx.workspace)
    found = st.found
    rows = [("container", f"{plan.name} ({found.id[:12]}, {found.state})" if found
             else f"{plan.name} (none)"),
            ("image", found.image if found else plan.image),
            ("matches recipe", "yes" if st.matches else "no"),
            *_plan_rows(plan)[2:],
            ("image present", st.image_arch or "no"),
            ("tool", f"{st.tool_version or 'not installed'}"
                     + (f" (wheel {st.tool_digest[:12]})" if st.tool_digest else ""))]
    emit(ctx, command="container status", status="ok", data=st.as_dict(),
         table=simple_table(("what", "value"), rows, status_col=-1))


@container_app.command("down")
def down(ctx: typer.Context) -> None:
    """Remove the container (the workspace and weights stay on the host)."""
    from dsv4_offload.serving.container import container_down

    pctx, plan = _plan(ctx, None)
    removed = container_down(plan, pctx.workspace)
    emit(ctx, command="container down", status="ok", data={"name": plan.name,
                                                           "removed": removed},
         lines=[f"removed {plan.name}" if removed else f"no container {plan.name}"])
    exit_with(ExitCode.OK)


def forward_into_container(ctx: typer.Context, sctx: Any, stage: str, args: list[str]) -> bool:
    """Run ``args`` in the recipe's container when ``stage`` last ran there; False when it
    did not (the caller goes on here). The server's pids are the container's: signalling
    them from the host would reach other processes."""
    from dsv4_offload.serving.container import (
        crossing_names,
        exec_argv,
        exec_attached,
        find_container,
        plan_container,
    )
    from dsv4_offload.workspace.placement import runs_in_container

    record = sctx.workspace.state().record(stage)
    if record is None or not record.container or not runs_in_container(sctx.recipe, stage):
        return False  # it ran here
    plan = plan_container(sctx.recipe, sctx.workspace)
    found = find_container(plan.name)
    g = options_of(ctx)
    if found is None or found.state != "running":
        emit(ctx, command=" ".join(args), status="failed", data={"container": plan.name,
                                                                 "running": False},
             lines=[f"container {plan.name} is not running: no server"])
        exit_with(ExitCode.FAILED)
    path = sctx.recipe.file
    inner = ["--json", *args] if g.json else list(args)
    code = exec_attached(exec_argv(plan, sctx.workspace, str(path) if path else None,
                                   g.overrides, inner, crossing_names(sctx.recipe)))
    exit_with(code)
