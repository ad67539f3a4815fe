"""The kill matrix: each stage killed (SIGKILL, SIGTERM) at points chosen by the events it
emits (tests/killpoint.py), then run again. Nothing verified is redone (inode and mtime
kept), nothing half-written is taken as done, no process of ours is left behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TESTS, run_cli
from serve_helpers import standin_servers
from standin_hub import HubRepo, StandinHub, isolate_clients, tiny_model_repo
from test_serve_cli import standin_on_host

from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.stages import download
from dsv4_offload.weights.checkpoint import MoeDims, write_synthetic_checkpoint
from dsv4_offload.weights.gguf_io import LayerLayout
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

DIMS = MoeDims(layers=3, experts=8, experts_per_token=2, hidden=128, intermediate=64)
GGUF = "dsv4_layer{}_mxfp4.gguf"
MXFP4_REPO = "deepseek-ai/DeepSeek-V4-Flash"
W8A8_REPO = "sgl-npu/DeepSeek-V4-Flash-W8A8"
KILLPOINT = TESTS / "killpoint.py"


TAG = "DSV4_TEST_KILL_MATRIX"  # in the environment of the killed run and all it starts


def tiered(points: list[Any]) -> list[Any]:
    """The first point of a stage in the default tier, the others in the long one (`slow`):
    each stage's kill, rerun and leftover checks keep a fast proof; the matrix runs whole
    in .ci/run."""
    first, *rest = points
    return [first, *(pytest.param(*(p if isinstance(p, tuple) else (p,)),
                                  marks=pytest.mark.slow) for p in rest)]


@pytest.fixture(autouse=True)
def _client_homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_clients(tmp_path, monkeypatch)


@pytest.fixture(autouse=True)
def _nothing_left_and_no_bystander_hit(tmp_path: Path) -> Iterator[None]:
    """A process not ours (its own group, beside the run) survives every kill and rerun, and
    no process of the killed run is left once its rerun is over."""
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        yield
        deadline = time.monotonic() + 10
        while ours_left(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ours_left(tmp_path) == [], "processes of the killed run are left"
        assert bystander.poll() is None, "a process not ours was signalled"
    finally:
        bystander.kill()
        bystander.wait()


def ours_left(tmp_path: Path) -> list[int]:
    """Live processes carrying this test's tag in their environment."""
    mark = f"{TAG}={tmp_path}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if mark in (entry / "environ").read_bytes().split(b"\0") and \
                        (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
    return found


def killed_at(spec: str, *args: str, tag: Path) -> subprocess.CompletedProcess[str]:
    """The CLI run with ``args``, killed at ``spec`` (tests/killpoint.py)."""
    full = {**os.environ, TAG: str(tag)}
    full.pop("DSV4_WORKSPACE", None)
    return subprocess.run([sys.executable, str(KILLPOINT), spec, "--", *args], env=full,
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def stamps(gguf: Path) -> dict[str, tuple[int, int]]:
    """Each complete layer file: (inode, mtime), what a rewrite would change."""
    conv = load_recipe_and_series(None)[0].conversion
    found = {}
    for layer in range(DIMS.layers):
        path = gguf / GGUF.format(layer)
        if path.exists():
            assert path.stat().st_size == LayerLayout.for_layer(layer, DIMS, conv).file_bytes, \
                f"{path}: a half-written file at its final name"
            found[path.name] = (path.stat().st_ino, path.stat().st_mtime_ns)
    return found


def digests(gguf: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(gguf.glob("*.gguf"))}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", DIMS,
                                      real_layout=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, source: Path) -> dict[str, str]:
    ws = tmp_path_factory.mktemp("ref")
    done = run_cli("-w", str(ws), "convert", "--source", str(source), "-j", "1")
    assert done.code == 0, done
    return digests(ws / "gguf")


# --- convert: a layer file that took its name just before the kill -------------------------


CONVERT_POINTS = [("replace:.gguf:1:KILL", 1), ("replace:.gguf:2:KILL", 2),
                  ("replace:.gguf:1:TERM", None)]


