"""Commands for serving and acceptance: ``serve [status|logs|stop]`` and ``accept``.

Only typer and cli.kit at import time; the supervisor, probes and rich load inside commands.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from dsv4_offload.cli import kit
from dsv4_offload.core.errors import ExitCode

if TYPE_CHECKING:
    from dsv4_offload.stages.serve import ServeOptions

serve_app = typer.Typer()  # its help is the callback's docstring


def register(app: typer.Typer) -> None:
    app.add_typer(serve_app, name="serve")
    app.command("accept")(accept)


@serve_app.callback(invoke_without_command=True)
def serve(
    ctx: typer.Context,
    print_only: bool = typer.Option(False, "--print",
                                    help="Show the exact command and environment; run nothing."),
    detach: bool = typer.Option(False, "--detach",
                                help="Leave the server under a background supervisor."),
    device: int | None = typer.Option(None, "--device", metavar="N",
                                      help="NPU id (default: the idlest "
                                      "healthy card npu-smi reports)."),
    longest_prompt: int | None = typer.Option(
        None, "--longest-prompt", metavar="TOKENS",
        help="Longest prompt you will send; the chunked prefill is raised to cover it."),
    python: str | None = typer.Option(
        None, "--python", metavar="PATH", help="Interpreter to serve with (default: PYTHON_BIN, "
        "the workspace's recorded one, else the first that imports numpy torch torch_npu "
        "sglang)."),
    api_key_file: str | None = typer.Option(
        None, "--api-key-file", metavar="FILE", help="Pass the key in FILE as sglang's "
        "--api-key (never printed, logged or stored)."),
    warm: bool = typer.Option(True, "--warm/--no-warm", help="Read the GGUF set into the page "
                              "cache before loading, when memory can hold it."),
    clean_shm: bool = typer.Option(
        False, "--clean-shm", help="Remove your /dev/shm segments that killed servers left "
        "(older than the running server's start, held by no process); start nothing."),
) -> None:
    """Start the hybrid server, supervised, and wait until it answers.

    1. Derive flags and env as the delivery's launcher does: a launcher knob you exported
       (KT_*, CHUNKED_PREFILL_SIZE, KT_CPUINFER, MEM_FRACTION, ...) wins over the recipe;
       threadpool = NUMA nodes, CPU-infer threads = 32, or 16 per node on multi-NUMA
       hosts, below the core count; KT_NSA_COMPRESSOR_MODE from CANN; the card from
       --device or the idlest healthy NPU; the CANN and ATB set_env scripts; proxies
       removed. --print shows each value with its origin.
    2. With KT_MXFP4_DEPOOL=1 refuse to start unless the AscendC operator is built
       (KT_MXFP4_OP_DIR points sglang at it).
    3. Warm the GGUF set into the page cache when MemAvailable can hold it.
    4. Start it as a child in its own process group, its log under logs/serve/; with
       --detach a small supervisor holds it and the command returns once ready.
    5. Ready = /health then /health_generate answer 200 within serve.readiness_timeout_s.
       A known fatal log line stops the wait at once with its fix; an HBM failure lowers
       --mem-fraction-static to its floor, then the resident experts
       (serve.gpu_experts_ladder); a KV-cache failure lowers the experts.
    """
    if ctx.invoked_subcommand is not None:
        return
    from dsv4_offload.stages.serve import ServeOptions

    g = kit.options_of(ctx)
    options = ServeOptions(
        detach=detach, device=device, longest_prompt=longest_prompt, python=python,
        api_key_file=api_key_file, warm=warm,
        # dotted keys of --set, so --print can tell them from the recipe's own values
        set_keys=tuple(o.split("=", 1)[0].strip() for o in g.overrides))
    if print_only:
        _print_plan(ctx, options)
        return
    if clean_shm:
        _clean_shm(ctx)
    if detach:
        kit.run_stage(ctx, "serve", options)
    _serve_foreground(ctx, options)


def _serve_foreground(ctx: typer.Context, options: ServeOptions) -> NoReturn:
    """Like kit.run_stage, but the server's log reaches the console even on a pipe."""
    import sys

    from dsv4_offload import pipeline
    from dsv4_offload.core.results import Progress

    class _EchoProgress(Progress):
        def message(self, text: str) -> None:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    sctx = kit.load_context(ctx, "serve", options)
    g = kit.options_of(ctx)
    if type(sctx.progress) is Progress and not (g.json or g.quiet):
        sctx.progress = _EchoProgress()  # no terminal: plain lines instead of rich output
    with sctx.workspace.lock("serve"):
        result = pipeline.dispatch_stage(sctx, "serve", options, standalone=True)
    kit.emit_result(ctx, "serve", result)
    kit.exit_with(kit.result_exit_code(result))


