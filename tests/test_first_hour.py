"""Issue 28, the first hour: what a new user meets on a bare non-target host, read as they
read it (a captured host with a small disk and no NPU, no docker). The commands run in this
process where what they answer is the point; README command 1 runs the console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HOSTS = Path(__file__).parent / "fixtures" / "hosts"
SCRIPT = Path(sys.executable).parent / "dsv4-offload"
CHUNK_LINE = ("--chunked-prefill-size -1 (serve.extra_args): must be a positive multiple of the "
              "page size 128 (the launcher refuses -1, L33-37: it overruns kt-kernel's buffer); "
              "set serve.chunked_prefill_size or CHUNKED_PREFILL_SIZE")


def cli(tmp_path: Path, *args: str, host: str | None = "x86-no-npu",
        path: str | None = None, script: bool = False,
        **more_env: str) -> subprocess.CompletedProcess[str]:
    """The command on a workspace in ``tmp_path``, its host the fixture ``host``, with only
    this environment (no DSV4_* or ASCEND_* of the caller's). In this process (what the
    command answers is the point: conftest.run_cli_inproc); ``script``: the console script as
    a process, as README command 1 runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_", "ASCEND_"))}
    env["COLUMNS"] = "240"
    if host is not None:
        env["DSV4_HOST_ROOT"] = str(HOSTS / host)
    if path is not None:
        env["PATH"] = path
    env.update(more_env)
    argv = ["--workspace", str(tmp_path / "ws"), *args]
    if not script:
        from conftest import run_cli_inproc

        res = run_cli_inproc(*argv, env=env, whole_env=True)
        return subprocess.CompletedProcess(argv, res.code, res.out, res.err)
    if not SCRIPT.exists():
        pytest.skip(f"no console script at {SCRIPT} (install the project into this venv)")
    return subprocess.run([str(SCRIPT), *argv], capture_output=True, text=True, env=env,
                          timeout=180, stdin=subprocess.DEVNULL)


def test_readme_command_1_shows_doctors_table_with_every_failing_row(tmp_path: Path) -> None:
    # x86-no-npu: an x86 host, no NPU, 80 GiB free (df.txt), no docker client; README
    # command 1's console script, as a process
    proc = cli(tmp_path, "run", script=True)
    assert proc.returncode == 1, proc
    out = proc.stdout
    table = out.index("┃check")
    for row in ("│arch", "│cpu-flags", "│cores", "│memory", "│disk", "│npu-smi", "│device-nodes"):
        line = next(ln for ln in out[table:].splitlines() if ln.startswith(row))
        assert "│ fail" in line, line
    # one disk figure: what `run` would write, and how much more it needs, in doctor's row
    disk = next(ln for ln in out.splitlines() if ln.startswith("fail disk: "))
    assert "the run needs 482.1 GiB more free space" in disk
    assert "it still writes 562.1 GiB" in disk and "only 80.0 GiB are free there" in disk
    assert "doctor: failed" in out
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: run stopped before any work: doctor failed (see its table); fix those rows "
        "and rerun `run`")
    assert not (tmp_path / "ws" / "weights").exists()  # nothing downloaded, nothing fetched
    assert not (tmp_path / "ws" / "sources").exists()


def test_run_json_refusal_is_one_event_line(tmp_path: Path) -> None:
    proc = cli(tmp_path, "--json", "run")
    assert proc.returncode == 1, proc
    events = [json.loads(line) for line in proc.stdout.splitlines()]  # each line one event
    assert events[-1]["event"] == "run.refused" and events[-1]["exit"] == 1
    failed = next(e for e in events if e["event"] == "stage.failed")
    assert failed["stage"] == "doctor" and "disk" in failed["error"]


def test_doctor_and_run_agree_on_the_disk_figure(tmp_path: Path) -> None:
    doc = json.loads(cli(tmp_path, "--json", "doctor").stdout)
    disk = {c["name"]: c for c in doc["data"]["data"]["checks"]}["disk"]
    assert disk["status"] == "fail"
    assert "this run still writes 562.1 GiB" in disk["required"]
    assert "the delivery's serial way" in disk["required"] and "412.1 GiB" in disk["required"]
    plan = json.loads(cli(tmp_path, "--json", "run", "--dry-run").stdout)["data"]
    written = sum(fs["need_bytes"] for fs in plan["disk"])
    assert f"{written / 1024**3:.1f}" == "562.1"


