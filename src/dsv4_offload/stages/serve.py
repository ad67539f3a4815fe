"""Stage `serve`: derive the launch line from recipe and host, start it supervised, wait ready.

Options: ``detach`` (leave a supervisor behind and return once ready; what `run` does),
``device`` (NPU index), ``longest_prompt`` (tokens), ``host_facts`` (a HostFacts, for
callers that probed already). In the foreground the stage returns when the server exits.
On a KV-cache or HBM failure it retries down ``serve.gpu_experts_ladder``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from dsv4_offload import supervisor as sv
from dsv4_offload.errors import Dsv4Error
from dsv4_offload.serveplan import (
    ServePlan,
    build_plan,
    cann_scripts,
    capture_script_env,
    inherited_env,
)
from dsv4_offload.stage import Problem, StageContext, StageResult, Status
from dsv4_offload.workspace import atomic_write_json, now_iso, read_json


def host_facts(ctx: StageContext) -> Any:
    facts = ctx.options.get("host_facts")
    if facts is not None:
        return facts
    from dsv4_offload.host import probe_host

    return probe_host(ctx.workspace.root)


def make_plan(ctx: StageContext, gpu_experts: int | None = None, facts: Any = None,
              strict: bool = True) -> ServePlan:
    """The plan for this context: host facts, the CANN scripts' env, then the pure rules.

    Not ``strict`` (for --print): a missing CANN toolkit becomes a note, not an error.
    """
    facts = facts if facts is not None else host_facts(ctx)
    serve = ctx.recipe.serve
    base = inherited_env()
    scripts = cann_scripts(serve, facts.cann_toolkit)
    problem = None
    if scripts and not scripts[0].is_file():
        problem = (f"{scripts[0]}: CANN set_env script not found; install the CANN toolkit "
                   "or set ASCEND_TOOLKIT_HOME (see `dsv4-offload doctor`)")
    elif not scripts:
        problem = ("no CANN toolkit found (ASCEND_TOOLKIT_HOME unset, no "
                   "ascend_toolkit_install.info); install CANN or set ASCEND_TOOLKIT_HOME")
    if problem and strict and serve.command is None:
        raise Dsv4Error(problem)
    script_env = capture_script_env(scripts, base, cache_dir=ctx.workspace.run_dir)
    if serve.kml_lib_dir and Path(serve.kml_lib_dir).is_dir():
        # the launcher puts Kunpeng's math library first when the host has it
        rest = script_env.get("LD_LIBRARY_PATH", base.get("LD_LIBRARY_PATH", ""))
        script_env["LD_LIBRARY_PATH"] = ":".join(p for p in (serve.kml_lib_dir, rest) if p)
    plan = build_plan(ctx.recipe, facts, ctx.workspace, base_env=base, script_env=script_env,
                      device=ctx.option("device"), longest_prompt=ctx.option("longest_prompt"),
                      gpu_experts=gpu_experts, require_layers=strict)
    if problem:
        plan.notes.append(problem.split(";")[0] + ": its environment is not included")
    return plan


def ladder(start: int, rungs: list[int]) -> list[int]:
    """The expert counts to try: the recipe's, then each lower rung of the ladder."""
    return [start] + [r for r in sorted(set(rungs), reverse=True) if r < start]


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
    detach = bool(ctx.option("detach", False))
    ws = ctx.workspace
    ws.ensure()
    ws.run_dir.mkdir(parents=True, exist_ok=True)
    facts = host_facts(ctx)
    existing = sv.read_record(ws.serve_record)
    if sv.record_alive(existing):
        assert existing is not None
        return _already_running(ctx, existing, facts)

    attempts: list[dict[str, Any]] = []
    start, remembered = _first_rung(ctx)
    rungs = ladder(start, ctx.recipe.serve.gpu_experts_ladder)
    for i, experts in enumerate(rungs):
        plan = make_plan(ctx, experts, facts)
        log = ctx.log_dir / f"server-{time.strftime('%Y%m%d-%H%M%S')}-{experts}.log"
        outcome, server = _start_and_wait(ctx, plan, log, experts, detach)
        attempts.append({"kt_num_gpu_experts": experts, "outcome": outcome.reason,
                         "seconds": round(outcome.seconds, 1), "log": str(log),
                         **({"fatal": outcome.fatal.key} if outcome.fatal else {})})
        if outcome.ready:
            _remember_rung(ctx, experts, attempts)
            return _ready(ctx, plan, log, experts, attempts, detach, server, remembered)
        _stop_attempt(ctx, server)
        fatal = outcome.fatal
        if fatal is not None and fatal.retry_fewer_experts and i + 1 < len(rungs):
            ctx.progress.message(f"{fatal.cause}; retrying with {rungs[i + 1]} resident experts")
            continue
        return _failed(ctx, plan, log, outcome, attempts)
    raise AssertionError("unreachable: the ladder has at least one rung")


def _ladder_key(ctx: StageContext) -> str:
    # what worked holds for this recipe value on this card
    return f"{ctx.recipe.serve.kt_num_gpu_experts}@{ctx.option('device', 'auto')}"


