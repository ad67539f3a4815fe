"""Supervising the server: its own process group, its log, readiness, known fatal lines, stop.

The server always runs as the child of a process that waits on it: the tool itself in the
foreground, or with --detach a small supervisor (``python -m dsv4_offload.serving.supervisor SPEC``)
started in a new session, because a reaped background parent takes sglang down with it.
The supervisor writes ``Workspace.serve_record`` (pids, URL, log) atomically.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from dsv4_offload.core import procs
from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.runner import start

TAIL_LINES = 40
NOFILE_WANTED = 65536  # the launcher raises the open-file limit for the 43 mmapped GGUFs
SIGTERM_WAIT_S = 10.0
SIGKILL_WAIT_S = 5.0


# --- the known fatal log lines: one table ---------------------------------------------------


@dataclass(frozen=True)
class FatalPattern:
    key: str
    pattern: re.Pattern[str]
    cause: str
    fix: str
    retry_fewer_experts: bool = False


FATAL_PATTERNS: tuple[FatalPattern, ...] = (
    FatalPattern(
        "kv-cache",
        # sglang's model runner / pool configurator when the KV pool gets no memory
        re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static"
                   r"|Raise --mem-fraction-static above|KV cache pool .*(fail|too small)", re.I),
        "KV-cache setup failed: the resident NPU experts left too little HBM for the KV pool",
        "lower serve.kt_num_gpu_experts (about 1 GB of HBM each) or serve.context_length",
        retry_fewer_experts=True,
    ),
    FatalPattern(
        "hbm-oom",
        re.compile(r"NPU out of memory|ACL_ERROR_RT_MEMORY_ALLOCATION|EL0004"
                   r"|aclrtMalloc.*fail|out of HBM", re.I),
        "the NPU ran out of HBM while loading",
        "pick an idle card (`npu-smi info`, then --device N), or lower "
        "serve.kt_num_gpu_experts; keep serve.mem_fraction_static at 0.81",
        retry_fewer_experts=True,
    ),
    FatalPattern(
        "llamafile",
        re.compile(r"llamafile not supported"),
        "kt-kernel was built with ARM SVE (its MXFP4 MoE has no SVE path)",
        "rebuild kt-kernel with CPUINFER_ARM_SVE=OFF CPUINFER_ARM_BF16=OFF "
        "CPUINFER_ARM_I8MM=OFF: `dsv4-offload build kt-kernel` (the recipe sets them)",
    ),
    FatalPattern(
        "numa",
        re.compile(r"NUMA node \d+ not found|set_mempolicy.*(fail|Invalid argument)"),
        "--kt-threadpool-count exceeds the host's NUMA nodes",
        "the threadpool count must not exceed the NUMA nodes; check `dsv4-offload doctor` "
        "and drop any --kt-threadpool-count from serve.extra_args",
    ),
    FatalPattern(
        "libmxfp4fused",
        re.compile(r"libmxfp4fused\.so.*(No such file|cannot open|not found|fail)"
                   r"|(No such file|cannot open|not found).*libmxfp4fused\.so", re.I),
        "the AscendC MXFP4 operator libmxfp4fused.so is missing (needed with KT_MXFP4_DEPOOL=1)",
        "`dsv4-offload build ascendc-op` (needs bisheng from CANN), or --set "
        "serve.env.KT_MXFP4_DEPOOL=0",
    ),
    FatalPattern(
        "gguf-missing",
        re.compile(r"GGUF path not found|No \.gguf files found"),
        "kt-kernel found no GGUF file at --kt-weight-path",
        "run `dsv4-offload convert` and `dsv4-offload verify-gguf`; check "
        "conversion.gguf_dir and conversion.file_template",
    ),
    FatalPattern(
        "quant-type",
        # kt-kernel (ktransformers d7b5b49) operators/llamafile/moe.hpp L203, L208, L213: the
        # GGUF's ggml type does not fit the layer shapes; upstream sglang's ModelConfig
        # ._verify_quantization: the W8A8 config and --quantization disagree (the pinned fork's
        # own text is not readable here, only its patches are)
        re.compile(r"must be a multiple of (gate|up|down)_type blck size"
                   r"|Quantization method specified in the model config \(.*\) does not match "
                   r"the quantization method specified in the .quantization. argument"),
        "quantization type mismatch at load time",
        "sglang is probably not at its pinned commit 298193eb3 (guide appendix G): check "
        "`dsv4-offload status`, re-fetch with `dsv4-offload fetch` and re-apply with "
        "`dsv4-offload patch`; if sglang is right, regenerate the GGUF with `dsv4-offload "
        "convert --force` and check it with `dsv4-offload verify-gguf`",
    ),
)


def match_fatal(line: str) -> FatalPattern | None:
    for fatal in FATAL_PATTERNS:
        if fatal.pattern.search(line):
            return fatal
    return None


def _first_fatal(lines: list[str]) -> tuple[FatalPattern | None, str]:
    """The first known fatal line among ``lines`` and its pattern, or (None, "")."""
    for line in lines:
        fatal = match_fatal(line)
        if fatal is not None:
            return fatal, line.strip()
    return None, ""


# --- process groups -------------------------------------------------------------------------


def group_alive(pgid: int, since: int | None = None, mark: str | None = None) -> bool:
    """Has our process group ``pgid`` a live member? Without ``since`` (the group of a child
    we have not reaped, so its id is still ours) any member counts; with it (the recorded
    start of its leader) only members proven ours (core/procs.owned_members, by ``mark``
    once the leader is gone). killpg(0) also succeeds for zombies: a group of zombies only
    is as good as gone."""
    if since is not None:
        return bool(procs.owned_members(pgid, since, mark))
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not procs.PROC.is_dir():
        return True
    return bool(procs.group_members(pgid))


def stop_group(pgid: int, *, interrupt_wait: float, reap: Callable[[], Any] | None = None,
               since: int | None = None, mark: str | None = None) -> str:
    """SIGINT, then SIGTERM, then SIGKILL on the group, each after a wait; the one that did it.
    ``since``/``mark``: the recorded start of its leader and the mark its members carry, so
    only processes proven ours are signalled (a reused group id is left alone)."""
    for sig, wait in ((signal.SIGINT, interrupt_wait), (signal.SIGTERM, SIGTERM_WAIT_S),
                      (signal.SIGKILL, SIGKILL_WAIT_S)):
        if since is not None:
            if not procs.signal_owned(pgid, since, mark, sig):
                return "already stopped"
        else:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return "already stopped"
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if reap is not None:
                reap()
            if not group_alive(pgid, since, mark):
                return sig.name
            time.sleep(0.05)
    return "SIGKILL (still listed)"


def pid_alive(pid: int | None, started: int | None = None) -> bool:
    """Is ``pid`` running, and the process that started at ``started`` (when known)?"""
    return bool(pid) and procs.alive(pid, started)


def _raise_nofile() -> None:
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = NOFILE_WANTED if hard == resource.RLIM_INFINITY else min(NOFILE_WANTED, hard)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


# --- the supervised child -------------------------------------------------------------------


@dataclass
class ServerProcess:
    """The server as a child in its own process group, its output appended to ``log``."""

    argv: list[str]
    env: dict[str, str]
    log: Path
    cwd: Path | None = None
    on_line: Callable[[str], None] | None = None
    # sglang's --api-key: read here, put into the exec'd argv only, masked in the log
    api_key_file: str | None = None
    # the detached supervisor's server runs on if the supervisor is killed outright; `serve
    # stop` finds it by its recorded pid and start time. In the foreground it dies with us.
    outlive: bool = False
    proc: subprocess.Popen[bytes] | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    _pump: threading.Thread | None = None
    _secret: str | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = list(self.argv)
        if self.api_key_file:
            from dsv4_offload.serving.flags import API_KEY_PLACEHOLDER
            from dsv4_offload.serving.rules import read_api_key

            self._secret = read_api_key(Path(self.api_key_file))
            argv = [self._secret if a == API_KEY_PLACEHOLDER else a for a in argv]
        with open(self.log, "a", encoding="utf-8") as fh:
            fh.write(f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} $ {' '.join(self.argv)}\n")
        try:
            self.proc = start(argv, env=self.env, cwd=self.cwd, preexec_fn=_raise_nofile,
                              outlive=self.outlive).proc
        except OSError as exc:
            raise InputError(
                f"cannot start the server {self.argv[0]!r} ({exc.strerror}); check "
                "serve.python / serve.command in the recipe"
            ) from None
        self._pump = threading.Thread(target=self._copy_output, daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log, "a", encoding="utf-8", errors="replace") as fh:
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                if self._secret:
                    # sglang prints its server_args (api_key included) at start-up
                    line = line.replace(self._secret, "***")
                fh.write(line + "\n")
                fh.flush()
                self.tail.append(line)
                if self.on_line is not None:
                    with contextlib.suppress(Exception):  # a display error must not stop the copy
                        self.on_line(line)

    def masked(self, argv: Any) -> list[str]:
        """``argv`` (the server's command line from /proc) with the API key masked."""
        return [a.replace(self._secret, "***") if self._secret else a for a in argv]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        if self._pump is not None:
            self._pump.join(timeout=5)
        return code

    def stop(self, interrupt_wait: float) -> str:
        if self.proc is None:
            return "not started"
        how = stop_group(self.proc.pid, interrupt_wait=interrupt_wait, reap=self.proc.poll)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout=5)
        return how


