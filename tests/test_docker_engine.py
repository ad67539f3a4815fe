"""The 910B recipe's container path against a real Docker engine, as a user runs it.

A dockerd started by the test (tests/docker_engine.py: vfs storage, no iptables, an OCI
shim that lets the delivery's `--privileged` and `--ulimit memlock=-1` start in this
sandbox) and a small Debian image imported from debootstrap stand in for the 910B host and
its image. The delivery's `docker run` line is unchanged; only the driver mounts point at
stand-in files, because this machine has no Ascend driver. What is real: `container up`,
the tool's own venv inside (installed from a wheelhouse the host fills: the container has
no network), a build step and `serve` sent into the container by the stand-alone commands,
a stand-in server started inside by the real launcher code, and knobs exported on the host
read back from inside the server process.

Skipped with the reason where no engine can start (not root, no docker.io); in CI (CI set)
a missing engine is a failure, never a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import docker_engine as de
import pytest

TESTS = Path(__file__).parent
IMAGE = "dsv4-test/bookworm:1"
NAME = "dsv4_singlecard"  # the launch script's container name (line 22)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[de.Engine]:
    why = de.unavailable()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the real engine test: {why}")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("engine")
    with de.running_engine(root) as eng:
        eng.load_image(IMAGE, de.image_tarball())
        yield eng


def _standin_mounts(root: Path) -> list[str]:
    """The launch script's driver mounts (lines 46-52), each pointing at a stand-in: the
    paths inside are the delivery's, the host side is a file or directory of the test."""
    for d in ("sbin", "dcmi", "driver", "firmware", "queue"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "npu-smi").write_text("#!/bin/sh\necho 'npu-smi stand-in (no NPU here)'\n")
    (root / "npu-smi").chmod(0o755)
    (root / "ascend_install.info").write_text("Driver_Install_Path_Param=/usr/local/Ascend\n")
    return [f"{root}/sbin:/usr/local/sbin", f"{root}/dcmi:/usr/local/dcmi",
            f"{root}/npu-smi:/usr/local/bin/npu-smi",
            f"{root}/driver:/usr/local/Ascend/driver/",
            f"{root}/firmware:/usr/local/Ascend/firmware",
            f"{root}/ascend_install.info:/etc/ascend_install.info",
            f"{root}/queue:/var/queue_schedule"]


