"""patch check --bisect and patch rebase on a 40-commit upstream history the tests make."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

pytest.register_assert_rewrite("gitfixtures")
from gitfixtures import (  # noqa: E402
    CONFLICT_AT,
    FAILS_AT,
    FUZZ_AT,
    HIST_LENGTH,
    UPSTREAM_AT,
    History,
    Upstreams,
    cli_subprocess,
    git,
    lines,
    run_cli,
    write_history_project,
)

pytest_plugins = ["gitfixtures"]  # upstreams, history and git_home fixtures
pytestmark = pytest.mark.usefixtures("git_home")


def _missing_blobs(repo: Path) -> int:
    out = git(repo, "rev-list", "--objects", "--missing=print", "--all")
    return sum(1 for line in out.splitlines() if line.startswith("?"))


def test_bisect_names_the_fuzz_fail_and_upstream_commits(
        tmp_path: Path, upstreams: Upstreams, history: History,
        capsys: pytest.CaptureFixture[str]) -> None:
    project = write_history_project(tmp_path / "p", upstreams, history)
    junit, md = tmp_path / "out" / "bisect.xml", tmp_path / "out" / "bisect.md"
    code, doc = run_cli(project.cli(tmp_path / "ws") + [
        "patch", "check", "--bisect", "hist=main", "--junit", str(junit),
        "--markdown", str(md)], capsys)
    assert code == 1, doc  # not every patch is clean at REF
    [report] = doc["data"]["targets"]
    assert report["ref_commit"] == history.at(HIST_LENGTH)
    assert report["commits_walked"] == HIST_LENGTH + 1  # the pinned commit and the 40 after it
    # only the pinned commit and those changing src/a.c or src/b.c are checked; a merge of a
    # side branch counts once and its own commit is not walked
    assert report["commits_checked"] == 5
    rows = {p["name"]: p for p in report["patches"]}
    moving = rows["hist-moving"]
    assert moving["at_ref"] == "already-upstream"
    assert moving["last_clean"]["commit"] == history.at(FUZZ_AT - 1)
    assert moving["first_offset"] is None
    assert moving["first_fuzz"]["commit"] == history.at(FUZZ_AT)
    assert moving["first_fuzz"]["subject"] == f"upstream {FUZZ_AT}: reword line 17"
    assert moving["first_fuzz"]["files"] == ["src/a.c"]
    assert moving["first_fuzz"]["date"].startswith("2025-03-01T10:00:00")
    assert "fuzz 1" in moving["first_fuzz"]["detail"]
    assert moving["first_fails"]["commit"] == history.at(FAILS_AT)
    assert moving["first_fails"]["detail"].startswith("rejected: src/a.c:")
    assert moving["first_upstream"]["commit"] == history.at(UPSTREAM_AT)
    assert [t["status"] for t in moving["transitions"]] == [
        "clean", "fuzz", "fails", "already-upstream"]
    mail = rows["hist-mail"]
    assert mail["at_ref"] == "fails"
    assert mail["last_clean"]["commit"] == history.at(CONFLICT_AT - 1)
    assert mail["first_fails"]["commit"] == history.at(CONFLICT_AT)
    assert mail["first_fails"]["files"] == ["src/b.c"]
    assert mail["first_fuzz"] is None and mail["first_upstream"] is None

    # the history came without blobs: the ones never read are still missing
    assert report["note"] == ""
    assert _missing_blobs(tmp_path / "cache" / "git" / "hist.history.git") > 0

    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "2" and suite.get("failures") == "2"
    failure = {c.get("name"): c.find("failure") for c in suite.iter("testcase")}
    assert failure["hist-mail"] is not None
    assert failure["hist-mail"].get("message") == (
        f"fails at main, since {history.at(CONFLICT_AT)[:12]} "
        f"upstream {CONFLICT_AT}: their line 10")
    summary = md.read_text()
    assert summary.startswith("## Patch bisect hist:")
    assert f"`{history.at(FAILS_AT)[:12]}` upstream {FAILS_AT}" in summary


def test_bisect_before_the_first_change_is_clean_and_a_filterless_host_is_noted(
        tmp_path: Path, upstreams: Upstreams, history: History,
        capsys: pytest.CaptureFixture[str]) -> None:
    refusing = tmp_path / "refusing"
    shutil.copytree(history.path, refusing)
    git(refusing, "config", "uploadpack.allowFilter", "false")
    project = write_history_project(tmp_path / "p", upstreams, history, url=refusing.as_uri())
    ref = history.at(FUZZ_AT - 1)
    code, doc = run_cli(project.cli(tmp_path / "ws") + [
        "patch", "check", "--bisect", f"hist={ref}"], capsys)
    assert code == 0, doc
    [report] = doc["data"]["targets"]
    assert report["commits_walked"] == FUZZ_AT and report["ok"] is True
    assert {p["name"]: p["last_clean"]["commit"] for p in report["patches"]} == {
        "hist-moving": ref, "hist-mail": ref}
    assert "does not allow filters" in report["note"]
    assert _missing_blobs(tmp_path / "cache" / "git" / "hist.history.git") == 0
    code, doc = run_cli(project.cli(tmp_path / "ws") + [
        "patch", "check", "--bisect", "nope=main"], capsys)
    assert code == 2 and "not a target" in doc["data"]["error"]
    code, doc = run_cli(project.cli(tmp_path / "ws") + [
        "patch", "check", "--bisect", "hist=main", "--rev", "hist=main"], capsys)
    assert code == 2 and "drop --rev" in doc["data"]["error"]
    code, doc = run_cli(project.cli(tmp_path / "ws") + [
        "patch", "check", "--bisect", "hist=no-such-branch"], capsys)
    assert code == 1 and "'no-such-branch' could not be fetched" in doc["data"]["error"]
    later = write_history_project(tmp_path / "later", upstreams, history, pinned=history.at(5))
    code, doc = run_cli(later.cli(tmp_path / "ws") + [
        "patch", "check", "--bisect", f"hist={history.at(2)}"], capsys)
    assert code == 2 and "is an ancestor of the pinned commit" in doc["data"]["error"]


def test_rebase_through_a_conflict_writes_a_series_that_checks_and_applies(
        tmp_path: Path, upstreams: Upstreams, history: History,
        capsys: pytest.CaptureFixture[str]) -> None:
    project = write_history_project(tmp_path / "p", upstreams, history)
    ws = tmp_path / "ws"
    out = tmp_path / "carried"
    code, doc = run_cli(project.cli(ws) + ["patch", "rebase", "hist=v2.0", "--out", str(out)],
                        capsys)
    assert code == 1, doc
    data = doc["data"]
    assert data["status"] == "stopped" and data["conflicts"] == ["src/b.c"]
    states = {p["name"]: p["state"] for p in data["patches"]}
    assert states == {"hist-moving": "dropped", "hist-mail": "conflict"}
    worktree = Path(data["worktree"])
    assert "<<<<<<<" in (worktree / "src/b.c").read_text()
    assert not (worktree / "README").exists()  # a sparse work tree: the touched files only

    # a new process: --continue refuses while the file is still conflicted
    code, doc = run_cli(project.cli(ws) + ["patch", "rebase", "--continue"], capsys)
    assert code == 2 and "still conflicted" in doc["data"]["error"]
    resolved = lines("b", 20).replace("b line 10\n", "b line 10 theirs ours\n")
    (worktree / "src/b.c").write_text(resolved)
    git(worktree, "add", "src/b.c")
    code, doc = run_cli(project.cli(ws) + ["patch", "rebase", "--continue"], capsys)
    assert code == 0, doc
    data = doc["data"]
    assert data["status"] == "done"
    new_dir = out / "hist-series@v2.0"
    assert data["out"] == str(new_dir) and data["written"] == ["hist-mail.patch"]
    assert not worktree.exists()
    branch = git(tmp_path / "cache/git/hist.history.git", "rev-parse",
                 "refs/heads/dsv4-rebase/hist-v2.0~1")
    assert branch == history.at(HIST_LENGTH)  # the work branch stays for review, on REF

    series = yaml.safe_load((new_dir / "hist-series-v2.0.yaml").read_text())
    [entry] = series["patches"]
    patch = (new_dir / "hist-mail.patch").read_bytes()
    assert entry["sha256"] == hashlib.sha256(patch).hexdigest()
    assert entry["origin"] == {"file": "hist-mail.patch"} and entry["upstream"] == "submitted"
    assert entry["method"] == "mbox"
    assert b"+b line 10 theirs ours" in patch and b"Dsv4-Patch" not in patch
    assert b"From: Alice Maintainer" in patch and b"Subject: [PATCH] b: our change" in patch
    text = (new_dir / "hist-series-v2.0.yaml").read_text()
    assert "hist-moving: already upstream at v2.0: dropped" in text
    assert "hist-mail: conflict in src/b.c resolved by hand" in text
    overlay = yaml.safe_load((new_dir / "recipe.yaml").read_text())
    assert overlay["extends"] == "../../p/recipe.yaml"
    assert overlay["sources"] == [{"name": "hist", "commit": history.at(HIST_LENGTH),
                                   "ref": "v2.0"}]

    # the overlay: check is clean at REF, and apply verifies the digests in a new workspace
    recipe = ["--recipe", str(new_dir / "recipe.yaml")]
    code, doc = run_cli(["--workspace", str(tmp_path / "ws2"), *recipe, "patch", "check"],
                        capsys)
    assert code == 0, doc
    assert doc["data"]["bases"] == {"hist": history.at(HIST_LENGTH)}
    assert [(p["name"], p["status"]) for p in doc["data"]["patches"]] == [("hist-mail", "clean")]
    ws2 = ["--workspace", str(tmp_path / "ws2"), *recipe]
    assert run_cli([*ws2, "fetch"], capsys)[0] == 0
    code, doc = run_cli([*ws2, "patch", "apply"], capsys)
    assert code == 0, doc
    applied = tmp_path / "ws2" / "src/hist"
    assert (applied / "src/b.c").read_text() == resolved
    assert f"Dsv4-Patch-Sha256: {entry['sha256']}" in git(applied, "log", "-1", "--format=%B")


def test_rebase_abort_drops_everything_and_a_second_start_is_refused(
        tmp_path: Path, upstreams: Upstreams, history: History,
        capsys: pytest.CaptureFixture[str]) -> None:
    project = write_history_project(tmp_path / "p", upstreams, history)
    ws = tmp_path / "ws"
    code, doc = run_cli(project.cli(ws) + ["patch", "rebase", "hist=main"], capsys)
    assert code == 1 and doc["data"]["status"] == "stopped"
    worktree = Path(doc["data"]["worktree"])
    code, doc = run_cli(project.cli(ws) + ["patch", "rebase", "hist=main"], capsys)
    assert code == 2 and "under way" in doc["data"]["error"]
    code, doc = run_cli(project.cli(ws) + ["patch", "rebase", "--abort"], capsys)
    assert code == 0 and doc["data"]["status"] == "aborted"
    assert not worktree.exists() and not (ws / "rebase" / "state.json").exists()
    hist_cache = tmp_path / "cache" / "git" / "hist.history.git"
    assert git(hist_cache, "branch", "--list", "dsv4-rebase/*") == ""
    assert not (ws / "rebased").exists()
    code, doc = run_cli(project.cli(ws) + ["patch", "rebase", "--continue"], capsys)
    assert code == 2 and "no rebase" in doc["data"]["error"]


def test_rebase_of_a_series_upstream_took_whole_says_so(
        tmp_path: Path, upstreams: Upstreams, history: History,
        capsys: pytest.CaptureFixture[str]) -> None:
    project = write_history_project(tmp_path / "p", upstreams, history, names=["hist-moving"])
    ws = tmp_path / "ws"
    code, doc = run_cli(project.cli(ws) + ["patch", "rebase", "hist=v2.0"], capsys)
    assert code == 2 and "nothing to carry" in doc["data"]["error"]
    assert not (ws / "rebased").exists()
    code, doc = run_cli(project.cli(ws) + ["patch", "rebase", "--abort"], capsys)
    assert code == 0 and [p["state"] for p in doc["data"]["patches"]] == ["dropped"]


@pytest.mark.parametrize("nth", [1, 2])
def test_a_rebase_killed_after_a_pick_restarts_that_pick(
        nth: int, tmp_path: Path, upstreams: Upstreams, history: History,
        capsys: pytest.CaptureFixture[str]) -> None:
    project = write_history_project(tmp_path / "p", upstreams, history)
    ws = tmp_path / "ws"
    # a git that runs the nth cherry-pick (1: the one upstream already has, which commits an
    # empty commit; 2: the conflicting one), then blocks, so the tool is killed after git
    # changed the work tree and before the tool recorded it
    shim, reached = tmp_path / "shim", tmp_path / "reached"
    shim.mkdir()
    (shim / "git").write_text(f"""#!/bin/sh
