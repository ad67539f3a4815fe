"""fetch: pinned sources into a shared cache and the workspace, on real git over file://."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytest.register_assert_rewrite("gitfixtures")
from gitfixtures import (  # noqa: E402
    Upstreams,
    git,
    refusing_env,
    repo_state,
    run_cli,
    write_git_shim,
    write_project,
)

pytest_plugins = ["gitfixtures"]  # the upstreams and git_home fixtures
pytestmark = pytest.mark.usefixtures("git_home")


def _sources(doc: dict) -> dict[str, dict]:
    return {s["name"]: s for s in doc["data"]["data"]["sources"]}


def test_fetch_depth1_by_sha_lays_out_the_tree(tmp_path: Path, upstreams: Upstreams,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    ws = tmp_path / "ws"
    code, doc = run_cli(project.cli(ws) + ["fetch"], capsys)
    assert code == 0, doc
    rows = _sources(doc)
    assert {r["cache"] for r in rows.values()} == {"sha"}
    assert {r["checkout"] for r in rows.values()} == {"created"}
    for name, rel in (("main", "src/main"), ("sub", "src/main/third_party/sub"),
                      ("lib", "src/main/third_party/lib"), ("delivery", "src/delivery")):
        assert (ws / rel / ".git").is_dir(), rel
        assert git(ws / rel, "rev-parse", "HEAD") == upstreams.commits[name]
    # depth 1: the later upstream commit on main never reached the cache
    cache = tmp_path / "cache" / "git" / "main.git"
    assert (cache / "shallow").exists()
    assert git(cache, "rev-list", "--all", "--count") == "1"
    # nested checkouts sit at gitlink paths of the tree root without making it dirty
    assert repo_state(ws / "src/main")["status"] == ""
    assert git(ws / "src/main", "ls-tree", "HEAD", "third_party/sub").split()[2] == "1" * 40
    # the submodule note: main records a different sub commit, but sub is not a submodule_of
    assert not any("records" in p["message"] for p in doc["data"]["problems"])


def test_refusing_host_falls_back_to_ref_then_branches(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in refusing_env().items():
        monkeypatch.setenv(key, value)
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    ws = tmp_path / "ws"
    code, doc = run_cli(project.cli(ws) + ["fetch"], capsys)
    assert code == 0, doc
    rows = _sources(doc)
    assert rows["main"]["cache"] == "ref"  # pinned is main~1: the ref's history had it
    assert rows["sub"]["cache"] == "heads"  # no ref in the recipe: all branches
    assert git(ws / "src/main", "rev-parse", "HEAD") == upstreams.commits["main"]
    log = (ws / "logs" / "fetch" / "git.log").read_text()
    assert "unadvertised object" in log


def test_dead_mirrors_are_skipped_in_order(tmp_path: Path, upstreams: Upstreams,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    dead = (tmp_path / "gone").as_uri()
    project = write_project(tmp_path / "p", upstreams, upstreams.good,
                            urls={"main": dead + "/recipe-url"},
                            mirrors={"main": [dead + "/recipe-mirror", upstreams.url("main")]})
    ws = tmp_path / "ws"
    code, doc = run_cli(project.cli(ws) + ["fetch", "--mirror", f"main={dead}/cli-mirror"], capsys)
    assert code == 0, doc
    assert _sources(doc)["main"]["url"] == upstreams.url("main")
    log = (ws / "logs" / "fetch" / "git.log").read_text()
    # tried in order: --mirror, the recipe URL, the recipe's first mirror, then the good one
    order = [log.index(f"{dead}/{n}") for n in ("cli-mirror", "recipe-url", "recipe-mirror")]
    assert order == sorted(order)


def test_mirrors_from_the_environment_and_bad_syntax(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    dead = (tmp_path / "gone").as_uri()
    project = write_project(tmp_path / "p", upstreams, upstreams.good, urls={"sub": dead})
    ws = tmp_path / "ws"
    code, doc = run_cli(project.cli(ws) + ["fetch", "--mirror", "no-equals-sign"], capsys)
    assert code == 2
    assert "expected NAME=URL" in doc["data"]["error"]
    monkeypatch.setenv("DSV4_MIRRORS", f"sub={upstreams.url('sub')}")
    code, doc = run_cli(project.cli(ws) + ["fetch"], capsys)
    assert code == 0, doc
    assert _sources(doc)["sub"]["url"] == upstreams.url("sub")


def test_unknown_mirror_name_is_one_line(tmp_path: Path, upstreams: Upstreams,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    code, doc = run_cli(project.cli(tmp_path / "ws") + ["fetch", "--mirror", "nope=file:///x"],
                        capsys)
    assert code == 2
    assert "not a source of recipe" in doc["data"]["error"]


def test_second_workspace_fetches_zero_new_objects(tmp_path: Path, upstreams: Upstreams,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    copies = tmp_path / "hosts"
    urls = {}
    for name in ("main", "sub", "lib", "delivery"):
        shutil.copytree(upstreams.root / name, copies / name, symlinks=True)
        urls[name] = (copies / name).as_uri()
    project = write_project(tmp_path / "p", upstreams, upstreams.good, urls=urls)
    code, _ = run_cli(project.cli(tmp_path / "ws1") + ["fetch"], capsys)
    assert code == 0
    cache = tmp_path / "cache" / "git"
    before = {n: git(cache / f"{n}.git", "count-objects", "-v") for n in urls}
    shutil.rmtree(copies)  # the hosts are gone: only the cache can serve the second workspace
    code, doc = run_cli(project.cli(tmp_path / "ws2") + ["fetch"], capsys)
    assert code == 0, doc
    assert {r["cache"] for r in _sources(doc).values()} == {"cached"}
    assert {n: git(cache / f"{n}.git", "count-objects", "-v") for n in urls} == before
    assert git(tmp_path / "ws2/src/main", "rev-parse", "HEAD") == upstreams.commits["main"]


def test_git_insteadof_is_honoured(tmp_path: Path, upstreams: Upstreams, git_home: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    fake = "https://git.example.invalid/"
    git_home.write_text(f'[url "{upstreams.root.as_uri()}/"]\n\tinsteadOf = {fake}\n')
    urls = {n: fake + n for n in ("main", "sub", "lib", "delivery")}
    project = write_project(tmp_path / "p", upstreams, upstreams.good, urls=urls)
    code, doc = run_cli(project.cli(tmp_path / "ws") + ["fetch"], capsys)
    assert code == 0, doc
    assert _sources(doc)["main"]["url"] == fake + "main"


@pytest.mark.parametrize("damage", ["dirty", "other-commit", "not-a-repo"])
def test_a_bad_checkout_is_left_alone_unless_force(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str],
        damage: str) -> None:
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    ws = tmp_path / "ws"
    assert run_cli(project.cli(ws) + ["fetch"], capsys)[0] == 0
    sub = ws / "src/main/third_party/sub"
    mod = sub / "pkg/mod.py"
    if damage == "dirty":
        mod.write_text("my precious edit\n")
    elif damage == "other-commit":
        mod.write_text("my precious edit\n")
        git(sub, "commit", "-q", "-am", "work of mine")
    else:
        shutil.rmtree(sub / ".git")
        mod.write_text("my precious edit\n")
    code, doc = run_cli(project.cli(ws) + ["fetch"], capsys)
    assert code == 1
    assert mod.read_text() == "my precious edit\n"
    message = " ".join(p["message"] + p["fix"] for p in doc["data"]["problems"])
    assert damage.replace("-", " ") in message and "--force" in message
    assert _sources(doc)["main"]["checkout"] == "pinned"  # the others are fine

    code, doc = run_cli(project.cli(ws) + ["fetch", "--force"], capsys)
    assert code == 0, doc
    moved = list(sub.parent.glob("sub.moved-*"))
    assert len(moved) == 1 and (moved[0] / "pkg/mod.py").read_text() == "my precious edit\n"
    assert git(sub, "rev-parse", "HEAD") == upstreams.commits["sub"]
    assert repo_state(sub)["status"] == ""


def test_fetch_again_keeps_a_patched_tree(tmp_path: Path, upstreams: Upstreams,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    ws = tmp_path / "ws"
    assert run_cli(project.cli(ws) + ["fetch"], capsys)[0] == 0
    assert run_cli(project.cli(ws) + ["patch", "apply"], capsys)[0] == 0
    heads = {n: git(ws / p, "rev-parse", "HEAD") for n, p in
             (("main", "src/main"), ("sub", "src/main/third_party/sub"))}
    code, doc = run_cli(project.cli(ws) + ["fetch"], capsys)
    assert code == 0, doc
    assert _sources(doc)["main"]["checkout"] == "patched"
    assert heads == {n: git(ws / p, "rev-parse", "HEAD") for n, p in
                     (("main", "src/main"), ("sub", "src/main/third_party/sub"))}


def test_fetch_recovers_from_a_checkout_interrupted_half_way(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    ws = tmp_path / "ws"
    # what a killed fetch leaves: a half-made repository beside the target, and the
    # empty gitlink placeholder of a nested checkout
    partial = ws / "src" / ".main.dsv4-partial"
    (partial / ".git").mkdir(parents=True)
    (partial / "half-written").write_text("x")
    code, doc = run_cli(project.cli(ws) + ["fetch"], capsys)
    assert code == 0, doc
    assert not partial.exists()
    assert git(ws / "src/main", "rev-parse", "HEAD") == upstreams.commits["main"]
    assert sorted(p.name for p in (ws / "src").iterdir()) == ["delivery", "main"]


def test_fetch_failed_checkout_leaves_no_partial_repository(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    ws = tmp_path / "ws"
    shim = write_git_shim(tmp_path / "shim", block_on="checkout", nth=1,
                          reached=tmp_path / "reached", fail=True)
    monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ['PATH']}")
    code, doc = run_cli(project.cli(ws) + ["fetch"], capsys)
    assert code != 0, doc
    assert "checkout refused" in json.dumps(doc)
    assert list(ws.rglob("*.dsv4-partial")) == []
    assert list((ws / "src").iterdir()) == []  # nothing half-made under any name


def test_progress_reads_bytes_from_git_output() -> None:
    from dsv4_offload.core.results import Progress
    from dsv4_offload.sources.git import _progress_reader

    progress = Progress()
    task = progress.task("fetch ktransformers", unit="bytes")
    received = [0]
    # one line as the runner hands it over: git's '\r'-redrawn progress of one phase
    line = ("Receiving objects:   1% (71/7023)\rReceiving objects:  50% (3512/7023), "
            "12.00 MiB | 11.9 MiB/s\rReceiving objects: 100% (7023/7023), 24.95 MiB | "
            "12.1 MiB/s, done.")
    _progress_reader(task, received)(line)
    assert received[0] == int(24.95 * 1024**2)
    assert task.completed == received[0]


def test_an_unusable_cache_names_dsv4_cache_as_the_fix_not_the_network(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 21: the fix column says what fixes it; a cache under a file is no network fault."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    monkeypatch.setenv("DSV4_CACHE", str(blocker / "cache"))
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    code, doc = run_cli(project.cli(tmp_path / "ws") + ["fetch"], capsys)
    assert code == 1, doc
    first = doc["data"]["problems"][0]
    assert "cannot create the git cache" in first["message"]
    assert first["fix"].startswith(f"set DSV4_CACHE to a writable directory (the cache is "
                                   f"{blocker / 'cache'})")
    assert "network" not in first["fix"] and "unreachable" not in doc["data"]["summary"]
