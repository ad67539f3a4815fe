"""Weights every host resolves to the same bytes (issue 30): a branch read as of a date,
through each hub's commit history, against a stand-in hub whose branches move."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from standin_hub import StandinHub, isolate_clients, tiny_model_repo

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import Status
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.stages import download
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

W8A8_REPO = "sgl-npu/DeepSeek-V4-Flash-W8A8"
MXFP4_REPO = "deepseek-ai/DeepSeek-V4-Flash"
TINY_BYTES = sum(len(d) for d in tiny_model_repo("x/y").files.values())
SIZES = [f"weights.{w}.expected_bytes={TINY_BYTES}" for w in ("w8a8", "mxfp4")]
# after the bundled recipes' not_after (2026-08-06): a V4.1 pushed on both branches
LATER = dt.datetime(2026, 9, 1, 12, 0, tzinfo=dt.timezone.utc)


@pytest.fixture(autouse=True)
def _client_homes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_clients(tmp_path, monkeypatch)


@pytest.fixture
def hub():  # type: ignore[no-untyped-def]
    repos = [tiny_model_repo(W8A8_REPO, commit="a" * 40),
             tiny_model_repo(MXFP4_REPO, commit="1" * 40)]
    with StandinHub(repos) as h:
        yield h


def make_ctx(root: Path, *sets: str, **options: object) -> StageContext:
    recipe, series = load_recipe_and_series(None, [*SIZES, *sets])
    return StageContext(recipe=recipe, series=series, workspace=Workspace(root),
                        options=dict(options), stage="download")


def lock(root: Path) -> dict:
    return json.loads((root / "weights.lock.json").read_text())


def tree(root: Path) -> dict[str, bytes]:
    """Every weight file of a workspace, by its path under the workspace."""
    files = sorted(p.relative_to(root) for p in (root / "weights").rglob("*") if p.is_file())
    return {p.as_posix(): (root / p).read_bytes() for p in files
            if not any(part.startswith(".") for part in p.parts)}


def checkpoint_0731(files: dict[str, bytes]) -> dict[str, bytes]:
    """A later checkpoint of the same model: same shape, other weights."""
    return {**files, "config.json": json.dumps(
        {"model_type": "deepseek_v4", "num_hidden_layers": 2, "checkpoint": "0731"}).encode()}


def v41(files: dict[str, bytes]) -> dict[str, bytes]:
    return {**files, "config.json": json.dumps(
        {"model_type": "deepseek_v41", "num_hidden_layers": 3}).encode()}


def test_two_hosts_a_month_apart_hold_the_same_commits_and_bytes(tmp_path: Path,
                                                                hub: StandinHub) -> None:
    first = download.run(make_ctx(tmp_path / "host1", endpoint=hub.url))
    assert first.status is Status.OK, first.problems
    old = {name: (repo.commit, dict(repo.files)) for name, repo in hub.repos.items()}
    for name, repo in hub.repos.items():  # both branches move on after the delivery's date
        repo.move_to(("b" if name == W8A8_REPO else "2") * 40, v41(repo.files), LATER)
    hub.requests.clear()
    second = download.run(make_ctx(tmp_path / "host2", endpoint=hub.url))
    assert second.status is Status.OK, second.problems
    one, two = lock(tmp_path / "host1"), lock(tmp_path / "host2")
    for key in (f"huggingface:{MXFP4_REPO}@main", f"modelscope:{W8A8_REPO}@master"):
        repo = key.split(":", 1)[1].rsplit("@", 1)[0]
        assert one[key]["resolved"] == two[key]["resolved"] == old[repo][0]
        assert two[key]["committed"] == "2026-07-01T08:00:00Z"
        assert two[key]["not_after"] == "2026-08-06"
    assert two[f"modelscope:{W8A8_REPO}@master"]["identity"] == "a" * 40  # a commit, no listing
    assert tree(tmp_path / "host1") == tree(tmp_path / "host2")
    assert b"deepseek_v41" not in b"".join(tree(tmp_path / "host2").values())
    # fetched by commit, never by branch name, on both hubs
    data = [r.path for r in hub.data_requests()]
    assert any(f"/resolve/{'1' * 40}/" in p for p in data)
    assert not any("/resolve/main/" in p for p in data)
    assert any(f"Revision={'a' * 40}" in p for p in data)
    assert not any("Revision=master" in p for p in data)


def test_a_branch_without_a_date_rule_is_warned_about(tmp_path: Path, hub: StandinHub) -> None:
    result = download.run(make_ctx(tmp_path, "weights.mxfp4.not_after=null", endpoint=hub.url,
                                   which="mxfp4"))
    (pin,) = [p for p in result.problems if p.check == "pin"]
    assert pin.severity == "warning"
    assert pin.message.startswith(f"mxfp4: {MXFP4_REPO}@main has no date rule: it resolved "
                                  f"to the branch's head today ({'1' * 40}, ")
    assert "weights.mxfp4.not_after" in pin.fix


def test_a_full_commit_is_its_own_pin(tmp_path: Path, hub: StandinHub) -> None:
    old = hub.repos[W8A8_REPO].commit
    hub.repos[W8A8_REPO].move_to("b" * 40, v41(hub.repos[W8A8_REPO].files), LATER)
    result = download.run(make_ctx(tmp_path, f"weights.w8a8.revision={old}", endpoint=hub.url,
                                   which="w8a8"))
    assert result.status is Status.WARN, result.problems  # only: mxfp4 not downloaded yet
    assert not any(p.check in ("pin", "drift") for p in result.problems)
    assert lock(tmp_path)[f"modelscope:{W8A8_REPO}@{old}"]["resolved"] == old


def test_a_date_before_any_commit_is_one_line_naming_the_field(tmp_path: Path,
                                                              hub: StandinHub) -> None:
    with pytest.raises(InputError) as err:
        download.run(make_ctx(tmp_path, "weights.mxfp4.not_after=2026-01-01", endpoint=hub.url,
                              which="mxfp4"))
    assert str(err.value).startswith(f"huggingface {MXFP4_REPO}@main has no commit at or "
                                     "before 2026-01-01 (weights.*.not_after)")


def test_the_date_rule_is_the_whole_day_in_utc(tmp_path: Path, hub: StandinHub) -> None:
    repo = hub.repos[W8A8_REPO]
    utc = dt.timezone.utc
    repo.move_to("c" * 40, v41(repo.files), dt.datetime(2026, 8, 6, 23, 59, tzinfo=utc))
    repo.move_to("d" * 40, v41(repo.files), dt.datetime(2026, 8, 7, 0, 0, tzinfo=utc))
    assert download.run(make_ctx(tmp_path, endpoint=hub.url, which="w8a8")).status is Status.WARN
    assert lock(tmp_path)[f"modelscope:{W8A8_REPO}@master"]["resolved"] == "c" * 40


# --- the pair: what the W8A8 set says about its base, against the MXFP4 commit -------------


def card(revision: str) -> bytes:
    return (f"---\nbase_model: {MXFP4_REPO}\nbase_model_revision: {revision}\n---\n"
            "# W8A8\n").encode()


def test_a_w8a8_quantised_from_another_base_revision_is_refused(tmp_path: Path,
                                                                hub: StandinHub) -> None:
    hub.repos[W8A8_REPO].files["README.md"] = card("9f" * 20)
    result = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert result.status is Status.FAILED
    (pair,) = [p for p in result.problems if p.check == "pair"]
    assert pair.severity == "error"
    assert pair.message.startswith(
        f"the weight sets are not one model: the W8A8 set (commit {'a' * 40} of "
        f"2026-07-01T08:00:00Z) was quantised from base revision {'9f' * 20} (README.md "
        f"base_model_revision), the MXFP4 set is commit {'1' * 40} of 2026-07-01T08:00:00Z")
    assert result.outputs == {}  # convert cannot start
    entry = lock(tmp_path)[f"modelscope:{W8A8_REPO}@master"]["base_model"]
    assert entry["revision"] == "9f" * 20


def test_a_w8a8_naming_the_mxfp4_commit_as_its_base_passes(tmp_path: Path,
                                                          hub: StandinHub) -> None:
    hub.repos[W8A8_REPO].files["README.md"] = card("1" * 12)  # an abbreviated sha will do
    result = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert result.status is Status.OK, result.problems
    assert not any(p.check == "pair" for p in result.problems)


def test_an_unstated_base_is_warned_about_when_the_w8a8_is_older(tmp_path: Path,
                                                                hub: StandinHub) -> None:
    repo = hub.repos[MXFP4_REPO]
    repo.move_to("3" * 40, dict(repo.files), dt.datetime(2026, 7, 20, tzinfo=dt.timezone.utc))
    result = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert result.status is Status.WARN, result.problems
    (pair,) = [p for p in result.problems if p.check == "pair"]
    assert pair.severity == "warning"
    assert pair.message == (
        f"the W8A8 set (commit {'a' * 40} of 2026-07-01T08:00:00Z) states no base revision "
        f"and is older than the MXFP4 set (commit {'3' * 40} of 2026-07-20T00:00:00Z): it "
        "cannot have been quantised from these MXFP4 weights unless they did not change in "
        "between")


def test_an_unstated_base_of_a_later_w8a8_is_a_note_naming_both(tmp_path: Path,
                                                               hub: StandinHub) -> None:
    result = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert result.status is Status.OK, result.problems
    (pair,) = [p for p in result.problems if p.check == "pair"]
    assert pair.severity == "info"
    assert f"commit {'a' * 40} of 2026-07-01T08:00:00Z" in pair.message
    assert f"commit {'1' * 40} of 2026-07-01T08:00:00Z" in pair.message
    assert "cannot be known" in pair.message


# --- one lock for a fleet; moving on deliberately; status -----------------------------------

FLOATING = ["weights.w8a8.not_after=null", "weights.mxfp4.not_after=null"]


def test_a_fleet_shares_one_lock_even_with_floating_branches(tmp_path: Path,
                                                            hub: StandinHub) -> None:
    assert download.run(make_ctx(tmp_path / "host1", *FLOATING, endpoint=hub.url)).status \
        is Status.WARN  # floating: warned about
    shared = tmp_path / "host1" / "weights.lock.json"
    for name, repo in hub.repos.items():
        repo.move_to(("b" if name == W8A8_REPO else "2") * 40, v41(repo.files))
    second = download.run(make_ctx(tmp_path / "host2", *FLOATING, endpoint=hub.url,
                                   lock=str(shared)))
    assert second.status is Status.WARN, second.problems
    assert {p.check for p in second.problems if p.severity == "warning"} == {"pin", "drift"}
    one, two = lock(tmp_path / "host1"), lock(tmp_path / "host2")
    for key in one:
        assert one[key]["resolved"] == two[key]["resolved"]
        assert two[key]["from_lock"] == str(shared)
    assert tree(tmp_path / "host1") == tree(tmp_path / "host2")


def test_a_shared_lock_without_the_set_is_one_line(tmp_path: Path, hub: StandinHub) -> None:
    shared = tmp_path / "fleet.json"
    shared.write_text("{}")
    with pytest.raises(InputError) as err:
        download.run(make_ctx(tmp_path / "ws", endpoint=hub.url, which="mxfp4", lock=str(shared)))
    assert str(err.value) == (
        f"--lock {shared}: no commit for 'huggingface:{MXFP4_REPO}@main' (the recipe's mxfp4 "
        "set); export the lock of a host that downloaded this recipe with this version, or "
        "download that set without --lock")
    shared.write_text("[1")
    with pytest.raises(InputError, match=r"^--lock .*fleet.json: not JSON"):
        download.run(make_ctx(tmp_path / "ws", endpoint=hub.url, which="mxfp4", lock=str(shared)))


def test_update_moves_the_lock_saying_from_what_to_what(tmp_path: Path,
                                                        hub: StandinHub) -> None:
    first = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert first.status is Status.OK, first.problems
    repo = hub.repos[MXFP4_REPO]
    repo.move_to("2" * 40, checkpoint_0731(repo.files), LATER)
    # the date rule holds: nothing moves, and the lock says the branch went past it
    again = download.run(make_ctx(tmp_path, endpoint=hub.url))
    assert again.status is Status.OK, again.problems
    from dsv4_offload.weights import weightlock

    moved = weightlock.moved_past(lock(tmp_path), {"mxfp4": ("huggingface", MXFP4_REPO, "main")})
    seen = lock(tmp_path)[f"huggingface:{MXFP4_REPO}@main"]["head"]["seen"]
    assert moved == [
        f"mxfp4: {MXFP4_REPO}@main has moved past the lock: its head was {'2' * 40} "
        f"(2026-09-01T12:00:00Z) when seen {seen}, "
        f"the lock holds {'1' * 40} (2026-07-01T08:00:00Z); to move on, change "
        "weights.mxfp4.not_after and run `dsv4-offload download --update mxfp4`"]
    # moving on deliberately: a later date, and --update
    update = download.run(make_ctx(tmp_path, "weights.mxfp4.not_after=2026-09-30",
                                   endpoint=hub.url, which="mxfp4", update="mxfp4"))
    assert update.status is Status.WARN, update.problems
    (line,) = [p for p in update.problems if p.check == "update"]
    assert line.message == (
        f"mxfp4: huggingface:{MXFP4_REPO}@main moved from {'1' * 40} (2026-07-01T08:00:00Z) "
        f"to {'2' * 40} (2026-09-01T12:00:00Z); the stages that read these weights are stale "
        "(convert, verify-gguf, serve: `dsv4-offload status` names them)")
    assert not any(p.check == "drift" for p in update.problems)
    assert update.outputs["mxfp4"]["resolved"] == "2" * 40  # convert's fingerprint reads it
    assert (tmp_path / "weights" / "DeepSeek-V4-Flash" / "config.json").read_bytes() == \
        repo.files["config.json"]
    assert weightlock.moved_past(lock(tmp_path),
                                 {"mxfp4": ("huggingface", MXFP4_REPO, "main")}) == []
