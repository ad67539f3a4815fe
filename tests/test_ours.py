"""A signal goes only to a process proven ours: after the server and its supervisor are
killed, a newcomer holding the server's pid (and leading its own group) is left alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli
from serve_helpers import free_port, leftovers, make_workspace
from test_serve_cli import host_env, standin_on_host

from dsv4_offload.core import procs

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def _gone(pid: int, timeout: float = 30) -> None:
    """Wait until ``pid`` is no process at all (init reaps the orphaned zombie)."""
    deadline = time.monotonic() + timeout
    while (procs.PROC / str(pid)).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (procs.PROC / str(pid)).exists(), f"pid {pid} still listed"


def take_pid(pid: int, argv: list[str]) -> subprocess.Popen[bytes]:
    """Start ``argv`` as process ``pid`` (the kernel hands out ns_last_pid + 1), or skip."""
    for _ in range(50):
        try:
            NS_LAST_PID.write_text(str(pid - 1))
        except OSError as exc:
            pytest.skip(f"{NS_LAST_PID} is not writable here ({exc.strerror}): the pid "
                        "reuse needs root in the initial pid namespace")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        if proc.pid == pid:
            return proc
        proc.kill()  # another process took it first: again
        proc.wait()
    pytest.skip(f"could not get pid {pid} in 50 tries (a busy machine)")


def test_serve_stop_leaves_a_newcomer_holding_the_dead_servers_pid_alone(tmp_path: Path,
                                                                          no_leftovers: str):
    ws, port, base, env = standin_on_host(tmp_path, no_leftovers, "--mode", "good")
    started = run_cli(*base, "serve", "--detach", env=env)
    assert started.code == 0, started
    record = json.loads(ws.serve_record.read_text())
    server, supervisor = record["server_pid"], record["supervisor_pid"]
    # the OOM killer, a kill -9: the supervisor and the server's whole group die at once
    os.killpg(supervisor, signal.SIGKILL)
    os.killpg(server, signal.SIGKILL)
    _gone(server)
    _gone(supervisor)
    assert not leftovers(no_leftovers)
    # a group leader not ours (a shell job, a daemon) is handed the server's pid
    stranger = take_pid(server, ["setsid", "sleep", "300"])
    try:
        time.sleep(0.2)  # setsid has made it a group leader, then exec'd sleep
        assert os.getpgid(server) == server
        status = run_cli(*base, "serve", "status", env=env)
        assert status.code == 1, status
        assert "running" not in status.out.replace("not running", ""), status.out
        stopped = run_cli(*base, "serve", "stop", env=env)
        assert stopped.code == 0, stopped
        time.sleep(0.5)
        assert stranger.poll() is None, "serve stop signalled a process that is not ours"
    finally:
        stranger.kill()
        stranger.wait()


def test_the_sweep_of_a_killed_stage_leaves_a_reused_group_alone(tmp_path: Path) -> None:
    """The group notes of a killed stage name a group whose leader is gone; a newcomer that
    took the leader's pid and leads its own group is not swept."""
    notes = procs.GroupNotes(tmp_path / "groups-convert")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    notes.begin(procs.Identity(dead.pid, 1))
    old = subprocess.Popen(["sleep", "300"], start_new_session=True)
    notes.note(old.pid)
    old.kill()
    old.wait()
    _gone(old.pid)
    time.sleep(0.05)  # start times count in clock ticks (10 ms): a newcomer is a tick later
    stranger = take_pid(old.pid, ["setsid", "sleep", "300"])
    try:
        time.sleep(0.2)
        assert notes.leftovers() == []
        assert notes.sweep(0.5) == []
        assert stranger.poll() is None, "the sweep signalled a process that is not ours"
    finally:
        stranger.kill()
        stranger.wait()