# --- readiness ------------------------------------------------------------------------------


@dataclass
class Readiness:
    ready: bool
    reason: str  # "ready" | "exited" | "fatal" | "timeout"
    seconds: float
    exit_code: int | None = None
    fatal: FatalPattern | None = None
    fatal_line: str = ""
    tail: list[str] = field(default_factory=list)


class LogFollower:
    """Reads the lines appended to a log file since the last call."""

    def __init__(self, path: Path, offset: int | None = None) -> None:
        self.path = path
        self.offset = offset if offset is not None else _size(path)
        self._partial = ""
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        text = self._partial + data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        self._partial = lines.pop()
        self.tail.extend(lines)
        return lines


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def wait_ready(url: str, health_paths: list[str], timeout: float, *, follower: LogFollower,
               exit_code: Callable[[], int | None], poll_s: float = 0.5,
               on_wait: Callable[[float], None] | None = None,
               headers: dict[str, str] | None = None) -> Readiness:
    """Wait until every health path answers 200, in order; stop at once on exit or a fatal line.

    ``headers`` go with every request (the API key's Authorization, when one is set).
    """
    import requests

    session = requests.Session()
    session.trust_env = False  # a proxy must never intercept a call to our own port
    session.headers.update(headers or {})
    start = time.monotonic()
    passed = 0
    while True:
        elapsed = time.monotonic() - start
        fatal, line = _first_fatal(follower.new_lines())
        if fatal is not None:
            return Readiness(False, "fatal", elapsed, fatal=fatal, fatal_line=line,
                             tail=list(follower.tail))
        code = exit_code()
        if code is not None:
            time.sleep(0.2)  # let the last lines reach the log
            fatal, line = _first_fatal(follower.new_lines())
            return Readiness(False, "fatal" if fatal else "exited", elapsed, exit_code=code,
                             fatal=fatal, fatal_line=line, tail=list(follower.tail))
        if elapsed > timeout:
            return Readiness(False, "timeout", elapsed, tail=list(follower.tail))
        if on_wait is not None:
            on_wait(elapsed)
        try:
            per_request = max(1.0, min(30.0, timeout - elapsed))
            resp = session.get(url + health_paths[passed], timeout=per_request)
            if resp.status_code == 200:
                passed += 1
                if passed == len(health_paths):
                    return Readiness(True, "ready", time.monotonic() - start,
                                     tail=list(follower.tail))
                continue
        except requests.RequestException:
            pass  # not listening yet
        time.sleep(poll_s)


