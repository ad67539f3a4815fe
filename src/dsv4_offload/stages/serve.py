"""Stage `serve`: derive the launch line from recipe and host, start it supervised, wait ready.

Options: ``detach`` (leave a supervisor behind and return once ready; what `run` does),
``device`` (NPU index), ``longest_prompt`` (tokens), ``accept_chunk`` (`run`'s: a chunk
for accept's longest bucket), ``host_facts`` (a HostFacts, for
callers that probed already). In the foreground the stage returns when the server exits.
On a KV-cache or HBM failure it retries down ``serve.gpu_experts_ladder``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.options import PathText, StageOptions
from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.serving import shm
from dsv4_offload.serving import supervisor as sv
from dsv4_offload.serving.cann import (
    atb_set_env,
    cann_scripts,
    capture_script_env,
    inherited_env,
    toolkit_home,
)
from dsv4_offload.serving.plan import ServePlan, build_plan
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import atomic_write_json, read_json


class ServeOptions(StageOptions):
    detach: bool = False  # leave the server under a background supervisor
    device: int | None = None  # the NPU (default: the idlest healthy one)
    longest_prompt: int | None = None  # tokens the chunked prefill must cover
    python: PathText | None = None  # the interpreter to serve with
    api_key_file: PathText | None = None  # sglang's --api-key, read from this file
    warm: bool = True  # read the GGUF set into the page cache first, when it fits
    set_keys: tuple[str, ...] = ()  # the dotted keys of --set, for --print's origins
    accept_chunk: bool = False  # under `run`: a chunk that takes accept's longest bucket


Options = ServeOptions


def host_facts(ctx: StageContext) -> Any:
    """The host's facts: those already on the context, else probed now."""
    if ctx.host_facts is not None:
        return ctx.host_facts
    from dsv4_offload.core.host import probe_host

    return probe_host(ctx.workspace.root, toolchain=False)  # the plan reads no version


def toolkit_example(cann: str) -> str:
    """Where the recipe's CANN usually lives: CANN 9 installs as Ascend/cann-<version>, the
    8.x toolkits (the 910B's 8.5) as Ascend/ascend-toolkit/latest."""
    if cann.split(".")[0].isdigit() and int(cann.split(".")[0]) >= 9:
        return f"/usr/local/Ascend/cann-{cann}"
    return "/usr/local/Ascend/ascend-toolkit/latest"


def make_plan(ctx: StageContext, gpu_experts: int | None = None, facts: Any = None,
              strict: bool = True, mem_fraction: float | None = None) -> ServePlan:
    """The plan for this context: host facts, the CANN scripts' env, then the pure rules.

    Not ``strict`` (for --print): a missing CANN toolkit, interpreter or operator becomes a
    note, not an error.
    """
    facts = facts if facts is not None else host_facts(ctx)
    serve = ctx.recipe.serve
    base = inherited_env()
    # the launcher's search first (env, ASCEND_HOME_PATH, four layouts), then the host probe's
    toolkit, toolkit_how = toolkit_home(base)
    toolkit_origin = f"host ({toolkit_how}, launcher L137-148)"
    if toolkit is None and facts.cann_toolkit:
        toolkit, toolkit_origin = facts.cann_toolkit, "host (CANN install info)"
    scripts = cann_scripts(serve, toolkit, base)
    problem = None
    if scripts and not scripts[0].is_file():
        problem = (f"{scripts[0]}: CANN set_env script not found; install the CANN toolkit "
                   "or set ASCEND_TOOLKIT_HOME (see `dsv4-offload doctor`)")
    elif not scripts:
        problem = (f"{toolkit_how}; install CANN {ctx.recipe.platform.cann}, source its "
                   "set_env.sh or export ASCEND_TOOLKIT_HOME="
                   f"{toolkit_example(ctx.recipe.platform.cann)}")
    if problem and strict and serve.command is None:
        raise Dsv4Error(problem)
    script_env = capture_script_env(scripts, base, cache_dir=ctx.workspace.run_dir)
    kml = base.get("KML_LIB_DIR") or serve.kml_lib_dir  # KML_LIB_DIR overrides (launcher L178)
    if kml and Path(kml).is_dir():
        # the launcher puts Kunpeng's math library first when the host has it (L178-179)
        rest = script_env.get("LD_LIBRARY_PATH", base.get("LD_LIBRARY_PATH", ""))
        script_env["LD_LIBRARY_PATH"] = ":".join(p for p in (kml, rest) if p)
    python, python_origin, python_note = _python(ctx, strict)
    options = ctx.options_as(ServeOptions)
    api_key_file = options.api_key_file or serve.api_key_file
    plan = build_plan(ctx.recipe, facts, ctx.workspace, base_env=base, script_env=script_env,
                      device=options.device, longest_prompt=longest_prompt(ctx),
                      gpu_experts=gpu_experts, mem_fraction=mem_fraction,
                      require_layers=strict, python=python, python_origin=python_origin,
                      toolkit=toolkit, toolkit_origin=toolkit_origin,
                      set_keys=options.set_keys,
                      api_key_file=Path(api_key_file) if api_key_file else None)
    if problem:
        plan.notes.append(problem.split(";")[0] + ": its environment is not included")
    if python_note:
        plan.notes.append(python_note)
    if toolkit and serve.command is None:
        atb, atb_how = atb_set_env(toolkit, base)
        if atb is None:
            plan.warnings.append(atb_how)
    return plan


