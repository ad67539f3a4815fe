"""The pipelined `run` (issue 23, the scheduler): stages as processes on the stage graph.

Every test runs the real CLI with the instrumented stages (tests/fakestages), whose
behaviours make overlap observable without sleeping: 'await STAGE' waits until STAGE has
started too (it fails after 30 s if the two never run at once), 'until STAGE STATUS' waits
until STAGE's record says STATUS.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CLI, SMALL_RECIPE, CliResult, run_cli_inproc
from serve_helpers import leftovers

from dsv4_offload.core import procs
from dsv4_offload.workspace.store import Workspace

WRITER = """
import sys
from dsv4_offload.workspace.store import Workspace
ws = Workspace(sys.argv[1])
me = sys.argv[2]
for i in range(int(sys.argv[3])):
    ws.write_stage_record(f"{me}-{i}", {"status": "done", "summary": f"{me} {i}"})
    ws.update_provenance(f"{me}-{i}", {"n": i})
"""


def test_concurrent_record_writes_lose_nothing(tmp_path: Path) -> None:
    """Stage processes of one run write the state file and the provenance at once: each
    read-modify-write holds the records lock, so no writer's record is lost."""
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    writers, each = 4, 25
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(ws.root), f"w{n}", str(each)])
             for n in range(writers)]
    assert [p.wait(timeout=120) for p in procs] == [0] * writers
    stages = ws.read_state()["stages"]
    expected = {f"w{n}-{i}" for n in range(writers) for i in range(each)}
    assert set(stages) == expected
    prov = json.loads(ws.provenance_file.read_text())
    assert expected <= set(prov)
    assert not [p.name for p in ws.meta_dir.iterdir() if p.name.endswith(".tmp")]


# --- the graph through the CLI ---------------------------------------------------------------

ALL = ["doctor", "fetch", "patch", "build", "selftest", "download", "convert", "verify-gguf",
       "serve", "accept"]
HOST = ["-r", str(SMALL_RECIPE)]  # on this host, with sets that pass the disk preflight
WAIT_S = 60
GIB = 1024**3


def _cli(ws: Path, env: dict[str, str], *args: str) -> CliResult:
    # the top command in this process; the stages it schedules are real processes
    return run_cli_inproc(*HOST, "-w", str(ws), *args, env=env)


def _behave(ws: Path, **what: str) -> None:
    (ws / "behave").mkdir(parents=True, exist_ok=True)
    for stage, text in what.items():
        (ws / "behave" / stage.replace("_", "-")).write_text(text)


def _events(res: CliResult) -> list[dict]:
    """The --json stream: every line one JSON object."""
    return [json.loads(line) for line in res.out.splitlines()]


def _first(docs: list[dict], event: str, stage: str) -> dict:
    return next(d for d in docs if d["event"] == event and d.get("stage") == stage)


def _t(doc: dict) -> float:
    return dt.datetime.fromisoformat(doc["t"]).timestamp()


