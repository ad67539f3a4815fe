"""Instrumented stand-ins for the stage modules, for testing the pipeline itself.

Selected with DSV4_STAGE_PACKAGE=fakestages. Each stage appends its name to
<workspace>/ran.log and obeys <workspace>/behave/<stage>: 'fail' returns a failed result,
'raise' raises an InputError, 'sleep' sleeps until killed, 'interrupt' raises Ctrl-C,
'children' runs a child through the runner that starts a grandchild in its group, writes
both pids to <workspace>/<stage>.pids and sleeps (as a build step's shell and compiler).
With <workspace>/record-env (names), it writes the values it saw to <workspace>/env-<stage>.json.

For the pipelined run (tests/test_schedule.py): 'sleep N' works N seconds; 'await OTHER'
writes <workspace>/<stage>.started and waits until <workspace>/<OTHER>.started exists too (so
the two ran at once; it fails after 30 s if they never do, as a serial run would make it);
'until OTHER STATUS' waits until OTHER's record in the state file says STATUS; 'same-record'
writes as its done record <workspace>/last-record.json (two runs in one second write the same);
'rows NAME...' fails with those check rows, declared as core/preflight declares them (doctor's).
A download reports its bytes as `download mxfp4` progress, a convert two layers converted and
one verified, a build its step (events; nothing when run alone).
"""

from __future__ import annotations

import json
import os
import time

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.workspace.context import StageContext


def make(name: str):  # type: ignore[no-untyped-def]
    def run(ctx: StageContext) -> StageResult:
        root = ctx.workspace.root
        behave_file = root / "behave" / name
        behave = behave_file.read_text().strip() if behave_file.exists() else "ok"
        inside = os.environ.get("DSV4_IN_CONTAINER")
        with open(root / "ran.log", "a") as fh:
            fh.write(f"{name}" + (f" (in container {inside})" if inside else "") + "\n")
        wanted = root / "record-env"
        if wanted.exists():  # the variables this stage saw, by name (None when unset)
            seen = {k: os.environ.get(k) for k in wanted.read_text().split()}
            (root / f"env-{name}.json").write_text(json.dumps(seen))
        _report(ctx, name)
        words = behave.split()
        if words[:1] == ["await"]:
            (root / f"{name}.started").write_text("x")
            if not _wait(lambda: (root / f"{words[1]}.started").exists()):
                return StageResult(Status.FAILED, f"{name} never ran beside {words[1]}")
        if words[:1] == ["until"]:
            def said() -> bool:
                try:
                    state = json.loads((root / ".dsv4" / "state.json").read_text())
                except (OSError, ValueError):
                    return False
                return state["stages"].get(words[1], {}).get("status") == words[2]
            if not _wait(said):
                return StageResult(Status.FAILED, f"{words[1]} never became {words[2]}")
        if words[:1] == ["sleep"] and len(words) == 2:  # 'sleep N': N seconds of work
            time.sleep(float(words[1]))
        if behave == "sleep":
            (root / f"{name}.started").write_text("x")
            time.sleep(600)
        if behave == "children":
            import sys

            from dsv4_offload.core.runner import run_command

            pids = root / f"{name}.pids"
            # both carry the pids file's path in their command line (tests find them by it)
            script = ("import os, subprocess, sys, time\n"
                      "g = subprocess.Popen([sys.executable, '-c',"
                      " 'import time; time.sleep(600)', sys.argv[1]])\n"
                      "open(sys.argv[1], 'w').write(f'{os.getpid()} {g.pid}\\n')\n"
                      "time.sleep(600)\n")
            run_command([sys.executable, "-c", script, str(pids)],
                        log=ctx.log_dir / "children.log")
        if behave == "same-record":  # its done record is the one it wrote last time, as a
            _same_record(ctx, name)     # rerun within the same second writes (stamps, seconds)
        if behave == "interrupt":
            raise KeyboardInterrupt
        if behave == "raise":
            raise InputError(f"{name}: bad input; fix it")
        if behave == "fail":
            return StageResult(Status.FAILED, f"{name} failed on purpose",
                               problems=[Problem("error", "told to fail", "remove behave file")])
        if words[:1] == ["rows"]:  # 'rows NAME...': a preflight whose declared rows fail
            from dsv4_offload.core.preflight import annotate

            checks = [annotate({"name": row, "status": "fail", "observed": "told to fail",
                                "required": "", "fix": "remove behave file"})
                      for row in words[1:]]
            return StageResult(Status.FAILED, f"{len(checks)} check(s) failed",
                               data={"checks": checks})
        return StageResult(Status.OK, f"{name} ok", outputs={"stage": name,
                           "options": sorted(k for k, v in ctx.options.items() if v)})

    return run


def _same_record(ctx: StageContext, name: str) -> None:
    """The done record this process writes is <workspace>/last-record.json (the test saved
    it from the last run): what two runs write when their stamps and seconds coincide."""
    from dsv4_offload.workspace.records import StageRecord, StageState
    from dsv4_offload.workspace.store import Workspace

    last = StageRecord.from_raw(json.loads((ctx.workspace.root / "last-record.json").read_text()))
    write = Workspace.write_stage_record

    def as_last(self, stage, record):  # type: ignore[no-untyped-def]
        done = getattr(record, "status", None) == StageState.DONE
        write(self, stage, last if stage == name and done else record)

    Workspace.write_stage_record = as_last  # type: ignore[method-assign]


def _wait(check, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _report(ctx: StageContext, name: str) -> None:
    """Events as the real stages send them (core/events; no-ops outside a pipelined run)."""
    if name == "download":
        with ctx.task("download mxfp4", total=2048, unit="B") as task:
            task.update(completed=2048)
        ctx.event("file.verified", set="mxfp4", path="model-00001-of-00046.safetensors",
                  bytes=2048)
    elif name == "convert":
        for layer in (0, 1):
            ctx.event("layer.converted", layer=layer)
        ctx.event("layer.verified", layer=0)
    elif name == "build":
        ctx.event("step.started", step="kt-kernel")