case " $* " in
  *" cherry-pick "*)
    n=$(cat "{shim}/count" 2>/dev/null || echo 0); n=$((n+1)); echo "$n" > "{shim}/count"
    if [ "$n" -eq {nth} ]; then
      "{shutil.which("git")}" "$@"
      echo $$ > "{reached}.tmp"; mv "{reached}.tmp" "{reached}"
      exec sleep 120
    fi ;;
esac
exec "{shutil.which("git")}" "$@"
""")
    (shim / "git").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"}
    proc = cli_subprocess(project.cli(ws) + ["patch", "rebase", "hist=main"], env)
    try:
        deadline = time.monotonic() + 60
        while not reached.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the rebase never reached its second pick"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    os.kill(int(reached.read_text()), signal.SIGKILL)
    state = json.loads((ws / "rebase" / "state.json").read_text())
    assert [p["state"] for p in state["picks"]] == (
        ["pending", "pending"] if nth == 1 else ["dropped", "pending"])
    worktree = Path(state["worktree"])
    if nth == 1:  # git made the (empty) commit, unrecorded
        assert git(worktree, "rev-parse", "HEAD~1") == history.at(HIST_LENGTH)
    else:  # git left the conflict behind, unrecorded
        assert git(worktree, "ls-files", "-u")

    code, doc = run_cli(project.cli(ws) + ["patch", "rebase", "--continue"], capsys)
    assert code == 1, doc
    assert doc["data"]["status"] == "stopped" and doc["data"]["conflicts"] == ["src/b.c"]
    assert git(worktree, "rev-parse", "HEAD") == history.at(HIST_LENGTH)
    (worktree / "src/b.c").write_text(lines("b", 20).replace("b line 10\n", "b line 10 both\n"))
    git(worktree, "add", "src/b.c")
    code, doc = run_cli(project.cli(ws) + ["patch", "rebase", "--continue"], capsys)
    assert code == 0 and doc["data"]["status"] == "done", doc
    assert [p["state"] for p in doc["data"]["patches"]] == ["dropped", "done"]
    # the branch is REF plus the carried patch: no leftover of the interrupted pick
    cache = tmp_path / "cache" / "git" / "hist.history.git"
    assert git(cache, "rev-parse", "dsv4-rebase/hist-main~1") == history.at(HIST_LENGTH)


def _same_as_worktree(clone: Path, commits: list[str], patches: list[tuple[str, bytes]],
                      tmp: Path) -> list[tuple[str, str, str]]:
    """Each patch, alone, against each commit: the index-only classification and the one of
    a real checkout (series.classify) side by side; returns (commit, patch, status) rows."""
    from dsv4_offload.recipe import PatchEntry
    from dsv4_offload.sources.indexcheck import IndexTree, method_of
    from dsv4_offload.sources.series import classify

    log = tmp / "log"
    rows = []
    for commit in commits:
        git(clone, "checkout", "-q", "--detach", commit)
        for name, data in patches:
            patch_file = tmp / f"{name}.patch"
            patch_file.write_bytes(data)
            worktree = classify(clone, patch_file, 1, log)
            index = IndexTree(clone, commit, tmp / "idx", log)
            entry = PatchEntry.model_validate({
                "name": name, "target": "t", "origin": {"file": "x"}, "sha256": "0" * 64,
                "method": "mbox" if data.startswith(b"From ") else "plain", "description": "x"})
            got = index.classify(patch_file, 1, method_of(entry))
            # the index check adds what a 3-way merge would do; the rest is the same
            assert (got.status, got.detail.split("; a 3-way merge")[0], got.hunks) == (
                worktree.status, worktree.detail, worktree.hunks), (commit, name)
            rows.append((commit, name, got.status))
    return rows


def test_index_only_classification_equals_a_checkouts(
        tmp_path: Path, upstreams: Upstreams, history: History) -> None:
    main = tmp_path / "main"
    git(tmp_path, "clone", "-q", str(upstreams.root / "main"), str(main))
    kitchen = [(n, upstreams.patches[n].data) for n in upstreams.kitchen_sink
               if upstreams.patches[n].target == "main"]
    rows = _same_as_worktree(main, [upstreams.commits["main"]], kitchen, tmp_path)
    assert {name: status for _, name, status in rows} == {
        n: upstreams.patches[n].expect for n, _ in kitchen}

    hist = tmp_path / "hist"
    git(tmp_path, "clone", "-q", str(history.path), str(hist))
    # the commits around each change of state (every commit takes seconds on 2 cores)
    numbers = [FUZZ_AT - 1, FUZZ_AT, FAILS_AT, UPSTREAM_AT, CONFLICT_AT - 1, CONFLICT_AT,
               HIST_LENGTH]
    rows = _same_as_worktree(hist, [history.pinned, *map(history.at, numbers)],
                             [(n, s.data) for n, s in history.patches.items()], tmp_path)
    assert {status for _, _, status in rows} == {"clean", "fuzz", "fails", "already-upstream"}
