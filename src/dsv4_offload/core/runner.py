"""External commands: every child process of the tool starts here.

One rule for all of them: the child gets its own session (so its process group is its own),
and an interrupt, an exception or a timeout stops that whole group (SIGTERM, then SIGKILL
after a short grace), so no child outlives the call that started it unless it was started to.
The shapes callers need:

- :func:`run_command`: a step of a stage; its output is logged (secrets redacted), timed,
  and a failure raises :class:`CommandFailed` with an excerpt and the log.
- :func:`capture`: a quick question (a version, a probe, ``git rev-parse``); stdout and
  stderr come back as text, nothing is logged.
- :func:`run_attached`: the child writes to our terminal (``docker exec`` of a forwarded
  command, a cross-build step whose output the build stage's log keeps); its exit code.
- :func:`start`: a long-lived child (the server, a streaming ``docker exec``); a
  :class:`Child` handle the caller waits on and stops as a group.

Every child but one started to outlive us (``outlive=True``: the detached server's
supervisor) also gets a parent-death signal, so even a SIGKILL of the tool takes it down;
SIGTERM and SIGHUP of the tool are turned into an interrupt (:func:`signals_as_interrupt`)
so the same cleanup as for Ctrl-C runs. :func:`watch_groups` tells a caller (the pipeline)
each process group started meanwhile, so a run killed outright can be swept up later.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dsv4_offload.core.childrun import GROUP_MARK_ENV
from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import Dsv4Error
from dsv4_offload.core.procs import own_mark

TAIL_LINES = 200
KILL_GRACE_S = 5.0  # between SIGTERM and SIGKILL of a child's group
EXCERPT_LINES = 8
# Lines that usually carry the cause of a failure; shown before the plain tail.
_ERROR_LINE = re.compile(r"error|fatal|failed|exception|traceback|not found|denied|refused", re.I)
# Secrets never reach a log: tokens in URLs and well-known token variables.
_SECRET_URL = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)([^/@\s:]+):([^/@\s]+)@")
# a token alone as the user of an https URL (https://ghp_xxx@host/...)
_TOKEN_USER = re.compile(r"(\bhttps?://)([^/@\s:]+)@")
_SECRET_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MODELSCOPE_API_TOKEN", "GITHUB_TOKEN")


def redact(text: str, env: Mapping[str, str] | None = None,
           secrets: Sequence[str] = ()) -> str:
    """``text`` without URL credentials, the well-known token variables' values and
    ``secrets`` (a value under 6 characters is a placeholder such as EMPTY, kept)."""
    text = _SECRET_URL.sub(r"\1\2:***@", text)
    text = _TOKEN_USER.sub(r"\1***@", text)
    env_values = [(env or os.environ).get(name) for name in _SECRET_ENV]
    for value in [*env_values, *secrets]:
        if value and len(value) >= 6:
            text = text.replace(value, "***")
    return text


def open_private_log(path: Path) -> IO[str]:
    """``path`` opened for appending, readable by its owner only (0600; its directory made
    0700 when new); a symlink in its place is refused, not followed."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    os.fchmod(fd, 0o600)  # a log made by an older version was 0644
    return os.fdopen(fd, "a", encoding="utf-8", errors="replace")


@dataclass
class CommandResult:
    """How a command ended; ``log`` for :func:`run_command`, ``stdout``/``stderr`` for
    :func:`capture` (which keeps no log)."""

    returncode: int
    log: Path | None
    duration: float
    tail: list[str] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""


class CommandFailed(Dsv4Error):
    """An external command exited non-zero (or timed out)."""

    def __init__(self, args: list[str], result: CommandResult, reason: str | None = None) -> None:
        self.result = result
        excerpt = failure_excerpt(result.tail)
        what = reason or f"exit code {result.returncode}"
        name = Path(args[0]).name if args else "command"
        detail = f": {excerpt[-1]}" if excerpt else ""
        super().__init__(f"{name} failed ({what}){detail}", log=str(result.log))
        self.excerpt = excerpt