@pytest.mark.parametrize(("spec", "kept"), tiered(CONVERT_POINTS))
def test_convert_killed_after_a_rename_keeps_the_layer(tmp_path: Path, source: Path,
                                                       reference: dict[str, str], spec: str,
                                                       kept: int | None) -> None:
    ws = tmp_path / "ws"
    args = ("-w", str(ws), "convert", "--source", str(source), "-j", "1")
    killed = killed_at(spec, *args, tag=tmp_path)
    assert killed.returncode in (-9, 130, 143), killed
    before = stamps(ws / "gguf")
    if kept is not None:  # SIGKILL: the files renamed so far are complete and stay
        assert len(before) == kept, before
    again = run_cli(*args)
    assert again.code == 0, again
    after = stamps(ws / "gguf")
    assert {name: after[name] for name in before} == before, "a complete layer was redone"
    assert f"converted {DIMS.layers - len(before)} layer(s)" in again.out, again.out
    assert digests(ws / "gguf") == reference
    assert not list((ws / "gguf").glob("*.tmp"))


# --- convert --follow beside a finished download ------------------------------------------


def _repos(src: Path) -> tuple[HubRepo, HubRepo]:
    mxfp4 = HubRepo(MXFP4_REPO, {p.name: p.read_bytes() for p in sorted(src.iterdir())
                                 if p.is_file()})
    w8a8 = tiny_model_repo(W8A8_REPO, commit="a" * 40)
    w8a8.files["config.json"] = (src / "config.json").read_bytes()
    return mxfp4, w8a8


def _sizes(*repos: HubRepo) -> list[str]:
    return [f"weights.{name}.expected_bytes={sum(len(d) for d in r.files.values())}"
            for name, r in zip(("mxfp4", "w8a8"), repos, strict=True)]


def _downloaded(ws: Path, source: Path) -> list[str]:
    """A workspace whose download has verified everything; the --set items it needs."""
    mxfp4, w8a8 = _repos(source)
    sets = _sizes(mxfp4, w8a8)
    recipe, series = load_recipe_and_series(None, sets)
    with StandinHub([mxfp4, w8a8]) as hub:
        ctx = StageContext(recipe=recipe, series=series, workspace=Workspace(ws),
                           options={"endpoint": hub.url}, stage="download")
        assert download.run(ctx).ok
    return [a for s in sets for a in ("--set", s)]


# with two jobs the layers are written by worker processes: the kill is the parent's
FOLLOW_POINTS = [("replace:.gguf:1:KILL", 1), ("replace:.gguf:2:KILL", 1),
                 ("after:layer.converted:1:KILL", 1), ("before:layer.verified:1:KILL", 1),
                 ("after:layer.verified:2:KILL", 1), ("before:layer.started:2:KILL", 1),
                 ("after:layer.converted:1:TERM", 1), ("after:layer.started:2:KILL", 2),
                 ("after:layer.verified:1:KILL", 2), ("after:layer.started:2:TERM", 2)]


@pytest.mark.parametrize(("spec", "jobs"), tiered(FOLLOW_POINTS))
def test_convert_follow_killed_anywhere_redoes_no_complete_layer(
        tmp_path: Path, source: Path, reference: dict[str, str], spec: str, jobs: int) -> None:
    ws = tmp_path / "ws"
    sets = _downloaded(ws, source)
    args = ("-w", str(ws), *sets, "--json", "convert", "--follow", "-j", str(jobs))
    killed = killed_at(spec, *args, tag=tmp_path)
    assert killed.returncode in (-9, 130, 143), killed
    before = stamps(ws / "gguf")
    assert before or "started:2" not in spec or jobs > 1
    again = run_cli(*args)
    assert again.code == 0, again
    data = again.json()["data"]["data"]
    after = stamps(ws / "gguf")
    assert {name: after[name] for name in before} == before, "a complete layer was redone"
    redone = {GGUF.format(layer) for layer in data["converted"]}
    assert not redone & set(before), (redone, before)
    assert digests(ws / "gguf") == reference
    checks = json.loads((ws / "gguf" / ".dsv4-layer-checks.json").read_text())
    assert sorted(checks) == sorted(reference)
    assert not list((ws / "gguf").glob("*.tmp"))


# --- download: killed around the files it verifies ----------------------------------------


DOWNLOAD_POINTS = ["after:file.verified:1:KILL", "before:file.verified:3:KILL",
                   "after:file.verified:4:KILL", "after:file.verified:2:TERM",
                   "before:stage.done:1:KILL", "after:stage.started:1:KILL"]


