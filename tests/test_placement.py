"""Where each stage runs: one function, walked over every bundled recipe (issue 17)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import TESTS, run_cli_inproc

from dsv4_offload.core.registry import STAGE_NAMES
from dsv4_offload.recipe import BUNDLED_RECIPES, load_recipe
from dsv4_offload.workspace.placement import placement_of, step_placement

IN_IMAGE = {"build", "selftest", "serve", "accept"}  # the 910B recipe's runtime.stages
EXPECTED = {
    "dsv4-flash-910b": {s: "container" if s in IN_IMAGE else "host" for s in STAGE_NAMES},
    "dsv4-flash-a3": dict.fromkeys(STAGE_NAMES, "host"),
    "dsv4-flash-x86-dev": dict.fromkeys(STAGE_NAMES, "host"),
    "dsv4-flash-arm-rehearsal": dict.fromkeys(STAGE_NAMES, "host"),
}


def test_every_bundled_recipe_says_where_each_stage_and_build_step_runs() -> None:
    bundled = sorted(p.stem for p in BUNDLED_RECIPES.glob("*.yaml"))
    assert bundled == sorted(EXPECTED), "a new bundled recipe: say where its stages run here"
    for name in bundled:
        recipe = load_recipe(name)
        assert {s: placement_of(recipe, s) for s in STAGE_NAMES} == EXPECTED[name], name
        steps = [s.name for s in recipe.build.steps]
        assert steps, name
        assert {s: step_placement(recipe, s) for s in steps} == dict.fromkeys(
            steps, EXPECTED[name]["build"]), name
    with pytest.raises(KeyError):
        step_placement(load_recipe("dsv4-flash-910b"), "no-such-step")


def test_the_serve_plan_env_reads_are_all_in_the_crossing_list() -> None:
    """Every variable the serve plan (serving/plan, rules, cann, flags) reads by name is one
    that crosses into the container."""
    from dsv4_offload.serving import plan
    from dsv4_offload.serving.container import env_read

    here = Path(plan.__file__).parent
    text = "\n".join((here / f"{m}.py").read_text() for m in ("plan", "rules", "cann", "flags"))
    read = set(re.findall(r'(?:env|base_env)(?:\.get\(|\[)"([A-Z][A-Z0-9_]+)"', text))
    read |= set(re.findall(r'(?:env_number\([\w.]*base_env, |launcher_number\()"([A-Z_]+)"',
                           text))
    read |= set(re.findall(r'for name in \(("[A-Z_]+"(?:, "[A-Z_]+")*)\)', text)[0]
                .replace('"', "").split(", "))
    own = {"HOME", "PYTHONPATH"}  # the container's own
    assert {"CHUNKED_PREFILL_SIZE", "EXTRA_FLAGS", "MEM_FRACTION", "PORT"} <= read
    assert read - own <= env_read(), sorted(read - own - env_read())
    assert {"PYTHON_BIN", "KT_NUM_GPU_EXPERTS", "KT_MXFP4_DEPOOL"} <= env_read()


def _no_docker_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The instrumented stages, and a PATH where no `docker` exists."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("DSV4_WORKSPACE", "DSV4_RUNTIME")}
    env.update({"PATH": str(bin_dir), "DSV4_STAGE_PACKAGE": "fakestages",
                "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
                **extra})
    return env


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The command in this process with ``env`` its whole environment (what it answers is the
    point: conftest.run_cli_inproc); the stages a `run` starts are processes."""
    res = run_cli_inproc(*args, env=env, whole_env=True)
    return subprocess.CompletedProcess(list(args), res.code, res.out, res.err)