def longest_prompt(ctx: StageContext) -> int | None:
    """--longest-prompt, else, under `run` (accept follows), the chunk accept's longest
    bucket needs (acceptance.throughput.server_chunk: the guide starts the throughput
    server with CHUNKED_PREFILL_SIZE=32768, §7 and §8.1)."""
    options = ctx.options_as(ServeOptions)
    given = options.longest_prompt
    if given or not options.accept_chunk or inherited_env().get("CHUNKED_PREFILL_SIZE"):
        return given  # an exported CHUNKED_PREFILL_SIZE is the user's: accept skips with why
    tp = ctx.recipe.acceptance.throughput
    return min(tp.server_chunk, ctx.recipe.serve.context_length)


def _python(ctx: StageContext, strict: bool) -> tuple[str, str, str]:
    """(interpreter, its origin, a note) for the server: the workspace's one interpreter."""
    serve = ctx.recipe.serve
    if serve.command is not None and not any("{python}" in c for c in serve.command):
        return serve.python, "recipe", ""
    from dsv4_offload.build.interpreter import chosen_python

    try:
        choice = chosen_python(ctx, python=ctx.options_as(ServeOptions).python, record=strict)
    except InputError as exc:
        # only raised with neither --python nor PYTHON_BIN given (both are taken unprobed):
        # no interpreter of this host imports the server, a host fact: exit 1, not 2
        if strict:
            raise Dsv4Error(exc.message) from None
        return serve.python, "recipe", f"{exc.one_line()} (shown with the recipe's python)"
    return choice.path, f"{choice.source} ({choice.reason})", ""


def ladder(start: int, rungs: list[int]) -> list[int]:
    """The expert counts to try: the recipe's, then each lower rung of the ladder."""
    return [start] + [r for r in sorted(set(rungs), reverse=True) if r < start]


def next_attempt(serve: Any, fraction: float, experts: int, fatal_key: str
                 ) -> tuple[float, int, str] | None:
    """(fraction, experts, why) for the retry after a KV-cache or HBM failure, or None.

    The guide's order (appendix G.1): HBM runs out -> lower MEM_FRACTION first, down to its
    floor (it only shrinks a KV pool larger than the context needs); only at the floor lower
    the resident experts. A KV pool too small below the floor -> back up to the floor.
    """
    floor = serve.mem_fraction_floor
    if fatal_key == "hbm-oom" and fraction > floor + 1e-9:
        lower = [f for f in sorted(set(serve.mem_fraction_ladder), reverse=True)
                 if floor - 1e-9 <= f < fraction - 1e-9]
        step = lower[0] if lower else floor
        return step, experts, f"lowering --mem-fraction-static to {step:g} (guide G.1)"
    if fatal_key == "kv-cache" and fraction < floor - 1e-9:
        return floor, experts, f"raising --mem-fraction-static to its floor {floor:g}"
    fewer = [r for r in ladder(experts, serve.gpu_experts_ladder) if r < experts]
    if not fewer:
        return None
    return fraction, fewer[0], f"retrying with {fewer[0]} resident experts"


def fingerprint_inputs(ctx: StageContext) -> dict[str, str]:
    # A server that died since makes `serve` stale, so `run` starts it again (the pipeline
    # records this after the stage ran, i.e. with the server up).
    record = sv.read_record(ctx.workspace.serve_record)
    if record is None:
        return {"server": "never started"}
    if sv.record_alive(record):
        return {"server": "up"}
    return {"server": f"{record.state} (exit code {record.exit_code})"}


