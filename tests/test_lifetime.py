"""Process lifetime (issue 19): real signals to a real CLI process, then what is left.

SIGTERM and SIGHUP are handled like Ctrl-C (children stopped, the stage recorded as
interrupted with the signal, the lock released, exit 128 + the signal); SIGKILL leaves no
cleanup to run, so children die with the CLI (a parent-death signal) and the next run stops
what is left. Every test finds its processes by its tmp_path in their command lines
(serve_helpers.leftovers) and leaves none behind (the no_leftovers fixture).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import CLI, HOST_RECIPE, SMALL_RECIPE, run_cli
from serve_helpers import free_port, leftovers, make_workspace, standin_overrides

from dsv4_offload.core import procs

HOSTS = Path(__file__).parent / "fixtures" / "hosts"
# `run` with the instrumented stages: SMALL_RECIPE (its sets pass the disk preflight)
HOST = ["-r", str(SMALL_RECIPE)]
WAIT_S = 30  # the most any one step here may take


def _gone(tag: str, timeout: float = 10) -> list[str]:
    """The command lines of the test's processes still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    left = leftovers(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = leftovers(tag)
    return [" ".join(p.info["cmdline"] or []) for p in left]


def _wait_for(check, what: str, timeout: float = WAIT_S) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.05)


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    full = {**os.environ, **env}
    full.pop("DSV4_WORKSPACE", None)
    return subprocess.Popen([*CLI, *args], env=full, text=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    code, _, err = _finish_out(proc)
    return code, err


def _finish_out(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def _states(ws: Path, env: dict[str, str]) -> dict[str, dict]:
    res = run_cli(*HOST, "--json", "-w", str(ws), "status", env=env)
    assert res.code == 0, res
    return {s["name"]: s for s in res.json()["data"]["stages"]}


def _record(ws: Path, stage: str) -> dict:
    return json.loads((ws / ".dsv4" / "state.json").read_text())["stages"][stage]


# --- a long stage ---------------------------------------------------------------------------


def _long_convert(ws: Path, env: dict[str, str], *extra: str
                  ) -> tuple[subprocess.Popen[str], list[int]]:
    """`run` with convert running a child that started a grandchild (as a build step's shell
    and its compiler); the CLI and the two pids."""
    (ws / "behave").mkdir(parents=True)
    (ws / "behave" / "convert").write_text("children")
    serial = [a for a in extra if a == "--serial"]
    extra = tuple(a for a in extra if a != "--serial")
    proc = _start([*HOST, "-w", str(ws), *extra, "run", *serial], env)
    pids_file = ws / "convert.pids"
    _wait_for(lambda: pids_file.exists() and pids_file.read_text().endswith("\n"),
              "convert's children")
    return proc, [int(p) for p in pids_file.read_text().split()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGHUP,
                                                                marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGHUP"])
def test_term_or_hup_during_a_stage_is_ctrl_c(tmp_path: Path, fake_stages_env, no_leftovers,
                                              sig: signal.Signals) -> None:
    """SIGHUP's run is in the long tier: both signals take Ctrl-C's way through the one
    handler (core/runner.signals_as_interrupt), and SIGTERM's run is its fast seam."""
    ws = tmp_path / "ws"
    proc, pids = _long_convert(ws, fake_stages_env)
    proc.send_signal(sig)
    code, err = _finish(proc)
    assert code == 128 + sig, err  # 143 / 129, as a shell reports the signal
    assert err.strip().endswith(f"interrupted by {sig.name}"), err
    assert "Traceback" not in err
    assert not any(procs.alive(p) for p in pids)  # the whole group: TERM, then KILL
    assert _gone(no_leftovers, 0) == []
    record = _record(ws, "convert")
    assert record["status"] == "interrupted" and record["signal"] == sig.name
    st = _states(ws, fake_stages_env)
    assert st["convert"]["state"] == "interrupted"
    assert f"interrupted by {sig.name}" in st["convert"]["reason"]
    assert st["doctor"]["state"] == "done"
    assert (ws / ".dsv4" / "lock").read_text() == ""  # released
    # the rerun resumes: convert again, and what else had not finished (the graph ran it
    # beside convert), but nothing that was done
    done = {name for name, row in st.items() if row["state"] == "done"}
    before = len((ws / "ran.log").read_text().split())
    (ws / "behave" / "convert").unlink()
    res = run_cli(*HOST, "-w", str(ws), "run", env=fake_stages_env)
    assert res.code == 0, res
    again = (ws / "ran.log").read_text().split()[before:]
    assert "convert" in again and not done & set(again), (done, again)
    assert _states(ws, fake_stages_env)["accept"]["state"] == "done"


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "graph"])
def test_a_json_run_says_it_was_interrupted(tmp_path: Path, fake_stages_env,
                                            no_leftovers, serial: bool) -> None:
    """`nohup dsv4-offload --json run > log.json`: the output says how it ended: --serial's
    one document, or the last event of the graph's stream (one JSON object per line)."""
    ws = tmp_path / "ws"
    proc, _ = _long_convert(ws, fake_stages_env, "--json", *(["--serial"] if serial else []))
    proc.send_signal(signal.SIGHUP)
    code, out, err = _finish_out(proc)
    assert code == 129, err
    if serial:
        doc = json.loads(out)
        assert doc["status"] == "interrupted" and doc["command"] == "run"
        assert doc["data"] == {"signal": "SIGHUP", "exit_code": 129}
    else:
        last = [json.loads(line) for line in out.splitlines()][-1]
        assert last["event"] == "run.finished" and last["signal"] == "SIGHUP", last
        assert last["exit"] == 129 and last["stages"]["convert"] == "interrupted"
    assert _gone(no_leftovers) == []


def test_sigkill_during_a_stage_leaves_nothing(tmp_path: Path, fake_stages_env,
                                                               no_leftovers) -> None:
    ws = tmp_path / "ws"
    proc, (child, grandchild) = _long_convert(ws, fake_stages_env)
    proc.send_signal(signal.SIGKILL)
    code, _ = _finish(proc)
    assert code == -signal.SIGKILL
    # the runner's child dies with the CLI (parent-death signal), at once; its grandchild
    # (a compiler under the step's shell) is stopped by the stage's sentinel, which sees
    # the CLI's end of its pipe close
    _wait_for(lambda: not procs.alive(child), "the child's death", timeout=10)
    _wait_for(lambda: not procs.alive(grandchild), "the grandchild's death", timeout=15)
    assert _gone(no_leftovers) == []
    st = _states(ws, fake_stages_env)
    assert st["convert"]["state"] == "interrupted"
    assert "killed" in st["convert"]["reason"]
    (ws / "behave" / "convert").unlink()
    res = run_cli(*HOST, "-w", str(ws), "run", env=fake_stages_env)
    assert res.code == 0, res
    assert _gone(no_leftovers, 0) == []
    assert not (ws / ".dsv4" / "run").exists()  # no group notes left behind
    assert _states(ws, fake_stages_env)["convert"]["state"] == "done"


def test_the_next_run_sweeps_what_a_killed_run_left(tmp_path: Path, fake_stages_env,
                                                    no_leftovers) -> None:
    """Without the sentinel (it was killed too, or the machine's pid namespace), the notes
    of the killed run name its groups: status lists what still runs, the next run stops it."""
    ws = tmp_path / "ws"
    assert run_cli(*HOST, "-w", str(ws), "run", "--to", "download", env=fake_stages_env).code == 0
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                                str(tmp_path)], start_new_session=True)
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        notes = procs.GroupNotes(ws / ".dsv4" / "run" / "groups-convert")
        notes.begin(procs.Identity(dead.pid, 1))
        notes.note(sleeper.pid)
        state = json.loads((ws / ".dsv4" / "state.json").read_text())
        state["stages"]["convert"] = {"status": "running", "pid": dead.pid,
                                      "pid_start_time": 1, "started": "x"}
        (ws / ".dsv4" / "state.json").write_text(json.dumps(state))
        st = _states(ws, fake_stages_env)["convert"]
        assert st["state"] == "interrupted" and f"pids {sleeper.pid}" in st["reason"], st
        res = run_cli(*HOST, "-w", str(ws), "run", env=fake_stages_env)
        assert res.code == 0, res
        assert sleeper.wait(timeout=10) == -signal.SIGTERM
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_a_running_record_whose_pid_is_reused_is_interrupted(tmp_path: Path,
                                                             fake_stages_env) -> None:
    """Liveness is pid plus start time: a live process with the recorded pid but another
    start time is not the run that wrote the record."""
    ws = tmp_path / "ws"
    assert run_cli(*HOST, "-w", str(ws), "run", "--to", "fetch", env=fake_stages_env).code == 0
    state = json.loads((ws / ".dsv4" / "state.json").read_text())
    me = procs.identity()
    state["stages"]["fetch"] = {"status": "running", "pid": me.pid,
                                "pid_start_time": (me.start_time or 0) + 1, "started": "x"}
    (ws / ".dsv4" / "state.json").write_text(json.dumps(state))
    assert _states(ws, fake_stages_env)["fetch"]["state"] == "interrupted"
    state["stages"]["fetch"]["pid_start_time"] = me.start_time
    (ws / ".dsv4" / "state.json").write_text(json.dumps(state))
    assert _states(ws, fake_stages_env)["fetch"]["state"] == "running"


