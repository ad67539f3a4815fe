"""External commands: one runner that logs everything and fails with an excerpt and the log."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import Dsv4Error

TAIL_LINES = 200
EXCERPT_LINES = 8
# Lines that usually carry the cause of a failure; shown before the plain tail.
_ERROR_LINE = re.compile(r"error|fatal|failed|exception|traceback|not found|denied|refused", re.I)
# Secrets never reach a log: tokens in URLs and well-known token variables.
_SECRET_URL = re.compile(r"(https?://)([^/@\s:]+):([^/@\s]+)@")
_SECRET_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MODELSCOPE_API_TOKEN", "GITHUB_TOKEN")


def redact(text: str, env: Mapping[str, str] | None = None) -> str:
    text = _SECRET_URL.sub(r"\1\2:***@", text)
    for name in _SECRET_ENV:
        value = (env or os.environ).get(name)
        if value and len(value) >= 6:
            text = text.replace(value, "***")
    return text


@dataclass
class CommandResult:
    returncode: int
    log: Path
    duration: float
    tail: list[str] = field(default_factory=list)


class CommandFailed(Dsv4Error):
    """An external command exited non-zero (or timed out)."""

    def __init__(self, args: list[str], result: CommandResult, reason: str | None = None) -> None:
        self.args_list = args
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
) -> CommandResult:
    """Run ``args``, appending a header and its combined output to ``log``.

    The child gets its own process group so Ctrl-C or a timeout stops all of it.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    start = time.monotonic()
    with open(log, "a", encoding="utf-8", errors="replace") as fh:
        fh.write(f"\n=== {now_iso()} $ {redact(shlex.join(args), env)}\n")
        fh.write(f"=== cwd: {cwd or os.getcwd()}\n")
        fh.flush()
        try:
            proc = subprocess.Popen(
                args,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
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
                clean = redact(line, env)
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


def _kill_group(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
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