def run(ctx: StageContext) -> StageResult:
    detach = ctx.options_as(ServeOptions).detach
    ws = ctx.workspace
    ws.ensure()
    ws.run_dir.mkdir(parents=True, exist_ok=True)
    facts = host_facts(ctx)
    existing = sv.read_record(ws.serve_record)
    if sv.record_alive(existing):
        return _already_running(ctx, existing, facts)

    attempts: list[dict[str, Any]] = []
    first, remembered = _first_rung(ctx)
    plan = make_plan(ctx, first, facts)  # validates first: no warm-up for a plan that fails
    warmth = _warm_page_cache(ctx, facts)
    while True:
        experts = int(plan.derived["kt_num_gpu_experts"])
        fraction = float(plan.derived["mem_fraction_static"])
        log = ctx.log_dir / f"server-{time.strftime('%Y%m%d-%H%M%S')}-{experts}.log"
        started_at = time.time()
        outcome, server = _start_and_wait(ctx, plan, log, experts, detach)
        attempts.append({"kt_num_gpu_experts": experts, "mem_fraction_static": fraction,
                         "outcome": outcome.reason, "seconds": round(outcome.seconds, 1),
                         "log": str(log),
                         **({"fatal": outcome.fatal.key} if outcome.fatal else {})})
        if outcome.ready:
            _remember_rung(ctx, experts, attempts)
            return _ready(ctx, plan, log, experts, attempts, server, started_at, remembered,
                          warmth)
        _stop_attempt(ctx, server)
        fatal = outcome.fatal
        # only a fatal line that fewer resident experts can cure is worth another start
        step = (next_attempt(ctx.recipe.serve, fraction, experts, fatal.key)
                if fatal is not None and fatal.retry_fewer_experts else None)
        if fatal is None or step is None:
            return _failed(ctx, plan, log, outcome, attempts)
        ctx.progress.message(f"{fatal.cause}; {step[2]}")
        plan = make_plan(ctx, step[1], facts, mem_fraction=step[0])


def _warm_page_cache(ctx: StageContext, facts: Any) -> dict[str, Any] | None:
    """Read the GGUF set into the page cache before loading, when memory can hold it."""
    if not ctx.options_as(ServeOptions).warm:
        return None
    from dsv4_offload.serving import pagecache
    from dsv4_offload.serving.rules import LAYER_PLACEHOLDER, weight_template

    template = weight_template(ctx.workspace, ctx.recipe)
    paths = [Path(template.replace(LAYER_PLACEHOLDER, str(i)))
             for i in range(ctx.recipe.conversion.layers)]
    avail = pagecache.mem_available_bytes()
    with ctx.task("warming the GGUF set into the page cache", unit="B") as task:
        def progress(done: int, total: int) -> None:
            task.update(completed=done, total=total)

        report = pagecache.warm(paths, mem_available=avail, on_progress=progress)
    info = report.as_dict()
    if report.skipped_reason:
        ctx.progress.message(f"page cache not warmed: {report.skipped_reason}; kt-kernel reads "
                             "the GGUF set from disk while loading (slower)")
    else:
        ctx.progress.message(
            f"page cache: {report.total / 2**30:.1f} GiB GGUF set, "
            f"{report.resident_share:.0%} already resident, read "
            f"{report.read / 2**30:.1f} GiB in {report.seconds:.1f}s")
    return info


def _ladder_key(ctx: StageContext) -> str:
    # what worked holds for this recipe value on this card
    device = ctx.options_as(ServeOptions).device
    return f"{ctx.recipe.serve.kt_num_gpu_experts}@{'auto' if device is None else device}"


def _first_rung(ctx: StageContext) -> tuple[int | None, str | None]:
    """Start where the last KV-cache retry came up, instead of reloading minutes for nothing.

    None: the plan's own value (the environment's KT_NUM_GPU_EXPERTS, else the recipe's).
    """
    from dsv4_offload.serving.cann import inherited_env

    if inherited_env().get("KT_NUM_GPU_EXPERTS"):
        return None, None  # an exported value is the user's explicit choice
    start = ctx.recipe.serve.kt_num_gpu_experts
    memo = read_json(ctx.workspace.serve_ladder, {})
    entry = memo.get(_ladder_key(ctx)) if isinstance(memo, dict) else None
    if isinstance(entry, dict) and isinstance(entry.get("worked"), int) \
            and 0 <= entry["worked"] < start:
        return entry["worked"], (f"started at {entry['worked']} resident experts: {start} "
                                 f"failed KV-cache setup on {entry.get('when', '?')}; delete "
                                 f"{ctx.workspace.serve_ladder} to try {start} again")
    return None, None


