"""Issue 28, the first hour: what a new user meets on a bare non-target host, read as they
read it (the console script, a captured host with a small disk and no NPU, no docker)."""

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
        path: str | None = None) -> subprocess.CompletedProcess[str]:
    if not SCRIPT.exists():
        pytest.skip(f"no console script at {SCRIPT} (install the project into this venv)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_", "ASCEND_"))}
    env["COLUMNS"] = "240"
    if host is not None:
        env["DSV4_HOST_ROOT"] = str(HOSTS / host)
    if path is not None:
        env["PATH"] = path
    return subprocess.run([str(SCRIPT), "--workspace", str(tmp_path / "ws"), *args],
                          capture_output=True, text=True, env=env, timeout=180,
                          stdin=subprocess.DEVNULL)


def test_readme_command_1_shows_doctors_table_with_every_failing_row(tmp_path: Path) -> None:
    # x86-no-npu: an x86 host, no NPU, 80 GiB free (df.txt), no docker client
    proc = cli(tmp_path, "run")
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
    assert "did you mean --chunked-prefill-size?" in proc.stdout
    assert ("--page-size (serve.extra_args) repeats a flag the plan sets" in proc.stdout)
    doc = json.loads(cli(tmp_path, *odd, "--json", "doctor").stdout)
    row = {c["name"]: c for c in doc["data"]["data"]["checks"]}["extra-args"]
    assert row["status"] == "warn" and "--chunked-prefill-sise" in row["observed"]