def _first_rung(ctx: StageContext) -> tuple[int, str | None]:
    """Start where the last KV-cache retry came up, instead of reloading minutes for nothing."""
    start = ctx.recipe.serve.kt_num_gpu_experts
    memo = read_json(ctx.workspace.serve_ladder, {})
    entry = memo.get(_ladder_key(ctx)) if isinstance(memo, dict) else None
    if isinstance(entry, dict) and isinstance(entry.get("worked"), int) \
            and 0 <= entry["worked"] < start:
        return entry["worked"], (f"started at {entry['worked']} resident experts: {start} "
                                 f"failed KV-cache setup on {entry.get('when', '?')}; delete "
                                 f"{ctx.workspace.serve_ladder} to try {start} again")
    return start, None


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
        spec = {"argv": plan.argv, "env": plan.env, "log": str(log), "record": str(ws.serve_record),
                "url": plan.url, "stop_timeout_s": serve.stop_timeout_s,
                "kt_num_gpu_experts": experts, "extra": {"derived": plan.derived}}
        pid = sv.spawn_detached(spec, ws.serve_spec, ws.serve_supervisor_log)
        exit_code = _detached_exit(ws.serve_record, pid)
        with sv.detached_guard(pid):
            outcome = _wait(ctx, plan, follower, exit_code)
        return outcome, None
    server = sv.ServerProcess(plan.argv, plan.env, log, on_line=ctx.progress.message)
    server.start()
    try:
        outcome = _wait(ctx, plan, follower, server.poll)
    except BaseException:
        server.stop(serve.stop_timeout_s)
        raise
    return outcome, server


def _detached_exit(record_path: Path, supervisor_pid: int) -> Any:
    def exit_code() -> int | None:
        record = sv.read_record(record_path)
        if record is not None and record.supervisor_pid == supervisor_pid:
            if record.state in ("exited", "stopped"):
                return record.exit_code if record.exit_code is not None else -1
            if record.server_pid and not sv.pid_alive(record.server_pid):
                return -1
        if not sv.pid_alive(supervisor_pid):
            return -1
        return None

    return exit_code


def _wait(ctx: StageContext, plan: ServePlan, follower: sv.LogFollower, exit_code: Any
          ) -> sv.Readiness:
    serve = ctx.recipe.serve
    with ctx.task(f"waiting for {plan.url} (up to {serve.readiness_timeout_s:.0f}s)",
                  total=serve.readiness_timeout_s, unit="s") as task:
        return sv.wait_ready(plan.url, serve.health_paths, serve.readiness_timeout_s,
                             follower=follower, exit_code=exit_code,
                             on_wait=lambda s: task.update(completed=s))


def _stop_attempt(ctx: StageContext, server: sv.ServerProcess | None) -> None:
    timeout = ctx.recipe.serve.stop_timeout_s
    if server is not None:
        server.stop(timeout)
    else:
        sv.stop_recorded(ctx.workspace.serve_record, timeout)


def _ready(ctx: StageContext, plan: ServePlan, log: Path, experts: int,
           attempts: list[dict[str, Any]], detach: bool, server: sv.ServerProcess | None,
           remembered: str | None = None) -> StageResult:
    outputs = {"url": plan.url, "log": str(log), "kt_num_gpu_experts": experts,
               "attempts": attempts, "argv": plan.argv, "derived": plan.derived,
               "ready_at": now_iso()}
    problems = [Problem("info", n, check="serve.plan") for n in plan.notes]
    if remembered:
        problems.append(Problem("info", remembered, check="serve.ladder"))
    if len(attempts) > 1:
        problems.append(Problem(
            "warning", f"ready with {experts} resident experts after KV-cache setup failed with "
            f"{attempts[0]['kt_num_gpu_experts']}",
            fix=f"make it the default: --set serve.kt_num_gpu_experts={experts}",
            check="serve.ladder"))
    status = Status.WARN if len(attempts) > 1 else Status.OK
    if detach:
        record = sv.read_record(ctx.workspace.serve_record)
        pid = record.server_pid if record else None
        return StageResult(status, f"server ready at {plan.url} (pid {pid}, {experts} resident "
                           "experts); stop it with `dsv4-offload serve stop`",
                           data=outputs, problems=problems, outputs=outputs, log=str(log))
    assert server is not None
    ctx.progress.message(f"server ready at {plan.url}; Ctrl-C stops it")
    try:
        code = server.wait()
    except KeyboardInterrupt:
        server.stop(ctx.recipe.serve.stop_timeout_s)
        raise
    outputs["exit_code"] = code
    if code != 0:
        return StageResult(Status.FAILED, f"server exited with code {code} after being ready",
                           data=outputs, log=str(log), problems=[Problem(
                               "error", "; ".join(list(server.tail)[-3:]) or f"exit {code}",
                               fix=f"read the log: {log}", check="serve.exit")])
    return StageResult(Status.OK, "server ran and exited cleanly", data=outputs, log=str(log),
                       problems=problems)


def _failed(ctx: StageContext, plan: ServePlan, log: Path, outcome: sv.Readiness,
            attempts: list[dict[str, Any]]) -> StageResult:
    tail = [line for line in outcome.tail if line.strip()][-8:]
    if outcome.fatal is not None:
        message = f"{outcome.fatal.cause}: {outcome.fatal_line}"
        fix = outcome.fatal.fix
        check = f"serve.{outcome.fatal.key}"
        if outcome.fatal.retry_fewer_experts and len(attempts) > 1:
            message += f" (tried {', '.join(str(a['kt_num_gpu_experts']) for a in attempts)} " \
                       "resident experts)"
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