def test_recipe_validate_refuses_what_serve_would_refuse(tmp_path: Path) -> None:
    bad = ["--set", 'serve.extra_args=["--chunked-prefill-size","-1"]']
    for args in (("recipe", "validate"), ("doctor",), ("run", "--dry-run")):
        proc = cli(tmp_path, *bad, *args)
        assert proc.returncode == 2, (args, proc)
        assert proc.stderr.strip() == f"error: {CHUNK_LINE}", (args, proc.stderr)


def test_recipe_validate_warns_of_an_unknown_flag_and_a_planned_one(tmp_path: Path) -> None:
    odd = ["--set", 'serve.extra_args=["--chunked-prefill-sise","8192","--page-size","128"]']
    proc = cli(tmp_path, *odd, "recipe", "validate")
    assert proc.returncode == 0, proc
    assert "valid recipe" in proc.stdout
    assert "warning: extra-args: " in proc.stderr  # doctor's row, judged from the recipe
    assert "did you mean --chunked-prefill-size?" in proc.stderr
    assert ("--page-size (serve.extra_args) repeats a flag the plan sets" in proc.stderr)
    doc = json.loads(cli(tmp_path, *odd, "--json", "doctor").stdout)
    row = {c["name"]: c for c in doc["data"]["data"]["checks"]}["extra-args"]
    assert row["status"] == "warn" and "--chunked-prefill-sise" in row["observed"]


def _bare_path(tmp_path: Path, docker: str | None = None) -> str:
    """A PATH with git and python but no docker (or a docker whose daemon is down)."""
    import shutil

    bin_dir = tmp_path / ("bin-docker-down" if docker else "bin")
    bin_dir.mkdir(exist_ok=True)
    for tool in ("git", "sh"):
        found = shutil.which(tool)
        if found and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(found)
    if docker is not None:
        (bin_dir / "docker").write_text(docker)
        (bin_dir / "docker").chmod(0o755)
    return str(bin_dir)


DAEMON_DOWN = ("#!/bin/sh\necho 'Cannot connect to the Docker daemon at "
               "unix:///var/run/docker.sock. Is the docker daemon running?' >&2\nexit 1\n")


def test_accept_url_checks_a_server_with_no_docker_on_path(tmp_path: Path) -> None:
    from serve_helpers import STANDIN, free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, str(STANDIN), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import time

        import requests

        for _ in range(100):
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.1)
        for docker in (None, DAEMON_DOWN):  # no client; a client whose daemon is down
            proc = cli(tmp_path, "accept", "--url", f"http://127.0.0.1:{port}", "--quick",
                       "--no-throughput-gate", host=None, path=_bare_path(tmp_path, docker))
            assert "docker" not in proc.stderr.lower(), proc.stderr
            assert "warning: running" not in proc.stderr  # no stage ran in a container's stead
            assert "GET /health" in proc.stdout, proc
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_accept_url_failure_does_not_send_to_this_workspaces_logs(tmp_path: Path) -> None:
    from serve_helpers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    proc = cli(tmp_path, "--runtime", "host", "accept", "--url", url, host=None,
               path=_bare_path(tmp_path))
    assert proc.returncode == 1, proc
    assert "serve logs" not in proc.stdout
    assert f"the server at {url} did not answer: check it is up and its own log" in proc.stdout
    assert "warning: running" not in proc.stderr  # neither serve nor build ran


def test_a_stage_that_needs_the_engine_names_its_state_and_runtime_host(tmp_path: Path) -> None:
    proc = cli(tmp_path, "selftest", host=None, path=_bare_path(tmp_path, DAEMON_DOWN))
    assert proc.returncode == 1, proc
    line = proc.stderr.strip()
    assert line.startswith("error: selftest runs in container "), line
    assert "Is the docker daemon running?" in line and "systemctl start docker" in line
    assert line.endswith("or `--runtime host` runs selftest on this host instead, with this "
                         "host's compiler, python and libraries rather than the image's"), line