def _sleeping(engine: de.Engine) -> bool:
    """Whether the slow build step's `sleep 127` runs in the container."""
    ps = engine.docker("exec", NAME, "ps", "-eo", "args", check=False)
    return any(line.strip() == "sleep 127" for line in ps.stdout.decode().splitlines())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_the_910b_container_path_on_a_real_engine(engine: de.Engine, tmp_path: Path) -> None:
    """The 910B container path on a real engine, a real image and the delivery's `docker run`.

    Fast tests of its seams, against a recording `docker` (tests/recording_docker.py): `up`,
    its reuse, a stand-alone stage sent in, knobs crossing by name, serve status and stop,
    and a killed CLI stopping its `docker exec`:
    tests/test_container.py::test_up_runs_the_delivery_docker_run_pulls_and_installs
    tests/test_container.py::test_matching_container_is_reused_and_rechecked
    tests/test_container.py::test_a_stand_alone_stage_command_runs_in_the_container_as_run_does
    tests/test_container.py::test_exported_knobs_cross_by_name_and_no_secret_is_on_argv
    tests/test_container.py::test_serve_status_and_stop_go_where_the_server_runs
    tests/test_container.py::test_killing_the_cli_stops_its_docker_exec_client
    What no fast test can: that a real engine and runc accept the delivery's line, the image's
    python runs the tool's venv, and the published port answers.
    """
    ws = tmp_path / "ws"
    ws.mkdir()
    port = _free_port()
    mounts = "\n".join(f"    - {m}" for m in _standin_mounts(tmp_path / "standin"))
    server = ws / "standin_server.py"
    shutil.copyfile(TESTS / "standin_server.py", server)
    report = ws / "standin-report.json"
    # the recipe a user of the 910B image writes for this machine: the image, the driver
    # mounts (stand-ins), one build step, the stand-in as the server; in the workspace,
    # which is the only host path the container sees
    recipe = ws / "engine.yaml"
    recipe.write_text(f"""extends: dsv4-flash-910b
name: engine-910b
runtime:
  image: {IMAGE}
  install_timeout: 600
  mounts:
{mounts}
build:
  python: "{{tool_python}}"   # inside: the tool's venv (numpy for the selftest child)
  steps:
    - name: probe
      command: [sh, -c, "echo inside=$DSV4_IN_CONTAINER; test -f /.dockerenv && echo DOCKERENV"]
      expect_markers: [DOCKERENV]
      log_sources: []
    - {{name: kt-kernel, remove: true}}
    - {{name: gguf-py, remove: true}}
    - {{name: sglang, remove: true}}
    - {{name: ascendc-op, remove: true}}
serve:
  port: {port}
  command: [python3.11, {server}, --report, {report}, --start-delay, "0.2", "{{flags}}"]
  readiness_timeout_s: 60
  reserved_cores: 0        # this machine has 2 cores; the Kunpeng-920 keeps 4 aside
  env:
    KT_MXFP4_DEPOOL: "0"
selftest:                   # small: the stand-in kt_kernel_ext computes in python
  module_dir: standin-kt
  experts: 4
  hidden: 64
  intermediate: 64
  top_k: 2
  tokens: [4, 16]
  timeout_s: 120
  api: low-level
acceptance:
  request_timeout_s: 10
  throughput:
    prompt_buckets: [16, 64]
    new_tokens: 16
    repeats: 2
""")
    # the GGUF set serve checks for (empty files: the stand-in reads none of them)
    from dsv4_offload.recipe import load_recipe
    from dsv4_offload.workspace.store import Workspace

    loaded = load_recipe(str(recipe))
    gguf = Workspace(ws).gguf_dir(loaded)
    gguf.mkdir(parents=True)
    for layer in range(loaded.conversion.layers):
        (gguf / loaded.conversion.file_name(layer)).touch()
    env = {**os.environ, **engine.env}
    for key in ("DSV4_HOST_ROOT", "DSV4_RUNTIME", "DSV4_WORKSPACE", "DSV4_STAGE_PACKAGE"):
        env.pop(key, None)

    def cli(*args: str, extra: dict[str, str] | None = None,
            timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dsv4_offload", "-w", str(ws), "-r",
                               str(recipe), *args], env={**env, **(extra or {})},
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    started = time.monotonic()
    up = cli("--json", "container", "up")
    assert up.returncode == 0, up
    doc = json.loads(up.stdout)["data"]
    assert (doc["action"], doc["packages"], doc["tool"]) == ("created", "present", "installed")
    # the delivery's flags started as they are (the shim only trims what this sandbox lacks)
    inspect = json.loads(engine.docker("inspect", NAME).stdout)[0]["HostConfig"]
    assert inspect["Privileged"] is True and inspect["IpcMode"] == "host"
    assert {"Name": "memlock", "Hard": -1, "Soft": -1} in inspect["Ulimits"]
    assert inspect["ShmSize"] == 16 * 2**30
    # the tool runs from its own venv in the workspace; the image's python is untouched
    venv_python = ws / ".dsv4" / "container-venv" / "bin" / "python"
    ours = engine.docker("exec", NAME, str(venv_python), "-m", "dsv4_offload", "--version",
                         check=False)
    assert ours.returncode == 0, ours
    theirs = engine.docker("exec", NAME, "python3.11", "-c", "import dsv4_offload",
                           check=False)
    assert theirs.returncode != 0
    up_seconds = time.monotonic() - started

    # doctor on the host judges the image's rows in the image (python 3.11, the compilers)
    doctor = cli("--json", "doctor")
    rows = {c["name"]: c for c in json.loads(doctor.stdout)["data"]["data"]["checks"]}
    assert rows["python"]["observed"].startswith(f"in {NAME}: "), rows["python"]
    assert "3.11" in rows["python"]["observed"], rows["python"]
    assert rows["libhwloc"]["status"] == "ok", rows["libhwloc"]  # baked into this image
    assert rows["libhwloc"]["observed"].startswith(f"in {NAME}: "), rows["libhwloc"]

    # a second `up` reuses it and reinstalls nothing
    again = cli("--json", "container", "up")
    assert again.returncode == 0, again
    doc = json.loads(again.stdout)["data"]
    assert (doc["action"], doc["tool"]) == ("reused", "present")

    # the stand-alone `build` runs inside, as `run` would
    built = cli("build")
    assert built.returncode == 0, built
    inner = (ws / "logs" / "container" / "build.log").read_text()
    assert "=== exit 0" in inner and "Fatal Python error" not in inner, inner[-1500:]
    log = (ws / "logs" / "build" / "probe.log").read_text()
    assert f"inside={NAME}" in log and "DOCKERENV" in log

    # the selftest inside: the stand-in kt_kernel_ext where the recipe says the build put it,
    # run by the real stage in a child of the tool's venv, against the numpy reference
    (ws / "standin-kt").mkdir()
    shutil.copyfile(TESTS / "standin_kt_kernel_ext.py", ws / "standin-kt" / "kt_kernel_ext.py")
    tested = cli("--json", "selftest")
    assert tested.returncode == 0, tested
    record = json.loads((ws / ".dsv4" / "state.json").read_text())["stages"]["selftest"]
    assert record["status"] == "done" and record.get("container"), record

    # `serve --print` runs inside too: each value as the server will see it, with its origin
    knobs = {"CHUNKED_PREFILL_SIZE": "32768", "KT_NUM_GPU_EXPERTS": "24"}
    printed = cli("serve", "--print", extra=knobs)
    assert printed.returncode == 0, printed
    assert "--chunked-prefill-size 32768" in printed.stdout, printed.stdout
    assert "environment (CHUNKED_PREFILL_SIZE" in printed.stdout, printed.stdout
    print("serve --print inside the container:\n" + printed.stdout)

    # `serve` inside: the launcher's knobs exported here reach the server process by name;
    # a key file outside every mount (issue 28) crosses owner-only, never on docker's argv
    home = tmp_path / "home"
    home.mkdir()
    key = "sk-" + os.urandom(8).hex()
    (home / "api.key").write_text(key + "\n")
    served = cli("serve", "--detach", "--api-key-file", str(home / "api.key"),
                 extra={"CHUNKED_PREFILL_SIZE": "32768", "KT_NUM_GPU_EXPERTS": "24"})
    assert served.returncode == 0, served
    got = json.loads(report.read_text())
    assert got["dockerenv"] is True
    argv = got["argv"]
    assert argv[argv.index("--chunked-prefill-size") + 1] == "32768"
    assert argv[argv.index("--kt-num-gpu-experts") + 1] == "24"
    assert got["env"]["CHUNKED_PREFILL_SIZE"] == "32768"
    assert argv[argv.index("--api-key") + 1] == key  # the server inside has the key
    (crossed,) = (ws / ".dsv4" / "keys").iterdir()
    assert oct(crossed.stat().st_mode & 0o777) == "0o600"
    # the delivery's `-p PORT:PORT` publishes it: the host reaches the server inside
    import urllib.error
    import urllib.request

    # (docker's userland proxy may reset the first connections while it sets the port up)
    deadline = time.monotonic() + 60
    while True:
        try:
            asked = urllib.request.Request(f"http://127.0.0.1:{port}/health",
                                           headers={"Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(asked, timeout=30) as answer:
                assert answer.status == 200
                break
        except (ConnectionError, urllib.error.URLError):
            assert time.monotonic() < deadline, "the published port never answered"
            time.sleep(1)
    # `accept` runs inside too, against the server there
    accepted = cli("--json", "accept")
    assert accepted.returncode == 0, accepted
    result = json.loads(accepted.stdout)
    assert result["status"] in ("ok", "warn"), result
    record = json.loads((ws / ".dsv4" / "state.json").read_text())["stages"]["accept"]
    assert record["status"] == "done" and record["summary"].startswith("passed:"), record
    stopped = cli("serve", "stop")
    assert stopped.returncode == 0, stopped
    assert not crossed.exists() and (home / "api.key").exists()  # the copy went with it
    # the host process dies (SIGKILL, as a dropped SSH session or the OOM killer would):
    # the stage it sent into the container stops with it instead of running on outside
    # the workspace lock, and its record says so

    slow = subprocess.Popen(
        [sys.executable, "-m", "dsv4_offload", "-w", str(ws), "-r", str(recipe), "--set",
         "build.steps[probe].command=[sh, -c, 'echo DOCKERENV; exec sleep 127']", "build"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not _sleeping(engine):
        assert time.monotonic() < deadline and slow.poll() is None, "the step never started"
        time.sleep(0.5)
    slow.kill()
    slow.wait(timeout=30)
    deadline = time.monotonic() + 60
    while _sleeping(engine):
        assert time.monotonic() < deadline, "the step runs on in the container"
        time.sleep(0.5)
    deadline = time.monotonic() + 30
    while True:
        record = json.loads((ws / ".dsv4" / "state.json").read_text())["stages"]["build"]
        if record["status"] != "running" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    logs = ws / "logs"
    assert record["status"] in ("interrupted", "failed") and "interrupted" in str(
        record.get("error", record.get("status"))), (
        record, (logs / "container" / "build.log").read_text()[-1500:],
        (logs / "build" / "probe.log").read_text()[-800:])
    print(f"engine test: container up {up_seconds:.1f}s, whole flow "
          f"{time.monotonic() - started:.1f}s")