# --- the server -----------------------------------------------------------------------------


def _serve_cli(ws_root: Path, tag: str, port: int, *mode: str) -> tuple[list[str], dict]:
    sets = [a for o in standin_overrides(tag, port, *(mode or ("--mode", "good")))
            for a in ("--set", o)]
    root = HOSTS / "x86-no-npu"
    env = {"DSV4_HOST_ROOT": str(root)}
    # a stand-in server on this host (HOST_RECIPE)
    return ["--workspace", str(ws_root), "-r", str(HOST_RECIPE), *sets], env


def _up(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def _server_pid(tag: str) -> int:
    found = [p.pid for p in leftovers(tag)
             if p.info["cmdline"][1:2] and p.info["cmdline"][1].endswith("standin_server.py")]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=["SIGTERM", "SIGHUP", "SIGKILL"])
def test_a_foreground_serve_never_leaves_its_server(tmp_path: Path, no_leftovers,
                                                    sig: signal.Signals) -> None:
    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    args, env = _serve_cli(ws.root, no_leftovers, port)
    proc = _start([*args, "serve"], env)
    _wait_for(lambda: _up(port), "the stand-in's readiness")
    server = _server_pid(no_leftovers)
    proc.send_signal(sig)
    code, err = _finish(proc)
    assert code == (-sig if sig == signal.SIGKILL else 128 + sig), err
    assert _gone(no_leftovers) == []  # the server too: stopped, or its parent-death signal
    assert not procs.alive(server) and not _up(port)
    record = _record(ws.root, "serve")
    if sig == signal.SIGKILL:  # no cleanup ran: the record is 'running', its pid dead
        assert record["status"] == "running"
        st = _states(ws.root, env)["serve"]
        assert st["state"] == "interrupted" and "killed" in st["reason"]
    else:
        assert record["status"] == "interrupted" and record["signal"] == sig.name


