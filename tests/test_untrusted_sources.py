"""Mirrors and source URLs from the user never run a command, and credentials never show.

Canaries: a mirror that would make git run ``touch CANARY`` (``--upload-pack=…``,
``ext::…``), through ``--mirror`` and through DSV4_MIRRORS; the canary must not appear,
and the error names where the URL came from.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

pytest.register_assert_rewrite("gitfixtures")
from gitfixtures import Upstreams, run_cli, write_project  # noqa: E402

from dsv4_offload.core.errors import InputError  # noqa: E402
from dsv4_offload.core.runner import redact  # noqa: E402
from dsv4_offload.sources.git import git_url_problem, parse_mirrors  # noqa: E402

pytest_plugins = ["gitfixtures"]
pytestmark = pytest.mark.usefixtures("git_home")


def injections(canary: Path) -> list[str]:
    return [f"--upload-pack=touch {canary}", f"--upload-pack=touch${{IFS}}{canary}",
            f"ext::sh -c touch% {canary}", f"ext::touch {canary}", "-oProxyCommand=touch x",
            f"ssh://-oProxyCommand=touch%20{canary}/x", "fd::17", "http://plain.example/x.git",
            f"file:///x {canary}", "javascript:alert(1)"]


def test_every_injection_is_refused_before_git_runs(tmp_path: Path) -> None:
    canary = tmp_path / "CANARY"
    for url in injections(canary):
        assert git_url_problem(url) is not None, url
        with pytest.raises(InputError, match="--mirror"):
            parse_mirrors([f"main={url}"])
        with pytest.raises(InputError, match="DSV4_MIRRORS"):
            parse_mirrors([], f"main={url}")
    for good in ("https://host/x.git", "ssh://git@host/x.git", "git://host/x", "file:///srv/x",
                 "git@github.com:org/x.git"):
        assert git_url_problem(good) is None, good
    assert not canary.exists()


@pytest.mark.parametrize("via", ["flag", "variable"])
def test_mirror_injection_through_fetch_runs_nothing(
        via: str, tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    canary = tmp_path / "CANARY"
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    for i, bad in enumerate([f"--upload-pack=touch {canary}", f"ext::sh -c touch% {canary}"]):
        args = project.cli(tmp_path / f"ws{i}") + ["fetch"]
        if via == "flag":
            args += ["--mirror", f"main={bad}"]
        else:
            monkeypatch.setenv("DSV4_MIRRORS", f"main={bad}")
        code, doc = run_cli(args, capsys)
        assert code == 2, doc
        error = doc["data"]["error"]
        assert ("--mirror" if via == "flag" else "DSV4_MIRRORS") in error, error
        assert "\n" not in error
        assert not canary.exists()


def test_credentials_in_a_mirror_url_never_reach_output_state_or_logs(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    token = "ghp_s3cr3tT0kenValue"
    dead = f"https://user:{token}@127.0.0.1:9/dead.git"
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    ws = tmp_path / "ws"
    code, doc = run_cli(project.cli(ws) + ["fetch", "--mirror", f"main={dead}"], capsys)
    assert code == 0, doc
    assert token not in json.dumps(doc)
    for path in ws.rglob("*"):
        if path.is_file() and ".git" not in path.parts:
            assert token.encode() not in path.read_bytes(), path
    log = ws / "logs" / "fetch" / "git.log"
    assert "127.0.0.1:9/dead.git" in log.read_text()  # the attempt is logged, redacted
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert redact(f"https://{token}@host/x") == "https://***@host/x"


def test_a_symlinked_checkout_is_never_written_through(
        tmp_path: Path, upstreams: Upstreams, capsys: pytest.CaptureFixture[str]) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_text("keep\n")
    project = write_project(tmp_path / "p", upstreams, upstreams.good)
    ws = tmp_path / "ws"
    (ws / "src").mkdir(parents=True)
    (ws / "src" / "main").symlink_to(outside)
    code, doc = run_cli(project.cli(ws) + ["fetch"], capsys)
    assert code == 1, doc
    messages = [p["message"] for p in doc["data"]["problems"]]
    assert any("main:" in m and "symlink" in m and str(outside) in m for m in messages), messages
    assert sorted(p.name for p in outside.iterdir()) == ["canary"]
    code, doc = run_cli(project.cli(ws) + ["fetch", "--force"], capsys)
    assert code == 0, doc
    assert not (ws / "src" / "main").is_symlink()
    assert sorted(p.name for p in outside.iterdir()) == ["canary"]


def test_recipe_show_masks_credentials_written_into_a_url(cli) -> None:  # type: ignore[no-untyped-def]
    """issue 18: a token a user put into a source URL is not printed back by `recipe show`."""
    token = "s3cr3t-t0ken-4242"
    url = f"https://user:{token}@example.com/kt.git"
    shown = cli("--set", f"sources[ktransformers].url={url}", "recipe", "show")
    assert shown.code == 0, shown
    assert "example.com/kt.git" in shown.out and token not in shown.out + shown.err
    as_json = cli("--json", "--set", f"sources[ktransformers].url={url}", "recipe", "show")
    assert as_json.code == 0 and token not in as_json.out
