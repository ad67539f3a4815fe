"""Issue 23's data half: the download order, per-file records, and per-layer streaming
conversion beside a running download, against the stand-in hub on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from standin_hub import HubRepo, StandinHub, isolate_clients, tiny_model_repo

from dsv4_offload.core.results import Status
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.stages import download
from dsv4_offload.weights import downloads
from dsv4_offload.weights.checkpoint import (
    INDEX_FILE,
    MoeDims,
    write_synthetic_checkpoint,
)
from dsv4_offload.weights.hubs import HubFile
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

MXFP4_REPO = "deepseek-ai/DeepSeek-V4-Flash"
W8A8_REPO = "sgl-npu/DeepSeek-V4-Flash-W8A8"
DIMS = MoeDims(layers=4, experts=8, experts_per_token=2, hidden=128, intermediate=64)


@pytest.fixture(autouse=True)
def _client_homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_clients(tmp_path, monkeypatch)


def repo_of(root: Path, repo_id: str) -> HubRepo:
    return HubRepo(repo_id, {p.name: p.read_bytes() for p in sorted(root.iterdir())
                             if p.is_file()})


def w8a8_repo(src: Path, shard_bytes: int = 0) -> HubRepo:
    """A small W8A8 set of the same model (its config is the MXFP4 one: the pair check
    compares them), with an extra shard of ``shard_bytes`` to make its download last."""
    repo = tiny_model_repo(W8A8_REPO, commit="a" * 40)
    repo.files["config.json"] = (src / "config.json").read_bytes()
    if shard_bytes:
        repo.files["model-00002-of-00002.safetensors"] = bytes(range(256)) * (shard_bytes // 256)
    return repo


def reversed_names(i: int, n: int) -> str:
    """Shard names that run against the layers: the first shard gets the last name."""
    return f"model-{n + 1 - i:05d}-of-{n:05d}.safetensors"


def sizes(*repos: HubRepo) -> list[str]:
    by_set = dict(zip(("mxfp4", "w8a8"), repos, strict=False))
    return [f"weights.{name}.expected_bytes={sum(len(d) for d in r.files.values())}"
            for name, r in by_set.items()]


def make_ctx(root: Path, overrides: list[str], stage: str = "download",
             **options: object) -> StageContext:
    recipe, series = load_recipe_and_series(None, overrides)
    return StageContext(recipe=recipe, series=series, workspace=Workspace(root),
                        options=dict(options), stage=stage)


# --- the order -----------------------------------------------------------------------------


def test_order_reads_the_index_not_the_names() -> None:
    weight_map = {
        "embed.weight": "a.safetensors",
        "layers.0.ffn.experts.0.w1.weight": "z.safetensors",
        "layers.0.ffn.experts.1.w1.weight": "z.safetensors",
        "model.layers.1.ffn.experts.0.w2.scale": "b.safetensors",
        "layers.2.ffn.experts.0.w3.weight": "m.safetensors",
        "layers.2.ffn_norm.weight": "m.safetensors",
        "head.weight": "c.safetensors",
    }
    files = [HubFile(p, 1) for p in ("README.md", "a.safetensors", "b.safetensors",
                                     "c.safetensors", "config.json", INDEX_FILE,
                                     "m.safetensors", "z.safetensors")]
    order = [f.path for f in downloads.download_order(files, weight_map)]
    assert order == ["config.json", INDEX_FILE, "z.safetensors", "b.safetensors",
                     "m.safetensors", "README.md", "a.safetensors", "c.safetensors"]
    assert downloads.layer_shards(weight_map) == {0: ["z.safetensors"], 1: ["b.safetensors"],
                                                  2: ["m.safetensors"]}
    # no index: config and index first all the same, the rest as listed
    assert [f.path for f in downloads.download_order(files, None)][:3] == [
        "config.json", INDEX_FILE, "README.md"]


def test_download_fetches_mxfp4_by_layer_then_w8a8(tmp_path: Path) -> None:
    src = write_synthetic_checkpoint(tmp_path / "src", DIMS, real_layout=True,
                                     shard_name=reversed_names)
    mxfp4, w8a8 = repo_of(src, MXFP4_REPO), w8a8_repo(src)
    weight_map = json.loads((src / INDEX_FILE).read_text())["weight_map"]
    by_layer = downloads.layer_shards(weight_map)
    with StandinHub([mxfp4, w8a8]) as hub:
        ctx = make_ctx(tmp_path / "ws", sizes(mxfp4, w8a8), endpoint=hub.url)
        result = download.run(ctx)
        assert result.status is Status.OK, result.problems
        got = [hub.file_of(r) for r in hub.data_requests() if r.method == "GET"]
    order = list(dict.fromkeys(key for key in got if key is not None))
    mx = [path for repo, path in order if repo == MXFP4_REPO]
    # config, index, then layer 0's shard (named last), layer 1's, ..., then the others
    assert mx[:2] == ["config.json", INDEX_FILE]
    assert mx[2:2 + DIMS.layers] == [by_layer[layer][0] for layer in range(DIMS.layers)]
    assert mx[2] == f"model-{DIMS.layers + 1:05d}-of-{DIMS.layers + 2:05d}.safetensors"
    assert sorted(mx[2 + DIMS.layers:]) == sorted(set(mxfp4.files) - set(mx[:2 + DIMS.layers]))
    # the W8A8 set only after every MXFP4 file
    first_w8a8 = next(i for i, (repo, _p) in enumerate(order) if repo == W8A8_REPO)
    assert all(repo == W8A8_REPO for repo, _p in order[first_w8a8:])
    record = json.loads(ctx.workspace.weights_record("mxfp4").read_text())
    assert set(record["verified"]) == set(mxfp4.files) and record["failed"] == {}


# --- records written from two processes ----------------------------------------------------


def _write_records(root: str, stage: str, count: int) -> None:
    ws = Workspace(root)
    for i in range(count):
        ws.write_stage_record(stage, {"status": "running", "started": str(i)})
        ws.update_provenance(stage, {"i": i})


def test_two_processes_writing_stage_records_lose_nothing(tmp_path: Path) -> None:
    import multiprocessing

    mp = multiprocessing.get_context("spawn")
    procs = [mp.Process(target=_write_records, args=(str(tmp_path), stage, 40))
             for stage in ("download", "convert")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    ws = Workspace(tmp_path)
    stages = ws.read_state()["stages"]
    assert stages["download"]["started"] == stages["convert"]["started"] == "39"
    prov = json.loads(ws.provenance_file.read_text())
    assert prov["download"] == prov["convert"] == {"i": 39}


# --- convert --follow, one process after the other ------------------------------------------


# two jobs: layers ready while both workers were busy must still start once the download
# has ended (they were failed as "never arrived" when the workers finished together)
@pytest.mark.parametrize("jobs", [1, 2])
def test_follow_after_a_finished_download_converts_and_checks_every_layer(tmp_path: Path,
                                                                          jobs: int) -> None:
    from dsv4_offload.stages import convert, verify_gguf

    src = write_synthetic_checkpoint(tmp_path / "src", DIMS, real_layout=True)
    mxfp4, w8a8 = repo_of(src, MXFP4_REPO), w8a8_repo(src)
    ws = tmp_path / "ws"
    with StandinHub([mxfp4, w8a8]) as hub:
        assert download.run(make_ctx(ws, sizes(mxfp4, w8a8), endpoint=hub.url)).ok
    result = convert.run(make_ctx(ws, sizes(mxfp4, w8a8), "convert", follow=True, jobs=jobs))
    assert result.status is Status.OK, result.problems
    assert result.data["converted"] == list(range(DIMS.layers))
    checks = json.loads((ws / "gguf" / ".dsv4-layer-checks.json").read_text())
    assert sorted(checks) == [f"dsv4_layer{i}_mxfp4.gguf" for i in range(DIMS.layers)]
    assert all(len(c["experts_compared"]) == 4 for c in checks.values())
    for name, check in checks.items():  # the digest recorded is the file's
        assert check["sha256"] == hashlib.sha256((ws / "gguf" / name).read_bytes()).hexdigest()
    # verify-gguf reads none of them again, and agrees
    verified = verify_gguf.run(make_ctx(ws, sizes(mxfp4, w8a8), "verify-gguf"))
    assert verified.ok, verified.problems
    assert verified.data["prechecked"] == list(range(DIMS.layers))
    # level 4 needs a kt-kernel build: none here
    assert verified.data["levels"] == {"1": "ok", "2": "recorded", "3": "ok", "4": "skipped"}
    assert verified.data["digests"] == {name: c["sha256"] for name, c in checks.items()}
    # a rerun converts nothing
    again = convert.run(make_ctx(ws, sizes(mxfp4, w8a8), "convert", follow=True, jobs=1))
    assert again.ok and again.data["skipped"] == list(range(DIMS.layers))
    assert again.data["converted"] == []
    # files written but never checked (killed in between) are checked, not rewritten
    mtimes = {p.name: p.stat().st_mtime_ns for p in (ws / "gguf").glob("*.gguf")}
    (ws / "gguf" / ".dsv4-layer-checks.json").unlink()
    checked = convert.run(make_ctx(ws, sizes(mxfp4, w8a8), "convert", follow=True, jobs=1))
    assert checked.ok and checked.data["checked"] == list(range(DIMS.layers))
    assert checked.data["converted"] == []
    assert {p.name: p.stat().st_mtime_ns for p in (ws / "gguf").glob("*.gguf")} == mtimes