def test_read_only_commands_need_no_engine_and_no_npu(tmp_path: Path) -> None:
    bare = _bare_path(tmp_path)
    printed = cli(tmp_path, "serve", "--print", path=bare)  # x86-no-npu: no NPU
    assert printed.returncode == 0, printed
    assert ("# no healthy NPU reported by npu-smi: the device is a placeholder, <N>; on the "
            "target the idlest healthy card is taken (or --device N)") in printed.stdout
    assert "export ASCEND_RT_VISIBLE_DEVICES='<N>'" in printed.stdout
    assert cli(tmp_path, "status", path=bare).returncode == 0
    report = cli(tmp_path, "report", "-o", str(tmp_path / "r.tar.gz"), path=bare)
    assert report.returncode == 0, report
    shown = cli(tmp_path, "recipe", "show", "dsv4-flash-x86-dev", path=bare)
    assert shown.returncode == 0 and "name: dsv4-flash-x86-dev" in shown.stdout, shown
    recipes = Path(__file__).parents[1] / "src" / "dsv4_offload" / "data" / "recipes"
    by_file = cli(tmp_path, "recipe", "show", str(recipes / "dsv4-flash-a3.yaml"), path=bare)
    assert by_file.returncode == 0 and "name: dsv4-flash-a3" in by_file.stdout, by_file


def test_a_failing_row_stops_the_stages_it_guards_and_what_feeds_them(
        tmp_path: Path, fake_stages_env) -> None:
    from conftest import SMALL_RECIPE
    from conftest import run_cli_inproc as run_cli

    ws = tmp_path / "ws"
    (ws / "behave").mkdir(parents=True)
    (ws / "behave" / "doctor").write_text("rows libhwloc")  # guards the build alone
    res = run_cli("-r", str(SMALL_RECIPE), "-w", str(ws), "run", "--to", "patch",
                  env=fake_stages_env)
    assert res.code == 1, res  # doctor failed, and says so
    assert (ws / "ran.log").read_text().split() == ["doctor", "fetch", "patch"]
    res = run_cli("-r", str(SMALL_RECIPE), "-w", str(ws), "run", "--to", "build",
                  env=fake_stages_env)
    assert res.code == 1, res
    # fetch and patch run only to feed the build, which libhwloc guards: nothing more ran
    assert (ws / "ran.log").read_text().split() == ["doctor", "fetch", "patch", "doctor"]
    assert "fetch: blocked — comes after doctor, whose libhwloc failed" in res.out, res


def test_every_doctor_row_is_declared_once(tmp_path: Path) -> None:
    from dsv4_offload.core.preflight import DECLARED, Where, declaration

    assert len({d.pattern for d in DECLARED}) == len(DECLARED)
    for host in ("x86-no-npu", "kunpeng920-910b"):
        for recipe in ("dsv4-flash-910b", "dsv4-flash-a3", "dsv4-flash-arm-rehearsal",
                       "dsv4-flash-x86-dev"):
            doc = json.loads(cli(tmp_path, "-r", recipe, "--json", "doctor", host=host).stdout)
            for row in doc["data"]["data"]["checks"]:
                assert declaration(row["name"]) is not None, (recipe, row["name"])
                assert set(row["guards"]) <= {"doctor", "fetch", "patch", "build", "selftest",
                                              "download", "convert", "verify-gguf", "serve",
                                              "accept"}, row
                assert row["where"] in {str(w) for w in Where}
    assert declaration("serve-bind").where is Where.RECIPE  # type: ignore[union-attr]


