"""`dsv4-offload serve ...` and `accept` as a user runs them, against fixture hosts."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
from conftest import HOST_RECIPE, run_cli, run_cli_inproc
from serve_helpers import (
    free_port,
    leftovers,
    make_workspace,
    standin_overrides,
    standin_servers,
)

from dsv4_offload.workspace.store import Workspace

HOSTS = Path(__file__).parent / "fixtures" / "hosts"


def host_env(name: str) -> dict[str, str]:
    root = HOSTS / name
    env = {"DSV4_HOST_ROOT": str(root)}
    if (root / "npu-smi-info.txt").is_file():
        env["DSV4_NPU_SMI"] = f"cat {shlex.quote(str(root / 'npu-smi-info.txt'))}"
    return env


def standin_on_host(tmp_path: Path, tag: str, *args: str
                    ) -> tuple[Workspace, int, list[str], dict[str, str]]:
    """What a serve test of the CLI starts from: a workspace, a free port, the global words
    that serve the stand-in (``args``: its flags) on this host (HOST_RECIPE), and the
    environment of the x86 host fixture without an NPU."""
    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    sets = [a for o in standin_overrides(tag, port, *args) for a in ("--set", o)]
    base = ["--workspace", str(ws.root), "-r", str(HOST_RECIPE), *sets]
    return ws, port, base, host_env("x86-no-npu")


def test_serve_print_on_the_kunpeng_host_shows_the_launch_line(tmp_path):
    ws = make_workspace(tmp_path / "ws")
    res = run_cli_inproc("--workspace", str(ws.root), "--json", "serve", "--print",
                         env=host_env("kunpeng920-910b"))
    assert res.code == 0, res
    doc = res.json()
    assert doc["schema"] == 1 and doc["command"] == "serve" and doc["status"] == "ok"
    argv = doc["data"]["argv"]
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--kt-threadpool-count") + 1] == "8"
    assert argv[argv.index("--kt-cpuinfer") + 1] == "128"
    assert doc["data"]["env_set"]["KT_NSA_COMPRESSOR_MODE"] == "split"
    # no CANN on this machine: shown as a note, the rest of the plan still printed
    assert any("CANN set_env script not found" in n for n in doc["data"]["notes"])
    human = run_cli_inproc("--workspace", str(ws.root), "serve", "--print", "--longest-prompt",
                           "9000", env=host_env("kunpeng920-910b"))
    assert human.code == 0, human
    assert "--chunked-prefill-size 9088" in human.out
    assert "'--kt-weight-path'" not in human.out and "{layer_idx}" in human.out


def test_serve_print_with_a_bad_device_is_one_line(tmp_path):
    ws = make_workspace(tmp_path / "ws")
    res = run_cli_inproc("--workspace", str(ws.root), "serve", "--print", "--device", "42",
                         env=host_env("kunpeng920-910b"))
    assert res.code == 2
    assert res.err.strip().startswith("error: --device 42: npu-smi lists devices")
    assert "Traceback" not in res.err


def test_serve_without_npu_or_cann_says_what_to_do(tmp_path):
    ws = make_workspace(tmp_path / "ws")
    # the serve stage on this host (HOST_RECIPE): what it says without an NPU or CANN
    res = run_cli_inproc("--workspace", str(ws.root), "-r", str(HOST_RECIPE), "serve",
                         env=host_env("x86-no-npu"))
    assert res.code != 0
    assert "CANN" in res.err and "Traceback" not in res.err


def test_detach_status_logs_accept_stop_lifecycle(tmp_path, no_leftovers):
    # start and stop by run_cli, as processes: the point is a detached server outliving the
    # CLI process that started it, and `serve stop` from another process proving it ours;
    # what the commands between answer is the point of those (in this process)
    ws, port, base, env = standin_on_host(tmp_path, no_leftovers, "--mode", "good")
    started = run_cli(*base, "serve", "--detach", env=env)
    assert started.code == 0, started
    assert f"http://127.0.0.1:{port}" in started.out
    try:
        status = run_cli_inproc(*base, "--json", "serve", "status", env=env)
        assert status.code == 0, status
        assert status.json()["data"]["running"] and status.json()["data"]["healthy"]
        logs = run_cli_inproc(*base, "serve", "logs", "-n", "200", env=env)
        assert "KV Cache is allocated" in logs.out
        accepted = run_cli_inproc(*base, "accept", env=env)
        assert accepted.code == 0, accepted
        assert "probe capital-en" in accepted.out and "tok/s" in accepted.out
        as_json = run_cli_inproc(*base, "--json", "accept", env=env)
        assert as_json.code == 0 and as_json.json()["data"]["data"]["status"] == "ok"
        state = run_cli_inproc(*base, "--json", "status", env=env)
        stages = {s["name"]: s for s in state.json()["data"]["stages"]}
        assert stages["serve"]["state"] == "done" and stages["accept"]["state"] == "done"
    finally:
        stopped = run_cli(*base, "serve", "stop", env=env)
    assert stopped.code == 0 and "stopped pid" in stopped.out
    assert not leftovers(no_leftovers)
    after = run_cli_inproc(*base, "serve", "status", env=env)
    assert after.code == 1 and "not running (stopped" in after.out


def test_accept_against_a_dead_url_fails_with_a_fix(tmp_path):
    ws = make_workspace(tmp_path / "ws")
    res = run_cli_inproc("--workspace", str(ws.root), "-r", str(HOST_RECIPE), "--json", "accept",
                         "--url", f"http://127.0.0.1:{free_port()}", "--api", "openai")
    assert res.code == 1
    doc = res.json()
    assert doc["status"] == "failed"
    assert "is the server up?" in doc["data"]["problems"][0]["message"]


def _standin_cli(ws_root: Path, tag: str, port: int) -> tuple[list[str], dict[str, str]]:
    sets = [a for o in standin_overrides(tag, port, "--mode", "good") for a in ("--set", o)]
    env = {**os.environ, **host_env("x86-no-npu")}
    env.pop("DSV4_WORKSPACE", None)
    # a stand-in server on this host (HOST_RECIPE)
    return [sys.executable, "-m", "dsv4_offload", "--workspace", str(ws_root),
            "-r", str(HOST_RECIPE), *sets], env


def _wait_http(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


def test_ctrl_c_on_a_foreground_serve_stops_the_server(tmp_path, no_leftovers):
    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    cmd, env = _standin_cli(ws.root, no_leftovers, port)
    proc = subprocess.Popen([*cmd, "serve"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")
        server = standin_servers(no_leftovers)
        assert server and server[0].ppid() == proc.pid  # the CLI holds it: nothing detached
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "KV Cache is allocated" in err  # the server's log, streamed to the console
    assert not leftovers(no_leftovers)


def test_logs_follow_ends_when_the_server_stops(tmp_path, no_leftovers):
    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    cmd, env = _standin_cli(ws.root, no_leftovers, port)
    assert subprocess.run([*cmd, "serve", "--detach"], env=env, capture_output=True,
                          timeout=60).returncode == 0
    follow = subprocess.Popen([*cmd, "serve", "logs", "-f"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
        time.sleep(0.5)
        assert subprocess.run([*cmd, "serve", "stop"], env=env, capture_output=True,
                              timeout=60).returncode == 0
        out, _ = follow.communicate(timeout=20)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert "KV Cache is allocated" in out
    assert "GET /health" in out  # a line written after `logs -f` started
    assert follow.returncode == 0


def test_ctrl_c_while_a_detached_server_loads_leaves_nothing(tmp_path, no_leftovers):
    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    sets = [a for o in standin_overrides(no_leftovers, port, "--mode", "slow-start",
                                         "--start-delay", "60") for a in ("--set", o)]
    env = {**os.environ, **host_env("x86-no-npu")}
    # a stand-in server on this host (HOST_RECIPE)
    cmd = [sys.executable, "-m", "dsv4_offload", "--workspace", str(ws.root),
           "-r", str(HOST_RECIPE), *sets]
    proc = subprocess.Popen([*cmd, "serve", "--detach"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not standin_servers(no_leftovers):
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    deadline = time.monotonic() + 10  # the supervisor stops its server, then exits
    while leftovers(no_leftovers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftovers(no_leftovers)


def test_logs_shows_the_last_n_lines_and_none_for_zero(tmp_path):
    ws = make_workspace(tmp_path / "ws")
    log = ws.log_dir("serve") / "server-20260101-000000-32.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("one\ntwo\nthree\n")
    base = ("--workspace", str(ws.root), "serve", "logs")
    assert run_cli_inproc(*base, "-n", "2").out.splitlines() == ["two", "three"]
    assert run_cli_inproc(*base, "-n", "5").out.splitlines() == ["one", "two", "three"]
    assert run_cli_inproc(*base, "-n", "0").out == ""