def _detached(ws_root: Path, tag: str, port: int) -> tuple[list[str], dict, dict]:
    args, env = _serve_cli(ws_root, tag, port)
    started = run_cli(*args, "serve", "--detach", env=env)
    assert started.code == 0, started
    record = json.loads((ws_root / ".dsv4" / "run" / "serve.json").read_text())
    return args, env, record


def test_serve_stop_finds_the_server_after_its_supervisor_was_killed(tmp_path: Path,
                                                                     no_leftovers) -> None:
    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    args, env, record = _detached(ws.root, no_leftovers, port)
    # the record names both by pid, start time and (the server) command line
    server = procs.Identity(record["server_pid"], record["server_start_time"],
                            tuple(record["server_cmdline"]))
    assert server.alive() and server.start_time is not None
    assert any(a.endswith("standin_server.py") for a in server.cmdline)
    assert procs.alive(record["supervisor_pid"], record["supervisor_start_time"])
    os.kill(record["supervisor_pid"], signal.SIGKILL)
    _wait_for(lambda: not procs.alive(record["supervisor_pid"]), "the supervisor's death")
    status = run_cli(*args, "--json", "serve", "status", env=env)
    assert status.code == 0, status  # still serving, unsupervised: status says so
    assert status.json()["data"]["supervisor_running"] is False
    assert "without its supervisor" in run_cli(*args, "serve", "status", env=env).out
    stopped = run_cli(*args, "serve", "stop", env=env)
    assert stopped.code == 0 and f"stopped pid {server.pid}" in stopped.out, stopped
    assert _gone(no_leftovers) == []
    after = run_cli(*args, "--json", "serve", "status", env=env)
    assert after.code == 1 and after.json()["data"]["state"] == "stopped", after


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_term_or_hup_to_the_detached_supervisor_stops_its_server(
        tmp_path: Path, no_leftovers, sig: signal.Signals) -> None:
    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    args, env, record = _detached(ws.root, no_leftovers, port)
    os.kill(record["supervisor_pid"], sig)
    assert _gone(no_leftovers) == []
    after = run_cli(*args, "--json", "serve", "status", env=env)
    assert after.code == 1 and after.json()["data"]["state"] == "stopped", after


def test_a_server_record_whose_pid_is_reused_is_not_running(tmp_path: Path) -> None:
    from dsv4_offload.serving import supervisor as sv

    me = procs.identity()
    record = sv.ServeRecord(me.pid, me.pid, "http://127.0.0.1:1", "log", [], "now", "running",
                            server_start_time=(me.start_time or 0) + 1,
                            supervisor_start_time=(me.start_time or 0) + 1)
    assert not sv.record_alive(record)
    assert "gone" in record.describe()
    record.server_start_time = me.start_time
    assert sv.record_alive(record)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
                         ids=["SIGTERM", "SIGHUP", "SIGKILL"])