def _start(ws: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    full = {**os.environ, **env}
    full.pop("DSV4_WORKSPACE", None)
    return subprocess.Popen([*CLI, *HOST, "-w", str(ws), *args], env=full, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def _wait_for(check, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.05)


def test_build_and_download_run_at_once(tmp_path: Path, fake_stages_env) -> None:
    """Each waits until the other has started: a run that did one after the other fails."""
    ws = tmp_path / "ws"
    _behave(ws, build="await download", download="await build")
    res = _cli(ws, fake_stages_env, "--json", "run")
    assert res.code == 0, res
    docs = _events(res)
    build_start, build_end = _first(docs, "stage.started", "build"), _first(docs, "stage.done",
                                                                           "build")
    down_start, down_end = (_first(docs, "stage.started", "download"),
                            _first(docs, "stage.done", "download"))
    assert _t(build_start) < _t(down_end) and _t(down_start) < _t(build_end)
    assert build_start["pid"] != down_start["pid"]  # each in its own process
    # the build's jobs: the cores but the one convert takes beside it (recipe pipeline:)
    assert build_start["options"]["jobs"] >= 1


def test_convert_starts_with_download_and_follows_it(tmp_path: Path, fake_stages_env) -> None:
    ws = tmp_path / "ws"
    _behave(ws, download="await convert", convert="await download")
    res = _cli(ws, fake_stages_env, "--json", "run", "--to", "convert")
    assert res.code == 0, res
    docs = _events(res)
    started = _first(docs, "stage.started", "convert")
    assert started["options"]["follow"] is True and started["options"]["jobs"] == 1
    assert _t(started) < _t(_first(docs, "stage.done", "download"))
    # a follower records its end once what it follows is over (its fingerprint takes that in)
    assert _t(_first(docs, "stage.done", "download")) <= _t(_first(docs, "stage.done",
                                                                  "convert"))
    assert _cli(ws, fake_stages_env, "--json", "status").json()["data"]["stages"][6][
        "state"] == "done"
    again = _events(_cli(ws, fake_stages_env, "--json", "run", "--to", "convert"))
    assert again[-1]["stages"]["convert"] == "skipped", again[-1]


def test_a_failing_build_leaves_the_download_running(tmp_path: Path, fake_stages_env) -> None:
    """The download waits until the build's record says failed, then finishes: the failure
    stopped only the build's branch. `run` ends non-zero, naming the build."""
    ws = tmp_path / "ws"
    _behave(ws, build="fail", download="until build failed")
    res = _cli(ws, fake_stages_env, "run")
    assert res.code == 1, res
    # the error once, as build's own command says it, as it ended; the end line points there
    assert res.out.count("told to fail") == 1, res
    assert "│ told to fail │ remove behave file│" in res.out, res
    assert "build: failed — build failed on purpose\n" in res.out, res
    assert "build failed: its error is shown above" in res.out, res
    assert "blocked by it: selftest, serve, accept" in res.out
    assert "run finished with build stopped" in res.out
    assert "went on to the end: doctor, fetch, patch, download, convert, verify-gguf" in res.out
    assert "selftest: blocked — needs build, which failed" in res.out
    ran = (ws / "ran.log").read_text().split()
    assert "download" in ran and "verify-gguf" in ran and "serve" not in ran
    status = {s["name"]: s for s in _cli(ws, fake_stages_env, "--json", "status").json()[
        "data"]["stages"]}
    assert status["build"]["state"] == "failed" and status["verify-gguf"]["state"] == "done"
    # the same as the --json stream's last event
    _behave(ws, download="ok")
    res = _cli(ws, fake_stages_env, "--json", "run")
    assert res.code == 1
    last = _events(res)[-1]
    assert last["event"] == "run.finished" and last["exit"] == 1
    assert last["failed"] == [{"stage": "build", "state": "failed",
                               "error": "build failed on purpose: told to fail",
                               "log": str(ws / "logs" / "build"), "exit_code": 1,
                               "blocked": ["selftest", "serve", "accept"]}]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_a_signal_stops_every_branch_and_leaves_nothing(tmp_path: Path, fake_stages_env,
                                                       no_leftovers, sig: signal.Signals
                                                       ) -> None:
    """The build and the download each run a child with a grandchild (a compiler under its
    shell, a hash worker): the signal to `run` stops all of them, each stage records it."""
    ws = tmp_path / "ws"
    _behave(ws, build="children", download="children")
    proc = _start(ws, fake_stages_env, "run")
    try:
        for stage in ("build", "download"):
            pids = ws / f"{stage}.pids"
            _wait_for(lambda p=pids: p.exists() and p.read_text().endswith("\n"),
                      f"{stage}'s children")
        pids = [int(p) for s in ("build", "download")
                for p in (ws / f"{s}.pids").read_text().split()]
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    code = 130 if sig == signal.SIGINT else 128 + sig
    assert proc.returncode == code, (out, err)
    assert "Traceback" not in err
    assert not any(procs.alive(p) for p in pids)
    assert leftovers(no_leftovers) == []
    how = "Ctrl-C" if sig == signal.SIGINT else sig.name
    state = json.loads((ws / ".dsv4" / "state.json").read_text())["stages"]
    for stage in ("build", "download"):
        assert state[stage]["status"] == "interrupted", state[stage]
        assert state[stage]["error"] == f"interrupted by {how}"
    assert f"run interrupted by {how}" in out
    assert (ws / ".dsv4" / "lock").read_text() == ""  # released, nothing lent


def test_json_stream_lines_parse_and_end_with_run_finished(tmp_path: Path,
                                                          fake_stages_env) -> None:
    ws = tmp_path / "ws"
    res = _cli(ws, fake_stages_env, "--json", "run")
    assert res.code == 0, res
    docs = _events(res)
    assert docs[0]["event"] == "run.started" and docs[0]["plan"] == dict.fromkeys(ALL, "run")
    assert docs[-1]["event"] == "run.finished"
    assert docs[-1]["exit"] == 0 and docs[-1]["failed"] == []
    assert docs[-1]["stages"] == dict.fromkeys(ALL, "done")
    assert all(d["v"] == 1 and "t" in d and "pid" in d for d in docs)
    kinds = {d["event"] for d in docs}
    assert {"stage.started", "stage.done", "stage.progress", "layer.converted",
            "file.verified", "step.started"} <= kinds
    # the same lines are the run's events file, which `status` reads
    assert (ws / "logs" / "run" / "events.jsonl").read_text().splitlines() == \
        res.out.splitlines()


def test_dry_run_shows_the_overlapped_plan(tmp_path: Path, fake_stages_env) -> None:
    ws = tmp_path / "ws"
    res = _cli(ws, fake_stages_env, "--json", "run", "--dry-run")
    assert res.code == 0, res
    data = res.json()["data"]
    plan = {p["stage"]: p for p in data["plan"]}
    assert data["mode"] == "pipelined" and list(plan) == ALL
    assert plan["convert"]["follows"] == ["download"] and plan["convert"]["options"] == {
        "jobs": 1, "follow": True}
    assert plan["build"]["waits_for"] == ["patch"] and "download" in plan["build"]["beside"]
    assert "build" in plan["download"]["beside"] and plan["download"]["waits_for"] == ["doctor"]
    assert plan["serve"]["waits_for"] == ["build", "verify-gguf", "selftest"]
    assert plan["serve"]["beside"] == []
    assert data["cpu"]["build_jobs"] == plan["build"]["options"]["jobs"]
    assert [s["set"] for fs in data["disk"] for s in fs["sets"]] == ["w8a8", "mxfp4", "gguf"]
    text = _cli(ws, fake_stages_env, "run", "--dry-run").out
    assert "follows download (starts with it)" in text and "beside download" in text
    assert "disk: ok" in text
    assert not (ws / "ran.log").exists()  # a dry run runs nothing
    serial = _cli(ws, fake_stages_env, "--json", "run", "--serial", "--dry-run").json()["data"]
    assert set(serial["plan"][0]) == {"stage", "action", "reason", "steps"}  # as it was


def test_the_disk_preflight_refuses_before_the_first_byte(tmp_path: Path,
                                                          fake_stages_env) -> None:
    ws = tmp_path / "ws"
    huge = ["--set", f"weights.w8a8.expected_bytes={2**60}"]
    res = _cli(ws, fake_stages_env, *huge, "run")
    assert res.code == 1, res
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: disk: the run needs "), res.err
    assert "GiB more free space" in lines[0]  # how much more, said as such
    assert str(ws / "weights" / "DeepSeek-V4-Flash-W8A8") in lines[0]
    assert "GiB are free there" in lines[0] and "--workspace DIR" in lines[0]
    # the preflight first (doctor, here a stand-in that passes), then nothing else ran
    assert "doctor:" in res.out
    assert (ws / "ran.log").read_text().split() == ["doctor"]
    second = _cli(ws, fake_stages_env, *huge, "--json", "run")
    events = [json.loads(line) for line in second.out.splitlines()]
    assert events[-1]["event"] == "run.refused" and events[-1]["error"].startswith("disk: "), second
    assert (ws / "ran.log").read_text().split() == ["doctor", "doctor"]
    assert "disk: failed" in _cli(ws, fake_stages_env, *huge, "run", "--dry-run").out
    assert _cli(ws, fake_stages_env, *huge, "run", "--to", "patch").code == 0  # no transfer
    # what is on disk already is taken off: a W8A8 set 1 GiB over the free space fits once
    # 2 GiB of it are there (a sparse file: its size counts, it takes no room)
    over = ["--set", f"weights.w8a8.expected_bytes={shutil.disk_usage(tmp_path).free + GIB}"]
    assert "disk: failed" in _cli(ws, fake_stages_env, *over, "run", "--dry-run").out
    w8a8 = ws / "weights" / "DeepSeek-V4-Flash-W8A8"
    w8a8.mkdir(parents=True)
    with open(w8a8 / "model-00001-of-00002.safetensors", "wb") as fh:
        fh.truncate(2 * GIB)
    assert "disk: ok" in _cli(ws, fake_stages_env, *over, "run", "--dry-run").out


def test_status_shows_what_is_in_flight(tmp_path: Path, fake_stages_env,
                                        no_leftovers) -> None:
    ws = tmp_path / "ws"
    _behave(ws, convert="sleep")
    proc = _start(ws, fake_stages_env, "run", "--to", "convert")
    try:
        _wait_for(lambda: (ws / "convert.started").exists(), "convert's start")
        rows = {s["name"]: s for s in _cli(ws, fake_stages_env, "--json", "status").json()[
            "data"]["stages"]}
        row = rows["convert"]
        assert row["state"] == "running" and row["pid"] != proc.pid, row
        assert row["reason"] == (f"running (pid {row['pid']}); convert: 2/43 layers "
                                 "converted, 1 verified"), row
        text = run_cli_inproc(*HOST, "-w", str(ws), "status",
                              env={**fake_stages_env, "COLUMNS": "200"}).out
        assert "2/43 layers converted" in text
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert leftovers(no_leftovers) == []


def test_the_cpu_budget_defaults_and_its_one_line_error(tmp_path: Path, fake_stages_env) -> None:
    """recipe pipeline: the build takes the cores convert does not; a budget over its cores
    is refused on load, naming the fields and the fix."""
    ws = tmp_path / "ws"
    data = _cli(ws, fake_stages_env, "--set", "pipeline.cores=8", "--json", "run",
                "--dry-run").json()["data"]
    assert data["cpu"] == {"cores": 8, "build_jobs": 7, "convert_beside_build": 1,
                           "convert_alone": None}
    plan = {p["stage"]: p for p in data["plan"]}
    assert plan["build"]["options"] == {"jobs": 7}
    # no build in this run: convert takes its alone budget (0 = its own default: no option)
    data = _cli(ws, fake_stages_env, "--set", "pipeline.convert_jobs=5", "--json", "run",
                "--from", "download", "--dry-run").json()["data"]
    assert {p["stage"]: p for p in data["plan"]}["convert"]["options"] == {"jobs": 5,
                                                                          "follow": True}
    bad = _cli(ws, fake_stages_env, "--set", "pipeline.cores=4", "--set",
               "pipeline.build_jobs=4", "run", "--dry-run")
    assert bad.code == 2, bad
    assert len(bad.err.strip().splitlines()) == 1
    assert ("build_jobs 4 + convert_jobs_beside_build 1 exceed cores 4; lower build_jobs"
            in bad.err)


def test_a_rerun_whose_record_equals_the_last_one_is_still_done(tmp_path: Path,
                                                                fake_stages_env) -> None:
    """A fast stage run twice within one second writes the very record it wrote before
    (stamps to the second, seconds to the millisecond): the run still sees it done. A CI run
    once refused with "doctor failed" so; here the stand-in writes its last record again."""
    ws = tmp_path / "ws"
    state = ws / ".dsv4" / "state.json"
    again = ["--json", "run", "--to", "doctor", "--force", "doctor"]
    assert _cli(ws, fake_stages_env, *again).code == 0
    last = json.loads(state.read_text())["stages"]["doctor"]
    (ws / "last-record.json").write_text(json.dumps(last))
    _behave(ws, doctor="same-record")
    res = _cli(ws, fake_stages_env, *again)
    assert json.loads(state.read_text())["stages"]["doctor"] == last  # the case is met
    assert res.code == 0, res
    assert json.loads(res.out.splitlines()[-1])["stages"] == {"doctor": "done"}
    assert (ws / "ran.log").read_text().split() == ["doctor", "doctor"]