def _remember_rung(ctx: StageContext, experts: int, attempts: list[dict[str, Any]]) -> None:
    memo = read_json(ctx.workspace.serve_ladder, {})
    memo = memo if isinstance(memo, dict) else {}
    key = _ladder_key(ctx)
    if len(attempts) > 1:
        memo[key] = {"worked": experts, "failed": [a["kt_num_gpu_experts"] for a in attempts[:-1]],
                     "when": now_iso()}
    elif key not in memo:
        return
    atomic_write_json(ctx.workspace.serve_ladder, memo)


def _start_and_wait(ctx: StageContext, plan: ServePlan, log: Path, experts: int, detach: bool
                    ) -> tuple[sv.Readiness, sv.ServerProcess | None]:
    serve = ctx.recipe.serve
    ws = ctx.workspace
    follower = sv.LogFollower(log, 0)
    server: sv.ServerProcess | None = None
    if detach:
        # the key itself never enters the spec: the supervisor reads the file at exec time
        spec = {"argv": plan.argv, "env": plan.env, "log": str(log), "record": str(ws.serve_record),
                "url": plan.url, "stop_timeout_s": serve.stop_timeout_s,
                "kt_num_gpu_experts": experts, "api_key_file": plan.api_key_file,
                # the file's path (not the key) lets `serve status` and `accept` authenticate
                "extra": {"derived": plan.derived, "api_key_file": plan.api_key_file}}
        pid = sv.spawn_detached(spec, ws.serve_spec, ws.serve_supervisor_log)
        exit_code = _detached_exit(ws.serve_record, pid)
        with sv.detached_guard(pid):
            outcome = _wait(ctx, plan, follower, exit_code)
            # ready or not: the server can print (a fatal line, readiness) before its
            # supervisor records it, and a stop that finds no record would leave it running
            sv.await_record(ws.serve_record, pid)
        return outcome, None
    server = sv.ServerProcess(plan.argv, plan.env, log, on_line=ctx.progress.message,
                              api_key_file=plan.api_key_file)
    server.start()
    # one record whoever started the server: the foreground one is recorded too
    sv.record_foreground(ws.serve_record, server, plan.url, experts,
                         {"derived": plan.derived, "api_key_file": plan.api_key_file})
    try:
        outcome = _wait(ctx, plan, follower, server.poll)
    except BaseException:
        server.stop(serve.stop_timeout_s)
        sv.close_foreground(ws.serve_record, server.pid, server.poll())
        raise
    return outcome, server


def _detached_exit(record_path: Path, supervisor_pid: int) -> Any:
    def exit_code() -> int | None:
        record = sv.read_record(record_path)
        if record is not None and record.supervisor_pid == supervisor_pid:
            if record.state in ("exited", "stopped"):
                return record.exit_code if record.exit_code is not None else -1
            if record.server_pid and not record.server_alive():
                return -1
        if not sv.pid_alive(supervisor_pid):
            return -1
        return None

    return exit_code


def _wait(ctx: StageContext, plan: ServePlan, follower: sv.LogFollower, exit_code: Any
          ) -> sv.Readiness:
    serve = ctx.recipe.serve
    from dsv4_offload.acceptance.probes import api_key_headers

    headers = api_key_headers(plan.api_key_file)
    with ctx.task(f"waiting for {plan.url} (up to {serve.readiness_timeout_s:.0f}s)",
                  total=serve.readiness_timeout_s, unit="s") as task:
        return sv.wait_ready(plan.url, serve.health_paths, serve.readiness_timeout_s,
                             follower=follower, exit_code=exit_code,
                             on_wait=lambda s: task.update(completed=s), headers=headers)


def _stop_attempt(ctx: StageContext, server: sv.ServerProcess | None) -> None:
    timeout = ctx.recipe.serve.stop_timeout_s
    if server is not None:
        server.stop(timeout)
        sv.close_foreground(ctx.workspace.serve_record, server.pid, server.poll())
    else:
        sv.stop_recorded(ctx.workspace.serve_record, timeout)