def test_a_signal_while_a_detached_server_loads_leaves_nothing(
        tmp_path: Path, no_leftovers, sig: signal.Signals) -> None:
    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    args, env = _serve_cli(ws.root, no_leftovers, port, "--mode", "slow-start",
                           "--start-delay", "60")
    proc = _start([*args, "serve", "--detach"], env)
    _wait_for(lambda: any(p.info["cmdline"][1:2] and
                          p.info["cmdline"][1].endswith("standin_server.py")
                          for p in leftovers(no_leftovers)), "the stand-in's start")
    proc.send_signal(sig)
    code, err = _finish(proc)
    # SIGKILL: the command never said the server was up; the stage's sentinel stops the
    # supervisor it had started (which stops its server), as Ctrl-C would have
    assert code == (-sig if sig == signal.SIGKILL else 128 + sig), err
    assert _gone(no_leftovers) == []


def test_an_unusable_workspace_is_one_line(tmp_path: Path) -> None:
    """A workspace this user cannot read or write: exit 2, one line naming the directory,
    its owner and the fix (a JSON document with --json). As root, access is simulated."""
    ws = tmp_path / "ws"
    (ws / ".dsv4").mkdir(parents=True)
    ws.chmod(0o500)
    program = ("import os, sys\n"
               "from dsv4_offload.cli import app\n"
               "real = os.access\n"
               "if os.geteuid() == 0:\n"
               "    os.access = lambda p, m, **k: (False if str(p).startswith(sys.argv[1])\n"
               "                                   else real(p, m, **k))\n"
               "app.main(sys.argv[2:])\n")
    try:
        for extra in ([], ["--json"]):
            proc = subprocess.run(
                [sys.executable, "-c", program, str(ws), *HOST, "-w", str(ws), *extra, "run",
                 "--to", "doctor"], capture_output=True, text=True, timeout=WAIT_S,
                env={**os.environ, "DSV4_STAGE_PACKAGE": "fakestages",
                     "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                    os.environ.get("PYTHONPATH", "")])})
            assert proc.returncode == 2, proc
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
            owner = __import__("pwd").getpwuid(ws.stat().st_uid).pw_name
            assert str(ws) in lines[0] and f"owned by {owner}" in lines[0]
            if os.geteuid() == 0:  # root is not told to chown to itself (issue 28)
                assert "chown -R" not in lines[0] and "read-only or pseudo filesystem" in lines[0]
            else:
                assert "chown" in lines[0]
            assert "--workspace" in lines[0]
            if extra:
                doc = json.loads(proc.stdout)
                assert doc["status"] == "error" and doc["data"]["exit_code"] == 2
    finally:
        ws.chmod(0o700)


def test_the_lock_owner_is_judged_by_pid_and_start_time(tmp_path: Path, fake_stages_env) -> None:
    """The lock names its holder with its start time: a holder whose pid is gone (the lock
    held by a process it started) is told apart from a live one."""
    import fcntl

    ws = tmp_path / "ws"
    (ws / ".dsv4").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(ws / ".dsv4" / "lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        fh.write(f"pid {dead.pid} (run, since x) start 1\n")
        fh.flush()
        res = run_cli(*HOST, "-w", str(ws), "run", env=fake_stages_env)
        assert res.code == 3, res
        assert f"pid {dead.pid} (run, since x), which has exited" in res.err, res
        me = procs.identity()
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {me.pid} (run, since x) start {me.start_time}\n")
        fh.flush()
        res = run_cli(*HOST, "-w", str(ws), "run", env=fake_stages_env)
        assert res.code == 3 and "exited" not in res.err, res
        assert f"in use by pid {me.pid} (run, since x);" in res.err, res


def test_an_unreadable_state_file_names_the_owner_not_move_it_aside(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`status` on a workspace it cannot read: the owner and the fix, never 'move it aside'
    (which would lose another user's state). As root, the refusal is simulated."""
    from dsv4_offload.core.errors import InputError
    from dsv4_offload.workspace.store import Workspace

    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    ws.state_file.write_text("{}")
    real = Path.read_text

    def refuse(self: Path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self == ws.state_file:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(InputError) as caught:
        ws.read_state()
    message = caught.value.one_line()
    assert "move it aside" not in message and "owned by" in message
    assert "cannot read it" in message and str(ws.meta_dir) in message
