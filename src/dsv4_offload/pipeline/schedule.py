"""The pipelined `run`: the stage graph, each stage in a process of its own (issue 23).

A stage starts as soon as every stage it needs (its registry row's ``needs`` and ``after``,
within --from/--to) is over and did not fail; a need listed in its ``streams`` only has to
be running in this run, and the stage then gets the option ``follow=True`` (when its module
says it can follow: ``FOLLOWS = True``). Each stage runs as a child of this process:
this same tool, on the same workspace, recipe and --set items, running `run --serial --from
S --to S --force S` under the lock this process holds and lends it, with the events file
(core/events) and its options (mirrors, device, follow, jobs) in its environment. The child
writes the stage's record (pipeline.run_stage); this process judges the outcome from its
exit code and that record, and tails the events file for the live view and `run --json`.

A failed stage blocks the stages that need it (transitively); the others go on to the end.
Ctrl-C, SIGTERM or SIGHUP stop every child (the same signal to each group, SIGKILL after a
grace), and each records itself interrupted; a SIGKILL of this process takes the children
with it (their parent-death signal), and the next run sweeps what they had started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_offload import pipeline as P
from dsv4_offload.core import childrun, events, preflight
from dsv4_offload.core.errors import Dsv4Error, ExitCode
from dsv4_offload.core.options import StageOptions
from dsv4_offload.core.registry import Cpu, StageSpec
from dsv4_offload.core.results import StageResult, Status
from dsv4_offload.core.runner import KILL_GRACE_S, Child, received_signal, start, stop_children
from dsv4_offload.core.states import StageState
from dsv4_offload.weights import diskplan
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.records import StageRecord

POLL_S = 0.1
# a stage process stops its own children first (TERM, then KILL after KILL_GRACE_S)
CHILD_GRACE_S = 2 * KILL_GRACE_S + 1
OVER_OK = (StageState.DONE, StageState.SKIPPED, StageState.NOT_APPLICABLE)
STOPPED = (StageState.FAILED, StageState.BLOCKED, StageState.INTERRUPTED)
ERROR_CODES = (ExitCode.FAILED, ExitCode.INVALID_INPUT, ExitCode.NOT_IMPLEMENTED)

# --- the graph -----------------------------------------------------------------------------


def can_follow(stage: StageSpec) -> bool:
    """Whether the stage's module follows its streams (``FOLLOWS = True``)."""
    module = P.load_stage_module(stage)
    return bool(getattr(module, "FOLLOWS", False)) if module is not None else False


@dataclass
class Slot:
    """One stage of the run: what it waits for and how it went."""

    spec: StageSpec
    deps: tuple[str, ...]  # over (and not failed) before it starts
    follows: tuple[str, ...]  # running (or over) before it starts, followed meanwhile
    state: StageState = StageState.WAITING  # then running, done, skipped, n/a, failed,
    # blocked or interrupted
    reason: str = ""
    root: str = ""  # blocked: the failed stage behind it
    child: Child | None = None
    options: StageOptions = field(default_factory=StageOptions)  # those it was started with
    t0: float | None = None
    seconds: float | None = None
    exit_code: int | None = None
    result: StageResult | None = None
    error: str = ""
    cli_error: str = ""  # the child's own one-line error (what serial `run` prints on stderr)
    log: str | None = None
    final_seen: bool = False
    announced: bool = False  # its process said stage.started: its record says running
    before: StageRecord | None = None  # its record when it was started

    @property
    def name(self) -> str:
        return self.spec.name


def graph(stages: tuple[StageSpec, ...]) -> dict[str, Slot]:
    names = {s.name for s in stages}
    out = {}
    for s in stages:
        follows = tuple(n for n in s.streams if n in names and can_follow(s))
        deps = tuple(dict.fromkeys(n for n in (*s.needs, *s.after)
                                   if n in names and n not in follows))
        out[s.name] = Slot(s, deps, follows)
    return out


def _before(slots: dict[str, Slot], name: str, memo: dict[str, set[str]]) -> set[str]:
    """The stages that are over before ``name`` starts (a followed stage ends before its
    follower does, so before the follower's dependents start)."""
    if name not in memo:
        s = slots[name]
        found: set[str] = set()
        for d in s.deps:
            found |= {d, *_before(slots, d, memo)}
            found |= {f for f in slots[d].follows} | {
                x for f in slots[d].follows for x in _before(slots, f, memo)}
        for f in s.follows:
            found |= _before(slots, f, memo)
        memo[name] = found
    return memo[name]


