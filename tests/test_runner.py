"""The runner: every shape of child process starts in its own group and leaves none behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4_offload.core.runner import (
    CommandFailed,
    capture,
    redact,
    run_attached,
    run_command,
    start,
)

# a child that starts a grandchild in its group, prints its pid and then sleeps
FAMILY = ("import subprocess, sys, time\n"
          "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          "print(g.pid, flush=True)\n"
          "time.sleep(60)\n")


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie whose parent is gone counts as gone
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except (OSError, IndexError):
            return True
        time.sleep(0.05)
    return False


def test_capture_returns_both_streams_as_text() -> None:
    res = capture([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr);"
                   "sys.stdout.buffer.write(b'\\xff'); sys.exit(3)"], timeout=30)
    assert (res.returncode, res.stdout, res.stderr) == (3, "out\n\ufffd", "err\n")
    assert res.log is None


def test_capture_feeds_input_and_never_the_terminal() -> None:
    echoed = capture([sys.executable, "-c", "import sys; print(sys.stdin.read().upper())"],
                     timeout=30, input="abc")
    assert echoed.stdout == "ABC\n"
    empty = capture([sys.executable, "-c", "import sys; print(repr(sys.stdin.read()))"],
                    timeout=30)
    assert empty.stdout == "''\n"


def test_capture_keeps_the_start_error_of_subprocess() -> None:
    with pytest.raises(FileNotFoundError):
        capture(["/nonexistent/dsv4-tool"], timeout=5)


def test_capture_timeout_stops_the_whole_group(tmp_path: Path) -> None:
    script = tmp_path / "family.py"
    script.write_text(FAMILY.replace("print(g.pid, flush=True)",
                                     f"open({str(tmp_path / 'pid')!r}, 'w').write(str(g.pid))"))
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        capture([sys.executable, str(script)], timeout=1)
    assert time.monotonic() - began < 15
    grandchild = int((tmp_path / "pid").read_text())
    assert _gone(grandchild), "the grandchild outlived the timeout"


def test_run_command_redacts_given_secrets_and_keeps_placeholders(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    res = run_command([sys.executable, "-c", "import sys; print('key', sys.argv[1:])",
                       "sk-secret-123", "EMPTY"], log=log, secrets=["sk-secret-123", "EMPTY"])
    text = log.read_text()
    assert res.returncode == 0 and "sk-secret-123" not in text
    assert "key ['***', 'EMPTY']" in text
    assert redact("a sk-secret-123 b", secrets=["sk-secret-123"]) == "a *** b"


def test_run_command_timeout_fails_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(CommandFailed, match=r"timed out after 1s"):
        run_command([sys.executable, "-c", "import time; time.sleep(60)"],
                    log=tmp_path / "t.log", timeout=1)


def test_run_attached_returns_the_exit_code_and_honours_its_timeout(
        capfd: pytest.CaptureFixture[str]) -> None:
    assert run_attached([sys.executable, "-c", "print('through'); raise SystemExit(4)"],
                        stdin=False) == 4
    assert "through" in capfd.readouterr().out
    with pytest.raises(subprocess.TimeoutExpired):
        run_attached([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)


def test_a_started_child_is_its_own_group_and_stops_with_it() -> None:
    with pytest.raises(KeyboardInterrupt), start([sys.executable, "-c", FAMILY]) as child:
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
        assert child.proc.stdout is not None
        grandchild = int(child.proc.stdout.readline())
        raise KeyboardInterrupt
    assert child.proc.poll() is not None
    assert _gone(grandchild), "the grandchild outlived the interrupt"


def _sentinels_of(notes: Path) -> list[int]:
    """Processes whose command line is the sentinel of this notes file."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dsv4_offload.core.procs" in argv and str(notes).encode() in argv:
            found.append(int(entry.name))
    return found


