"""patch check: the CI verification, index-only against the cache (no checkout)."""

from __future__ import annotations

import os
import socket
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.register_assert_rewrite("gitfixtures")
from gitfixtures import Upstreams, git, run_cli, write_project  # noqa: E402

pytest_plugins = ["gitfixtures"]  # the upstreams and git_home fixtures


@pytest.mark.usefixtures("git_home")
def test_check_reports_every_kind_of_patch(tmp_path: Path, upstreams: Upstreams,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    project = write_project(tmp_path / "p", upstreams, upstreams.kitchen_sink)
    ws = tmp_path / "ws"
    junit, md = tmp_path / "out" / "junit.xml", tmp_path / "out" / "summary.md"
    code, doc = run_cli(project.cli(ws) + ["patch", "check", "--junit", str(junit),
                                           "--markdown", str(md)], capsys)
    assert code == 1
    assert doc["command"] == "patch check" and doc["status"] == "failed"
    rows = {r["name"]: r for r in doc["data"]["patches"]}
    assert {n: r["status"] for n, r in rows.items()} == {
        n: upstreams.patches[n].expect for n in upstreams.kitchen_sink}
    assert [r["name"] for r in doc["data"]["patches"]] == upstreams.kitchen_sink  # series order
    assert rows["main-offset"]["detail"] == "applies with offset: hunk 1 at 17 (+3)"
    assert "fuzz 1" in rows["main-fuzz"]["detail"]
    assert rows["main-bad"]["hunks"] == ["src/bad.c:7"]
    assert rows["sub-fails"]["hunks"] == ["pkg/other.py:3"]
    assert doc["data"]["bases"] == {"main": upstreams.commits["main"],
                                    "sub": upstreams.commits["sub"]}

    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("tests") == "9" and suite.get("failures") == "5"
    failed = {c.get("name"): c.find("failure").get("type")  # type: ignore[union-attr]
              for c in suite.iter("testcase") if c.find("failure") is not None}
    assert failed == {"main-offset": "offset", "main-fuzz": "fuzz",
                      "main-already-upstream": "already-upstream", "main-bad": "fails",
                      "sub-fails": "fails"}
    summary = md.read_text()
    assert summary.startswith("## Patch series check: FAILED")
    assert "| `main-bad` | main |" in summary and "src/bad.c:7" in summary

    # never touches the workspace, and no worktree of the cache is made
    assert not (ws / "src").exists()
    for name in ("main", "sub"):
        cache = tmp_path / "cache" / "git" / f"{name}.git"
        assert git(cache, "worktree", "list").count("\n") == 0  # only the bare repo itself


@pytest.mark.usefixtures("git_home")
def test_check_leaves_a_fetched_and_patched_workspace_alone(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    ws = tmp_path / "ws"
    assert run_cli(project.cli(ws) + ["fetch"], capsys)[0] == 0
    assert run_cli(project.cli(ws) + ["patch", "apply"], capsys)[0] == 0
    (ws / "src/main/src/core.c").write_text("work in progress\n")
    heads = git(ws / "src/main", "rev-parse", "HEAD")
    code, doc = run_cli(project.cli(ws) + ["patch", "check", "--only", "sub"], capsys)
    assert code == 0, doc  # sub's two patches are clean
    assert [r["target"] for r in doc["data"]["patches"]] == ["sub", "sub"]
    assert (ws / "src/main/src/core.c").read_text() == "work in progress\n"
    assert git(ws / "src/main", "rev-parse", "HEAD") == heads


@pytest.mark.usefixtures("git_home")
def test_check_includes_the_marker_audit_of_the_patched_workspace(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    project = write_project(tmp_path / "p", upstreams, ["main-core", "sub-mbox"])  # clean
    ws = tmp_path / "ws"
    code, doc = run_cli(project.cli(ws) + ["patch", "check"], capsys)
    assert code == 0, doc  # nothing laid out: the sglang-side markers are unchecked
    assert doc["data"]["audit"]["ok"] is True
    assert run_cli(project.cli(ws) + ["fetch"], capsys)[0] == 0
    assert run_cli(project.cli(ws) + ["patch", "apply"], capsys)[0] == 0
    recipe = yaml.safe_load(project.recipe.read_text())
    # a line the patched tree prints (main-core's change) and one that nothing prints
    recipe["acceptance"]["log_markers_required"] = ["core line 15 patched", "KV Cache is allocated"]
    project.recipe.write_text(yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True))
    code, doc = run_cli(project.cli(ws) + ["patch", "check"], capsys)
    assert code == 1 and doc["status"] == "failed"
    assert doc["data"]["ok"] is True  # every patch applies cleanly: the audit failed it
    verdicts = {m["marker"]: (m["verdict"], m["where"]) for m in doc["data"]["audit"]["markers"]}
    assert verdicts["core line 15 patched"] == ("found", "main/src/core.c:15")
    assert verdicts["KV Cache is allocated"] == ("missing", "")


@pytest.mark.usefixtures("git_home")
def test_check_against_a_newer_upstream_rev(tmp_path: Path, upstreams: Upstreams,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    project = write_project(tmp_path / "p", upstreams,
                            ["main-core", "main-delete-and-mode", "sub-mbox"])
    code, doc = run_cli(project.cli(tmp_path / "ws") + [
        "patch", "check", "--rev", "main=main", "--only", "main"], capsys)
    assert code == 0, doc
    assert doc["data"]["bases"] == {"main": upstreams.tips["main"]}
    assert {r["status"] for r in doc["data"]["patches"]} == {"clean"}
    code, doc = run_cli(project.cli(tmp_path / "ws") + [
        "patch", "check", "--only", "nope"], capsys)
    assert code == 2 and "not a target" in doc["data"]["error"]
    code, doc = run_cli(project.cli(tmp_path / "ws") + [
        "patch", "check", "--rev", "main=no-such-branch"], capsys)
    assert code == 1 and "no-such-branch" in doc["data"]["error"]


@pytest.mark.usefixtures("git_home")
def test_check_refuses_a_tampered_patch(tmp_path: Path, upstreams: Upstreams,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    own = project.dir / "patches" / "sub-own.patch"
    own.write_bytes(own.read_bytes() + b"\n")
    code, doc = run_cli(project.cli(tmp_path / "ws") + ["patch", "check"], capsys)
    assert code == 2
    assert "sub-own" in doc["data"]["error"] and "sha256" in doc["data"]["error"]


def _reachable(host: str, port: int = 443, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@pytest.mark.network
def test_real_series_checks_against_the_public_upstreams(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    if not _reachable("github.com"):
        pytest.skip("github.com is not reachable")
    monkeypatch.setenv("DSV4_CACHE", os.environ.get("DSV4_TEST_CACHE", str(tmp_path / "cache")))
    code, doc = run_cli(["--workspace", str(tmp_path / "ws"), "patch", "check",
                         "--junit", str(tmp_path / "junit.xml")], capsys)
    rows = {r["name"]: r["status"] for r in doc["data"]["patches"]}
    assert len(rows) == 10
    # our fix goes on top of sglang/0003 at the pin: wherever 0003 applies, so does it
    if rows["sglang-streaming-prefill-depool"] == "clean":
        assert rows["sglang-resident-write-through"] == "clean", doc
    # the delivery states these apply cleanly to the pinned commits
    for name in ("kt-kernel-ascend-npu-backend", "kt-kernel-cpu-moe-mxfp4-kernel",
                 "llama-cpp-gguf-numpy2-reader", "llama-cpp-ggml-type-mxfp4"):
        assert rows[name] == "clean", doc
    assert code == (0 if set(rows.values()) == {"clean"} else 1)
