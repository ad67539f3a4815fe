"""The download stage against a stand-in hub on 127.0.0.1, through the real hub clients."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from standin_hub import StandinHub, isolate_clients, tiny_model_repo

from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.results import Status
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.stages import download
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

W8A8_REPO = "sgl-npu/DeepSeek-V4-Flash-W8A8"
MXFP4_REPO = "deepseek-ai/DeepSeek-V4-Flash"
SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(autouse=True)
def _client_homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_clients(tmp_path, monkeypatch)


@pytest.fixture
def hub():  # type: ignore[no-untyped-def]
    repos = [tiny_model_repo(W8A8_REPO, commit="a" * 40), tiny_model_repo(MXFP4_REPO)]
    with StandinHub(repos) as h:
        yield h


TINY_BYTES = sum(len(d) for d in tiny_model_repo("x/y").files.values())
# the recipe's expected sizes scaled down to the stand-in repos
SIZES = [f"weights.{w}.expected_bytes={TINY_BYTES}" for w in ("w8a8", "mxfp4")]


def make_ctx(root: Path, **options: object) -> StageContext:
    recipe, series = load_recipe_and_series(None, SIZES)
    return StageContext(recipe=recipe, series=series, workspace=Workspace(root),
                        options=dict(options), stage="download")


def weights(ctx: StageContext, which: str) -> Path:
    return ctx.workspace.weights_dir(ctx.recipe, which)


def test_download_both_sets_then_rerun_makes_no_data_request(tmp_path: Path, hub: StandinHub
                                                             ) -> None:
    ctx = make_ctx(tmp_path, endpoint=hub.url)
    result = download.run(ctx)
    assert result.status is Status.OK, result.problems
    repo = hub.repos[MXFP4_REPO]
    for which, name in (("mxfp4", MXFP4_REPO), ("w8a8", W8A8_REPO)):
        for path, data in hub.repos[name].files.items():
            assert (weights(ctx, which) / path).read_bytes() == data
    assert result.outputs["mxfp4"]["resolved"] == repo.commit
    assert result.outputs["mxfp4"]["files"] == 4
    assert result.outputs["w8a8"]["hub"] == "modelscope"
    assert len(hub.data_requests()) > 0

    hub.requests.clear()
    again = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert again.status is Status.OK
    assert hub.data_requests() == []
    assert again.data["mxfp4"]["hashed_bytes"] == 0
    assert again.data["w8a8"]["fetched"] == []
    assert again.outputs == result.outputs  # stable: convert's fingerprint depends on it


def test_corrupted_local_file_is_named_and_fetched_again(tmp_path: Path, hub: StandinHub
                                                         ) -> None:
    ctx = make_ctx(tmp_path, endpoint=hub.url)
    assert download.run(ctx).ok
    shard = weights(ctx, "mxfp4") / SHARD
    blob = bytearray(shard.read_bytes())
    blob[-1] ^= 0x01  # same size, one bit off: only a hash can tell
    shard.write_bytes(bytes(blob))
    hub.requests.clear()

    result = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert result.status is Status.OK
    assert SHARD in result.data["mxfp4"]["refetched_corrupt"]
    assert "sha256" in result.data["mxfp4"]["refetched_corrupt"][SHARD]
    assert any(SHARD in p.message and "corrupt" in p.message for p in result.problems)
    assert shard.read_bytes() == hub.repos[MXFP4_REPO].files[SHARD]
    # only that file travels: its HEAD on the hub, then its bytes from the "CDN"
    sha = hub.repos[MXFP4_REPO].sha256(SHARD)
    fetched = {r.path.rsplit("/", 1)[-1] for r in hub.data_requests()}
    assert fetched == {SHARD, sha}


def test_hub_serving_bad_bytes_fails_naming_the_file_and_next_run_repairs(
        tmp_path: Path, hub: StandinHub) -> None:
    hub.repos[MXFP4_REPO].corrupt_served.add(SHARD)
    result = download.run(make_ctx(tmp_path, endpoint=hub.url, which="mxfp4"))
    assert result.status is Status.FAILED
    errors = [p for p in result.problems if p.severity == "error"]
    assert len(errors) == 1 and SHARD in errors[0].message and "sha256" in errors[0].message
    assert "rerun `dsv4-offload download mxfp4`" in errors[0].fix
    ctx = make_ctx(tmp_path, endpoint=hub.url, which="mxfp4")
    assert not (weights(ctx, "mxfp4") / SHARD).exists()  # never left looking complete

    hub.repos[MXFP4_REPO].corrupt_served.clear()
    hub.requests.clear()
    fixed = download.run(ctx)
    assert fixed.ok
    assert fixed.data["mxfp4"]["fetched"] == [SHARD]


def test_repair_rehashes_everything(tmp_path: Path, hub: StandinHub) -> None:
    ctx = make_ctx(tmp_path, endpoint=hub.url, which="mxfp4")
    assert download.run(ctx).ok
    again = download.run(make_ctx(tmp_path, endpoint=hub.url, which="mxfp4", repair=True))
    total = sum(len(d) for d in hub.repos[MXFP4_REPO].files.values())
    assert again.data["mxfp4"]["hashed_bytes"] == total


def test_unreachable_hub_is_one_clean_line(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = make_ctx(tmp_path, endpoint=f"http://127.0.0.1:{port}", which="mxfp4")
    with pytest.raises(Dsv4Error) as err:
        download.run(ctx)
    line = err.value.one_line()
    assert "\n" not in line
    assert "cannot list deepseek-ai/DeepSeek-V4-Flash on huggingface" in line
    assert "--local-dir-only" in line


def test_not_enough_disk_fails_before_any_data_request(tmp_path: Path, hub: StandinHub) -> None:
    hub.repos[MXFP4_REPO].phantom["model-00002-of-00002.safetensors"] = 1 << 60  # 1 EiB
    result = download.run(make_ctx(tmp_path, endpoint=hub.url, which="mxfp4"))
    assert result.status is Status.FAILED
    disk = [p for p in result.problems if p.check == "disk"]
    assert disk and "GiB still to download but only" in disk[0].message
    assert hub.data_requests() == []


def test_local_dir_only_checks_without_network(tmp_path: Path, hub: StandinHub) -> None:
    ctx = make_ctx(tmp_path, endpoint=hub.url, which="mxfp4")
    no_record = download.run(make_ctx(tmp_path, which="mxfp4", local_dir_only=True))
    assert no_record.status is Status.FAILED
    assert "with network access" in no_record.problems[0].fix
    assert download.run(ctx).ok
    hub.stop()
    record_file = ctx.workspace.weights_record("mxfp4")
    record = json.loads(record_file.read_text())
    record["listed"] = listed = "2026-01-02T03:04:05+00:00"
    record_file.write_text(json.dumps(record))

    offline = download.run(make_ctx(tmp_path, which="mxfp4", local_dir_only=True))
    assert offline.ok
    # the record still says when the hub was asked, not when the disk was last checked
    assert json.loads(record_file.read_text())["listed"] == listed
    (weights(ctx, "mxfp4") / "tokenizer.json").unlink()
    shard = weights(ctx, "mxfp4") / SHARD
    shard.write_bytes(shard.read_bytes()[::-1])  # same size, other bytes
    missing = download.run(make_ctx(tmp_path, which="mxfp4", local_dir_only=True))
    assert missing.status is Status.FAILED
    assert "tokenizer.json (missing)" in missing.problems[0].message
    assert f"{SHARD} (sha256 " in missing.problems[0].message
    assert shard.exists()  # offline, a bad copy is reported, never deleted


def test_partial_file_resumes_with_a_range_request(tmp_path: Path, hub: StandinHub) -> None:
    ctx = make_ctx(tmp_path, endpoint=hub.url, which="w8a8")
    data = hub.repos[W8A8_REPO].files[SHARD]
    target = weights(ctx, "w8a8") / SHARD
    target.parent.mkdir(parents=True)
    # modelscope's client keeps the partial beside the target as <name>.incomplete
    target.with_name(SHARD + ".incomplete").write_bytes(data[:1000])
    result = download.run(ctx)
    assert result.ok, result.problems
    assert target.read_bytes() == data
    ranges = [r.range for r in hub.data_requests() if SHARD in r.path]
    assert "bytes=1000-" in ranges


def test_hf_endpoint_variable_is_honoured(tmp_path: Path, hub: StandinHub,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    result = download.run(make_ctx(tmp_path, which="mxfp4"))
    assert result.ok
    assert result.data["mxfp4"]["endpoint"] == hub.url


def test_one_set_only_warns_about_the_other(tmp_path: Path, hub: StandinHub) -> None:
    result = download.run(make_ctx(tmp_path, endpoint=hub.url, which="mxfp4"))
    assert result.status is Status.WARN
    assert any("w8a8" in p.message for p in result.problems)
    assert set(result.outputs) == {"mxfp4"}


def test_unknown_revision_and_set_are_input_errors(tmp_path: Path, hub: StandinHub) -> None:
    recipe, series = load_recipe_and_series(None, [*SIZES, "weights.mxfp4.revision=nope"])
    ctx = StageContext(recipe=recipe, series=series, workspace=Workspace(tmp_path),
                       options={"endpoint": hub.url, "which": "mxfp4"}, stage="download")
    with pytest.raises(InputError, match="no revision 'nope'"):
        download.run(ctx)
    with pytest.raises(InputError, match="unknown weight set 'fp8'"):
        download.run(make_ctx(tmp_path, endpoint=hub.url, which="fp8"))


def test_record_is_valid_json_listing(tmp_path: Path, hub: StandinHub) -> None:
    ctx = make_ctx(tmp_path, endpoint=hub.url, which="mxfp4")
    assert download.run(ctx).ok
    record = json.loads(ctx.workspace.weights_record("mxfp4").read_text())
    assert record["listing"]["resolved"] == hub.repos[MXFP4_REPO].commit
    assert set(record["verified"]) == set(hub.repos[MXFP4_REPO].files)


def test_listing_far_from_the_recipe_size_warns(tmp_path: Path, hub: StandinHub) -> None:
    recipe, series = load_recipe_and_series(None)  # the real ~150 GiB expectation
    ctx = StageContext(recipe=recipe, series=series, workspace=Workspace(tmp_path),
                       options={"endpoint": hub.url, "which": "mxfp4"}, stage="download")
    result = download.run(ctx)
    assert result.status is Status.WARN
    size = [p for p in result.problems if p.check == "size"]
    assert size and "the recipe expects about 150.0 GiB" in size[0].message


def test_hand_copied_weights_offline_get_a_structure_check(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, which="mxfp4", local_dir_only=True)
    target = weights(ctx, "mxfp4")
    target.mkdir(parents=True)
    for path, data in tiny_model_repo(MXFP4_REPO).files.items():
        (target / path).write_bytes(data)
    result = download.run(ctx)
    assert result.status is Status.WARN
    assert any("only the structure was checked" in p.message for p in result.problems)
    assert not ctx.workspace.weights_record("mxfp4").exists()  # online run still verifies all

    shard = target / SHARD
    shard.write_bytes(shard.read_bytes()[:-100])  # a copy cut short
    truncated = download.run(make_ctx(tmp_path, which="mxfp4", local_dir_only=True))
    assert truncated.status is Status.FAILED
    assert SHARD in truncated.problems[0].message and "truncated" in truncated.problems[0].message


def test_modelscope_client_rejecting_bad_bytes_is_reported(tmp_path: Path, hub: StandinHub,
                                                            capfd: pytest.CaptureFixture[str]
                                                            ) -> None:
    hub.repos[W8A8_REPO].corrupt_served.add(SHARD)
    ctx = make_ctx(tmp_path, endpoint=hub.url, which="w8a8")
    result = download.run(ctx)
    assert result.status is Status.FAILED
    (error,) = [p for p in result.problems if p.severity == "error"]
    assert SHARD in error.message and "Hash mismatch" in error.message
    assert not (weights(ctx, "w8a8") / SHARD).exists()
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # the client's bars and warnings went to the stage log
    assert "Hash validation failed" in (ctx.log_dir / "download.log").read_text()


def test_sets_downloaded_one_at_a_time_add_up_in_the_record(tmp_path: Path, hub: StandinHub
                                                            ) -> None:
    from dsv4_offload import pipeline

    ctx = make_ctx(tmp_path, endpoint=hub.url)
    with ctx.workspace.lock("download"):
        first = pipeline.run_stage(ctx, "download", {"endpoint": hub.url, "which": "mxfp4"})
        assert first.status is Status.WARN  # w8a8 still missing
        second = pipeline.run_stage(ctx, "download", {"endpoint": hub.url, "which": "w8a8"})
    assert second.status is Status.OK, second.problems
    assert set(second.outputs) == {"w8a8", "mxfp4"}
    record = ctx.workspace.read_state()["stages"]["download"]
    assert record["status"] == "done" and set(record["outputs"]) == {"w8a8", "mxfp4"}


def test_hf_hub_offline_variable_means_local_dir_only(tmp_path: Path, hub: StandinHub,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert download.run(make_ctx(tmp_path, endpoint=hub.url, which="mxfp4")).ok
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = download.run(make_ctx(tmp_path, endpoint=hub.url, which="mxfp4"))
    assert result.ok
    assert hub.requests == []


def test_hf_leftover_partials_are_dropped_and_the_file_fetched_whole(tmp_path: Path,
                                                                       hub: StandinHub) -> None:
    # huggingface_hub 2.x never resumes a plain-HTTP partial (it writes a fresh temp file per
    # process); what a killed run leaves behind must not pile up on a 150 GiB download
    ctx = make_ctx(tmp_path, endpoint=hub.url, which="mxfp4")
    repo = hub.repos[MXFP4_REPO]
    data = repo.files[SHARD]
    leftover = (weights(ctx, "mxfp4") / ".cache" / "huggingface" / "download"
                / f"x.{repo.sha256(SHARD)}.1234abcd.incomplete")
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(data[:1000])
    result = download.run(ctx)
    assert result.ok, result.problems
    assert (weights(ctx, "mxfp4") / SHARD).read_bytes() == data
    assert not leftover.exists()
    assert not list(leftover.parent.rglob("*.incomplete"))


# --- the weights lock: resolved revisions, drift, the base model of both sets ---------------


def _lock(root: Path) -> dict:
    return json.loads((root / "weights.lock.json").read_text())


def test_download_locks_both_resolved_revisions(tmp_path: Path, hub: StandinHub) -> None:
    result = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert result.status is Status.OK, result.problems
    lock = _lock(tmp_path)
    hf = lock[f"huggingface:{MXFP4_REPO}@main"]
    assert hf["resolved"] == hub.repos[MXFP4_REPO].commit == hf["identity"]
    assert hf["base_model"]["name"] == MXFP4_REPO
    assert hf["not_after"] == "2026-08-06" and hf["committed"] == "2026-07-01T08:00:00Z"
    ms = lock[f"modelscope:{W8A8_REPO}@master"]
    # ModelScope's commit history names the commit its listing does not (issue 30)
    assert ms["resolved"] == "a" * 40 == ms["identity"]
    assert ms["committed"] == "2026-07-01T08:00:00Z"


def _revised(repo_files: dict[str, bytes]) -> dict[str, bytes]:
    return {**repo_files, "config.json": json.dumps(
        {"model_type": "deepseek_v4", "num_hidden_layers": 2, "revised": 1}).encode()}


def test_drift_on_the_hub_fetches_the_locked_commit(tmp_path: Path, hub: StandinHub) -> None:
    # one set at a time: the other's absence is a warning
    first = download.run(make_ctx(tmp_path / "a", endpoint=hub.url, which="mxfp4"))
    assert first.status is Status.WARN, first.problems
    repo = hub.repos[MXFP4_REPO]
    old_sha, old_files = repo.commit, dict(repo.files)
    repo.move_to("b" * 40, _revised(repo.files))  # `main` moves on
    # another machine with this lock and no weights yet (or the weights deleted)
    ws = tmp_path / "b"
    ws.mkdir()
    (ws / "weights.lock.json").write_bytes((tmp_path / "a" / "weights.lock.json").read_bytes())
    hub.requests.clear()
    again = download.run(make_ctx(ws, endpoint=hub.url, which="mxfp4"))
    assert again.status is Status.WARN, again.problems
    (drift,) = [p for p in again.problems if p.check == "drift"]
    assert drift.severity == "warning"
    assert drift.message.startswith(f"mxfp4: {MXFP4_REPO}@main now resolves to {'b' * 40}, "
                                    f"locked at {old_sha} on ")
    assert f"fetching the locked commit {old_sha} instead" in drift.message
    assert f"--set weights.mxfp4.revision={'b' * 40}" in drift.fix
    target = weights(make_ctx(ws), "mxfp4")
    for path, data in old_files.items():
        assert (target / path).read_bytes() == data  # the locked commit's files, not main's
    assert any(f"/resolve/{old_sha}/" in r.path for r in hub.data_requests())
    assert not any("/resolve/main/" in r.path for r in hub.requests)
    assert again.outputs["mxfp4"]["resolved"] == old_sha
    assert again.outputs["mxfp4"]["revision"] == "main"  # the lock's key stays the recipe's
    entry = _lock(ws)[f"huggingface:{MXFP4_REPO}@main"]
    assert entry["resolved"] == old_sha and entry["revision_moved_to"] == "b" * 40
    # moving on purpose: pin the new commit
    moved = download.run(StageContext(
        recipe=load_recipe_and_series(None, [*SIZES, f"weights.mxfp4.revision={'b' * 40}"])[0],
        series=None, workspace=Workspace(ws), options={"endpoint": hub.url, "which": "mxfp4"},
        stage="download"))
    assert moved.status is Status.WARN and not any(p.check == "drift" for p in moved.problems)
    assert (target / "config.json").read_bytes() == repo.files["config.json"]


def test_drift_to_a_commit_the_hub_no_longer_has_is_refused(tmp_path: Path,
                                                            hub: StandinHub) -> None:
    assert download.run(make_ctx(tmp_path, endpoint=hub.url, which="mxfp4")).status is Status.WARN
    repo = hub.repos[MXFP4_REPO]
    repo.move_to("c" * 40, _revised(repo.files))
    repo.history.clear()  # force-pushed away
    again = download.run(make_ctx(tmp_path, endpoint=hub.url, which="mxfp4"))
    assert again.status is Status.FAILED
    (drift,) = [p for p in again.problems if p.check == "drift"]
    assert "the locked commit cannot be listed any more" in drift.message
    assert drift.fix.startswith(f"To move on purpose, pin the new commit (--set "
                                f"weights.mxfp4.revision={'c' * 40})")


def test_drift_on_modelscope_fetches_the_locked_commit(tmp_path: Path, hub: StandinHub) -> None:
    assert download.run(make_ctx(tmp_path, endpoint=hub.url, which="w8a8")).status is Status.WARN
    repo = hub.repos[W8A8_REPO]
    old_files = dict(repo.files)
    repo.move_to("d" * 40, _revised(repo.files))  # `master` moves on, before not_after
    for path in old_files:  # another host with this lock: nothing on disk yet
        (weights(make_ctx(tmp_path), "w8a8") / path).unlink()
    again = download.run(make_ctx(tmp_path, endpoint=hub.url, which="w8a8"))
    assert again.status is Status.WARN, again.problems
    (drift,) = [p for p in again.problems if p.check == "drift"]
    assert drift.message.startswith(f"w8a8: {W8A8_REPO}@master now resolves to {'d' * 40}, "
                                    f"locked at {'a' * 40} on ")
    assert f"fetching the locked commit {'a' * 40} instead" in drift.message
    for path, data in old_files.items():
        assert (weights(make_ctx(tmp_path), "w8a8") / path).read_bytes() == data
    assert _lock(tmp_path)[f"modelscope:{W8A8_REPO}@master"]["resolved"] == "a" * 40


def test_an_older_lock_with_a_modelscope_listing_digest_stays_readable(
        tmp_path: Path, hub: StandinHub) -> None:
    assert download.run(make_ctx(tmp_path, endpoint=hub.url, which="w8a8")).status is Status.WARN
    lock_file = tmp_path / "weights.lock.json"
    doc = _lock(tmp_path)
    entry = doc[f"modelscope:{W8A8_REPO}@master"]
    # what main 9d24765 wrote: no commit, the listing digest as identity
    entry.update(resolved=None, identity=f"listing:{entry['listing_digest']}")
    for k in ("committed", "not_after"):
        entry.pop(k)
    lock_file.write_text(json.dumps(doc))
    again = download.run(make_ctx(tmp_path, endpoint=hub.url, which="w8a8"))
    assert again.status is Status.WARN and not any(p.check == "drift" for p in again.problems)
    assert _lock(tmp_path)[f"modelscope:{W8A8_REPO}@master"]["identity"] == "a" * 40
    # the same old entry, the hub moved since: refused, naming the entry to delete
    lock_file.write_text(json.dumps(doc))
    hub.repos[W8A8_REPO].move_to("d" * 40, _revised(hub.repos[W8A8_REPO].files))
    moved = download.run(make_ctx(tmp_path, endpoint=hub.url, which="w8a8"))
    assert moved.status is Status.FAILED
    (drift,) = [p for p in moved.problems if p.check == "drift"]
    assert "it holds a listing digest from before ModelScope commits were resolved" in \
        drift.message
    assert f"delete the entry 'modelscope:{W8A8_REPO}@master' from {tmp_path}" not in drift.fix


def test_a_w8a8_set_of_another_base_is_refused_before_conversion(tmp_path: Path,
                                                                hub: StandinHub) -> None:
    hub.repos[W8A8_REPO].files["README.md"] = (
        b"---\nbase_model: deepseek-ai/DeepSeek-V4.1-Flash\nlicense: mit\n---\n# W8A8\n")
    result = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert result.status is Status.FAILED
    (pair,) = [p for p in result.problems if p.check == "pair"]
    assert pair.message.startswith(
        "the weight sets are not one model: the W8A8 set names base model "
        f"deepseek-ai/DeepSeek-V4.1-Flash (README.md base_model), the MXFP4 set is {MXFP4_REPO}")
    assert "refused before conversion" in pair.message
    assert result.outputs == {}  # convert, which needs download, cannot start
    lock = _lock(tmp_path)  # both recorded, for the report
    assert lock[f"modelscope:{W8A8_REPO}@master"]["base_model"]["name"] == \
        "deepseek-ai/DeepSeek-V4.1-Flash"


def test_a_w8a8_card_naming_the_same_base_passes(tmp_path: Path, hub: StandinHub) -> None:
    hub.repos[W8A8_REPO].files["README.md"] = (
        f"---\nbase_model:\n- {MXFP4_REPO}\n---\n# W8A8\n".encode())
    result = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert result.status is Status.OK, result.problems


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_loopback_mirror_is_reached_past_an_exported_proxy(
        tmp_path: Path, hub: StandinHub, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(var, dead)
    monkeypatch.setenv("NO_PROXY", "corp.example")
    monkeypatch.delenv("no_proxy", raising=False)
    result = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert result.status is Status.OK, result.problems
    assert "added to NO_PROXY/no_proxy" in (tmp_path / "logs").rglob("download.log").__next__(
        ).read_text()
    assert os.environ["NO_PROXY"] == "corp.example"  # restored after the stage
    assert "no_proxy" not in os.environ


def test_an_unreachable_mirror_names_the_exported_proxy(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    dead = f"http://user:secret@127.0.0.1:{_closed_port()}"
    for var in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, dead)
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    ctx = make_ctx(tmp_path, endpoint="http://mirror.invalid", which="mxfp4")
    with pytest.raises(Dsv4Error) as err:
        download.run(ctx)
    line = err.value.one_line()
    assert "a proxy is exported (http_proxy=http://127.0.0.1:" in line
    assert "secret" not in line  # the proxy's credentials are never shown
    assert "add its host to NO_PROXY" in line