# --- the budget and the plan ---------------------------------------------------------------


@dataclass
class Budget:
    cores: int
    build_jobs: int
    convert_beside_build: int
    convert_alone: int | None  # None: convert's own default

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def budget(ctx: StageContext) -> Budget:
    p = ctx.recipe.pipeline
    cores = p.cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                        else os.cpu_count() or 1)
    build = p.build_jobs or max(1, cores - p.convert_jobs_beside_build)
    return Budget(cores, build, p.convert_jobs_beside_build, p.convert_jobs or None)


def jobs_for(stage: StageSpec, cpu: Budget, compile_pending: bool) -> dict[str, Any]:
    """The `jobs` option of a stage, by its CPU class: the compile budget, or the budget
    that yields (fewer jobs while a compiling stage of this run is still to finish)."""
    if stage.cpu is Cpu.COMPILE:
        return {"jobs": cpu.build_jobs}
    if stage.cpu is Cpu.YIELDS:
        jobs = cpu.convert_beside_build if compile_pending else cpu.convert_alone
        return {"jobs": jobs} if jobs else {}
    return {}


@dataclass
class OverlapItem:
    stage: str
    action: str
    reason: str
    steps: list[str]
    waits_for: list[str]
    follows: list[str]
    beside: list[str]
    options: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def overlapped_plan(ctx: StageContext, start: str | None, stop: str | None,
                    force: tuple[str, ...]) -> tuple[list[OverlapItem], Budget]:
    """The plan (run/skip and why, as `--serial` plans it) with, for each stage to run,
    what it waits for, what it follows and what may run beside it, and its jobs."""
    items = P.plan(ctx, start, stop, force)
    slots = graph(P.stage_range(start, stop, force))
    runs = {i.stage for i in items if i.action == "run"}
    memo: dict[str, set[str]] = {}
    cpu = budget(ctx)
    out = []
    for item in items:
        s = slots[item.stage]
        if item.action != "run":
            out.append(OverlapItem(item.stage, item.action, item.reason, item.steps, [], [],
                                   [], {}))
            continue
        mine = _before(slots, item.stage, memo)
        beside = [o for o in runs if o != item.stage and o not in mine and o not in s.follows
                  and item.stage not in _before(slots, o, memo)
                  and item.stage not in slots[o].follows]
        follows = [f for f in s.follows if f in runs]
        compiling = any(slots[o].spec.cpu is Cpu.COMPILE and o not in mine for o in runs)
        options = jobs_for(s.spec, cpu, compiling)
        if follows:
            options["follow"] = True
        P.stage_options(item.stage, given=options)  # a name the stage does not take: said now
        out.append(OverlapItem(item.stage, "run", item.reason, item.steps,
                               [d for d in s.deps if d in runs], follows,
                               [o for o in slots if o in beside], options))
    return out, cpu


def disk_needs(ctx: StageContext, items: list[OverlapItem]) -> list[diskplan.FsNeed]:
    """The peak disk of the plan: the disk sets of the stages it runs (their registry rows),
    what is on disk already taken off, per filesystem."""
    sets = tuple(d for i in items if i.action == "run" for d in P.spec(i.stage).disk_sets)
    if not sets:
        return []
    return diskplan.by_filesystem(diskplan.set_needs(ctx.recipe, ctx.workspace, sets))


# --- running -------------------------------------------------------------------------------


@dataclass
class Outcome:
    slots: list[Slot]
    exit_code: int
    interrupted: str | None
    seconds: float

    @property
    def failed(self) -> list[Slot]:
        return [s for s in self.slots if s.state.stopped]

    def blocked_by(self, root: str) -> list[Slot]:
        return [s for s in self.slots if s.state == StageState.BLOCKED and s.root == root]

    def statuses(self) -> dict[str, StageState]:
        return {s.name: s.state for s in self.slots}

    def branches(self) -> list[dict[str, Any]]:
        """Each branch that stopped: the stage, why, its log, and what it blocked."""
        return [{"stage": s.name, "state": s.state, "error": s.error, "log": s.log,
                 "exit_code": s.exit_code,
                 "blocked": [b.name for b in self.blocked_by(s.name)]} for s in self.failed]


