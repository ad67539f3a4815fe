"""Sources pinned only by an abbreviated SHA (`commit_prefix` on a branch), on real git.

The delivery pins ops-transformer as `dd9f31f34` on master (setup_dsv4_env_from_clean_cann.sh
line 76): fetch resolves such a prefix once on the named branch, refuses an ambiguous or
missing one, and locks the full SHA (state, lock file, provenance) for every later fetch.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml

pytest.register_assert_rewrite("gitfixtures")
from gitfixtures import Upstreams, git, run_cli, write_project  # noqa: E402

pytest_plugins = ["gitfixtures"]
pytestmark = pytest.mark.usefixtures("git_home")

PREFIX_LEN = 7  # the shortest commit_prefix the recipe accepts
_STAMP = "U <u@example.org> 1735689600 +0000"


@pytest.fixture(scope="module")
def prefixed_repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str, str]:
    """A repository on `master` grown one commit at a time until two SHAs share a 7-digit
    prefix. SHAs are computed as git does (so we know when to stop), then written by one
    `git fast-import`. Returns (repo, ambiguous prefix, a unique prefix, its full SHA)."""
    blob = hashlib.sha1(b"blob 6\0hello\n").hexdigest()
    entry = b"100644 f\0" + bytes.fromhex(blob)
    tree = hashlib.sha1(b"tree %d\0" % len(entry) + entry).hexdigest()
    seen: dict[str, str] = {}
    shas: list[str] = []
    parent = None
    ambiguous = None
    while ambiguous is None:
        msg = f"c{len(shas)}\n"
        body = f"tree {tree}\n" + (f"parent {parent}\n" if parent else "") + \
            f"author {_STAMP}\ncommitter {_STAMP}\n\n{msg}"
        sha = hashlib.sha1(b"commit %d\0" % len(body.encode()) + body.encode()).hexdigest()
        if sha[:PREFIX_LEN] in seen:
            ambiguous = sha[:PREFIX_LEN]
        seen[sha[:PREFIX_LEN]] = sha
        shas.append(sha)
        parent = sha
    stream = ["blob\nmark :1\ndata 6\nhello\n"]
    for i in range(len(shas)):
        msg = f"c{i}\n"
        stream.append(f"commit refs/heads/master\nauthor {_STAMP}\ncommitter {_STAMP}\n"
                      f"data {len(msg)}\n{msg}" + ("M 100644 :1 f\n" if i == 0 else "") + "\n")
    repo = tmp_path_factory.mktemp("prefixed") / "ops.git"
    git(repo.parent, "init", "-q", "--bare", "-b", "master", str(repo))
    subprocess.run(["git", "fast-import", "--quiet"], cwd=repo, input="".join(stream).encode(),
                   check=True)
    assert git(repo, "rev-parse", "master") == shas[-1]  # our SHAs are git's
    counts = Counter(s[:PREFIX_LEN] for s in shas)
    assert counts[ambiguous] == 2
    unique = shas[len(shas) // 2]
    assert counts[unique[:PREFIX_LEN]] == 1
    return repo, ambiguous, unique[:9], unique


def _project(tmp_path: Path, upstreams: Upstreams, repo: Path, prefix: str) -> list[str]:
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    doc = yaml.safe_load(project.recipe.read_text())
    doc["sources"].append({"name": "ops", "url": f"file://{repo}", "commit_prefix": prefix,
                           "branch": "master", "path": "src/ops", "patched": False})
    project.recipe.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return project.cli(tmp_path / "ws")


def _messages(doc: dict) -> list[str]:
    return [p["message"] for p in doc["data"]["problems"]]


def test_unique_prefix_is_resolved_locked_and_reused(
        tmp_path: Path, upstreams: Upstreams, prefixed_repo: tuple[Path, str, str, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    repo, _, prefix, full = prefixed_repo
    args = _project(tmp_path, upstreams, repo, prefix)
    ws = tmp_path / "ws"
    code, doc = run_cli(args + ["fetch"], capsys)
    assert code == 0, doc
    row = next(r for r in doc["data"]["data"]["sources"] if r["name"] == "ops")
    assert row["commit"] == full and row["lock"] == "resolved" and row["checkout"] == "created"
    assert git(ws / "src/ops", "rev-parse", "HEAD") == full
    lock = json.loads((ws / ".dsv4/sources.lock.json").read_text())
    assert lock["sources"]["ops"]["commit"] == full
    assert lock["sources"]["ops"]["commit_prefix"] == prefix
    state = json.loads((ws / ".dsv4/state.json").read_text())
    assert state["stages"]["fetch"]["outputs"]["ops"] == full
    assert json.loads((ws / "provenance.json").read_text())["fetch"]["ops"] == full

    # the branch moves on: a later fetch keeps the locked SHA and asks no server for it
    tip = git(repo, "rev-parse", "master")
    git(repo, "update-ref", "refs/heads/master", git(repo, "rev-parse", "master~3"))
    repo.rename(repo.with_name("gone.git"))
    try:
        code, doc = run_cli(args + ["fetch"], capsys)
    finally:
        repo.with_name("gone.git").rename(repo)
        git(repo, "update-ref", "refs/heads/master", tip)
    assert code == 0, doc
    row = next(r for r in doc["data"]["data"]["sources"] if r["name"] == "ops")
    assert row["commit"] == full and row["lock"] == "locked"
    # and status, in another process, sees fetch as done
    code, doc = run_cli(args + ["status"], capsys)
    assert next(s for s in doc["data"]["stages"] if s["name"] == "fetch")["state"] == "done"


def test_ambiguous_prefix_is_refused(
        tmp_path: Path, upstreams: Upstreams, prefixed_repo: tuple[Path, str, str, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    repo, ambiguous, _, _ = prefixed_repo
    args = _project(tmp_path, upstreams, repo, ambiguous)
    code, doc = run_cli(args + ["fetch"], capsys)
    assert code == 1
    msg = next(m for m in _messages(doc) if "ops" in m)
    assert f"commit_prefix {ambiguous} is ambiguous on master (2 commits" in msg
    assert not (tmp_path / "ws/src/ops").exists()
    assert not (tmp_path / "ws/.dsv4/sources.lock.json").exists()


def test_missing_prefix_is_refused(
        tmp_path: Path, upstreams: Upstreams, prefixed_repo: tuple[Path, str, str, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    repo, _, _, _ = prefixed_repo
    shas = set(git(repo, "rev-list", "master").split())
    absent = next(p for p in (f"{i:07x}" for i in range(4096))
                  if not any(s.startswith(p) for s in shas))
    args = _project(tmp_path, upstreams, repo, absent)
    code, doc = run_cli(args + ["fetch"], capsys)
    assert code == 1
    assert any(f"no commit on master starts with {absent}" in m for m in _messages(doc))


def test_recipe_refuses_a_prefix_without_branch_or_with_a_commit(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    doc = yaml.safe_load(project.recipe.read_text())
    doc["sources"][3]["commit_prefix"] = "dd9f31f34"
    project.recipe.write_text(yaml.safe_dump(doc, sort_keys=False))
    code, out = run_cli(["--recipe", str(project.recipe), "recipe", "validate"], capsys)
    assert code != 0
    assert "give either 'commit'" in out["data"]["error"]
    del doc["sources"][3]["commit"]
    project.recipe.write_text(yaml.safe_dump(doc, sort_keys=False))
    code, out = run_cli(["--recipe", str(project.recipe), "recipe", "validate"], capsys)
    assert code != 0 and "commit_prefix needs 'branch'" in out["data"]["error"]