def test_a_workspace_through_a_file_is_said_as_such(tmp_path: Path) -> None:
    afile = tmp_path / "hostname"
    afile.write_text("x\n")
    for cmd in ("status", "run"):
        proc = subprocess.run([str(SCRIPT), "-w", str(afile / "ws"), cmd], capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert proc.returncode == 2, proc
        assert "unreadable JSON" not in proc.stderr
        assert f"{afile} is a file, not a directory; pick another --workspace DIR" in proc.stderr


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="as root")
def test_root_is_not_told_to_chown_a_pseudo_filesystem(tmp_path: Path) -> None:
    proc = subprocess.run([str(SCRIPT), "-w", "/sys/dsv4-ws", "run"], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc
    assert "chown -R" not in proc.stderr and "run as root" not in proc.stderr, proc.stderr
    assert "you (root) cannot read and write it: a read-only or pseudo filesystem" in proc.stderr


def test_a_failed_fetch_says_its_error_once(tmp_path: Path) -> None:
    """Every git URL goes through a proxy on a closed local port: the fetch fails as offline
    (no host is ever reached). Its error is in fetch's table, once, as `fetch` shows it; the
    progress line and the end of the run point there."""
    dead = "http://127.0.0.1:9"
    proc = cli(tmp_path, "-r", "dsv4-flash-x86-dev", "--runtime", "host", "run", "--to",
               "fetch", https_proxy=dead, HTTPS_PROXY=dead, http_proxy=dead, no_proxy="",
               NO_PROXY="", DSV4_CACHE=str(tmp_path / "cache"))
    assert proc.returncode == 1, proc
    out = proc.stdout
    assert out.count("ktransformers': commit") == 1, out  # the error, once
    assert out.count("--mirror ktransformers=URL") == 1, out  # its fix, once, in the fix column
    assert out.index("┃check") < out.index("fetch: failed —"), out  # doctor's table first
    assert "fetch failed: its error is shown above (log: " in out
    assert "Traceback" not in proc.stderr


def test_status_says_whose_records_it_shows(tmp_path: Path) -> None:
    """A workspace shared by two recipes: `status` under one names the stages recorded under
    the other, and how to read them as that recipe does."""
    first = cli(tmp_path, "-r", "dsv4-flash-x86-dev", "--runtime", "host", "run", "--to",
                "doctor")
    assert first.returncode == 1, first  # the x86-no-npu fixture fails some of its rows
    proc = cli(tmp_path, "--json", "status")
    doc = json.loads(proc.stdout)
    assert doc["status"] == "warn", doc
    assert doc["data"]["warnings"] == [
        "doctor: recorded under recipe dsv4-flash-x86-dev, not dsv4-flash-910b; "
        "`-r dsv4-flash-x86-dev status` reads them as that recipe does"]
    doctor = next(r for r in doc["data"]["stages"] if r["name"] == "doctor")
    assert doctor["recipe"] == "dsv4-flash-x86-dev"
    same = json.loads(cli(tmp_path, "--json", "-r", "dsv4-flash-x86-dev", "status").stdout)
    assert same["data"]["warnings"] == [] and all(r["recipe"] is None
                                                  for r in same["data"]["stages"])


@pytest.mark.slow
def test_readme_command_1_from_a_fresh_venv(tmp_path: Path) -> None:
    """README command 1 as written, in a new venv (the package and its dependencies from
    the registry, as a new user gets them), on the small-disk host fixture: doctor's table
    first, with every failing row, then the refusal. The fast tier's seam:
    tests/test_first_hour.py::test_readme_command_1_shows_doctors_table_with_every_failing_row
    runs the same console script from the test venv."""
    import shutil
    import socket

    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        pytest.skip("the package registry (pypi.org) is not reachable: README command 1 "
                    "installs from it")
    root = Path(__file__).resolve().parents[1]
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(root), str(clone)], check=True, timeout=120)
    if (root / ".git").exists():  # the tree under test, not its last commit
        for rel in subprocess.run(["git", "-C", str(root), "ls-files", "-m", "-o",
                                   "--exclude-standard"], capture_output=True, text=True,
                                  check=True).stdout.split():
            src = root / rel
            if src.is_file():
                (clone / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, clone / rel)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DSV4_", "ASCEND_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(COLUMNS="240", DSV4_HOST_ROOT=str(HOSTS / "x86-no-npu"),
               DSV4_CACHE=str(tmp_path / "cache"))
    # README command 1, word for word, run by a shell in the clone
    proc = subprocess.run(
        ["bash", "-c", "python3 -m venv .venv && .venv/bin/pip install -q . && "
         ".venv/bin/dsv4-offload run"], cwd=clone, env=env, capture_output=True, text=True,
        timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc
    out = proc.stdout
    before = out[:out.index("┏")].splitlines()  # nothing but doctor's start before its table
    assert before[0] == "run: pipelined, 1 to run (doctor)", out[:400]
    assert before[1].startswith("doctor: started (pid ") and len(before) == 2, out[:400]
    assert out[out.index("┏"):].splitlines()[1].startswith("┃check"), out[:600]
    for row in ("│arch", "│cpu-flags", "│cores", "│memory", "│disk", "│npu-smi", "│device-nodes"):
        line = next(ln for ln in out.splitlines() if ln.startswith(row))
        assert "│ fail" in line, line
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: run stopped before any work: doctor failed (see its table); fix those rows "
        "and rerun `run`")