class Scheduler:
    """One pipelined run; ``on_event`` sees every event of the run, in file order."""

    def __init__(self, ctx: StageContext, start: str | None = None, stop: str | None = None,
                 force: tuple[str, ...] = (),
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 verbose: bool = False,
                 on_finish: Callable[[Slot], None] | None = None) -> None:
        self.ctx = ctx
        self.ws = ctx.workspace
        self.start, self.stop, self.force = start, stop, force
        stages = P.stage_range(start, stop, force)
        self.slots = graph(stages)
        self.order = [s.name for s in stages]
        self.on_event = on_event
        self.on_finish = on_finish  # each stage that ran, once it ended: its result is final
        self.verbose = verbose
        self.path = self.ws.events_file
        self.offset = 0
        self.token = ""
        self.cpu = budget(ctx)

    # --- the run ---
    def run(self, check_disk: bool = True) -> Outcome:
        """Plan, check the disk, run the graph; the caller holds the workspace lock."""
        t0 = time.monotonic()
        items, _ = overlapped_plan(self.ctx, self.start, self.stop, self.force)
        short = diskplan.shortfall(disk_needs(self.ctx, items)) if check_disk else None
        if short:
            raise Dsv4Error(short)  # before the first byte
        self._new_events_file()
        P.sweep_leftovers(self.ws)
        self._emit("run.started", mode="pipelined", cpu=self.cpu.as_dict(),
                   plan={i.stage: i.action for i in items})
        interrupted = None
        with self.ws.lend_lock() as token:
            self.token = token
            try:
                self._loop()
            except KeyboardInterrupt as exc:
                interrupted = self._stop_all(getattr(exc, "signum", None) or received_signal())
            except BaseException:
                # an error of the scheduler itself (a state file gone bad meanwhile): no stage
                # runs on without it; the error is what the command reports
                with contextlib.suppress(Exception):
                    self._stop_all(signal.SIGTERM)
                raise
        self._drain()
        outcome = Outcome([self.slots[n] for n in self.order], 0, interrupted,
                          round(time.monotonic() - t0, 3))
        outcome.exit_code = _exit_code(outcome)
        self._emit("run.finished", exit=outcome.exit_code, seconds=outcome.seconds,
                   failed=outcome.branches(), stages=outcome.statuses(),
                   **({"signal": interrupted} if interrupted else {}))
        self._drain()
        return outcome

    def _loop(self) -> None:
        while True:
            self._start_ready()
            running = [s for s in self.slots.values() if s.state == StageState.RUNNING]
            if not running:
                break
            ended = [(s, s.child) for s in running
                     if s.child is not None and s.child.proc.poll() is not None]
            self._drain()
            for s, child in ended:
                self._finish(s, child)
            if not ended:
                time.sleep(POLL_S)
        for s in self.slots.values():  # cannot happen: every wait ends in a start or a block
            if s.state == StageState.WAITING:
                s.state, s.reason = StageState.BLOCKED, "never became ready"

    def _start_ready(self) -> None:
        changed = True
        while changed:
            changed = False
            for name in self.order:
                s = self.slots[name]
                if s.state != StageState.WAITING:
                    continue
                bad = next((d for d in (*s.deps, *s.follows)
                            if self.slots[d].state in STOPPED and not self._passes(d, s)), None)
                rows = self._guarding(s) if bad is None else None
                if bad is not None:
                    self._block(s, bad)
                elif rows is not None:
                    self._block(s, rows[0], rows[1])
                elif all(self.slots[d].state in OVER_OK or self._passes(d, s)
                         for d in s.deps) and all(
                        self._followable(self.slots[d]) for d in s.follows):
                    self._begin(s)
                else:
                    continue
                changed = True

    def _feeds(self, name: str) -> set[str]:
        """``name`` and every stage of this run that waits for it, directly or not."""
        found, todo = {name}, [name]
        while todo:
            here = todo.pop()
            for o in self.slots.values():
                if o.name not in found and here in (*o.deps, *o.follows):
                    found.add(o.name)
                    todo.append(o.name)
        return found

    def _rows_against(self, p: Slot, s: Slot) -> list[str] | None:
        """The failed rows of preflight ``p`` that guard ``s`` or a stage it feeds; None when
        its rows are not declared (every failure of it stops everything after it)."""
        if not p.spec.preflight or p.state != StageState.FAILED or p.result is None:
            return None
        fed = self._feeds(s.name)
        found = [preflight.guarded(p.result.data, f) for f in sorted(fed)]
        if any(f is None for f in found):
            return None
        return sorted({row for rows in found for row in rows or ()})

    def _passes(self, d: str, s: Slot) -> bool:
        """A failed preflight ``d`` whose failed rows guard neither ``s`` nor what it feeds."""
        return self._rows_against(self.slots[d], s) == []

    def _guarding(self, s: Slot) -> tuple[str, str] | None:
        """(the preflight, why) when a failed row of a preflight of this run guards ``s`` or
        what it feeds, though ``s`` does not wait for it directly."""
        for p in self.slots.values():
            rows = self._rows_against(p, s)
            if rows and p.name not in (*s.deps, *s.follows):
                return p.name, f"{p.name}'s {', '.join(rows)} failed"
        return None

    @staticmethod
    def _followable(s: Slot) -> bool:
        """Over, or running with its record written (the follower waits for that record to
        end before it records its own: pipeline.run_stage)."""
        return s.state in OVER_OK or (s.state == StageState.RUNNING and s.announced)

    def _block(self, s: Slot, bad: str, why: str = "") -> None:
        b = self.slots[bad]
        how = "needs" if bad in s.spec.needs else "comes after"
        rows = self._rows_against(b, s)
        if why or rows:  # a preflight's rows: which of them stop this stage
            s.root = bad
            s.reason = why or f"{how} {bad}, whose {', '.join(rows or ())} failed"
        elif b.state == StageState.BLOCKED:
            s.root = b.root
            s.reason = f"{how} {bad}, which is blocked ({b.root} {self.slots[b.root].state})"
        else:
            s.root = bad
            went = "failed" if b.state == StageState.FAILED else "was interrupted"
            s.reason = f"{how} {bad}, which {went}"
        s.state = StageState.BLOCKED
        self._emit("stage.blocked", stage=s.name, reason=s.reason)

    def _begin(self, s: Slot) -> None:
        why_not = P.not_applicable_reason(self.ctx, s.name)
        if why_not:
            s.state, s.reason = StageState.NOT_APPLICABLE, why_not
            self._emit("stage.skipped", stage=s.name, reason=why_not)
            return
        try:
            # planned at its turn, as --serial does: what ran before changes its fingerprint
            item = P.plan(self.ctx, s.name, s.name, self.force)[0]
        except Dsv4Error as exc:
            s.state, s.error, s.exit_code = StageState.FAILED, exc.one_line(), int(exc.exit_code)
            s.cli_error = s.error
            self._emit("stage.failed", stage=s.name, error=s.error, log=None)
            self._ended(s)
            return
        if item.action == "skip":
            s.state, s.reason = StageState.SKIPPED, item.reason
            self._emit("stage.skipped", stage=s.name, reason=item.reason)
            return
        compiling = any(o.spec.cpu is Cpu.COMPILE
                        and o.state in (StageState.WAITING, StageState.RUNNING)
                        for o in self.slots.values())
        added = jobs_for(s.spec, self.cpu, compiling)
        if any(self.slots[f].state == StageState.RUNNING for f in s.follows):
            added["follow"] = True
        # `run`'s own (mirrors, device) where the stage takes them, and these; checked here
        s.options = P.stage_options(s.name, self.ctx.options, added)
        s.before = self.ws.state().record(s.name)
        s.reason = item.reason
        out, err = self._stdio(s.name)
        with out, err:
            s.child = start(self._argv(s.name), env=self._env(s.options), stdout=out,
                            stderr=err)
        s.state, s.t0 = StageState.RUNNING, time.monotonic()

    def _argv(self, name: str) -> list[str]:
        recipe = self.ctx.recipe
        file = ["--recipe", str(recipe.file)] if recipe.file is not None else []
        return [*childrun.tool_argv(sys.executable, self.ws.root, file, list(recipe.overrides),
                                    verbose=self.verbose), *childrun.stage_argv(name)]

    def _env(self, options: StageOptions) -> dict[str, str]:
        return childrun.stage_env(os.environ, self.token, options.to_wire(),
                                  events_file=self.path, scheduler_pid=os.getpid())

    def _stdio(self, name: str) -> tuple[Any, Any]:
        """The child's stdout (its one JSON document) and stderr, new for this run."""
        base = self.path.parent
        return (_private(base / f"{name}.out"), _private(base / f"{name}.err"))

    def _finish(self, s: Slot, child: Child) -> None:
        code = child.proc.returncode
        s.exit_code = code
        s.seconds = round(time.monotonic() - (s.t0 or time.monotonic()), 3)
        report = childrun.read_report(_text(self.path.parent / f"{s.name}.out"), s.name)
        if report.result is not None:
            s.result = report.result
        if report.error:
            s.cli_error = report.error
        record = self.ws.state().record(s.name)
        # its own: changed by it, or the same as before when its final event says it wrote
        # one (a fast stage rerun within the second writes the very record of its last run)
        mine = record if record is not None and (record != s.before or s.final_seen) \
            else StageRecord()
        status = mine.status  # pending: none of its own
        s.log = mine.log or (s.result.log if s.result else None)
        if code == 0 and status == StageState.DONE:
            s.state = StageState.DONE
        elif status == StageState.INTERRUPTED or code in (
                ExitCode.HANGUP, ExitCode.INTERRUPTED, ExitCode.TERMINATED) or code < 0:
            s.state = StageState.INTERRUPTED
            s.error = mine.error or (
                f"the stage process ended by {signal.Signals(-code).name}" if code < 0
                else f"the stage process exited {code}")
        else:
            s.state = StageState.FAILED
            s.error = mine.error or s.cli_error or _last_line(
                self.path.parent / f"{s.name}.err") or f"exit code {code}"
        if status == StageState.RUNNING:  # it died without recording its end (killed outright)
            s.error = (f"the stage process (pid {child.pid}) ended with exit code {code} "
                       "without recording its outcome")
            self.ws.write_stage_record(s.name, mine.changed(
                status=s.state, ended=events.stamp(), error=s.error))
        if s.log is None:
            s.log = str(self.path.parent / f"{s.name}.err")
        if not s.final_seen:
            if s.state == StageState.DONE:
                self._emit("stage.done", stage=s.name, summary=s.result.summary
                           if s.result else "", seconds=s.seconds)
            elif s.state == StageState.INTERRUPTED:
                self._emit("stage.interrupted", stage=s.name, signal=s.error)
            else:
                self._emit("stage.failed", stage=s.name, error=s.error, log=s.log)
        self._ended(s)

    def _ended(self, s: Slot) -> None:
        if self.on_finish is not None:
            self.on_finish(s)

    def _stop_all(self, signum: int | None) -> str:
        """Every running child stopped with the signal we got (Ctrl-C: SIGINT); each
        records itself interrupted. Further Ctrl-Cs wait for this to finish."""
        sig = signum or signal.SIGINT
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            running = [s for s in self.slots.values() if s.state == StageState.RUNNING]
            stop_children([s.child for s in running if s.child is not None], CHILD_GRACE_S,
                          first=sig)
            self._drain()
            for s in running:
                if s.child is not None:
                    self._finish(s, s.child)
                if s.state == StageState.FAILED:  # stopped by us, whatever its exit said
                    s.state = StageState.INTERRUPTED
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        return "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name

    # --- events ---
    def _new_events_file(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.path.exists():
            os.replace(self.path, self.path.with_name("events.prev.jsonl"))
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        self.offset = 0

    def _emit(self, kind: str, **fields: Any) -> None:
        events.write(self.path, events.make(kind, **fields))
        self._drain()

    def _drain(self) -> None:
        new, self.offset = events.read_new(self.path, self.offset)
        for doc in new:
            name = doc.get("stage")
            if (doc.get("event") == "stage.started" and name in self.slots
                    and doc.get("pid") != os.getpid()):
                self.slots[name].announced = True
            if (doc.get("event") in ("stage.done", "stage.failed", "stage.interrupted")
                    and name in self.slots and doc.get("pid") != os.getpid()):
                self.slots[name].final_seen = True
            if self.on_event is not None:
                self.on_event(doc)


def _exit_code(outcome: Outcome) -> int:
    if outcome.interrupted:
        signum = received_signal()
        return 128 + signum if signum else int(ExitCode.INTERRUPTED)
    for s in outcome.failed:
        code = s.exit_code or 1
        return code if code in ERROR_CODES or code in (ExitCode.INTERRUPTED, ExitCode.HANGUP,
                                                       ExitCode.TERMINATED) else 1
    return 0


def _private(path: Path) -> Any:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "wb")


def _text(path: Path) -> str:
    """The file's text; empty when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].removeprefix("error: ") if lines else ""


def stage_result(s: Slot) -> StageResult | None:
    """What the CLI renders for a stage that ran: its result, or one made of its error."""
    if s.result is not None:
        return s.result
    if s.state.stopped:
        return StageResult(Status.FAILED, s.error, log=s.log)
    return None