def _ready(ctx: StageContext, plan: ServePlan, log: Path, experts: int,
           attempts: list[dict[str, Any]], server: sv.ServerProcess | None, started_at: float,
           remembered: str | None = None, warmth: dict[str, Any] | None = None) -> StageResult:
    outputs = {"url": plan.url, "log": str(log), "kt_num_gpu_experts": experts,
               "attempts": attempts, "argv": plan.argv, "derived": plan.derived,
               "ready_at": now_iso(), "page_cache": warmth,
               "api_key": bool(plan.api_key_file)}
    problems = [Problem("info", n, check="serve.plan") for n in plan.notes]
    problems += [Problem("warning", w, check="serve.plan") for w in plan.warnings]
    outputs["startup"] = _startup(ctx, log, problems)
    root = server.pid if server is not None else getattr(
        sv.read_record(ctx.workspace.serve_record), "server_pid", None)
    outputs["memory"] = _anon_memory(ctx, plan, log, root, problems)
    if warmth and warmth.get("skipped_reason"):
        problems.append(Problem("warning", f"page cache not warmed: {warmth['skipped_reason']}",
                                fix="free memory (MemAvailable) for the GGUF set: loading "
                                "reads it from disk instead", check="serve.page-cache"))
    # segments older than this start that no process holds: servers killed without SIGINT
    stale = shm.stale_segments(started_at)
    outputs["stale_shm_segments"] = len(stale)
    if stale:
        problems.append(Problem("warning", f"{shm.summary(stale)}, {shm.WHY}", fix=shm.FIX,
                                check="serve.shm"))
    if remembered:
        problems.append(Problem("info", remembered, check="serve.ladder"))
    if len(attempts) > 1:
        first = attempts[0]
        fraction = plan.derived["mem_fraction_static"]
        problems.append(Problem(
            "warning", f"ready with {experts} resident experts and --mem-fraction-static "
            f"{fraction:g} after {first.get('fatal', 'KV-cache')} failed with "
            f"{first['kt_num_gpu_experts']} and {first['mem_fraction_static']:g}",
            fix=f"make it the default: --set serve.kt_num_gpu_experts={experts} --set "
            f"serve.mem_fraction_static={fraction:g}", check="serve.ladder"))
    status = Status.WARN if len(attempts) > 1 else Status.OK
    if server is None:  # detached: the supervisor holds the server
        record = sv.read_record(ctx.workspace.serve_record)
        pid = record.server_pid if record else None
        return StageResult(status, f"server ready at {plan.url} (pid {pid}, {experts} resident "
                           "experts); stop it with `dsv4-offload serve stop`",
                           data=outputs, problems=problems, outputs=outputs, log=str(log))
    ctx.progress.message(f"server ready at {plan.url}; Ctrl-C stops it")
    try:
        code = server.wait()
    except KeyboardInterrupt:
        server.stop(ctx.recipe.serve.stop_timeout_s)
        sv.close_foreground(ctx.workspace.serve_record, server.pid, server.poll())
        raise
    outputs["exit_code"] = code
    if sv.close_foreground(ctx.workspace.serve_record, server.pid, code):
        return StageResult(Status.OK, "server stopped by `dsv4-offload serve stop`",
                           data=outputs, log=str(log), problems=problems)
    if code != 0:
        return StageResult(Status.FAILED, f"server exited with code {code} after being ready",
                           data=outputs, log=str(log), problems=[Problem(
                               "error", "; ".join(list(server.tail)[-3:]) or f"exit {code}",
                               fix=f"read the log: {log}", check="serve.exit")])
    return StageResult(Status.OK, "server ran and exited cleanly", data=outputs, log=str(log),
                       problems=problems)