# --- the detached supervisor ----------------------------------------------------------------


@dataclass
class ServeRecord:
    """What ``Workspace.serve_record`` holds."""

    supervisor_pid: int
    server_pid: int | None
    url: str
    log: str
    argv: list[str]
    started: str
    state: str = "starting"  # starting | running | exited | stopped
    exit_code: int | None = None
    kt_num_gpu_experts: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # who they are beyond the pid (procs.start_time): a reused pid is not our server
    server_start_time: int | None = None
    server_cmdline: list[str] = field(default_factory=list)
    supervisor_start_time: int | None = None
    # what the server's group carries in its environment (core/procs.own_mark of the process
    # that started it): proves its members ours once the server itself is gone
    group_mark: str | None = None
    # the server runs in the foreground of the tool itself (its "supervisor"): `serve stop`
    # stops the server, and the tool, waiting on it, closes the record and exits by itself
    foreground: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def server_alive(self) -> bool:
        """The recorded server (or what is left of its process group) is still there."""
        if not self.server_pid:
            return False
        if pid_alive(self.server_pid, self.server_start_time):
            return True
        # the leader gone, members of its group (sglang's schedulers) may still run: those
        # carrying its mark; a newcomer holding the pid (or leading a group of that id) is not
        return self.server_start_time is not None and group_alive(
            self.server_pid, self.server_start_time, self.group_mark)

    def supervisor_alive(self) -> bool:
        return pid_alive(self.supervisor_pid, self.supervisor_start_time)

    def describe(self) -> str:
        """One phrase: what runs of it now."""
        server, supervisor = self.server_alive(), self.supervisor_alive()
        if server and supervisor:
            return "running"
        if server:
            return "running without its supervisor (killed); `serve stop` stops it"
        if supervisor and self.state in ("starting", "running"):
            return "starting"
        if self.state in ("starting", "running"):
            return "gone: the server and its supervisor were killed (the record was not closed)"
        return f"{self.state} (exit code {self.exit_code})"