def _clean_shm(ctx: typer.Context) -> NoReturn:
    """Remove this user's stale /dev/shm segments, each checked again as held by no process
    right before it goes; the server's own (newer than its start) are never touched."""
    from dsv4_offload.serving import shm
    from dsv4_offload.serving import supervisor as sv
    from dsv4_offload.workspace.store import Workspace

    ws = Workspace.from_option(kit.options_of(ctx).workspace)
    before = shm.last_start(sv.read_record(ws.serve_record))
    found = shm.stale_segments(before)
    removed, left = shm.clear(found)
    freed = sum(s.size for s in removed)
    line = (f"serve --clean-shm: removed {len(removed)} stale segment"
            f"{'s' if len(removed) != 1 else ''} ({freed / 2**20:.1f} MiB) from {shm.shm_dir()}"
            + (f"; {len(left)} left" if left else ""))
    kit.emit(ctx, command="serve --clean-shm", status="failed" if left else "ok",
             data={"removed": [str(s.path) for s in removed], "left": left,
                   "bytes_freed": freed, "dir": str(shm.shm_dir())},
             lines=[*left, line])
    kit.exit_with(ExitCode.FAILED if left else ExitCode.OK)


def _print_plan(ctx: typer.Context, options: ServeOptions) -> None:
    from dsv4_offload.stages import serve as serve_stage

    sctx = kit.load_context(ctx, "serve", options)
    note = _print_inside(ctx, sctx)
    plan = serve_stage.make_plan(sctx, strict=False)
    lines = [f"# note: {note}"] if note else []
    lines += [f"# warning: {w}" for w in plan.warnings]
    lines += [f"# {note}" for note in plan.notes]
    lines += [f"# {k}: {v}" for k, v in plan.derived.items() if k.endswith("_reason")]
    lines += ["# every flag and variable, with its origin:"]
    lines += [f"#   {line}" for line in plan.origin_lines()]
    lines += plan.script()
    kit.emit(ctx, command="serve", status="ok", data={"print": True, **plan.as_dict()},
                lines=lines, payload=True)


def _print_inside(ctx: typer.Context, sctx: Any) -> str:
    """With serve in the recipe's container, `--print` runs there (the knobs crossing by name
    as they will for the server), so each value is the one the server will see; when the
    container is not up, the host's view is printed with a note saying so."""
    from dsv4_offload.serving.container import (
        crossing_names,
        exec_argv,
        exec_attached,
        find_container,
        plan_container,
    )
    from dsv4_offload.workspace.placement import runs_in_container

    if not runs_in_container(sctx.recipe, "serve"):
        return ""
    from dsv4_offload.core.errors import Dsv4Error

    plan = plan_container(sctx.recipe, sctx.workspace)
    try:
        found = find_container(plan.name)
    except Dsv4Error as exc:  # no client or no engine: what the host can say is still useful
        return (f"computed on the host: the container cannot be asked ({exc.one_line()}); the "
                "image's environment (its CANN set_env, its python) may change values")
    if found is None or found.state != "running":
        return (f"computed on the host: container {plan.name} is not running, and the image's "
                "environment (its CANN set_env, its python) may change values; "
                "`dsv4-offload container up` and run this again to see them as the server will")
    g = kit.options_of(ctx)
    path = sctx.recipe.file
    inner = [*(["--json"] if g.json else []), "serve", "--print"]
    from dsv4_offload.stages.serve import ServeOptions

    given = sctx.options_as(ServeOptions)
    for flag, value in (("--device", given.device), ("--longest-prompt", given.longest_prompt),
                        ("--python", given.python)):
        if value is not None:
            inner += [flag, str(value)]
    kit.exit_with(exec_attached(exec_argv(plan, sctx.workspace, str(path) if path else None,
                                          g.overrides, inner, crossing_names(sctx.recipe))))