def _weights(ws: Path, sets: list[str]) -> Path:
    recipe, _series = load_recipe_and_series(None, [s for s in sets if s != "--set"])
    return Workspace(ws).weights_dir(recipe, "mxfp4")


@pytest.mark.parametrize("spec", tiered(DOWNLOAD_POINTS))
def test_download_killed_anywhere_fetches_no_verified_file_again(tmp_path: Path, source: Path,
                                                                 spec: str) -> None:
    ws = tmp_path / "ws"
    mxfp4, w8a8 = _repos(source)
    sets = [a for s in _sizes(mxfp4, w8a8) for a in ("--set", s)]
    record = ws / ".dsv4" / "weights" / "mxfp4.json"
    with StandinHub([mxfp4, w8a8]) as hub:
        args = ("-w", str(ws), *sets, "--json", "download", "mxfp4", "--endpoint", hub.url)
        killed = killed_at(spec, *args, tag=tmp_path)
        assert killed.returncode in (-9, 130, 143), killed
        verified = json.loads(record.read_text())["verified"] if record.exists() else {}
        files = _weights(ws, sets)
        kept = {name: ((files / name).stat().st_ino, (files / name).stat().st_mtime_ns)
                for name in verified}
        hub.requests.clear()
        again = run_cli(*args)
        assert again.code == 0, again
        fetched = {path for (_repo, path), n in hub.sent_by_file().items() if n}
    assert not fetched & set(verified), fetched & set(verified)
    assert {name: ((files / name).stat().st_ino, (files / name).stat().st_mtime_ns)
            for name in verified} == kept, "a verified file was written again"
    for name, data in mxfp4.files.items():
        assert (files / name).read_bytes() == data, name
    status = run_cli("-w", str(ws), *sets, "--json", "status").json()["data"]["stages"]
    assert {s["name"]: s["state"] for s in status}["download"] == "done"


# --- verify-gguf: killed before its record is written -------------------------------------


# its record is written just before `stage.done` (so killed there it is done, and must be
# whole); the manifest is its last write before the record
VERIFY_POINTS = ["after:stage.started:1:KILL", "replace:gguf-sha256.txt:1:KILL",
                 "before:stage.done:1:KILL", "after:stage.started:1:TERM",
                 "replace:gguf-sha256.txt:1:TERM"]


def _manifest(gguf: Path) -> dict[str, str]:
    path = gguf / "gguf-sha256.txt"
    if not path.exists():
        return {}
    return {name.strip(): digest for digest, name in
            (line.split(maxsplit=1) for line in path.read_text().splitlines() if line.strip())}


@pytest.mark.parametrize("spec", tiered(VERIFY_POINTS))
def test_verify_gguf_killed_anywhere_is_not_taken_as_done(tmp_path: Path, source: Path,
                                                          reference: dict[str, str],
                                                          spec: str) -> None:
    ws = tmp_path / "ws"
    made = run_cli("-w", str(ws), "convert", "--source", str(source), "-j", "1")
    assert made.code == 0, made
    before = stamps(ws / "gguf")
    args = ("-w", str(ws), "--json", "verify-gguf", "--no-kernel", "--source", str(source))
    killed = killed_at(spec, *args, tag=tmp_path)
    assert killed.returncode in (-9, 130, 143), killed
    status = run_cli("-w", str(ws), "--json", "status").json()["data"]["stages"]
    if {s["name"]: s["state"] for s in status}["verify-gguf"] == "done":
        assert _manifest(ws / "gguf") == reference  # taken as done only when it is whole
    else:
        assert "before:stage.done" not in spec
    again = run_cli(*args)
    assert again.code == 0, again
    assert stamps(ws / "gguf") == before  # verifying never writes a layer file
    assert digests(ws / "gguf") == reference
    status = run_cli("-w", str(ws), "--json", "status").json()["data"]["stages"]
    assert {s["name"]: s["state"] for s in status}["verify-gguf"] == "done"


# --- build: killed around its steps, and while a step's command runs ---------------------


STEP = """\
import os, signal, sys, time
name = sys.argv[1]
open(name + ".part", "w").write("half")
if os.environ.get("KILL_BUILD_IN") == name:  # the build killed while its command runs
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)  # a long compile: the sentinel of the killed build must stop it
time.sleep(0.2)
os.replace(name + ".part", name + ".out")
print(name + " built")
"""


