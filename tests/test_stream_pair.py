"""`download` and `convert --follow` as a pipelined run starts them: two CLI processes on
one workspace (under the lock a parent lends them), against a throttled stand-in hub
serving a synthetic MXFP4 checkpoint in the real shard layout and a small W8A8 set."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CLI
from standin_hub import HubRepo, StandinHub
from test_stream import DIMS, MXFP4_REPO, repo_of, sizes, w8a8_repo

from dsv4_offload.core.childrun import EVENTS_ENV, HANDOFF_ENV
from dsv4_offload.core.events import iter_file
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.weights import downloads
from dsv4_offload.weights.checkpoint import INDEX_FILE, MoeDims, write_synthetic_checkpoint
from dsv4_offload.weights.conversion import convert_layer
from dsv4_offload.weights.gguf_io import LayerLayout
from dsv4_offload.workspace.store import Workspace

GGUF = "dsv4_layer{}_mxfp4.gguf"
RATE = 200_000  # B/s: the whole download takes ~3 s


def synthetic_source(factory: pytest.TempPathFactory, dims: MoeDims) -> Path:
    """A synthetic MXFP4 checkpoint of ``dims`` in the real shard layout."""
    return write_synthetic_checkpoint(factory.mktemp("src") / "ckpt", dims, real_layout=True)


def reference_files(factory: pytest.TempPathFactory, source: Path, dims: MoeDims
                    ) -> dict[int, bytes]:
    """Each layer's file as a plain conversion of the whole checkpoint writes it."""
    recipe, _series = load_recipe_and_series(None)
    out = factory.mktemp("reference")
    files = {}
    for layer in range(dims.layers):
        final = out / GGUF.format(layer)
        convert_layer(source, LayerLayout.for_layer(layer, dims, recipe.conversion), final)
        files[layer] = final.read_bytes()
    return files


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_source(tmp_path_factory, DIMS)


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory, source: Path) -> dict[int, bytes]:
    return reference_files(tmp_path_factory, source, DIMS)


