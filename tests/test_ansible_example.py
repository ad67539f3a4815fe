"""examples/ansible/bringup.yml as an operator runs it: ansible-core against two hosts (both
this machine, connection local, a workspace and a virtualenv each), the tool installed from
a wheel as an air-gapped site does, `run --json` driven as an async job, and the weights
from the stand-in hub on 127.0.0.1 (a synthetic MXFP4 checkpoint in the real shard layout
and a small W8A8 set).

The run goes from download to verify-gguf: the stages before need sources, a compiler
toolchain and an NPU this machine does not have (the other tests cover them). The tool is
installed without its dependencies (the test has no network); they come from the test's
own interpreter through PYTHONPATH, handed over with the playbook's `dsv4_environment`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from standin_hub import StandinHub
from test_stream import DIMS, MXFP4_REPO, W8A8_REPO, repo_of, sizes, w8a8_repo

from dsv4_offload.weights.checkpoint import write_synthetic_checkpoint

pytest.importorskip("ansible", reason="ansible-core is in the test extras")

ROOT = Path(__file__).resolve().parents[1]
PLAYBOOK = ROOT / "examples" / "ansible" / "bringup.yml"
PLAYBOOK_BIN = Path(sys.executable).with_name("ansible-playbook")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    (found,) = out.glob("dsv4_offload-*.whl")
    return found


def _playbook(tmp_path: Path, hosts: dict[str, dict[str, object]], group: dict[str, object],
              ) -> subprocess.CompletedProcess[str]:
    """ansible-playbook with an inventory of ``hosts`` (their own variables) in the group
    dsv4 (``group``: variables every host shares), as an operator writes one."""
    inventory = tmp_path / "inventory.yml"  # JSON is YAML
    inventory.write_text(json.dumps({"dsv4": {"hosts": hosts, "vars": {
        **group, "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}))
    env = {**os.environ, "ANSIBLE_HOME": str(tmp_path / "ansible-home"),
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"),
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0",
           "ANSIBLE_RETRY_FILES_ENABLED": "False"}
    return subprocess.run([str(PLAYBOOK_BIN), "-i", str(inventory), str(PLAYBOOK)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)


def _recap(out: str) -> dict[str, dict[str, int]]:
    recap = {}
    for m in re.finditer(r"^(\S+)\s+:\s+(.*)$", out.split("PLAY RECAP", 1)[-1], re.M):
        recap[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return recap


def _status(venv: Path, ws: Path, env: dict[str, str], sets: list[str]
            ) -> dict[str, tuple[str, str]]:
    """Each stage's state and when it ended, as `status` of the host's own install says."""
    res = subprocess.run([str(venv / "bin" / "dsv4-offload"), "--workspace", str(ws),
                          *(a for x in sets for a in ("--set", x)), "--json", "status"],
                         capture_output=True, text=True, env=env, timeout=120)
    return {s["name"]: (s["state"], s["ended"])
            for s in json.loads(res.stdout)["data"]["stages"]}


STAGES = ("download", "convert", "verify-gguf")


@pytest.mark.slow
def test_two_hosts_come_up_and_a_rerun_resumes_the_one_that_failed(
        tmp_path: Path, wheel: Path) -> None:
    """Two hosts, one failing, then a rerun of the whole playbook: only the failed one works.

    Fast tests of its seams (the playbook itself, installed from the wheel and driving
    `run --json`; a rerun that resumes; a failing stage's record):
    tests/test_ansible_example.py::test_the_fleets_weights_lock_gives_a_later_host_the_same_commits
    tests/test_pipeline.py::test_killed_run_resumes_from_the_interrupted_stage
    tests/test_pipeline.py::test_failure_stops_the_run_with_a_failed_record
    """
    src = write_synthetic_checkpoint(tmp_path / "ckpt", DIMS, real_layout=True)
    mxfp4, w8a8 = repo_of(src, MXFP4_REPO), w8a8_repo(src)
    site = sysconfig.get_paths()["purelib"]  # the test interpreter's dependencies
    with StandinHub([mxfp4, w8a8]) as hub:
        environment = {"PYTHONPATH": site, "HF_ENDPOINT": hub.url,
                       "MODELSCOPE_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
                       "MODELSCOPE_CACHE": str(tmp_path / "ms"), "DSV4_CACHE":
                       str(tmp_path / "cache")}
        common: dict[str, Any] = {
                  "dsv4_package": str(wheel), "dsv4_pip_extra_args": "--no-index --no-deps",
                  "dsv4_python": sys.executable, "dsv4_environment": environment,
                  "dsv4_set": [*sizes(mxfp4, w8a8), "conversion.expected_file_bytes=4096"],
                  "dsv4_run_args": ["--from", "download", "--to", "verify-gguf"],
                  "dsv4_poll_s": 1, "dsv4_timeout_s": 300}
        hosts: dict[str, dict[str, object]] = {
            f"host{i}": {"dsv4_workspace": str(tmp_path / f"ws{i}"),
                         "dsv4_venv": str(tmp_path / f"venv{i}")} for i in (1, 2)}
        # host2's operator mistyped the MXFP4 revision: its run fails, host1's goes on
        hosts["host2"]["dsv4_set"] = [*common["dsv4_set"],
                                      "weights.mxfp4.revision=no-such-branch"]
        first = _playbook(tmp_path, hosts, common)
        out = first.stdout + first.stderr
        assert first.returncode == 2, out  # ansible's "a host failed"
        recap = _recap(first.stdout)
        assert recap["host1"]["failed"] == 0 and recap["host2"]["failed"] == 1, out
        # host2's failure is one line naming the host, the stage and the reason
        msg = next(line for line in out.splitlines() if '"msg": "host2:' in line)
        assert "download failed" in msg and "no-such-branch" in msg, msg
        run_env = {**os.environ, **environment}
        venv1 = tmp_path / "venv1"
        states = _status(venv1, tmp_path / "ws1", run_env, common["dsv4_set"])
        assert [states[s][0] for s in STAGES] == ["done"] * 3, states
        # the tool ran from the virtualenv the playbook made, not from the test's checkout
        where = subprocess.run([str(venv1 / "bin" / "python"), "-c",
                                "import dsv4_offload; print(dsv4_offload.__file__)"],
                               capture_output=True, text=True, env=run_env, check=True)
        assert where.stdout.startswith(str(venv1)), where.stdout

        # the operator fixes host2 and reruns the whole playbook: host1 has nothing to do,
        # host2 comes up
        del hosts["host2"]["dsv4_set"]
        hub.requests.clear()
        second = _playbook(tmp_path, hosts, common)
        out2 = second.stdout + second.stderr
        assert second.returncode == 0, out2
        recap2 = _recap(second.stdout)
        assert recap2["host1"]["failed"] == recap2["host2"]["failed"] == 0, out2
        assert recap2["host1"]["changed"] == 0, out2  # installed already, every stage done
        # host1: nothing ran again
        assert _status(venv1, tmp_path / "ws1", run_env, common["dsv4_set"]) == states
        sent = sum(r.sent for r in hub.data_requests())
        assert 0 < sent <= sum(len(d) for r in (mxfp4, w8a8) for d in r.files.values())
        states2 = _status(tmp_path / "venv2", tmp_path / "ws2", run_env, common["dsv4_set"])
        assert [states2[s][0] for s in STAGES] == ["done"] * 3, states2


def test_the_fleets_weights_lock_gives_a_later_host_the_same_commits(
        tmp_path: Path, wheel: Path) -> None:
    from standin_hub import tiny_model_repo

    repos = [tiny_model_repo(MXFP4_REPO), tiny_model_repo(W8A8_REPO, commit="a" * 40)]
    tiny = sum(len(d) for d in repos[0].files.values())
    site = sysconfig.get_paths()["purelib"]
    with StandinHub(repos) as hub:
        environment = {"PYTHONPATH": site, "HF_ENDPOINT": hub.url,
                       "MODELSCOPE_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
                       "MODELSCOPE_CACHE": str(tmp_path / "ms"),
                       "DSV4_CACHE": str(tmp_path / "cache")}
        common: dict[str, Any] = {
            "dsv4_package": str(wheel), "dsv4_pip_extra_args": "--no-index --no-deps",
            "dsv4_python": sys.executable, "dsv4_environment": environment,
            # floating branches: without the fleet's lock, host2 would get the moved commits
            "dsv4_set": [f"weights.{w}.{k}" for w in ("w8a8", "mxfp4")
                         for k in (f"expected_bytes={tiny}", "not_after=null")],
            "dsv4_run_args": ["--from", "download", "--to", "download"],
            "dsv4_poll_s": 1, "dsv4_timeout_s": 300}
        host1 = {"dsv4_workspace": str(tmp_path / "ws1"), "dsv4_venv": str(tmp_path / "venv")}
        first = _playbook(tmp_path, {"host1": host1}, common)
        assert first.returncode == 0, first.stdout + first.stderr
        fleet = tmp_path / "fleet-weights.lock.json"  # what the operator fetched from host1
        fleet.write_bytes((tmp_path / "ws1" / "weights.lock.json").read_bytes())
        for repo in repos:  # a week later both branches have moved
            repo.move_to(("2" if repo.repo_id == MXFP4_REPO else "b") * 40,
                         {**repo.files, "config.json": b'{"model_type": "deepseek_v41"}'})
        host2 = {"dsv4_workspace": str(tmp_path / "ws2"), "dsv4_venv": str(tmp_path / "venv"),
                 "dsv4_weights_lock": str(fleet)}
        second = _playbook(tmp_path, {"host2": host2}, common)
        assert second.returncode == 0, second.stdout + second.stderr
    one, two = (json.loads((tmp_path / ws / "weights.lock.json").read_text())
                for ws in ("ws1", "ws2"))
    assert {k: e["resolved"] for k, e in one.items()} == \
        {k: e["resolved"] for k, e in two.items()}
    assert two[f"modelscope:{W8A8_REPO}@master"]["resolved"] == "a" * 40
    for name in ("DeepSeek-V4-Flash", "DeepSeek-V4-Flash-W8A8"):
        for f in (tmp_path / "ws1" / "weights" / name).iterdir():
            twin = tmp_path / "ws2" / "weights" / name / f.name
            assert f.name.startswith(".") or twin.read_bytes() == f.read_bytes()
