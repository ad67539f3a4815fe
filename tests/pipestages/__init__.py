"""Stage modules for whole-pipeline runs: the real weights stages, stand-ins for the rest.

Selected with DSV4_STAGE_PACKAGE=pipestages (tests/ on PYTHONPATH), as fakestages is; used by
tests/test_run_e2e.py and bench/bench_time_to_ready.py (issue 23) against the stand-in hub.

- ``download``, ``convert``, ``verify-gguf`` are the REAL stages: each module here re-exports
  the real module's ``run``, ``fingerprint_inputs`` and ``FOLLOWS`` (convert), the run
  wrapped only to note the stage's name in <workspace>/ran.log first.
- ``build`` is a stand-in that burns a stated amount of CPU: <workspace>/behave/build says
  ``burn N`` (N CPU-seconds, default 0) and optionally ``fail`` after it. The burn is one
  child process started through core/runner (``run_command``, logged in the stage's log
  dir) that spins, split over the stage's ``jobs`` option in as many processes, until each
  has used its share of CPU time (its own ``process_time``), so the cost is the same however
  busy the machine is; it reports a ``step.started``/``step.done`` pair for the step
  ``stand-in``. ``fail`` then returns a failed result (the burn has happened).
- ``serve`` is a stand-in server with a stated start time: behave/serve says ``start N``
  (seconds, default 0). It first checks that what the server would load is there (both
  weight sets' records with every listed file verified, one GGUF file per layer of the
  MXFP4 config, each with its digest in verify-gguf's manifest), sleeps N seconds (the
  load), then writes <workspace>/serve.ready (``time.time()`` at readiness) and returns.
- ``doctor``, ``fetch``, ``patch``, ``selftest``, ``accept`` note their name and return ok
  (behave ``fail``: a failed result).

Every stage appends its name to <workspace>/ran.log when it starts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.workspace.context import StageContext

StageRun = Callable[[StageContext], StageResult]


def note(ctx: StageContext, name: str) -> None:
    with open(ctx.workspace.root / "ran.log", "a") as fh:
        fh.write(f"{name}\n")


def behave(ctx: StageContext, name: str) -> list[str]:
    path = ctx.workspace.root / "behave" / name
    return path.read_text().split() if path.exists() else []


def number(words: list[str], key: str, default: float = 0.0) -> float:
    """The number after ``key`` in the behave words (``burn 3`` -> 3.0)."""
    if key in words and words.index(key) + 1 < len(words):
        return float(words[words.index(key) + 1])
    return default


def noted(name: str, real: StageRun) -> StageRun:
    """The real stage's run, noting its name in ran.log first."""
    def run(ctx: StageContext) -> StageResult:
        note(ctx, name)
        return real(ctx)

    run.__doc__ = real.__doc__
    return run


def failed(name: str) -> StageResult:
    return StageResult(Status.FAILED, f"{name} failed on purpose",
                       problems=[Problem("error", "told to fail", f"remove behave/{name}")])


def standin(name: str) -> StageRun:
    """A stage that notes itself and returns ok (or fails when told)."""
    def run(ctx: StageContext) -> StageResult:
        note(ctx, name)
        if "fail" in behave(ctx, name):
            return failed(name)
        return StageResult(Status.OK, f"{name} stand-in ok", outputs={"stage": name})

    return run


def ready_file(root: Path) -> Path:
    return root / "serve.ready"