@serve_app.command("status")
def serve_status(ctx: typer.Context) -> None:
    """Is the supervised server running and healthy? Exit 0 if so, 1 if not."""
    import requests

    from dsv4_offload.serving import supervisor as sv

    sctx = kit.load_context(ctx, "serve")
    from dsv4_offload.cli.container import forward_into_container

    forward_into_container(ctx, sctx, "serve", ["serve", "status"])  # its pids are in there
    record = sv.read_record(sctx.workspace.serve_record)
    alive = sv.record_alive(record)
    data: dict[str, Any] = {"running": alive, **(record.as_dict() if record else {})}
    healthy = False
    if alive and record is not None:
        from dsv4_offload.acceptance.probes import api_key_headers
        from dsv4_offload.core.errors import InputError

        try:
            headers = api_key_headers((record.extra or {}).get("api_key_file"))
        except InputError:
            headers = {}  # the key file is gone: ask without it
        try:
            path = sctx.recipe.serve.health_paths[0]
            healthy = requests.get(record.url + path, timeout=5, headers=headers,
                                   proxies={"http": "", "https": ""}).status_code == 200
        except requests.RequestException:
            healthy = False
    data["healthy"] = healthy
    if record is None:
        line = "no server started from this workspace"
    elif alive:
        data["supervisor_running"] = record.supervisor_alive()
        line = (f"{record.describe()}: {record.url} pid {record.server_pid} (supervisor "
                f"{record.supervisor_pid}), {record.kt_num_gpu_experts} resident experts, "
                f"{'healthy' if healthy else 'not answering /health yet'}; log {record.log}")
    else:
        line = f"not running ({record.describe()}); log {record.log}"
    kit.emit(ctx, command="serve status", status="ok" if alive else "failed", data=data,
                lines=[line])
    kit.exit_with(ExitCode.OK if alive else ExitCode.FAILED)


@serve_app.command("logs")
def serve_logs(
    ctx: typer.Context,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    lines: int = typer.Option(50, "--lines", "-n", min=0, metavar="N",
                              help="How many last lines to show."),
) -> None:
    """The server's log: the last lines, and with -f the new ones until Ctrl-C."""
    import sys

    from dsv4_offload.core.errors import InputError
    from dsv4_offload.serving import supervisor as sv
    from dsv4_offload.stages import serve as serve_stage

    sctx = kit.load_context(ctx, "serve")
    log = serve_stage.server_log(sctx)
    if log is None:
        raise InputError(f"no server log under {sctx.log_dir}; start one with `dsv4-offload "
                         "serve`")
    every = log.read_text(encoding="utf-8", errors="replace").splitlines()
    text = every[max(0, len(every) - lines):]  # not [-lines:]: -n 0 would show it all
    g = kit.options_of(ctx)
    if g.json:
        kit.emit(ctx, command="serve logs", status="ok", data={"log": str(log), "lines": text})
        return
    for line in text:
        sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if not follow:
        return
    follower = sv.LogFollower(log)
    try:
        while True:
            for line in follower.new_lines():
                sys.stdout.write(line + "\n")
            sys.stdout.flush()
            if not sv.record_alive(sv.read_record(sctx.workspace.serve_record)):
                for line in follower.new_lines():
                    sys.stdout.write(line + "\n")
                return
            time.sleep(0.3)
    except KeyboardInterrupt:
        return


@serve_app.command("stop")
def serve_stop(ctx: typer.Context) -> None:
    """Stop the server: SIGINT, then SIGTERM, then SIGKILL on its process group."""
    from dsv4_offload.serving import supervisor as sv

    sctx = kit.load_context(ctx, "serve")
    from dsv4_offload.cli.container import forward_into_container

    forward_into_container(ctx, sctx, "serve", ["serve", "stop"])  # its pids are in there
    record = sv.read_record(sctx.workspace.serve_record)
    if not sv.record_alive(record):
        if record is not None and record.state in ("starting", "running"):
            # its supervisor was killed with it: close the record, so status tells the truth
            sv.stop_recorded(sctx.workspace.serve_record, sctx.recipe.serve.stop_timeout_s)
        _forget_key(sctx.workspace, record)
        kit.emit(ctx, command="serve stop", status="ok", data={"stopped": False},
                    lines=["no server running"])
        return
    stopped, how = sv.stop_recorded(sctx.workspace.serve_record,
                                    sctx.recipe.serve.stop_timeout_s)
    pid = stopped.server_pid if stopped else None
    _forget_key(sctx.workspace, stopped)
    kit.emit(ctx, command="serve stop", status="ok", data={"stopped": True, "signal": how,
                                                             "pid": pid},
                lines=[f"stopped pid {pid} ({how})"])