def failure_excerpt(tail: list[str], limit: int = EXCERPT_LINES) -> list[str]:
    """The lines most likely to explain a failure: error-looking lines, else the last ones."""
    errors = [line for line in tail if _ERROR_LINE.search(line)]
    picked = errors[-limit:] if errors else tail[-limit:]
    return [line.rstrip() for line in picked if line.strip()]


def run_command(
    args: list[str],
    *,
    log: Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    on_line: Callable[[str], None] | None = None,
    check: bool = True,
    secrets: Sequence[str] = (),
) -> CommandResult:
    """Run ``args``, appending a header and its combined output to ``log``; ``secrets``
    (an API key on the command line) are masked in both, like the token variables.

    The child gets its own process group so Ctrl-C or a timeout stops all of it.
    """
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    start = time.monotonic()
    with open_private_log(log) as fh:
        fh.write(f"\n=== {now_iso()} $ {redact(shlex.join(args), env, secrets)}\n")
        fh.write(f"=== cwd: {cwd or os.getcwd()}\n")
        fh.flush()
        try:
            proc = _spawn(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            fh.write(f"=== could not start: {exc}\n")
            result = CommandResult(127, log, 0.0, [str(exc)])
            if check:
                raise CommandFailed(args, result, reason=f"cannot start: {exc.strerror}") from None
            return result
        timed_out = threading.Event()

        def _kill_on_timeout() -> None:
            timed_out.set()
            _kill_group(proc)

        timer = threading.Timer(timeout, _kill_on_timeout) if timeout else None
        if timer:
            timer.daemon = True
            timer.start()
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode("utf-8", errors="replace")
                clean = redact(line, env, secrets)
                fh.write(clean)
                tail.append(clean.rstrip("\n"))
                if on_line:
                    on_line(clean.rstrip("\n"))
            proc.wait()
        except BaseException:
            # Ctrl-C or an error in on_line: never leave the child running
            _kill_group(proc)
            proc.wait()
            fh.write("=== interrupted\n")
            raise
        finally:
            if timer:
                timer.cancel()
        duration = time.monotonic() - start
        fh.write(f"=== exit {proc.returncode} after {duration:.1f}s\n")
    result = CommandResult(proc.returncode, log, duration, list(tail))
    if timed_out.is_set():
        result.returncode = result.returncode or -1
        if check:
            raise CommandFailed(args, result, reason=f"timed out after {timeout:.0f}s")
    elif check and proc.returncode != 0:
        raise CommandFailed(args, result)
    return result


def capture(
    args: list[str],
    *,
    timeout: float | None,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    input: str | None = None,
) -> CommandResult:
    """Run a quick command and return its output as text (undecodable bytes replaced).

    Nothing is logged: these are read-only questions whose answer the caller interprets.
    Failing to start raises the ``OSError`` (``FileNotFoundError``...) and a timeout
    ``subprocess.TimeoutExpired``, as ``subprocess.run`` would, but only after the child's
    whole group is gone. stdin is ``input`` or nothing (never the terminal).
    """
    start_time = time.monotonic()
    proc = _spawn(args, cwd=cwd, env=env,
                  stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(None if input is None else input.encode(), timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        _close_pipes(proc)
        raise subprocess.TimeoutExpired(args, timeout or 0.0) from None
    except BaseException:
        _kill_group(proc)
        _close_pipes(proc)
        raise
    return CommandResult(proc.returncode, None, time.monotonic() - start_time,
                         stdout=out.decode("utf-8", errors="replace"),
                         stderr=err.decode("utf-8", errors="replace"))


def run_attached(
    args: list[str],
    *,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    stdin: bool = True,
    timeout: float | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> int:
    """Run ``args`` on our stdout and stderr (and stdin unless ``stdin`` is False); its
    exit code. Failing to start raises the ``OSError``; a timeout
    ``subprocess.TimeoutExpired`` once the group is stopped."""
    proc = _spawn(args, cwd=cwd, env=env, stdin=None if stdin else subprocess.DEVNULL,
                  stdout=None, stderr=None, preexec_fn=preexec_fn)
    try:
        return proc.wait(timeout=timeout)
    except BaseException:  # the timeout, Ctrl-C: the group goes with us
        _kill_group(proc)
        raise


class Child:
    """A long-lived child started by :func:`start`, in its own process group.

    ``with start(...) as child:`` stops the group if the block raises (Ctrl-C included);
    a caller that lets the child run on (a detached supervisor) keeps it without ``with``.
    """

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        """The child's pid, which is also its process group's id."""
        return self.proc.pid

    def stop(self, grace: float = KILL_GRACE_S) -> None:
        """SIGTERM the group, SIGKILL after ``grace`` seconds; returns once the child is reaped."""
        _kill_group(self.proc, grace)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.stop()


def stop_children(children: Sequence[Child], grace: float = KILL_GRACE_S,
                  first: int = signal.SIGTERM) -> None:
    """Stop several children at once: ``first`` (SIGTERM; a scheduler passes on the signal
    it got, so each child records that cause) to every group, then SIGKILL to the groups of
    those still running after ``grace`` seconds; returns once all are reaped."""
    live = [c for c in children if c.proc.poll() is None]
    for child in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, first)
    deadline = time.monotonic() + grace
    for child in live:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(child.proc, 0.0)
            child.proc.wait()


def start(
    args: list[str],
    *,
    cwd: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    stdout: int | IO[Any] | None = subprocess.PIPE,
    stderr: int | IO[Any] | None = subprocess.STDOUT,
    preexec_fn: Callable[[], None] | None = None,
    stdin: int | None = subprocess.DEVNULL,
    outlive: bool = False,
) -> Child:
    """Start a long-lived child in its own session, stdin closed (or a pipe the caller holds
    open as a proof of life: ``stdin=subprocess.PIPE``); failing to start raises the
    ``OSError``. The caller reads ``child.proc.stdout`` and stops it with ``stop``.
    ``outlive``: the child is meant to run on after this process (no parent-death signal)."""
    return Child(_spawn(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout,
                        stderr=stderr, preexec_fn=preexec_fn, outlive=outlive))


def _spawn(args: list[str], *, cwd: Path | str | None, env: Mapping[str, str] | None,
           stdin: int | None, stdout: int | IO[Any] | None, stderr: int | IO[Any] | None,
           preexec_fn: Callable[[], None] | None = None, outlive: bool = False,
           watched: bool = True) -> subprocess.Popen[bytes]:
    """The one ``Popen`` of the package: a new session, so the group can be stopped whole;
    unless ``outlive``, the child dies with us (a parent-death signal). Unless ``watched``
    is off (a sentinel), the watchers of :func:`watch_groups` are told before and after."""
    if watched:
        for watcher in list(_group_watchers):
            watcher.before()  # a failure here stops the start: nothing would watch the child
    before = preexec_fn
    child_env = dict(os.environ if env is None else env)
    wrapper = _pdeathsig_wrapper() if not outlive and preexec_fn is None else []
    if wrapper:  # the parent-death signal set by setpriv's exec: Popen can vfork
        _check_runnable(args[0], child_env, cwd)
        args, outlive = [*wrapper, *args], True
    if not outlive:
        parent = os.getpid()

        def before() -> None:
            die_with_parent()
            if os.getppid() != parent:  # it died before the signal was armed
                os._exit(143)
            if preexec_fn is not None:
                preexec_fn()

    # the child and all it starts carry our mark: once its group's leader is gone, what is
    # left of the group is proven ours by it (core/procs.owned_members), never by its age
    child_env[GROUP_MARK_ENV] = own_mark()
    proc = subprocess.Popen(args, cwd=cwd, env=child_env,
                            stdin=stdin, stdout=stdout, stderr=stderr,
                            start_new_session=True, preexec_fn=before, close_fds=True)
    for watcher in list(_group_watchers) if watched else []:
        with contextlib.suppress(Exception):  # a record that cannot be written stops nothing
            watcher.started(proc.pid)
    return proc


_setpriv: list[list[str]] = []  # probed once a process


def _pdeathsig_wrapper() -> list[str]:
    """``setpriv --pdeathsig TERM --``: util-linux's (2.33 and later) sets the parent-death
    signal and executes the command in place (the same pid and command line), so the child
    needs no ``preexec_fn`` and Popen starts it with vfork, not a fork of this process: from a
    200 MB process (a test worker, a scheduler with its imports) 7.4 ms of CPU a start by
    fork, 0.9 ms by vfork. Empty where setpriv cannot (absent, older): a preexec_fn then."""
    if not _setpriv:
        found = shutil.which("setpriv")
        wrapper = [found, "--pdeathsig", "TERM", "--"] if found else []
        try:
            ok = bool(found) and subprocess.run(
                [*wrapper, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        _setpriv.append(wrapper if ok else [])
    return _setpriv[0]


def _check_runnable(program: str, env: Mapping[str, str], cwd: Path | str | None) -> None:
    """Raise what Popen raises for a program that cannot run (FileNotFoundError,
    PermissionError): behind setpriv it would fail in setpriv, after the start."""
    if os.sep in program:
        path = os.path.join(cwd, program) if cwd is not None else program
        if not os.path.exists(path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        if os.path.isdir(path) or not os.access(path, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
        return
    if shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


class Sentinel:
    """A child that outlives us, reading a pipe only we hold: EOF tells it we are gone."""

    def __init__(self, proc: subprocess.Popen[bytes], write_fd: int) -> None:
        self.proc = proc
        self._fd: int | None = write_fd

    def release(self, timeout: float = 5.0) -> None:
        """Close our end (the sentinel sees EOF and, finding nothing left, exits); reap it."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(self.proc, 1.0)


def start_sentinel(args: list[str]) -> Sentinel | None:
    """Start ``args`` to outlive us, its stdin the read end of a pipe whose write end only
    this process holds (never inherited): when we exit, by any signal SIGKILL included, it
    reads EOF and can clean up after us. None when it cannot be started."""
    read_fd, write_fd = os.pipe()  # both non-inheritable: no other child holds them
    try:
        proc = _spawn(args, cwd=None, env=None, stdin=read_fd, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL, outlive=True, watched=False)
    except OSError:
        os.close(write_fd)
        return None
    finally:
        os.close(read_fd)
    return Sentinel(proc, write_fd)


@dataclass(frozen=True)
class _Watcher:
    before: Callable[[], None]
    started: Callable[[int], None]


_group_watchers: list[_Watcher] = []


@contextlib.contextmanager
def watch_groups(callback: Callable[[int], None],
                 before: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Meanwhile, ``before()`` ahead of every child's start and ``callback(pgid)`` once it
    started (each child leads its own group)."""
    watcher = _Watcher(before, callback)
    _group_watchers.append(watcher)
    try:
        yield
    finally:
        _group_watchers.remove(watcher)


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    """Close what is left of a stopped child's pipes (a grandchild that left the group may
    still hold their other ends: never wait on them)."""
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def _kill_group(proc: subprocess.Popen[bytes], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the child's process group, then SIGKILL after a grace period."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


# --- dying together ---------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """As a child's ``preexec_fn``: SIGTERM it when this process dies, by any signal
    SIGKILL included (Linux prctl; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised as an interrupt: ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []


def forget_signals() -> None:
    """Forget the signals noted so far (an in-process caller starting its next command)."""
    _received.clear()


def received_signal() -> int | None:
    """The first SIGTERM/SIGHUP this process got under :func:`signals_as_interrupt`, or None."""
    return _received[0] if _received else None


def interrupt_name(exc: BaseException | None = None) -> str:
    """How the interrupt came: 'SIGTERM', 'SIGHUP' or 'Ctrl-C'."""
    signum = getattr(exc, "signum", None) or received_signal()
    return signal.Signals(signum).name if signum else "Ctrl-C"


@contextlib.contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Interrupted` (a KeyboardInterrupt) meanwhile, so the
    same cleanup as for Ctrl-C runs (their default would end this process at once and
    orphan its children). Only the first one raises: repeats while that cleanup runs (a
    scheduler that sends SIGTERM twice) are noted, not allowed to cut it short."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        first = not _received
        _received.append(signum)
        if first:
            raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