def test_x86_rehearsal_runs_to_selftest_without_docker(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ws = tmp_path / "ws"
    env = _no_docker_env(tmp_path)
    r = _cli(env, "--recipe", "dsv4-flash-x86-dev", "-w", str(ws), "run", "--to", "selftest")
    assert r.returncode == 0, r
    assert (ws / "ran.log").read_text().splitlines() == [
        "doctor", "fetch", "patch", "build", "selftest"]
    assert "docker" not in (r.stdout + r.stderr).lower()
    # and in this process: nothing asks for docker, by lookup or by running it
    from dsv4_offload.cli.app import main

    asked: list[str] = []
    which, popen = shutil.which, subprocess.Popen

    def spy_which(cmd, *a, **k):  # type: ignore[no-untyped-def]
        asked.append(str(cmd))
        return which(cmd, *a, **k)

    class SpyPopen(popen):  # type: ignore[misc, valid-type]
        def __init__(self, args, *a, **k):  # type: ignore[no-untyped-def]
            asked.append(str(args))
            super().__init__(args, *a, **k)

    monkeypatch.setattr(shutil, "which", spy_which)
    monkeypatch.setattr(subprocess, "Popen", SpyPopen)
    for key in ("DSV4_STAGE_PACKAGE", "PATH"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.delenv("DSV4_RUNTIME", raising=False)
    with pytest.raises(SystemExit) as done:  # --serial: the stages run in this process
        main(["--recipe", "dsv4-flash-x86-dev", "-w", str(tmp_path / "ws2"), "run", "--serial",
              "--to", "selftest", "--force", "build"])
    capsys.readouterr()
    assert done.value.code == 0
    assert (tmp_path / "ws2" / "ran.log").read_text().split() == [
        "doctor", "fetch", "patch", "build", "selftest"]
    assert not [a for a in asked if "docker" in a], asked


@pytest.mark.parametrize("how", ["option", "environment"])
def test_runtime_host_runs_container_stages_here_and_warns_once_each(
        tmp_path: Path, how: str) -> None:
    ws = tmp_path / "ws"
    extra = {"DSV4_RUNTIME": "host"} if how == "environment" else {}
    env = _no_docker_env(tmp_path, **extra)
    flag = ["--runtime", "host"] if how == "option" else []
    r = _cli(env, *flag, "-w", str(ws), "run", "--to", "selftest")
    assert r.returncode == 0, r
    assert (ws / "ran.log").read_text().split() == ["doctor", "fetch", "patch", "build",
                                                    "selftest"]
    image = load_recipe("dsv4-flash-910b").runtime.image
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: running")]
    assert warnings == [
        f"warning: running build on the host although the recipe puts it in container {image}",
        f"warning: running selftest on the host although the recipe puts it in container "
        f"{image}"], r.stderr
    # a stand-alone command of a container stage: the same hatch, the same warning
    alone = _cli(env, *flag, "-w", str(ws), "selftest")
    assert alone.returncode == 0, alone
    assert alone.stderr.count("warning: running selftest on the host") == 1
    assert (ws / "ran.log").read_text().split()[-1] == "selftest"


def test_runtime_takes_recipe_or_host_only(tmp_path: Path) -> None:
    env = _no_docker_env(tmp_path)
    r = _cli(env, "--runtime", "podman", "-w", str(tmp_path / "ws"), "status")
    assert r.returncode == 2 and "--runtime 'podman'" in r.stderr and "recipe or host" in r.stderr


def test_without_the_hatch_a_stand_alone_container_stage_goes_to_docker(tmp_path: Path) -> None:
    """The bundled 910B recipe puts build in its image: a stand-alone `build` asks docker (here
    a client whose engine is down) instead of building on the host."""
    ws = tmp_path / "ws"
    env = _no_docker_env(tmp_path)
    docker = tmp_path / "bin" / "docker"
    docker.write_text("#!/bin/sh\necho \"$@\" >> \"$(dirname \"$0\")/docker.argv\"\n"
                      "echo 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock."
                      " Is the docker daemon running?' >&2\nexit 1\n")
    docker.chmod(0o755)
    env["PATH"] = f"{docker.parent}{os.pathsep}/usr/bin{os.pathsep}/bin"
    r = _cli(env, "-w", str(ws), "--json", "build")
    assert r.returncode != 0, r
    assert "Cannot connect to the Docker daemon" in r.stdout + r.stderr
    assert not (ws / "ran.log").exists()  # not built on the host
    assert json.loads(r.stdout)["command"] == "build"
    assert (docker.parent / "docker.argv").read_text().startswith("ps -a --filter")