def _forget_key(workspace: Any, record: Any) -> None:
    """No server runs now: the private copy of its key, if one crossed for it, goes."""
    from dsv4_offload.serving.crossing import forget

    if record is not None:
        forget(workspace, (record.extra or {}).get("api_key_file"))


def accept(
    ctx: typer.Context,
    url: str | None = typer.Option(None, "--url", metavar="URL",
                                   help="Server to check (default: the one "
                                   "`serve` started, else serve.host:port)."),
    api: str | None = typer.Option(None, "--api", metavar="native|openai",
                                   help="native (sglang /generate) or openai "
                                   "(/v1/completions, /v1/chat/completions)."),
    model: str | None = typer.Option(None, "--model", metavar="NAME",
                                     help="Model name for an OpenAI server."),
    probes: str | None = typer.Option(None, "--probes", metavar="FILE",
                                      help="YAML list of probes instead of the recipe's."),
    server_log: str | None = typer.Option(
        None, "--server-log", metavar="FILE", help="The log of a server started elsewhere "
        "(the delivery's script, a container); read after all requests."),
    require_line: list[str] = typer.Option(
        [], "--require-line", metavar="REGEX", help="A line the log must have; with "
        "--forbid-line, replaces the recipe's (sglang) markers. Repeatable."),
    forbid_line: list[str] = typer.Option(
        [], "--forbid-line", metavar="REGEX", help="A line the log must not have. Repeatable."),
    quick: bool = typer.Option(False, "--quick", help="Short throughput run: "
                               "acceptance.throughput.quick_new_tokens, one repeat."),
    no_throughput_gate: bool = typer.Option(
        False, "--no-throughput-gate", help="Throughput below the reference only warns."),
    gpqa_rounds: int = typer.Option(0, "--gpqa", metavar="N", min=0, help="Also run N rounds "
                                    "of GPQA-diamond through evalscope (hours per round)."),
    api_key_file: str | None = typer.Option(
        None, "--api-key-file", metavar="FILE", help="Send the key in FILE (default: the one "
        "`serve --api-key-file` used)."),
) -> None:
    """Check the running server: coherent, deterministic, fast enough, clean log.

    1. /health and /health_generate answer 200 (/v1/models with --api openai).
    2. Each greedy probe is non-empty and not degenerate as the guide defines it (garbled
       text, one character or token repeated, a short loop, NaN, U+FFFD) and mentions what
       it must; a long answer cycling through one sentence passes with a note. The
       determinism probe gives the same text twice.
    3. Decode tok/s as the delivery's decode_throughput_test.sh measures it: per bucket
       (130/1000/8000/16000/32000 tokens, counted in the server's own tokens) one warm-up,
       then 3 streamed runs of 1000 tokens with ignore_eos; mean/median/min/max. A bucket
       longer than the server's chunked prefill (/get_server_info, else the serve record,
       else the recipe) is skipped with a note. A failed request, a dead server or a median
       below the recipe's reference fails.
    4. Then the server still answers, and its log (the supervised one or --server-log) has
       the weights loaded, the depool slot (KT_MXFP4_DEPOOL=1), the SWAC4C128KV pool and the
       NPU graph, and no streaming-prefill fallback or dedup warning.
    5. With --gpqa N: N rounds of GPQA-diamond through evalscope, mean and spread against
       the recipe's reference.
    JSON report and PNG chart under reports/, the verdict in provenance.json.
    """
    from rich.markup import escape

    from dsv4_offload import pipeline
    from dsv4_offload.cli.render import console
    from dsv4_offload.stages.accept import AcceptOptions

    options = AcceptOptions(url=url, api=api, model=model, probes=probes, log=server_log,
                            require_lines=tuple(require_line), forbid_lines=tuple(forbid_line),
                            quick=quick, no_throughput_gate=no_throughput_gate,
                            gpqa=gpqa_rounds, api_key_file=api_key_file)
    sctx = kit.load_context(ctx, "accept", options)
    with sctx.workspace.lock("accept"):
        result = pipeline.dispatch_stage(sctx, "accept", options, standalone=True)
    kit.emit_result(ctx, "accept", result)  # the checks table, the fixes, the verdict
    g = kit.options_of(ctx)
    if not g.json and not g.quiet and result.data.get("report"):
        chart = f", chart {result.data['chart']}" if result.data.get("chart") else ""
        console().print(escape(f"report {result.data['report']}{chart}"), soft_wrap=True)
    kit.exit_with(kit.result_exit_code(result))
