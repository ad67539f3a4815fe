"""The pipeline through the real CLI, with instrumented stages: resume, staleness, lock.

`run` runs the stage graph (tests/test_schedule.py tests what is its own); the tests here
that are about the order of the stages, or about stopping at the first failure, say
`--serial`, the run as it was before the graph, which keeps both."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CLI, SMALL_RECIPE, run_cli_inproc

ALL = ["doctor", "fetch", "patch", "build", "selftest", "download", "convert", "verify-gguf",
       "serve", "accept"]


# the pipeline on one host: every command here names the host recipe (HOST_RECIPE says why),
# with sets of a few KiB (SMALL_RECIPE: the stand-in stages write none of the 562 GiB)
HOST = ["-r", str(SMALL_RECIPE)]


@pytest.fixture
def cli():  # type: ignore[no-untyped-def]
    # the commands in this process; a killed or a background run is a real process
    # (start_background), and the stages a run starts are real processes either way
    def run(*args: str, **kwargs):  # type: ignore[no-untyped-def]
        return run_cli_inproc(*HOST, *args, **kwargs)

    return run


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    return tmp_path / "ws"


def ran(ws: Path) -> list[str]:
    log = ws / "ran.log"
    return log.read_text().split() if log.exists() else []


def behave(ws: Path, stage: str, what: str | None) -> None:
    path = ws / "behave" / stage
    if what is None:
        path.unlink(missing_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(what)


def states(cli, ws: Path, env: dict[str, str], *extra: str) -> dict[str, dict]:
    res = cli("--json", "-w", str(ws), *extra, "status", env=env)
    assert res.code == 0, res
    return {s["name"]: s for s in res.json()["data"]["stages"]}


def start_background(ws: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    full = dict(os.environ, **env)
    return subprocess.Popen([*CLI, *HOST, "-w", str(ws), *args], env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_new_workspace_is_all_pending(cli, ws: Path, fake_stages_env) -> None:
    st = states(cli, ws, fake_stages_env)
    assert list(st) == ALL
    assert {s["state"] for s in st.values()} == {"pending"}


@pytest.mark.parametrize("mode", [[], ["--serial"]], ids=["graph", "serial"])
def test_run_then_rerun_skips_everything(cli, ws: Path, fake_stages_env, mode) -> None:
    res = cli("-w", str(ws), "run", *mode, env=fake_stages_env)
    assert res.code == 0, res
    # --serial keeps the registry's order; the graph runs the same stages, in its own
    assert ran(ws) == ALL if mode else sorted(ran(ws)) == sorted(ALL)
    first = ran(ws)
    assert {s["state"] for s in states(cli, ws, fake_stages_env).values()} == {"done"}
    again = cli("-w", str(ws), "run", *mode, env=fake_stages_env)
    assert again.code == 0, again
    assert ran(ws) == first  # nothing ran a second time
    assert "skip (done)" in again.out
    prov = (ws / "provenance.json").read_text()
    assert '"accept"' in prov and '"schema": 1' in prov


def test_serve_runs_detached_inside_run(cli, ws: Path, fake_stages_env) -> None:
    res = cli("--json", "-w", str(ws), "run", "--serial", "--to", "serve", env=fake_stages_env)
    assert res.code == 0, res
    # detached, and with a chunk that takes accept's longest bucket (guide §7, §8.1)
    assert res.json()["data"]["stages"]["serve"]["outputs"]["options"] == ["accept_chunk",
                                                                          "detach"]
    # the same in its own process on the graph (--json streams events: its start says)
    res = cli("--json", "-w", str(ws), "run", "--to", "serve", "--force", "serve",
              env=fake_stages_env)
    assert res.code == 0, res
    started = [json.loads(line) for line in res.out.splitlines()
               if '"stage.started"' in line and '"serve"' in line]
    assert started[0]["options"] == {"accept_chunk": True, "detach": True}


def test_killed_run_resumes_from_the_interrupted_stage(cli, ws: Path, fake_stages_env) -> None:
    # in order: every stage before convert done, every one after it pending
    behave(ws, "convert", "sleep")
    proc = start_background(ws, fake_stages_env, "run", "--serial")
    try:
        wait_for(ws / "convert.started")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    st = states(cli, ws, fake_stages_env)
    assert st["convert"]["state"] == "interrupted"
    assert [st[s]["state"] for s in ALL[:6]] == ["done"] * 6
    assert [st[s]["state"] for s in ALL[7:]] == ["pending"] * 3
    behave(ws, "convert", None)
    res = cli("-w", str(ws), "run", "--serial", env=fake_stages_env)
    assert res.code == 0, res
    assert ran(ws) == ALL[:7] + ALL[6:]  # convert again, then the rest, nothing before it


def test_recipe_change_makes_exactly_the_dependents_stale(cli, ws: Path, fake_stages_env) -> None:
    assert cli("-w", str(ws), "run", env=fake_stages_env).code == 0
    st = states(cli, ws, fake_stages_env, "--set", "acceptance.probes.0.prompt=Rome is in")
    assert [s for s in ALL if st[s]["state"] == "stale"] == ["accept"]
    assert "recipe.acceptance.probes[capital-zh].prompt" in st["accept"]["reason"]

    other = "1" * 40
    st = states(cli, ws, fake_stages_env, "--set", f"sources.1.commit={other}")
    stale = [s for s in ALL if st[s]["state"] == "stale"]
    assert stale == ["fetch", "patch", "build", "selftest", "serve", "accept"]
    assert "recipe.sources[sglang].commit" in st["fetch"]["reason"]
    assert "stage.fetch" in st["patch"]["reason"]

    st = states(cli, ws, fake_stages_env, "--set", "conversion.digests.5=" + "0" * 64)
    assert [s for s in ALL if st[s]["state"] == "stale"] == ["verify-gguf", "serve", "accept"]

    # running with the change reruns exactly those stages
    res = cli("-w", str(ws), "--set", f"sources.1.commit={other}", "run", env=fake_stages_env)
    assert res.code == 0, res
    assert ran(ws)[len(ALL):] == ["fetch", "patch", "build", "selftest", "serve", "accept"]


def test_failure_stops_the_run_with_a_failed_record(cli, ws: Path, fake_stages_env) -> None:
    # --serial stops at the first failure (the graph goes on beside it: test_schedule.py)
    behave(ws, "build", "fail")
    res = cli("-w", str(ws), "run", "--serial", env=fake_stages_env)
    assert res.code == 1, res
    assert ran(ws) == ALL[:4]
    assert "run stopped at build" in res.out
    st = states(cli, ws, fake_stages_env)
    assert st["build"]["state"] == "failed"
    assert "told to fail" in st["build"]["reason"]
    assert st["build"]["log"].endswith("logs/build")
    behave(ws, "build", "raise")
    for mode in (["--serial"], [], ["--json"]):  # the graph prints the stage's own error
        res = cli("-w", str(ws), "run", *mode, env=fake_stages_env)  # line too, --json alike
        assert res.code == 2 and res.err.strip() == "error: build: bad input; fix it", res
    assert states(cli, ws, fake_stages_env)["build"]["state"] == "failed"


@pytest.mark.parametrize("mode", [[], ["--serial"]], ids=["graph", "serial"])
def test_ctrl_c_records_the_stage_as_interrupted(cli, ws: Path, fake_stages_env, mode) -> None:
    # issue 19: an interrupt is recorded as such (with how it came), not as a failure
    behave(ws, "fetch", "interrupt")
    res = cli("-w", str(ws), "run", *mode, env=fake_stages_env)
    assert res.code == 130, res
    if mode:
        assert res.err.strip().endswith("interrupted"), res
    else:  # the graph: that branch stopped, named; the download went on
        assert "fetch interrupted: interrupted by Ctrl-C" in res.out, res
    st = states(cli, ws, fake_stages_env)
    assert st["fetch"]["state"] == "interrupted" and "Ctrl-C" in st["fetch"]["reason"]


def test_second_concurrent_run_is_refused(cli, ws: Path, fake_stages_env) -> None:
    behave(ws, "doctor", "sleep")
    proc = start_background(ws, fake_stages_env, "run")
    try:
        wait_for(ws / "doctor.started")
        t0 = time.monotonic()
        res = cli("-w", str(ws), "run", env=fake_stages_env)
        assert time.monotonic() - t0 < 20
        assert res.code == 3, res
        assert f"pid {proc.pid}" in res.err and "is in use" in res.err
        assert ran(ws) == ["doctor"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_from_to_force_and_dry_run(cli, ws: Path, fake_stages_env) -> None:
    res = cli("-w", str(ws), "run", "--from", "fetch", "--to", "patch", env=fake_stages_env)
    assert res.code == 0 and ran(ws) == ["fetch", "patch"], res
    res = cli("--json", "-w", str(ws), "run", "--dry-run", "--force", "fetch",
              env=fake_stages_env)
    plan = {p["stage"]: (p["action"], p["reason"]) for p in res.json()["data"]["plan"]}
    assert plan["fetch"] == ("run", "forced")
    assert plan["patch"][0] == "skip"
    assert plan["build"] == ("run", "pending")
    assert ran(ws) == ["fetch", "patch"]  # a dry run runs nothing
    res = cli("-w", str(ws), "run", "--to", "patch", "--force", "fetch", env=fake_stages_env)
    assert res.code == 0 and ran(ws) == ["fetch", "patch", "doctor", "fetch"], res
    bad = cli("-w", str(ws), "run", "--from", "accept", "--to", "fetch", env=fake_stages_env)
    assert bad.code == 2 and "comes after" in bad.err
    bad = cli("-w", str(ws), "run", "--from", "compile", env=fake_stages_env)
    assert bad.code == 2 and "unknown stage 'compile'" in bad.err


def test_unimplemented_stage_stops_run_and_is_never_done(cli, ws: Path, fake_stages_env) -> None:
    env = dict(fake_stages_env, DSV4_STAGE_PACKAGE="partialstages")
    res = cli("-w", str(ws), "run", env=env)
    assert res.code == 4, res
    assert "stage 'fetch' is not implemented" in res.err
    st = states(cli, ws, env)
    assert st["doctor"]["state"] == "done" and st["fetch"]["state"] == "pending"


def test_state_file_is_valid_json_after_every_step(ws: Path, fake_stages_env) -> None:
    # the state file is replaced atomically: no temp files remain next to it
    full = dict(os.environ, **fake_stages_env)
    done = subprocess.run([*CLI, *HOST, "-w", str(ws), "run"], env=full, capture_output=True,
                          text=True)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    meta = ws / ".dsv4"
    # records.lock: the flock around each read-modify-write of the records (stage processes
    # of one run write them at once)
    assert sorted(p.name for p in meta.iterdir()) == ["lock", "records.lock", "state.json"]


def test_corrupt_state_file_gives_one_line(cli, ws: Path, fake_stages_env) -> None:
    (ws / ".dsv4").mkdir(parents=True)
    (ws / ".dsv4" / "state.json").write_text("{not json")
    res = cli("-w", str(ws), "status", env=fake_stages_env)
    assert res.code == 2 and "state.json: unreadable JSON" in res.err, res
    assert len(res.err.strip().splitlines()) == 1


def test_help_lists_every_command(cli) -> None:
    res = cli("--help")
    assert res.code == 0
    for command in ("run", "status", "doctor", "recipe"):
        assert command in res.out
    assert sys.executable  # the console script equals `python -m dsv4_offload`


@pytest.mark.parametrize("args", [["run", "--frm", "x"], ["nocmd"], ["doctor", "--device", "x"]])
def test_usage_errors_exit_2_without_traceback(cli, args: list[str]) -> None:
    res = cli(*args)
    assert res.code == 2, res
    assert "Traceback" not in res.err and "Error:" in res.err


def test_status_table_shows_bracketed_field_names_verbatim(cli, ws: Path, fake_stages_env) -> None:
    # "[sglang]" is data, not rich markup: the human table must show it as written (fetch's
    # row: the stages after it need not run)
    assert cli("-w", str(ws), "run", "--to", "fetch", env=fake_stages_env).code == 0
    res = cli("-w", str(ws), "--set", "sources.1.commit=" + "1" * 40, "status",
              env=dict(fake_stages_env, COLUMNS="200"))
    assert res.code == 0, res
    assert "recipe.sources[sglang].commit" in res.out


def test_a_stage_running_in_the_container_is_not_judged_by_the_hosts_pids(
        cli, ws: Path) -> None:
    """A running record made in the container carries its name: its pid is the container's,
    so the host says where it runs instead of calling it killed; a host record with a dead
    pid is still interrupted."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (ws / ".dsv4").mkdir(parents=True)
    (ws / ".dsv4" / "state.json").write_text(json.dumps({"schema": 1, "stages": {
        "build": {"status": "running", "pid": dead.pid, "pid_start_time": 1,
                  "started": "2026-12-07T10:00:00+00:00", "container": "dsv4_singlecard"},
        "fetch": {"status": "running", "pid": dead.pid, "pid_start_time": 1,
                  "started": "2026-12-07T10:00:00+00:00"}}}))
    rows = {s["name"]: s for s in cli("-w", str(ws), "--json", "status").json()["data"]["stages"]}
    assert rows["build"]["state"] == "running", rows["build"]
    assert rows["build"]["reason"].startswith(
        f"running in container dsv4_singlecard (pid {dead.pid} there; not checked from here")
    assert rows["fetch"]["state"] == "interrupted", rows["fetch"]