def _startup(ctx: StageContext, log: Path, problems: list[Problem]) -> dict[str, Any]:
    """HBM left and the KV pools' sizes from the start-up lines, kept in the serve record;
    a declared prompt the SWA pool cannot admit is a warning with the fix."""
    from dsv4_offload.serving.startup_log import longest_prompt_warning, startup_facts

    try:
        facts = startup_facts(log.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return {}
    _into_record(ctx, log, "startup", facts)
    longest = longest_prompt(ctx) or ctx.recipe.serve.longest_prompt_tokens
    warning = longest_prompt_warning(facts, longest)
    if warning:
        problems.append(Problem("warning", warning, check="serve.swa-pool"))
    return facts


def _anon_memory(ctx: StageContext, plan: ServePlan, log: Path, pid: int | None,
                 problems: list[Problem]) -> dict[str, Any]:
    """The server's RssAnon after ready, summed over its process tree (sglang's scheduler
    holds kt-kernel), against the plan's memory model (serving.rules.anon_memory_verdict);
    kept in the serve record, a contradiction a warning with the fix."""
    from dsv4_offload.core.procs import tree_kib
    from dsv4_offload.serving.rules import anon_memory_verdict

    read = tree_kib(pid) if pid else None
    if read is None:
        return {"rss_anon_gib": None, "verdict": f"not read (no /proc/{pid}/status)"}
    figures, warning = anon_memory_verdict(ctx.recipe, int(plan.derived["threadpool_count"]),
                                           *read)
    _into_record(ctx, log, "memory", figures)
    if warning is not None:
        problems.append(Problem("warning", warning[0], fix=warning[1], check="serve.memory"))
    return figures


def _into_record(ctx: StageContext, log: Path, key: str, value: Any) -> None:
    """``value`` under ``extra[key]`` of the serve record of this server (by its log)."""
    record = sv.read_record(ctx.workspace.serve_record)
    if record is not None and record.log == str(log):
        record.extra[key] = value
        sv.write_record(ctx.workspace.serve_record, record)


def _failed(ctx: StageContext, plan: ServePlan, log: Path, outcome: sv.Readiness,
            attempts: list[dict[str, Any]]) -> StageResult:
    tail = [line for line in outcome.tail if line.strip()][-8:]
    if outcome.fatal is not None:
        message = f"{outcome.fatal.cause}: {outcome.fatal_line}"
        fix = outcome.fatal.fix
        check = f"serve.{outcome.fatal.key}"
        if outcome.fatal.retry_fewer_experts and len(attempts) > 1:
            message += f" (tried {', '.join(str(a['kt_num_gpu_experts']) for a in attempts)} " \
                       "resident experts"
            fractions = sorted({a["mem_fraction_static"] for a in attempts}, reverse=True)
            if len(fractions) > 1:
                message += f", --mem-fraction-static {', '.join(f'{f:g}' for f in fractions)}"
            message += ")"
    elif outcome.reason == "timeout":
        message = (f"not ready within {ctx.recipe.serve.readiness_timeout_s:.0f}s "
                   f"({' then '.join(ctx.recipe.serve.health_paths)} never answered 200)")
        fix = ("loading takes 2-3.5 min with a warm page cache; raise "
               "serve.readiness_timeout_s or read the log")
        check = "serve.timeout"
    else:
        message = f"the server exited (code {outcome.exit_code}) before it was ready"
        fix = "read the last lines below and the log"
        check = "serve.exit"
    problems = [Problem("error", message, fix=fix, check=check)]
    problems += [Problem("info", line, check="serve.log-tail") for line in tail]
    data = {"url": plan.url, "log": str(log), "reason": outcome.reason, "attempts": attempts,
            "tail": tail, "argv": plan.argv, "fix": fix}
    return StageResult(Status.FAILED, f"server not ready: {message}", data=data,
                       problems=problems, log=str(log))


def _already_running(ctx: StageContext, record: sv.ServeRecord, facts: Any) -> StageResult:
    plan = make_plan(ctx, record.kt_num_gpu_experts, facts)
    data = {"url": record.url, "pid": record.server_pid, "log": record.log,
            "kt_num_gpu_experts": record.kt_num_gpu_experts}
    if record.argv != plan.argv:
        return StageResult(Status.FAILED, "a server with other flags is already running",
                           data=data, problems=[Problem(
                               "error", f"pid {record.server_pid} serves {record.url} with "
                               "flags that differ from the current recipe",
                               fix="`dsv4-offload serve stop`, then serve again",
                               check="serve.running")])
    outputs = {**data, "argv": record.argv, "derived": plan.derived}
    return StageResult(Status.OK, f"server already running at {record.url} "
                       f"(pid {record.server_pid})", data=data, outputs=outputs, log=record.log)


def server_log(ctx: StageContext) -> Path | None:
    """The current (or last) server log, for `serve logs`."""
    record = sv.read_record(ctx.workspace.serve_record)
    if record is not None and Path(record.log).is_file():
        return Path(record.log)
    logs = sorted(ctx.log_dir.glob("server-*.log"), key=os.path.getmtime)
    return logs[-1] if logs else None