def _build_site(tmp_path: Path) -> tuple[Path, list[str]]:
    """A workspace whose build has two steps, each a real program that leaves its product
    under a temporary name first; the recipe's build on the host."""
    import yaml

    from dsv4_offload.recipe.load import BUNDLED_RECIPES

    ws = tmp_path / "ws"
    tree = ws / "src" / "ktransformers"
    tree.mkdir(parents=True)
    (tree / "step.py").write_text(STEP)
    doc = yaml.safe_load((BUNDLED_RECIPES / "dsv4-flash-910b.yaml").read_text())
    doc["build"] = {"python": sys.executable, "steps": [
        {"name": n, "workdir": "src/ktransformers", "command": ["{python}", "step.py", n],
         "expect_markers": [f"^{n} built"], "log_sources": []} for n in ("alpha", "beta")]}
    doc["series"] = str(BUNDLED_RECIPES.parent / "patches" / "dsv4-flash.yaml")
    doc["runtime"]["kind"] = "host"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(doc))
    return tree, ["-r", str(recipe), "-w", str(ws)]


BUILD_POINTS = [("after:no-such-event:1:KILL", "beta"),  # beta's command kills the build
                ("after:step.started:1:KILL", ""), ("before:step.done:1:KILL", ""),
                ("after:step.done:2:KILL", ""), ("after:step.started:2:TERM", ""),
                ("after:stage.started:1:KILL", "")]