def read_record(path: Path) -> ServeRecord | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return ServeRecord(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise InputError(f"{path}: unreadable server record ({exc}); check no server runs "
                         "(`ps`), then delete the file") from None


def write_record(path: Path, record: ServeRecord) -> None:
    from dsv4_offload.workspace.store import atomic_write_json

    atomic_write_json(path, record.as_dict())


def record_alive(record: ServeRecord | None) -> TypeGuard[ServeRecord]:
    """Is the supervised server (or its supervisor, while starting it) still there? By pid
    and start time: a pid reused by another process is not our server."""
    if record is None:
        return False
    return record.server_alive() or (record.state in ("starting", "running")
                                     and record.supervisor_alive())


def spawn_detached(spec: dict[str, Any], spec_path: Path, supervisor_log: Path) -> int:
    """Start ``python -m dsv4_offload.serving.supervisor SPEC`` in a new session; its pid."""
    from dsv4_offload.workspace.store import atomic_write_json

    atomic_write_json(spec_path, spec)
    supervisor_log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the directory holding dsv4_offload
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    with open(supervisor_log, "ab") as out:
        # meant to outlive us: no `with`; detached_guard stops it if the caller fails
        child = start([sys.executable, "-m", "dsv4_offload.serving.supervisor", str(spec_path)],
                      env=env, stdout=out, outlive=True)
    return child.pid


def await_record(path: Path, supervisor_pid: int, timeout: float = 10.0) -> None:
    """Until the detached supervisor ``supervisor_pid`` has recorded its server: on a busy
    machine the server may answer before the supervisor has written the record, and a
    `serve` that says ready must leave the record `serve status` and `stop` read."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(supervisor_pid):
        with contextlib.suppress(InputError):
            record = read_record(path)
            if record is not None and record.supervisor_pid == supervisor_pid \
                    and record.server_pid:
                return
        time.sleep(0.05)


def stop_recorded(path: Path, interrupt_wait: float) -> tuple[ServeRecord | None, str]:
    """Stop the recorded server's group (SIGINT, SIGTERM, SIGKILL) and its supervisor."""
    record = read_record(path)
    if record is None:
        return None, "no server record"
    how = "not running"
    if record.server_pid and record.server_alive():
        # said before the signal: a foreground `serve` waiting on it tells a stop from a crash
        record.state = "stopping"
        write_record(path, record)
        # by pid and start time, with or without its supervisor
        how = stop_group(record.server_pid, interrupt_wait=interrupt_wait,
                         since=record.server_start_time, mark=record.group_mark)
    deadline = time.monotonic() + SIGTERM_WAIT_S
    while record.supervisor_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    # a foreground `serve` is the user's own command (its group may hold their pipeline):
    # never signalled, it exits once its server is gone
    if record.supervisor_alive() and not record.foreground:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(record.supervisor_pid, signal.SIGKILL)
    fresh = read_record(path) or record
    fresh.state = "stopped"
    write_record(path, fresh)
    return fresh, how


def record_foreground(path: Path, server: ServerProcess, url: str, experts: int | None,
                      extra: dict[str, Any]) -> None:
    """Record the server this process runs in the foreground, as the supervisor records a
    detached one: `status`, `serve status` and `serve stop` read the same record."""
    from dsv4_offload.core.clock import now_iso

    me, server_id = procs.identity(), procs.identity(server.pid)
    write_record(path, ServeRecord(
        me.pid, server.pid, url, str(server.log), list(server.argv), now_iso(), "running", None,
        experts, extra, server_start_time=server_id.start_time,
        server_cmdline=server.masked(server_id.cmdline), supervisor_start_time=me.start_time,
        group_mark=procs.own_mark(), foreground=True))


def close_foreground(path: Path, server_pid: int, code: int | None) -> bool:
    """Write how the foreground server ``server_pid`` ended; True when `serve stop` stopped
    it. A record of another server (a later one) is left alone."""
    try:
        record = read_record(path)
    except InputError:
        return False
    if record is None or record.server_pid != server_pid or record.supervisor_pid != os.getpid():
        return False
    stopped = record.state in ("stopping", "stopped")
    record.state, record.exit_code = ("stopped" if stopped else "exited"), code
    write_record(path, record)
    return stopped


def supervise(spec: dict[str, Any]) -> int:
    """The detached supervisor's body: run the server, keep the record, stop it on a signal."""
    from dsv4_offload.core.clock import now_iso

    record_path = Path(spec["record"])
    server = ServerProcess(list(spec["argv"]), dict(spec["env"]), Path(spec["log"]),
                           cwd=Path(spec["cwd"]) if spec.get("cwd") else None,
                           api_key_file=spec.get("api_key_file"), outlive=True)
    me = procs.identity()
    stopping = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    try:
        server.start()
    except Dsv4Error as exc:
        with open(spec["log"], "a", encoding="utf-8") as fh:
            fh.write(f"=== could not start: {exc.one_line()}\n")
        write_record(record_path, ServeRecord(
            os.getpid(), None, spec["url"], spec["log"], spec["argv"], now_iso(), "exited", 127,
            spec.get("kt_num_gpu_experts"), supervisor_start_time=me.start_time))
        return 127
    server_id = procs.identity(server.pid)
    record = ServeRecord(os.getpid(), server.pid, spec["url"], spec["log"], spec["argv"],
                         now_iso(), "running", None, spec.get("kt_num_gpu_experts"),
                         spec.get("extra", {}), server_start_time=server_id.start_time,
                         server_cmdline=server.masked(server_id.cmdline),
                         supervisor_start_time=me.start_time, group_mark=procs.own_mark())
    write_record(record_path, record)
    while server.poll() is None and not stopping.is_set():
        time.sleep(0.1)
    if stopping.is_set() and server.poll() is None:
        server.stop(float(spec.get("stop_timeout_s", 30)))
    code = server.wait()
    # what `serve` added meanwhile (extra: the start-up facts, the memory figure) stays
    record = _current(record_path, record)
    record.state, record.exit_code = ("stopped" if stopping.is_set() else "exited"), code
    write_record(record_path, record)
    return 0


def _current(path: Path, mine: ServeRecord) -> ServeRecord:
    """The record on disk when it is still this supervisor's, else ``mine``."""
    try:
        found = read_record(path)
    except InputError:
        return mine
    if found is None or (found.supervisor_pid, found.server_pid) != \
            (mine.supervisor_pid, mine.server_pid):
        return mine
    return found


@contextlib.contextmanager
def detached_guard(pid: int) -> Iterator[None]:
    """Kill a just-spawned supervisor's session if the caller fails or is interrupted."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        raise


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m dsv4_offload.serving.supervisor SPEC.json\n")
        return 2
    spec_path = Path(args[0])
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    # the spec holds the server's whole environment (tokens included): written 0600 by
    # atomic_write_json's mkstemp, and gone as soon as it has been read
    spec_path.unlink(missing_ok=True)
    return supervise(spec)


if __name__ == "__main__":
    sys.exit(main())