def test_what_is_left_of_our_group_is_found_by_its_mark_alone(tmp_path: Path) -> None:
    """The leader gone, members carrying our mark are ours and stopped; a member of the
    same group id without it (or started before the leader) is not."""
    from dsv4_offload.core.runner import start

    # our group: a leader that leaves a child behind in its group, then exits
    script = "sleep 300 & echo $!; exit 0"
    child = start(["sh", "-c", script], outlive=True)
    assert child.proc.stdout is not None
    orphan = int(child.proc.stdout.readline())
    leader, leader_start = child.pid, procs.start_time(child.pid)
    child.proc.wait()
    try:
        assert procs.owned_members(leader, leader_start, procs.own_mark()) == [orphan]
        assert procs.owned_members(leader, leader_start, "1-1") == []  # another's mark
        assert procs.owned_members(leader, leader_start) == []  # no mark: not proven
        notes = procs.GroupNotes(tmp_path / "groups-x")
        notes.begin(procs.Identity(child.pid, 1))  # an owner long gone
        with open(notes.path, "a") as fh:
            fh.write(f"group {leader} {leader_start} {procs.own_mark()}\n")
        assert notes.leftovers() == [orphan]
        assert notes.sweep(5.0) == [orphan]
        deadline = time.monotonic() + 10
        while procs.alive(orphan) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not procs.alive(orphan)
    finally:
        if procs.alive(orphan):
            os.kill(orphan, signal.SIGKILL)


def test_a_foreground_server_has_the_one_record_status_and_stop_agree_on(
        tmp_path: Path, no_leftovers: str) -> None:
    from test_serve_cli import _standin_cli, _wait_http

    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    cmd, env = _standin_cli(ws.root, no_leftovers, port)
    proc = subprocess.Popen([*cmd, "serve"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    base = ["--workspace", str(ws.root), *cmd[cmd.index("-r"):]]
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")
        status = run_cli(*base, "--json", "serve", "status", env=host_env("x86-no-npu"))
        assert status.code == 0, status
        assert status.json()["data"]["running"] and status.json()["data"]["healthy"]
        stages = {s["name"]: s for s in run_cli(*base, "--json", "status").json()["data"]["stages"]}
        assert stages["serve"]["state"] == "running", stages["serve"]
        stopped = run_cli(*base, "serve", "stop", env=host_env("x86-no-npu"))
        assert stopped.code == 0 and "stopped pid" in stopped.out, stopped
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert "stopped by `dsv4-offload serve stop`" in out + err
    after = run_cli(*base, "serve", "status", env=host_env("x86-no-npu"))
    assert after.code == 1 and "not running (stopped" in after.out, after
    stages = {s["name"]: s for s in run_cli(*base, "--json", "status").json()["data"]["stages"]}
    assert stages["serve"]["state"] != "running", stages["serve"]
    assert not leftovers(no_leftovers)


_SYS_EXIT = {"x86_64": 60, "aarch64": 93}  # exit(2) of the calling thread alone


@pytest.mark.skipif(os.uname().machine not in _SYS_EXIT, reason="exit(2)'s number not known")
def test_a_child_signalled_by_a_parent_still_holding_its_pid_sees_the_parent_dying(
        tmp_path: Path) -> None:
    """The kernel's parent-death signal comes when the thread that started the child leaves.
    The parent here starts its child through the runner (the signal armed), then its main
    thread leaves by exit(2) while a second thread keeps the pid for 3 s, as the first
    thread out of a SIGKILLed scheduler does: the child's getppid() still names the parent,
    and procs.exiting says it is dying."""
    out = tmp_path / "child.json"
    child = (
        "import json, os, signal, sys, time\n"
        "from dsv4_offload.core import procs\n"
        "parent = os.getppid()\n"
        "def seen(signum, frame):\n"
        "    doc = {'same': os.getppid() == parent, 'exiting': procs.exiting(parent)}\n"
        f"    open({str(out)!r} + '.part', 'w').write(json.dumps(doc))\n"
        f"    os.rename({str(out)!r} + '.part', {str(out)!r})\n"
        "    os._exit(0)\n"
        "signal.signal(signal.SIGTERM, seen)\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n")
    parent = (
        "import ctypes, sys, threading, time\n"
        "from dsv4_offload.core import runner\n"
        f"c = runner.start([sys.executable, '-c', {child!r}], outlive=False)\n"
        "assert c.proc.stdout.readline() == b'ready\\n'\n"
        "threading.Thread(target=time.sleep, args=(3,)).start()\n"
        f"ctypes.CDLL(None).syscall({_SYS_EXIT[os.uname().machine]}, 0)\n")
    proc = subprocess.run([sys.executable, "-c", parent], timeout=30, capture_output=True)
    assert proc.returncode == 0, proc
    doc = json.loads(out.read_text())
    assert doc == {"same": True, "exiting": True}, doc
    assert not procs.exiting(os.getpid())  # a live process with threads is not dying