@pytest.mark.parametrize(("spec", "inside"), tiered(BUILD_POINTS))
def test_build_killed_anywhere_is_not_taken_as_built(tmp_path: Path, spec: str,
                                                     inside: str) -> None:
    """Killed between its steps, or (``inside``) while a step's command runs: the record is
    never `done`, status says interrupted, the command left running is stopped, and the rerun
    builds every step whole."""
    tree, base = _build_site(tmp_path)
    env = {**os.environ, TAG: str(tmp_path), "KILL_BUILD_IN": inside}
    env.pop("DSV4_WORKSPACE", None)
    killed = subprocess.run([sys.executable, str(KILLPOINT), spec, "--", *base, "build"],
                            env=env, capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert killed.returncode in (-9, 130, 143), killed
    # the step's command outlives the stage's process only until the sentinel stops it
    deadline = time.monotonic() + 15
    while ours_left(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ours_left(tmp_path) == [], "the killed build's command is left running"
    stage = {s["name"]: s for s in
             run_cli(*base, "--json", "status").json()["data"]["stages"]}["build"]
    assert stage["state"] == "interrupted", stage
    again = run_cli(*base, "build")
    assert again.code == 0, again
    assert sorted(p.name for p in tree.glob("*.out")) == ["alpha.out", "beta.out"]
    assert not list(tree.glob("*.part")), "a half-made product is left beside the whole one"
    stage = {s["name"]: s for s in
             run_cli(*base, "--json", "status").json()["data"]["stages"]}["build"]
    assert stage["state"] == "done", stage


# --- serve --detach: killed around its stage record ----------------------------------------


SERVE_POINTS = ["after:stage.started:1:KILL", "before:stage.done:1:KILL",
                "after:stage.started:1:TERM", "before:stage.done:1:TERM"]


@pytest.mark.parametrize("spec", tiered(SERVE_POINTS))
def test_serve_detach_killed_anywhere_leaves_one_server_that_status_and_stop_agree_on(
        tmp_path: Path, no_leftovers: str, spec: str) -> None:
    ws, port, base, env = standin_on_host(tmp_path, no_leftovers, "--mode", "good")
    killed = subprocess.run([sys.executable, str(KILLPOINT), spec, "--", *base, "serve",
                             "--detach"], env={**os.environ, **env, TAG: str(tmp_path)},
                            capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert killed.returncode in (-9, 130, 143), killed
    try:
        servers = standin_servers(no_leftovers)
        status = run_cli(*base, "serve", "status", env=env)
        assert (status.code == 0) == bool(servers), (status, servers)
        again = run_cli(*base, "serve", "--detach", env=env)
        assert again.code == 0, again
        servers = standin_servers(no_leftovers)
        assert len(servers) == 1, servers  # one server: a second never starts beside it
        stages = {s["name"]: s for s in
                  run_cli(*base, "--json", "status", env=env).json()["data"]["stages"]}
        assert stages["serve"]["state"] == "done", stages["serve"]
    finally:
        stopped = run_cli(*base, "serve", "stop", env=env)
    assert stopped.code == 0, stopped
    after = run_cli(*base, "serve", "status", env=env)
    assert after.code == 1, after


@pytest.mark.slow
def test_serve_detach_killed_while_its_server_loads_leaves_nothing_that_status_hides(
        tmp_path: Path, no_leftovers: str) -> None:
    """The stage process killed while the server loads (its record names the server, not yet
    ready): the supervisor takes the server down with it, and `status`, `serve status` and
    `serve stop` all say nothing runs; the rerun starts one server. The fast tier's seam:
    tests/test_kills.py::test_serve_detach_killed_anywhere_leaves_one_server_that_status_and_stop_agree_on
    (its first point)."""
    ws, port, base, env = standin_on_host(tmp_path, no_leftovers, "--mode", "good",
                                          "--start-delay", "4")
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_offload", *base, "serve", "--detach"],
                            env={**os.environ, **env, TAG: str(tmp_path)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    record = ws.root / ".dsv4" / "run" / "serve.json"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (
            record.is_file() and json.loads(record.read_text() or "{}").get("server_pid")):
        time.sleep(0.05)
    loading = json.loads(record.read_text())
    assert loading["server_pid"] and proc.poll() is None, loading  # loading, not yet ready
    proc.kill()
    proc.wait()
    try:
        deadline = time.monotonic() + 15
        while ours_left(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ours_left(tmp_path) == [], "the loading server outlived its stage process"
        said = run_cli(*base, "serve", "status", env=env)
        assert said.code == 1 and said.out.startswith("not running"), said
        stages = {s["name"]: s for s in
                  run_cli(*base, "--json", "status", env=env).json()["data"]["stages"]}
        assert stages["serve"]["state"] == "interrupted", stages["serve"]
        stop = run_cli(*base, "serve", "stop", env=env)
        assert stop.code == 0 and "no server running" in stop.out, stop
        again = run_cli(*base, "serve", "--detach", env=env)
        assert again.code == 0, again
        servers = standin_servers(no_leftovers)
        assert len(servers) == 1, servers
    finally:
        run_cli(*base, "serve", "stop", env=env)


# --- run: the pipelined run killed around the events it writes ---------------------------


RUN_POINTS = ["wafter:run.started:1:KILL", "seen:stage.done:2:KILL", "seen:stage.started:4:KILL",
              "seen:stage.done:6:KILL", "seen:stage.started:3:TERM"]


def _records(ws: Path) -> dict[str, tuple[str, str]]:
    state = json.loads((ws / ".dsv4" / "state.json").read_text())
    return {name: (r.get("status", ""), r.get("started", ""))
            for name, r in state.get("stages", {}).items()}


@pytest.mark.parametrize("spec", tiered(RUN_POINTS))
def test_run_killed_anywhere_redoes_no_done_stage(tmp_path: Path, fake_stages_env: dict[str, str],
                                                 spec: str) -> None:
    from conftest import SMALL_RECIPE

    ws = tmp_path / "ws"
    args = ("-r", str(SMALL_RECIPE), "-w", str(ws), "run")
    env = {**os.environ, **fake_stages_env, TAG: str(tmp_path)}
    env.pop("DSV4_WORKSPACE", None)
    killed = subprocess.run([sys.executable, str(KILLPOINT), spec, "--", *args], env=env,
                            capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert killed.returncode in (-9, 130, 143), killed
    deadline = time.monotonic() + 15  # the stage processes die with the run
    while ours_left(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ours_left(tmp_path) == []
    done = {name: r for name, r in _records(ws).items() if r[0] == "done"} \
        if (ws / ".dsv4" / "state.json").exists() else {}
    status = run_cli(*args[:-1], "--json", "status", env=fake_stages_env)
    states = {s["name"]: s["state"] for s in status.json()["data"]["stages"]}
    assert "running" not in states.values(), states  # nothing of it runs any more
    again = run_cli(*args, env=fake_stages_env)
    assert again.code == 0, again
    after = _records(ws)
    assert {name: after[name] for name in done} == done, "a stage done before was redone"
    assert all(status == "done" for status, _started in after.values()), after
