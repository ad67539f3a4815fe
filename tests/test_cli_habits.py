"""A newcomer's habits (issue 21): -h, --json for usage errors, -q, metavars, status header."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer.main

from dsv4_offload.cli.app import app, main

ROOT = typer.main.get_command(app)


def _commands(group: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        out.append((*path, name))
        if hasattr(cmd, "commands"):
            out.extend(_commands(cmd, (*path, name)))
    return out


COMMANDS = _commands(ROOT)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(argv)
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


# click's and typer's type labels, which say nothing to a user
_TYPE_LABEL = re.compile(r"<(str|int|float|bool|path|list\[[^\]]*\]|[a-z]+ range)>")


@pytest.mark.parametrize("path", [(), *COMMANDS], ids=["root", *[" ".join(p) for p in COMMANDS]])
def test_dash_h_is_help_everywhere_and_metavars_say_what_they_take(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run([*path, "-h"], capsys)
    assert code == 0, err
    assert out.startswith("Usage: dsv4-offload"), out
    assert "-h, --help" in out
    assert not _TYPE_LABEL.search(out), f"{' '.join(path)}: {_TYPE_LABEL.search(out)}\n{out}"


def test_numbered_lists_in_help_keep_their_lines(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _run(["run", "-h"], capsys)
    assert re.search(r"^\s+1\. Plan:", out, re.M) and re.search(r"^\s+2\. Run", out, re.M), out


def test_build_help_lists_the_steps_of_the_recipe_in_effect(
    capsys: pytest.CaptureFixture[str]
) -> None:
    from dsv4_offload.recipe import load_recipe

    for name in ("dsv4-flash-910b", "dsv4-flash-x86-dev"):
        steps = [s.name for s in load_recipe(name).build.steps]
        _, out, _ = _run(["-r", name, "build", "-h"], capsys)
        flat = " ".join(out.split()).replace("- ", "-")
        for step in steps:
            assert step in flat, (name, step, out)
    x86 = {s.name for s in load_recipe("dsv4-flash-x86-dev").build.steps}
    if "ascendc-op" not in x86:  # a step the recipe lacks is not offered
        _, out, _ = _run(["-r", "dsv4-flash-x86-dev", "build", "-h"], capsys)
        assert "ascendc-op" not in out.split("Options:")[0].split("Arguments:")[1], out


def test_a_global_option_missing_its_value_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["status", "-w"], capsys)
    assert code == 2
    assert "Option '-w' requires an argument" in err and "Missing command" not in err, err


def test_usage_errors_are_json_when_json_was_asked(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["status", "--jsno", "--json"], capsys)
    assert code == 2
    doc = json.loads(out)
    assert doc["status"] == "error" and doc["command"] == "status", doc
    assert "--jsno" in doc["data"]["error"] and doc["data"]["exit_code"] == 2
    assert "No such option" in err  # the human line is still on stderr
    code, out, _ = _run(["--json", "run", "--from"], capsys)
    assert code == 2 and json.loads(out)["data"]["error"], out


def test_status_names_what_it_read_and_warns_on_a_missing_workspace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ws = tmp_path / "typo"
    code, out, err = _run(["status", "-w", str(ws)], capsys)
    assert code == 0  # documented: a warning, not a failure
    head = out.splitlines()[:3]
    assert head[0].startswith("workspace:") and str(ws) in head[0], out
    assert "does not exist" in head[0]
    assert head[1].startswith("recipe:") and "dsv4-flash-910b" in head[1], out
    assert head[2].startswith("lock:") and "sources.lock.json" in head[2], out
    assert "warning" in err and "does not exist" in err, err
    assert not ws.exists()  # status creates nothing
    code, out, _ = _run(["--json", "status", "-w", str(ws)], capsys)
    doc = json.loads(out)
    assert doc["status"] == "warn" and doc["data"]["warnings"], doc
    assert doc["data"]["read"]["workspace"].startswith(str(ws))
    ws.mkdir()
    code, out, err = _run(["status", "-w", str(ws)], capsys)
    assert code == 0 and "warning" not in err and "does not exist" not in out


@pytest.mark.parametrize("argv", [["status"], ["run", "--dry-run"], ["recipe", "validate"]])
def test_quiet_is_one_line(argv: list[str], tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    code, out, err = _run([*argv, "-q", "-w", str(ws)], capsys)
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1, out
    loud = _run([*argv, "-w", str(ws)], capsys)[1]
    assert len(loud.strip().splitlines()) >= 1
