"""Issue 23 end to end: `dsv4-offload run` as a user runs it (pipelined, the default) with the
real download, convert and verify-gguf stages against the throttled stand-in hub, and
stand-ins for the rest (tests/pipestages: a build that burns CPU, a server with a start
time). Each run is a few seconds: a synthetic MXFP4 checkpoint in the real shard layout
(config, index, an embeddings shard, one shard per layer, a head shard) and a small W8A8 set.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CLI, HOST_RECIPE, TESTS, CliResult, run_cli
from serve_helpers import leftovers
from standin_hub import HubRepo, StandinHub
from test_stream import MXFP4_REPO, W8A8_REPO, repo_of, w8a8_repo
from test_stream_pair import reference_files, synthetic_source

from dsv4_offload.core import procs
from dsv4_offload.core.events import iter_file
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.weights import downloads
from dsv4_offload.weights.checkpoint import INDEX_FILE, MoeDims
from dsv4_offload.weights.gguf_io import LayerLayout

DIMS = MoeDims(layers=6, experts=8, experts_per_token=2, hidden=128, intermediate=64)
RATE = 200_000  # B/s: the whole download (~0.75 MB) takes ~4 s
GGUF = "dsv4_layer{}_mxfp4.gguf"
ALL = ["doctor", "fetch", "patch", "build", "selftest", "download", "convert", "verify-gguf",
       "serve", "accept"]
WAIT_S = 60
# the end-to-end pipelined runs are the long tier: each test names the fast tests of its seams
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_source(tmp_path_factory, DIMS)


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory, source: Path) -> dict[int, bytes]:
    return reference_files(tmp_path_factory, source, DIMS)


def recipe_args(repos: list[HubRepo], source: Path) -> list[str]:
    """The 910B recipe on this host, sized for the synthetic sets (the disk preflight counts
    them; conversion.layers stays 43, its published digests name them all); level 4 of
    verify-gguf needs a kt-kernel build, which none is here."""
    recipe, _series = load_recipe_and_series(None)
    layout = LayerLayout.for_layer(0, DIMS, recipe.conversion)
    items = [f"weights.mxfp4.expected_bytes={sum(len(d) for d in repos[0].files.values())}",
             f"weights.w8a8.expected_bytes={sum(len(d) for d in repos[1].files.values())}",
             f"conversion.expected_file_bytes={layout.file_bytes}",
             "selftest.real_layer.enabled=false"]
    return ["-r", str(HOST_RECIPE), *(a for item in items for a in ("--set", item))]


class Site:
    """A workspace, the hub serving both sets, and the environment `run` gets."""

    def __init__(self, tmp: Path, hub: StandinHub, repos: list[HubRepo], source: Path) -> None:
        self.ws, self.hub, self.repos = tmp / "ws", hub, repos
        self.args = [*recipe_args(repos, source), "-w", str(self.ws)]
        path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
        self.env = {"DSV4_STAGE_PACKAGE": "pipestages", "PYTHONPATH": path.rstrip(os.pathsep),
                    "HF_HOME": str(tmp / "hf-home"), "MODELSCOPE_CACHE": str(tmp / "ms"),
                    "HF_ENDPOINT": hub.url, "MODELSCOPE_ENDPOINT": hub.url,
                    "HF_HUB_OFFLINE": ""}

    def behave(self, **what: str) -> None:
        (self.ws / "behave").mkdir(parents=True, exist_ok=True)
        for stage, text in what.items():
            (self.ws / "behave" / stage).write_text(text)

    def run(self, *args: str) -> CliResult:
        return run_cli(*self.args, *args, env=self.env)

    def start(self, *args: str) -> subprocess.Popen[str]:
        full = {**os.environ, **self.env}
        full.pop("DSV4_WORKSPACE", None)
        return subprocess.Popen([*CLI, *self.args, *args], env=full, text=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)

    def events(self) -> list[dict[str, Any]]:
        return list(iter_file(self.ws / "logs" / "run" / "events.jsonl"))

    def record(self, stage: str) -> dict[str, Any]:
        return json.loads((self.ws / ".dsv4" / "state.json").read_text())["stages"][stage]

    def verified(self, which: str) -> set[str]:
        record = json.loads((self.ws / ".dsv4" / "weights" / f"{which}.json").read_text())
        return set(record["verified"])

    def fetched(self) -> dict[tuple[str, str], int]:
        """Body bytes the hub sent per (repo, file) since its requests were last cleared."""
        return {key: n for key, n in self.hub.sent_by_file().items() if n}

    def gguf(self, layer: int) -> bytes:
        return (self.ws / "gguf" / GGUF.format(layer)).read_bytes()


@pytest.fixture
def site(tmp_path: Path, source: Path) -> Iterator[Site]:
    repos = [repo_of(source, MXFP4_REPO), w8a8_repo(source, shard_bytes=96 << 10)]
    with StandinHub(repos) as hub:
        hub.throttle = RATE
        yield Site(tmp_path, hub, repos, source)


def lines(res: CliResult) -> list[dict[str, Any]]:
    """`run --json`: every line of stdout one event, the last run.finished."""
    docs = [json.loads(line) for line in res.out.splitlines()]
    assert docs and docs[-1]["event"] == "run.finished", res
    return docs


def first(docs: list[dict[str, Any]], event: str, stage: str | None = None,
          **match: Any) -> dict[str, Any]:
    return next(d for d in docs if d["event"] == event
                and (stage is None or d.get("stage") == stage)
                and all(d.get(k) == v for k, v in match.items()))


def t(doc: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(doc["t"]).timestamp()


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def shard_of(source: Path, layer: int) -> str:
    weight_map = json.loads((source / INDEX_FILE).read_text())["weight_map"]
    return downloads.layer_shards(weight_map)[layer][0]


def test_convert_and_build_run_while_the_download_does(site: Site,
                                                      expected: dict[int, bytes]) -> None:
    """`run` overlaps the build and the conversion with the real download from the hub.

    Fast tests of its seams, the real download and convert stages paired, and the scheduler
    starting the branches at once with instrumented stages:
    tests/test_stream_pair.py::test_layers_convert_while_the_download_runs
    tests/test_schedule.py::test_build_and_download_run_at_once
    tests/test_schedule.py::test_convert_starts_with_download_and_follows_it
    """
    site.behave(build="burn 0.5", serve="start 0.5")
    res = site.run("--json", "run")
    assert res.code == 0, res
    docs = lines(res)
    assert docs[-1]["stages"] == dict.fromkeys(ALL, "done"), docs[-1]
    down_start, down_done = first(docs, "stage.started", "download"), first(
        docs, "stage.done", "download")
    # convert of layer 0 starts long before the download's end
    layer0 = first(docs, "layer.started", "convert", layer=0)
    assert layer0["convert"] is True and t(layer0) < t(down_done)
    later = [d for d in docs if d["event"] == "file.verified" and t(d) > t(layer0)]
    assert {d["set"] for d in later} == {"mxfp4", "w8a8"}, later
    # the build runs while the bytes arrive: its start and end between the download's
    build_start, build_done = first(docs, "stage.started", "build"), first(
        docs, "stage.done", "build")
    assert t(down_start) < t(build_start) < t(build_done) < t(down_done)
    assert first(docs, "step.done", "build")["status"] == "ok"
    # every layer converted once, as the plain conversion of the whole checkpoint writes it
    started = [d["layer"] for d in docs if d["event"] == "layer.started"]
    assert started == list(range(DIMS.layers))
    assert {d["layer"] for d in docs if d["event"] == "layer.verified"} == set(range(DIMS.layers))
    for layer, data in expected.items():
        assert site.gguf(layer) == data
    # verify-gguf reads no layer again (convert checked each as it wrote it)
    assert first(docs, "stage.done", "verify-gguf")["result"] in ("ok", "warn")
    assert t(down_done) < t(first(docs, "stage.started", "verify-gguf"))
    assert (site.ws / "serve.ready").exists()
    # each file travelled once
    assert all(n == len(site.repos[0 if repo == MXFP4_REPO else 1].files[path])
               for (repo, path), n in site.fetched().items()), site.fetched()
    # the follower's record was written once the download's was done: a rerun skips all
    site.hub.requests.clear()
    again = lines(site.run("--json", "run"))
    assert again[-1]["stages"] == dict.fromkeys(ALL, "skipped"), again[-1]
    assert site.fetched() == {}


def test_sigkill_of_run_and_a_rerun_resume_both_streams(site: Site, source: Path,
                                                        expected: dict[int, bytes],
                                                        no_leftovers: str) -> None:
    """SIGKILL of `run` mid-download; the rerun fetches and converts only what was missing.

    Fast tests of its seams, the download and the convert following it each killed and
    rerun, and a killed run resumed:
    tests/test_kills.py::test_download_killed_anywhere_fetches_no_verified_file_again
    tests/test_kills.py::test_convert_follow_killed_anywhere_redoes_no_complete_layer
    tests/test_pipeline.py::test_killed_run_resumes_from_the_interrupted_stage
    """
    site.behave(build="burn 0.5")
    proc = site.start("--json", "run")
    try:
        wait_for(lambda: any(e["event"] == "layer.verified" and e["layer"] >= 1
                             for e in site.events()), "layer 1 verified")
        docs = site.events()
        assert not any(d["event"] == "stage.done" and d.get("stage") == "download"
                       for d in docs), "the download ended before the kill"
        os.killpg(proc.pid, signal.SIGKILL)  # `run` and only it: its stages have groups of
        proc.communicate()                  # their own, and die by their parent-death signal
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stage_pids = {d["pid"] for d in docs if d["event"] == "stage.started"}
    wait_for(lambda: not any(procs.alive(p) for p in stage_pids), "the stage processes' end")
    # nothing of the killed run is left (stage processes, their sentinels and children)
    wait_for(lambda: not leftovers(no_leftovers), "the killed run's processes to go")
    wait_for(lambda: site.record("download")["status"] != "running", "download's record")
    assert site.record("download")["status"] == "interrupted", site.record("download")
    assert "was killed" in site.record("download")["error"]
    had = {(MXFP4_REPO, p) for p in site.verified("mxfp4")}
    if (site.ws / ".dsv4" / "weights" / "w8a8.json").exists():
        had |= {(W8A8_REPO, p) for p in site.verified("w8a8")}
    layers_done = {e["layer"] for e in site.events() if e["event"] == "layer.verified"}
    sent_before = set(site.fetched())
    assert had and layers_done >= {0, 1}
    assert len(layers_done) < DIMS.layers

    site.hub.requests.clear()
    res = site.run("--json", "run")
    assert res.code == 0, res
    again = lines(res)
    assert again[-1]["stages"]["download"] == again[-1]["stages"]["convert"] == "done"
    fetched = set(site.fetched())
    # no finished file travels again; of the others only the one in flight had bytes before
    # (a plain-HTTP file of the Hub client restarts from zero)
    assert not fetched & had, fetched & had
    assert len(fetched & sent_before) <= 1, fetched & sent_before
    # no layer verified before the kill is converted again; the others are, once
    converted = [e["layer"] for e in again if e["event"] == "layer.started" and e["convert"]]
    assert not set(converted) & layers_done
    assert sorted(converted) == sorted(set(range(DIMS.layers)) - layers_done)
    assert {e["layer"] for e in again if e["event"] == "layer.verified"
            and e.get("already")} == layers_done
    for layer, data in expected.items():
        assert site.gguf(layer) == data


def test_a_corrupt_shard_stops_only_its_layer_and_the_rerun_fetches_just_it(
        site: Site, source: Path, expected: dict[int, bytes]) -> None:
    """A corrupt shard stops its layer alone; the rerun fetches just that shard.

    Fast test of its seam, the same with the download and convert pair:
    tests/test_stream_pair.py::test_a_corrupt_shard_stops_only_its_layer_and_is_fetched_again
    """
    bad = shard_of(source, 1)
    site.repos[0].corrupt_served.add(bad)
    site.behave(build="burn 0.5")
    res = site.run("run")  # as a user reads it; the events are in the run's events file
    assert res.code == 1, res
    assert "run finished with download, convert stopped" in res.out, res
    # the failure said once, as convert's own command shows it, the moment convert ended: in
    # the table right before convert's line (download's line may come before it or after)
    head = res.out[:res.out.index("convert: failed —")].splitlines()
    stage_line = re.compile(r"\s*[\w-]+: (done|failed|skipped|blocked|interrupted)\b")
    ends = [i for i, line in enumerate(head) if stage_line.match(line)]
    table = "\n".join(head[ends[-1] + 1:] if ends else head)
    assert f"layer 1: its shard {bad} failed to" in table, res.out
    assert "convert: failed — 1 of 6 layer(s) not converted" in res.out
    said = next(x for x in res.out.splitlines() if x.startswith("convert failed: "))
    assert said.startswith("convert failed: its error is shown above (log: "), said
    assert "blocked by it: verify-gguf, serve, accept" in res.out
    docs = site.events()
    finished = docs[-1]
    branches = {b["stage"]: b for b in finished["failed"]}
    assert set(branches) == {"download", "convert"}, finished
    assert bad in branches["download"]["error"] and "sha256" in branches["download"]["error"]
    assert bad in branches["convert"]["error"], branches["convert"]
    assert branches["convert"]["blocked"] == ["verify-gguf", "serve", "accept"]
    assert finished["stages"]["build"] == "done"
    failed = [d for d in docs if d["event"] == "layer.failed"]
    assert [d["layer"] for d in failed] == [1] and bad in failed[0]["error"]
    assert failed[0]["fix"] == "rerun `dsv4-offload run` to fetch it again"
    # the failure stopped layer 1 only, before the download's end
    assert t(failed[0]) < t(first(docs, "stage.failed", "download"))
    verified = {d["layer"] for d in docs if d["event"] == "layer.verified"}
    assert verified == set(range(DIMS.layers)) - {1}
    assert not (site.ws / "gguf" / GGUF.format(1)).exists()
    assert bad in first(docs, "stage.failed", "convert")["error"]

    site.repos[0].corrupt_served.clear()
    site.hub.requests.clear()
    res = site.run("--json", "run")
    assert res.code == 0, res
    again = lines(res)
    assert set(site.fetched()) == {(MXFP4_REPO, bad)}
    assert [e["layer"] for e in again if e["event"] == "layer.started" and e["convert"]] == [1]
    assert again[-1]["stages"]["build"] == "skipped"
    for layer, data in expected.items():
        assert site.gguf(layer) == data


def test_a_failing_build_leaves_download_and_conversion_to_finish(
        site: Site, expected: dict[int, bytes]) -> None:
    """A failing build stops only its dependents; the download and conversion finish.

    Fast test of its seam, with instrumented stages:
    tests/test_schedule.py::test_a_failing_build_leaves_the_download_running
    """
    site.behave(build="burn 0.3 fail")
    res = site.run("--json", "run")
    assert res.code == 1, res
    docs = lines(res)
    finished = docs[-1]
    assert finished["exit"] == 1
    assert [(b["stage"], b["blocked"]) for b in finished["failed"]] == [
        ("build", ["selftest", "serve", "accept"])], finished
    assert finished["failed"][0]["error"] == "build failed on purpose: told to fail"
    for stage in ("download", "convert", "verify-gguf"):
        assert finished["stages"][stage] == "done", finished
    # the build failed while the download ran on; the conversion went on to the end
    assert t(first(docs, "stage.failed", "build")) < t(first(docs, "stage.done", "download"))
    for layer, data in expected.items():
        assert site.gguf(layer) == data
    assert not (site.ws / "serve.ready").exists()


def test_serial_keeps_the_order(site: Site, expected: dict[int, bytes]) -> None:
    """`run --serial` runs every stage in the registry's order, the conversion not following.

    Fast test of its seam, with instrumented stages:
    tests/test_pipeline.py::test_run_then_rerun_skips_everything
    """
    site.behave(build="burn 0.2")
    res = site.run("--json", "run", "--serial")
    assert res.code == 0, res
    assert (site.ws / "ran.log").read_text().split() == ALL
    doc = res.json()
    assert doc["data"]["stages"]["convert"]["data"].get("followed") is None  # not beside it
    for layer, data in expected.items():
        assert site.gguf(layer) == data
    assert (site.ws / "serve.ready").exists()
