"""The kill matrix: each stage killed (SIGKILL, SIGTERM) at points chosen by the events it
emits (tests/killpoint.py), then run again. Nothing verified is redone (inode and mtime
kept), nothing half-written is taken as done, no process of ours is left behind."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TESTS, run_cli
from standin_hub import HubRepo, StandinHub, isolate_clients, tiny_model_repo

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


@pytest.fixture(autouse=True)
def _client_homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_clients(tmp_path, monkeypatch)


def killed_at(spec: str, *args: str, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    """The CLI run with ``args``, killed at ``spec`` (tests/killpoint.py)."""
    full = {**os.environ, **(env or {})}
    full.pop("DSV4_WORKSPACE", None)
    return subprocess.run([sys.executable, str(KILLPOINT), spec, "--", *args], env=full,
                          capture_output=True, text=True, timeout=300,
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


@pytest.mark.parametrize(("spec", "kept"), CONVERT_POINTS)
def test_convert_killed_after_a_rename_keeps_the_layer(tmp_path: Path, source: Path,
                                                       reference: dict[str, str], spec: str,
                                                       kept: int | None) -> None:
    ws = tmp_path / "ws"
    args = ("-w", str(ws), "convert", "--source", str(source), "-j", "1")
    killed = killed_at(spec, *args)
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


FOLLOW_POINTS = ["replace:.gguf:1:KILL", "replace:.gguf:2:KILL", "after:layer.converted:1:KILL",
                 "before:layer.verified:1:KILL", "after:layer.verified:2:KILL",
                 "before:layer.started:2:KILL", "after:layer.converted:1:TERM"]


@pytest.mark.parametrize("spec", FOLLOW_POINTS)
def test_convert_follow_killed_anywhere_redoes_no_complete_layer(
        tmp_path: Path, source: Path, reference: dict[str, str], spec: str) -> None:
    ws = tmp_path / "ws"
    sets = _downloaded(ws, source)
    args = ("-w", str(ws), *sets, "--json", "convert", "--follow", "-j", "1")
    killed = killed_at(spec, *args)
    assert killed.returncode in (-9, 130, 143), killed
    before = stamps(ws / "gguf")
    assert before or "started:2" not in spec
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
