"""A build stand-in that burns a stated amount of CPU (behave/build: ``burn N [fail]``).

N CPU-seconds in one child process started through core/runner (logged in the stage's log
dir), split over the ``jobs`` option (forked into as many spinning processes of its group);
each spins until its own CPU time reaches its share, so the cost is stated in CPU, not in
wall time. ``fail``: a failed result after the burn.
"""

from __future__ import annotations

import sys
import time

from dsv4_offload.core.results import StageResult, Status
from dsv4_offload.core.runner import run_command
from dsv4_offload.workspace.context import StageContext
from pipestages import behave, failed, note, number

BURN = """
import os, sys, time
def spin(share):
    end = time.process_time() + share
    n = 0
    while time.process_time() < end:
        n += 1
total, jobs = float(sys.argv[1]), max(1, int(sys.argv[2]))
forked = []
for _ in range(jobs - 1):
    pid = os.fork()
    if pid == 0:
        spin(total / jobs)
        os._exit(0)
    forked.append(pid)
spin(total / jobs)
for pid in forked:
    os.waitpid(pid, 0)
print(f"burned {total} CPU-seconds in {jobs} process(es)")
"""


def run(ctx: StageContext) -> StageResult:
    note(ctx, "build")
    words = behave(ctx, "build")
    seconds = number(words, "burn")
    jobs = int(ctx.options.jobs or 1)
    ctx.event("step.started", step="stand-in")
    t0 = time.monotonic()
    if seconds > 0:
        run_command([sys.executable, "-c", BURN, str(seconds), str(jobs)],
                    log=ctx.log_dir / "stand-in.log")
    took = round(time.monotonic() - t0, 3)
    ctx.event("step.done", step="stand-in", status="failed" if "fail" in words else "ok",
              seconds=took)
    if "fail" in words:
        return failed("build")
    return StageResult(Status.OK, f"build stand-in: {seconds:g} CPU-seconds in {took:.1f} s "
                       f"({jobs} job(s))", outputs={"stage": "build", "cpu_seconds": seconds})