def test_a_stage_starts_its_sentinel_before_its_first_child_and_none_without_one(
        tmp_path: Path) -> None:
    from dsv4_offload.core import procs
    from dsv4_offload.pipeline.groups import groups_noted
    from dsv4_offload.workspace.store import Workspace

    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    notes = ws.run_dir / "groups-build"
    with groups_noted(ws, "build", procs.identity()):
        assert notes.exists() and _sentinels_of(notes) == []  # no child yet: no sentinel
    with groups_noted(ws, "build", procs.identity()):
        # the child looks for the sentinel as it starts: it is there already
        looks = ("import os, sys\nfrom pathlib import Path\n"
                 "print(any(b'dsv4_offload.core.procs' in p.read_bytes() and\n"
                 "          sys.argv[1].encode() in p.read_bytes()\n"
                 "          for p in Path('/proc').glob('[0-9]*/cmdline')\n"
                 "          if p.parent.name != str(os.getpid())))\n")  # not itself
        out = capture([sys.executable, "-c", looks, str(notes)], timeout=30)
        assert out.stdout.strip() == "True", out
        sentinel = _sentinels_of(notes)
        assert len(sentinel) == 1
        run_command([sys.executable, "-c", "pass"], log=tmp_path / "second.log")
        assert _sentinels_of(notes) == sentinel  # one for the stage, not one a child
    assert _gone(sentinel[0])  # released with the stage


def test_a_program_that_cannot_run_raises_at_the_start_as_popen_does(tmp_path: Path) -> None:
    """Behind setpriv (the parent-death signal set by its exec) a program that cannot run
    would fail in setpriv, after the start: the runner raises what Popen raises instead."""
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\necho ran in \"$PWD\"\n")
    with pytest.raises(PermissionError):
        start([str(tool)])  # not executable
    tool.chmod(0o755)
    with pytest.raises(FileNotFoundError):
        start(["./tool"])  # relative to the child's directory, which is not this one
    assert capture(["./tool"], cwd=tmp_path, timeout=30).stdout.strip() == f"ran in {tmp_path}"
    with pytest.raises(FileNotFoundError):
        capture(["no-such-tool-here"], timeout=30)
    child = start(["sleep", "30"])
    try:  # the command runs in place of the wrapper: same pid, its own command line
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        child.proc.kill()
        child.proc.wait()


def test_without_setpriv_the_parent_death_signal_is_set_in_the_child(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A host without util-linux's setpriv: the runner sets the signal in a preexec_fn (a
    fork instead of vfork), the same child otherwise."""
    from dsv4_offload.core import runner

    monkeypatch.setattr(runner, "_setpriv", [[]])
    out = capture([sys.executable, "-c", "import os; print(os.getpgid(0) == os.getpid())"],
                  timeout=30)
    assert out.stdout.strip() == "True"  # its own group, as ever
    with pytest.raises(FileNotFoundError):
        capture(["no-such-tool-here"], timeout=30)  # Popen's own error


def test_the_next_runs_sweep_takes_a_run_directory_that_goes_meanwhile(tmp_path: Path) -> None:
    """Each stage process removes the run directory when it leaves it empty, so another one
    sweeping (every stage does, before it starts) may see it go between pathlib's look and its
    listing: that is no leftover, not a FileNotFoundError that fails the stage (a CI run's
    verify-gguf did). The directory is made and removed here as fast as a thread can; the
    sweep and the leftover count read it meanwhile (the old listing failed ~1 in 1,000)."""
    import contextlib
    import threading

    from dsv4_offload.pipeline.groups import leftover_processes, sweep_leftovers
    from dsv4_offload.workspace.store import Workspace

    ws = Workspace(tmp_path / "ws")
    done = threading.Event()

    def churn() -> None:
        while not done.is_set():
            ws.run_dir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # a sweep's rmdir got there first
                ws.run_dir.rmdir()

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(10_000):
            assert sweep_leftovers(ws) == [] and leftover_processes(ws) == []
    finally:
        done.set()
        thread.join()