class Pair:
    """The two processes of one pipelined attempt, with their events and the hub's traffic."""

    def __init__(self, ws: Path, hub: StandinHub, repos: list[HubRepo], run: str,
                 env: dict[str, str], jobs: int) -> None:
        self.ws, self.hub, self.events = ws, hub, ws.parent / f"events-{run}.jsonl"
        base = [*CLI, "--workspace", str(ws), *(a for s in sizes(*repos) for a in ("--set", s))]
        full = {**os.environ, **env, EVENTS_ENV: str(self.events)}
        full.pop("DSV4_WORKSPACE", None)
        opts: dict[str, Any] = {"env": full, "stdout": subprocess.PIPE,
                                "stderr": subprocess.PIPE, "text": True,
                                "stdin": subprocess.DEVNULL}
        self.download = subprocess.Popen(
            [*base, "--json", "download", "--endpoint", f"huggingface={hub.url}",
             "--endpoint", f"modelscope={hub.url}"], **opts)
        # the scheduler's order: convert starts once download's running record is written,
        # this process's (a killed attempt's record says running too, with its own pid)
        wait_for(lambda: (self.stage("download").get("status") == "running"
                          and self.stage("download").get("pid") == self.download.pid)
                 or self.download.poll() is not None, "download's running record")
        self.convert = subprocess.Popen([*base, "--json", "convert", "--follow",
                                         "--jobs", str(jobs)], **opts)
        self.download_ended: float | None = None

    def stage(self, name: str) -> dict[str, Any]:
        path = self.ws / ".dsv4" / "state.json"
        try:
            return json.loads(path.read_text())["stages"].get(name) or {}
        except (OSError, ValueError):
            return {}

    def list(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in iter_file(self.events) if kind is None or e["event"] == kind]

    def watch(self) -> None:
        if self.download_ended is None and self.download.poll() is not None:
            self.download_ended = time.time()

    def finish(self, timeout: float = 90) -> tuple[dict[str, Any], dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while self.download.poll() is None or self.convert.poll() is None:
            self.watch()
            assert time.monotonic() < deadline, "the pair did not finish"
            time.sleep(0.05)
        self.watch()
        out = []
        for proc in (self.download, self.convert):
            stdout, stderr = proc.communicate()
            doc = json.loads(stdout) if stdout.strip() else {}
            out.append({"code": proc.returncode, "doc": doc, "err": stderr})
        return out[0], out[1]

    def kill(self) -> None:
        for proc in (self.download, self.convert):
            proc.send_signal(signal.SIGKILL)
            proc.communicate()


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def epoch(event: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(event["t"]).timestamp()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"HF_HOME": str(tmp_path / "hf-home"), "MODELSCOPE_CACHE": str(tmp_path / "ms"),
            "HF_ENDPOINT": "", "MODELSCOPE_ENDPOINT": ""}


@pytest.fixture
def lent(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """The workspace, locked by this test as `run` locks it, its lock lent to the pair."""
    ws = tmp_path / "ws"
    workspace = Workspace(ws)
    with workspace.lock("run"), workspace.lend_lock() as token:
        yield ws, {HANDOFF_ENV: token}


def shard_of(source: Path, layer: int) -> str:
    weight_map = json.loads((source / INDEX_FILE).read_text())["weight_map"]
    return downloads.layer_shards(weight_map)[layer][0]


def test_layers_convert_while_the_download_runs(source: Path, expected: dict[int, bytes],
                                                lent: tuple[Path, dict[str, str]],
                                                env: dict[str, str]) -> None:
    ws, token = lent
    repos = [repo_of(source, MXFP4_REPO), w8a8_repo(source, shard_bytes=96 << 10)]
    with StandinHub(repos) as hub:
        hub.throttle = RATE
        pair = Pair(ws, hub, repos, "1", {**env, **token}, jobs=1)
        download, convert = pair.finish()
    assert download["code"] == 0, download
    assert convert["code"] == 0, convert
    started = {e["layer"]: e for e in pair.list("layer.started")}
    verified = pair.list("file.verified")
    assert sorted(started) == list(range(DIMS.layers))
    # layer 0 starts while the download still has files to verify, long before it ends
    assert pair.download_ended is not None
    assert epoch(started[0]) < epoch(verified[-1]) < pair.download_ended
    later = [e for e in verified if epoch(e) > epoch(started[0])]
    assert {e["set"] for e in later} == {"mxfp4", "w8a8"}, later
    # layers start in order, each after its shard is verified
    assert [e["layer"] for e in pair.list("layer.started")] == list(range(DIMS.layers))
    when_verified = {e["path"]: epoch(e) for e in verified}
    for layer, event in started.items():
        assert when_verified[shard_of(source, layer)] <= epoch(event)
    layer_events = {e["layer"] for e in pair.list("layer.verified")}
    assert layer_events == set(range(DIMS.layers))
    for layer, data in expected.items():
        assert (ws / "gguf" / GGUF.format(layer)).read_bytes() == data
    # convert ends after the download, and both are recorded done
    assert convert["doc"]["data"]["outputs"]["layers"] == list(range(DIMS.layers))
    assert pair.stage("download")["status"] == pair.stage("convert")["status"] == "done"


@pytest.mark.slow
def test_sigkill_of_both_and_a_rerun_redo_nothing(source: Path, expected: dict[int, bytes],
                                                  lent: tuple[Path, dict[str, str]],
                                                  env: dict[str, str]) -> None:
    """Download and the convert following it, both killed outright mid-way, then rerun. The
    fast tier's seams (each of the two killed anywhere in the pair, resumed):
    tests/test_kills.py::test_download_killed_anywhere_fetches_no_verified_file_again
    tests/test_kills.py::test_convert_follow_killed_anywhere_redoes_no_complete_layer
    """
    ws, token = lent
    repos = [repo_of(source, MXFP4_REPO), w8a8_repo(source, shard_bytes=96 << 10)]
    with StandinHub(repos) as hub:
        hub.throttle = RATE
        first = Pair(ws, hub, repos, "1", {**env, **token}, jobs=1)
        wait_for(lambda: any(e["layer"] >= 1 for e in first.list("layer.verified")),
                 "layer 1 verified")
        assert first.download.poll() is None  # mid-way: the download still runs
        first.kill()
        record = json.loads((ws / ".dsv4" / "weights" / "mxfp4.json").read_text())
        had = set(record["verified"])
        layers_done = {e["layer"] for e in first.list("layer.verified")}
        sent_before = {path for (_repo, path), n in hub.sent_by_file().items() if n}
        assert layers_done and had

        hub.requests.clear()
        second = Pair(ws, hub, repos, "2", {**env, **token}, jobs=1)
        download, convert = second.finish()
        assert download["code"] == 0, download
        assert convert["code"] == 0, convert
        fetched = {path for (repo, path), n in hub.sent_by_file().items()
                   if n and repo == MXFP4_REPO}
    # no verified file travels again; of the others, only the one in flight had bytes before
    assert not fetched & had
    assert len(fetched & sent_before) <= 1, fetched & sent_before
    # and none is hashed again: only the files not verified at the kill are
    listed = repos[0].files
    assert download["doc"]["data"]["data"]["mxfp4"]["hashed_bytes"] == sum(
        len(data) for path, data in listed.items() if path not in had)
    # no layer verified before the kill is converted again
    converted_again = {e["layer"] for e in second.list("layer.started") if e["convert"]}
    assert not converted_again & layers_done
    assert {e["layer"] for e in second.list("layer.verified") if e.get("already")} \
        >= layers_done
    for layer, data in expected.items():
        assert (ws / "gguf" / GGUF.format(layer)).read_bytes() == data


def test_a_corrupt_shard_stops_only_its_layer_and_is_fetched_again(
        source: Path, expected: dict[int, bytes], lent: tuple[Path, dict[str, str]],
        env: dict[str, str]) -> None:
    ws, token = lent
    bad = shard_of(source, 1)
    repos = [repo_of(source, MXFP4_REPO), w8a8_repo(source, shard_bytes=96 << 10)]
    repos[0].corrupt_served.add(bad)
    with StandinHub(repos) as hub:
        hub.throttle = RATE
        pair = Pair(ws, hub, repos, "1", {**env, **token}, jobs=2)
        download, convert = pair.finish()
        assert download["code"] == 1, download
        assert any(bad in p["message"] for p in download["doc"]["data"]["problems"])
        # named in the record and in an event, and removed
        record = json.loads((ws / ".dsv4" / "weights" / "mxfp4.json").read_text())
        assert list(record["failed"]) == [bad] and "sha256" in record["failed"][bad]["reason"]
        assert [e["path"] for e in pair.list("file.failed")] == [bad]
        assert not (ws / "weights" / "DeepSeek-V4-Flash" / bad).exists()
        assert convert["code"] == 1, convert
        problems = convert["doc"]["data"]["problems"]
        assert [p["check"] for p in problems] == ["layer 1"], problems
        assert bad in problems[0]["message"] and "sha256" in problems[0]["message"]
        assert problems[0]["fix"] == "rerun `dsv4-offload run` to fetch it again"
        failed = pair.list("layer.failed")
        assert [e["layer"] for e in failed] == [1] and bad in failed[0]["error"]
        assert pair.download_ended is not None and epoch(failed[0]) < pair.download_ended
        assert {e["layer"] for e in pair.list("layer.verified")} == {0, 2, 3}
        assert not (ws / "gguf" / GGUF.format(1)).exists()

        repos[0].corrupt_served.clear()
        hub.requests.clear()
        again = Pair(ws, hub, repos, "2", {**env, **token}, jobs=2)
        download, convert = again.finish()
        assert download["code"] == 0 and convert["code"] == 0, (download, convert)
        fetched = {path for (repo, path), n in hub.sent_by_file().items()
                   if n and repo == MXFP4_REPO}
    assert fetched == {bad}
    assert [e["layer"] for e in again.list("layer.started") if e["convert"]] == [1]
    for layer, data in expected.items():
        assert (ws / "gguf" / GGUF.format(layer)).read_bytes() == data
