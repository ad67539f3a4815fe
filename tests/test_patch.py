"""patch apply / status / reset / refresh on real git trees made by the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.register_assert_rewrite("gitfixtures")
from gitfixtures import (  # noqa: E402
    AUTHOR,
    Project,
    Upstreams,
    cli_subprocess,
    git,
    repo_state,
    run_cli,
    write_git_shim,
    write_project,
)

pytest_plugins = ["gitfixtures"]  # the upstreams and git_home fixtures
pytestmark = pytest.mark.usefixtures("git_home")

MAIN, SUB = "src/main", "src/main/third_party/sub"


def _fetched(tmp_path: Path, up: Upstreams, names: list[str], capsys: pytest.CaptureFixture[str],
             ws_name: str = "ws") -> tuple[Project, Path]:
    project = write_project(tmp_path / "p", up, names)
    ws = tmp_path / ws_name
    code, doc = run_cli(project.cli(ws) + ["fetch"], capsys)
    assert code == 0, doc
    return project, ws


def _status(project: Project, ws: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    _, doc = run_cli(project.cli(ws) + ["patch", "status"], capsys)
    return {p["name"]: p["state"] for p in doc["data"]["patches"]}


def _subjects(repo: Path, base: str) -> list[str]:
    return git(repo, "log", "--reverse", "--format=%s", f"{base}..HEAD").splitlines()


def test_apply_status_apply_again_reset(tmp_path: Path, upstreams: Upstreams,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    project, ws = _fetched(tmp_path, upstreams, upstreams.good, capsys)
    main, sub = ws / MAIN, ws / SUB
    assert set(_status(project, ws, capsys).values()) == {"not-applied"}

    code, doc = run_cli(project.cli(ws) + ["patch", "apply"], capsys)
    assert code == 0, doc
    assert _subjects(main, upstreams.commits["main"]) == [
        "main-core: test patch main-core", "main-delete-and-mode: test patch main-delete-and-mode",
        "main-offset: test patch main-offset"]
    # the tree: a changed file, a new file, a deleted file, a mode change, an offset hunk
    assert "core line 15 patched" in (main / "src/core.c").read_text()
    assert (main / "src/new.c").exists() and not (main / "src/old.c").exists()
    assert os.access(main / "tools/run.sh", os.X_OK)
    assert git(main, "ls-tree", "HEAD", "tools/run.sh").startswith("100755")
    assert "shift line 20 patched" in (main / "src/shift.c").read_text()
    # plain diffs: fixed identity; mbox: the mail's author is kept; trailers everywhere
    assert git(main, "log", "-1", "--format=%an <%ae>") == "dsv4-offload <dsv4-offload@localhost>"
    mbox = git(sub, "log", "-1", "--format=%an <%ae>%x00%B", "HEAD~1").split("\x00")
    assert mbox[0] == f"{AUTHOR[0]} <{AUTHOR[1]}>"
    sha = upstreams.patches["sub-mbox"].sha256
    assert "Dsv4-Patch: sub-mbox" in mbox[1] and f"Dsv4-Patch-Sha256: {sha}" in mbox[1]
    assert f"Dsv4-Patch-Source: delivery@{upstreams.delivery_commit}:" in mbox[1]
    # the nested checkouts were not swept into the tree root's commits
    touched = git(main, "diff", "--name-only", upstreams.commits["main"], "HEAD").splitlines()
    assert not any(p.startswith("third_party/") for p in touched)
    assert git(main, "ls-tree", "HEAD", "third_party/sub").split()[2] == "1" * 40
    assert set(_status(project, ws, capsys).values()) == {"applied"}

    before = {n: repo_state(ws / p) for n, p in (("main", MAIN), ("sub", SUB))}
    code, doc = run_cli(project.cli(ws) + ["patch", "apply"], capsys)
    assert code == 0 and doc["status"] == "skipped", doc
    assert {n: repo_state(ws / p) for n, p in (("main", MAIN), ("sub", SUB))} == before

    code, doc = run_cli(project.cli(ws) + ["patch", "reset", "--only", "sub"], capsys)
    assert code == 0, doc
    assert git(sub, "rev-parse", "HEAD") == upstreams.commits["sub"]
    kept = doc["data"]["targets"][0]["kept"]
    assert len(kept) == 1 and git(sub, "rev-parse", kept[0]) == before["sub"]["head"]
    assert git(main, "rev-parse", "HEAD") == before["main"]["head"]  # only the one asked
    code, doc = run_cli(project.cli(ws) + ["patch", "reset"], capsys)
    assert code == 0
    assert git(main, "rev-parse", "HEAD") == upstreams.commits["main"]
    assert repo_state(main)["status"] == "" and not (main / "src/new.c").exists()
    assert set(_status(project, ws, capsys).values()) == {"not-applied"}


def test_same_series_gives_same_commit_ids(tmp_path: Path, upstreams: Upstreams,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    heads = []
    for ws_name in ("a", "b"):
        project, ws = _fetched(tmp_path, upstreams, upstreams.good, capsys, ws_name)
        assert run_cli(project.cli(ws) + ["patch"], capsys)[0] == 0  # bare `patch` applies
        heads.append((git(ws / MAIN, "rev-parse", "HEAD"), git(ws / SUB, "rev-parse", "HEAD")))
    assert heads[0] == heads[1]


def test_commit_hooks_are_disabled(tmp_path: Path, upstreams: Upstreams,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    project, ws = _fetched(tmp_path, upstreams, upstreams.good, capsys)
    for repo in (ws / MAIN, ws / SUB):
        hooks = repo / ".git" / "hooks"
        for hook in ("pre-commit", "commit-msg", "applypatch-msg", "pre-applypatch"):
            (hooks / hook).write_text("#!/bin/sh\necho hook ran >&2\nexit 1\n")
            (hooks / hook).chmod(0o755)
    code, doc = run_cli(project.cli(ws) + ["patch", "apply"], capsys)
    assert code == 0, doc
    assert len(_subjects(ws / SUB, upstreams.commits["sub"])) == 2


def test_a_patch_altered_by_one_byte_is_refused_before_any_change(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    project, ws = _fetched(tmp_path, upstreams, upstreams.good, capsys)
    own = project.dir / "patches" / "sub-own.patch"
    data = bytearray(own.read_bytes())
    data[-2] ^= 0x01  # one byte of the last line
    own.write_bytes(bytes(data))
    before = {p: repo_state(ws / p) for p in (MAIN, SUB)}
    code, doc = run_cli(project.cli(ws) + ["patch", "apply"], capsys)
    assert code == 2
    error = doc["data"]["error"]
    assert upstreams.patches["sub-own"].sha256 in error  # expected
    import hashlib

    assert hashlib.sha256(bytes(data)).hexdigest() in error  # actual
    # main comes first in the series and its patches are fine: still untouched
    assert {p: repo_state(ws / p) for p in (MAIN, SUB)} == before


def test_a_failing_third_patch_leaves_the_target_at_the_pinned_commit(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    project, ws = _fetched(tmp_path, upstreams, upstreams.third_fails, capsys)
    main = ws / MAIN
    pinned = repo_state(main)
    code, doc = run_cli(project.cli(ws) + ["patch", "apply"], capsys)
    assert code == 1
    assert repo_state(main) == pinned
    assert pinned["head"] == upstreams.commits["main"]
    assert not (main / "src/new.c").exists() and (main / "src/old.c").exists()
    assert git(main, "for-each-ref", "refs/dsv4/pre-series") == ""
    problem = next(p for p in doc["data"]["problems"] if p["check"] == "main")
    assert "main-bad" in problem["message"] and "src/bad.c:7" in problem["message"]
    assert "see the log" in problem["fix"]
    status = _status(project, ws, capsys)
    assert status["main-core"] == "not-applied"
    assert status["sub-mbox"] == "applied"  # the other target is independent


def test_a_dirty_tree_is_not_patched(tmp_path: Path, upstreams: Upstreams,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    project, ws = _fetched(tmp_path, upstreams, upstreams.good, capsys)
    core = ws / MAIN / "src/core.c"
    core.write_text("my edit\n")
    code, doc = run_cli(project.cli(ws) + ["patch", "apply"], capsys)
    assert code == 1
    assert core.read_text() == "my edit\n"
    assert git(ws / MAIN, "rev-parse", "HEAD") == upstreams.commits["main"]
    assert any("local changes" in p["message"] for p in doc["data"]["problems"])
    code, doc = run_cli(project.cli(ws) + ["patch", "reset", "--only", "main"], capsys)
    assert code == 1 and core.read_text() == "my edit\n"
    code, doc = run_cli(project.cli(ws) + ["patch", "reset", "--target", "main", "--force"], capsys)
    assert code == 0
    kept = doc["data"]["targets"][0]["kept"]
    assert kept and git(ws / MAIN, "show", f"{kept[0]}:src/core.c") == "my edit"


def test_status_reports_changed_and_missing(tmp_path: Path, upstreams: Upstreams,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    assert set(_status(project, tmp_path / "empty", capsys).values()) == {"missing"}
    project, ws = _fetched(tmp_path, upstreams, upstreams.good, capsys)
    assert run_cli(project.cli(ws) + ["patch", "apply"], capsys)[0] == 0
    (ws / MAIN / "src/new.c").write_text("edited after apply\n")
    # a new version of our own patch: same change plus a comment line, new digest
    own = project.dir / "patches" / "sub-own.patch"
    old_sha = upstreams.patches["sub-own"].sha256
    new_data = own.read_bytes().replace(b"+ours = True\n", b"+ours = True\n+# v2\n")
    new_data = new_data.replace(b"@@ -0,0 +1 @@", b"@@ -0,0 +1,2 @@")
    own.write_bytes(new_data)
    import hashlib

    project.series.write_text(project.series.read_text().replace(
        old_sha, hashlib.sha256(new_data).hexdigest()))
    code, doc = run_cli(project.cli(ws) + ["patch", "status"], capsys)
    assert code == 1
    rows = {p["name"]: p for p in doc["data"]["patches"]}
    assert rows["main-core"]["state"] == "changed" and "src/new.c" in rows["main-core"]["detail"]
    assert rows["sub-own"]["state"] == "changed" and "sha256" in rows["sub-own"]["detail"]
    assert rows["sub-mbox"]["state"] == "applied"
    # apply refuses to stack on a different version, --force re-applies (old state kept)
    (ws / MAIN / "src/new.c").write_text("int added;\n")
    code, doc = run_cli(project.cli(ws) + ["patch", "apply"], capsys)
    assert code == 1 and "patch reset --only sub" in doc["data"]["problems"][0]["message"]
    code, doc = run_cli(project.cli(ws) + ["patch", "apply", "--force"], capsys)
    assert code == 0, doc
    assert "# v2" in (ws / SUB / "pkg/ours.py").read_text()
    assert git(ws / SUB, "for-each-ref", "--format=%(refname)", "refs/dsv4/").count("patched-") == 1


def test_refresh_regenerates_our_patch_from_its_commit(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    project, ws = _fetched(tmp_path, upstreams, upstreams.good, capsys)
    assert run_cli(project.cli(ws) + ["patch", "apply"], capsys)[0] == 0
    sub = ws / SUB
    code, doc = run_cli(project.cli(ws) + ["patch", "refresh"], capsys)
    assert code == 0
    rows = {r["name"]: r["result"] for r in doc["data"]["patches"]}
    assert rows["sub-own"] == "unchanged" and rows["sub-mbox"] == "not ours"
    # a maintainer edits the tree and amends the patch's commit (the last one on sub)
    (sub / "pkg/ours.py").write_text("ours = True\nalso = 2\n")
    git(sub, "commit", "-q", "-a", "--amend", "--no-edit")
    code, doc = run_cli(project.cli(ws) + ["patch", "refresh"], capsys)
    assert code == 0, doc
    row = next(r for r in doc["data"]["patches"] if r["name"] == "sub-own")
    assert row["result"] == "refreshed"
    data = (project.dir / "patches" / "sub-own.patch").read_bytes()
    import hashlib

    assert hashlib.sha256(data).hexdigest() == row["sha256"]
    assert b"+also = 2" in data and b"Dsv4-Patch" not in data
    assert row["sha256"] in project.series.read_text()
    assert project.series.read_text().startswith("# test series")  # comments kept
    # the refreshed series re-applies to the same tree
    assert run_cli(project.cli(ws) + ["patch", "reset", "sub"], capsys)[0] == 0
    assert run_cli(project.cli(ws) + ["patch", "apply"], capsys)[0] == 0
    assert (sub / "pkg/ours.py").read_text() == "ours = True\nalso = 2\n"
    assert set(_status(project, ws, capsys).values()) == {"applied"}


def _apply_blocked_at_second_commit(tmp_path: Path, cli: list[str]
                                    ) -> tuple[subprocess.Popen[bytes], Path]:
    """`patch apply` in a subprocess whose git blocks at its second commit; returns once it
    does (the blocked git's pid is in the returned file)."""
    reached = tmp_path / "reached"
    shim = write_git_shim(tmp_path / "shim", block_on="commit", nth=2, reached=reached)
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"}
    proc = cli_subprocess(cli + ["patch", "apply"], env)
    try:
        deadline = time.monotonic() + 60
        while not reached.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the apply never reached its second commit"
            time.sleep(0.02)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc, reached


def test_sigkill_in_the_middle_of_apply_is_recovered(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    # reference: an uninterrupted run in another workspace
    project, ref_ws = _fetched(tmp_path, upstreams, upstreams.good, capsys, "reference")
    assert run_cli(project.cli(ref_ws) + ["patch", "apply"], capsys)[0] == 0
    ws = tmp_path / "ws"
    assert run_cli(project.cli(ws) + ["fetch"], capsys)[0] == 0

    proc, reached = _apply_blocked_at_second_commit(tmp_path, project.cli(ws) + ["--quiet"])
    os.killpg(proc.pid, signal.SIGKILL)  # the tool...
    proc.wait()
    os.kill(int(reached.read_text()), signal.SIGKILL)  # ...and its git (own process group)
    main = ws / MAIN
    # killed half-way: one patch committed, the next one staged, the crash marker set
    assert len(_subjects(main, upstreams.commits["main"])) == 1
    assert git(main, "status", "--porcelain", "--ignore-submodules=all") != ""
    assert git(main, "for-each-ref", "refs/dsv4/pre-series") != ""

    code, doc = run_cli(project.cli(ws) + ["patch", "apply"], capsys)
    assert code == 0, doc
    assert any("recovered" in p["message"] for p in doc["data"]["problems"])
    for rel in (MAIN, SUB):
        assert repo_state(ws / rel) == repo_state(ref_ws / rel), rel
        trees = [git(r / rel, "log", "--format=%T", "-n", "4") for r in (ws, ref_ws)]
        assert trees[0] == trees[1]
    assert git(main, "for-each-ref", "refs/dsv4/pre-series") == ""


def test_ctrl_c_in_the_middle_of_apply_rolls_back(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    project, ws = _fetched(tmp_path, upstreams, upstreams.good, capsys)
    main = ws / MAIN
    pinned = repo_state(main)
    proc, _ = _apply_blocked_at_second_commit(tmp_path, project.cli(ws))
    try:
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert b"Traceback" not in err
    assert repo_state(main) == pinned
    assert git(main, "for-each-ref", "refs/dsv4/pre-series") == ""


def test_a_failing_mail_patch_is_aborted_and_rolled_back(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    project, ws = _fetched(tmp_path, upstreams, ["sub-mbox", "sub-own", "sub-mbox-fails"],
                           capsys)
    sub = ws / SUB
    pinned = repo_state(sub)
    for _ in range(2):  # a second attempt is not blocked by a leftover `git am` session
        code, doc = run_cli(project.cli(ws) + ["patch", "apply"], capsys)
        assert code == 1
        assert repo_state(sub) == pinned
        assert not (sub / ".git" / "rebase-apply").exists()
        target = doc["data"]["data"]["targets"][0]
        assert target["failed_patch"] == "sub-mbox-fails"
        assert target["rejected"] == ["pkg/other.py:6"]


def test_patch_reset_makes_the_patch_stage_stale(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    project, ws = _fetched(tmp_path, upstreams, upstreams.good, capsys)
    assert run_cli(project.cli(ws) + ["patch", "apply"], capsys)[0] == 0

    def patch_stage() -> dict:
        _, doc = run_cli(project.cli(ws) + ["status"], capsys)
        return next(s for s in doc["data"]["stages"] if s["name"] == "patch")

    assert patch_stage()["state"] == "done"
    assert run_cli(project.cli(ws) + ["patch", "reset", "sub"], capsys)[0] == 0
    # the trees no longer hold the series: `run` must not skip the patch stage
    stage = patch_stage()
    assert stage["state"] == "stale" and "head:sub" in stage["reason"]
    assert run_cli(project.cli(ws) + ["patch", "apply"], capsys)[0] == 0
    assert patch_stage()["state"] == "done"


def test_a_new_patch_digest_makes_the_patch_stage_stale(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    project, ws = _fetched(tmp_path, upstreams, upstreams.good, capsys)
    assert run_cli(project.cli(ws) + ["patch", "apply"], capsys)[0] == 0
    _, doc = run_cli(project.cli(ws) + ["status"], capsys)
    states = {s["name"]: s["state"] for s in doc["data"]["stages"]}
    assert states["fetch"] == "done" and states["patch"] == "done"
    own = project.dir / "patches" / "sub-own.patch"
    new_data = own.read_bytes().replace(b"+ours = True\n", b"+ours = False\n")
    own.write_bytes(new_data)
    import hashlib

    project.series.write_text(project.series.read_text().replace(
        upstreams.patches["sub-own"].sha256, hashlib.sha256(new_data).hexdigest()))
    _, doc = run_cli(project.cli(ws) + ["status"], capsys)
    patch = next(s for s in doc["data"]["stages"] if s["name"] == "patch")
    assert patch["state"] == "stale" and "sub-own" in patch["reason"]
