"""`dsv4-offload doctor` as a user runs it: the venv's console script, exit codes, JSON."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

HOSTS = Path(__file__).parent / "fixtures" / "hosts"
SCRIPT = Path(sys.executable).parent / "dsv4-offload"


def doctor(tmp_path: Path, *args: str, host: str | None = None, in_image: bool = False
           ) -> subprocess.CompletedProcess[str]:
    if not SCRIPT.exists():
        pytest.skip(f"no console script at {SCRIPT} (install the project into this venv)")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DSV4_", "ASCEND_"))}
    env["COLUMNS"] = "240"  # wide enough that rich does not fold words inside table cells
    if in_image:  # as `container exec -- doctor` runs it: the build's toolchain is judged here
        env["DSV4_IN_CONTAINER"] = "dsv4_singlecard"
    if host is not None:
        env["DSV4_HOST_ROOT"] = str(HOSTS / host)
        smi = HOSTS / host / "npu-smi-info.txt"
        if smi.exists():
            env["DSV4_NPU_SMI"] = f"cat '{smi}'"
    return subprocess.run([str(SCRIPT), "--workspace", str(tmp_path / "ws"), *args],
                          capture_output=True, text=True, env=env, timeout=120,
                          stdin=subprocess.DEVNULL)


def checks_of(doc: dict) -> dict[str, dict[str, str]]:  # type: ignore[type-arg]
    return {c["name"]: c for c in doc["data"]["data"]["checks"]}


def test_this_machine_fails_and_the_json_names_the_arch(tmp_path: Path) -> None:
    proc = doctor(tmp_path, "--json", "doctor")
    assert proc.returncode == 1, proc
    doc = json.loads(proc.stdout)  # stdout is one JSON document and nothing else
    assert doc["schema"] == 1 and doc["command"] == "doctor" and doc["status"] == "failed"
    checks = checks_of(doc)
    if platform.machine() != "aarch64":
        assert checks["arch"]["status"] == "fail"
        assert checks["arch"]["observed"].startswith(platform.machine())
        assert "arch" in doc["data"]["summary"]
        assert any(p["check"] == "arch" and p["fix"] for p in doc["data"]["problems"])
    assert checks["npu-smi"]["status"] == "fail" or checks["device-nodes"]["status"] == "fail"
    assert (tmp_path / "ws" / "reports" / "doctor.json").is_file()


def test_kunpeng_fixture_exits_0(tmp_path: Path) -> None:
    proc = doctor(tmp_path, "--set", "serve.host=127.0.0.1", "--json", "doctor",
                  host="kunpeng920-910b")
    assert proc.returncode == 0, proc
    doc = json.loads(proc.stdout)
    assert doc["status"] == "ok"
    assert doc["data"]["data"]["host"]["cores"] == 192


def test_a3_fixture_warns_and_exits_0(tmp_path: Path) -> None:
    proc = doctor(tmp_path, "--recipe", "dsv4-flash-a3", "--json", "doctor", host="a3-host")
    assert proc.returncode == 0, proc
    doc = json.loads(proc.stdout)
    assert doc["status"] == "warn"
    assert checks_of(doc)["cpu-build-off"]["status"] == "warn"


def test_bad_npu_fixture_exits_1_with_the_fix_in_the_table(tmp_path: Path) -> None:
    proc = doctor(tmp_path, "doctor", host="npu-bad-state", in_image=True)
    assert proc.returncode == 1, proc
    out = proc.stdout
    assert "doctor: failed" in out
    assert "npu-health" in out and "Alarm" in out
    assert "devmm_svm" in out
    assert "libhwloc-dev" in out
