"""A stage process's command line read without typer (cli/serial.py): every command line the
scheduler and the container crossing build (core/childrun) is read as the typer application
reads it, any other goes to typer, and both ways answer alike."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import CLI, SMALL_RECIPE, run_cli_inproc

from dsv4_offload.cli.serial import StageCall, stage_call
from dsv4_offload.core import childrun


@pytest.mark.parametrize("recipe", [[], ["--recipe", "/r.yaml"]], ids=["default", "file"])
@pytest.mark.parametrize("overrides", [[], ["serve.port=1", "x=[1, 2]"]], ids=["bare", "set"])
@pytest.mark.parametrize("verbose", [False, True])
@pytest.mark.parametrize("device", [None, 3])
def test_every_stage_command_line_childrun_builds_is_read(
        recipe: list[str], overrides: list[str], verbose: bool, device: int | None) -> None:
    argv = [*childrun.tool_argv("/py", Path("/ws"), recipe, overrides, verbose=verbose),
            *childrun.stage_argv("verify-gguf", device=device)]
    assert argv[1:3] == ["-m", "dsv4_offload"]
    call = stage_call(argv[3:])
    assert isinstance(call, StageCall)
    assert (call.stage, call.device) == ("verify-gguf", device)
    g = call.options
    assert (g.workspace, g.recipe, g.overrides) == ("/ws", recipe[1] if recipe else None,
                                                    overrides)
    assert (g.json, g.verbose, g.quiet) == (True, verbose, False)


@pytest.mark.parametrize("words", [
    "--json run --serial --from build --to build",  # not forced
    "run --serial --from build --to build --force build",  # no --json
    "--json run --from build --to build --force build",  # the graph
    "--json run --serial --from build --to serve --force build",  # more than one stage
    "--json run --serial --from build --to build --force build --dry-run",
    "--json run --serial --from build --to build --force build --device x",
    "--json --runtime host run --serial --from build --to build --force build",
    "-q --json run --serial --from build --to build --force build",
    "--json status",
    "--json build",
    "--json run",
])
def test_any_other_command_line_goes_to_typer(words: str) -> None:
    assert stage_call(["--workspace", "/ws", *words.split()]) is None


def test_the_workspace_variable_counts_as_typer_counts_it(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setenv("DSV4_WORKSPACE", "/from-env")
    words = [*childrun.stage_argv("doctor")]
    call = stage_call(words)
    assert call is not None and call.options.workspace == "/from-env"
    call = stage_call(["-w", "/given", *words])
    assert call is not None and call.options.workspace == "/given"


def _as_a_stage_process(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m dsv4_offload ARGS` as the scheduler starts it (cli/__init__.main reads it)."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("behaviour", ["", "fail"], ids=["ok", "failed"])
def test_a_stage_process_answers_as_the_typer_application_does(
        tmp_path: Path, fake_stages_env: dict[str, str], behaviour: str) -> None:
    ws = tmp_path / "ws"
    if behaviour:
        (ws / "behave").mkdir(parents=True)
        (ws / "behave" / "build").write_text(behaviour)
    words = ["--workspace", str(ws), "--recipe", str(SMALL_RECIPE), "--set",
             "serve.port=30123", "--json", "run", "--serial", "--from", "build", "--to", "build",
             "--force", "build"]
    assert stage_call(words) is not None  # the way without typer
    fast = _as_a_stage_process(*words, env=fake_stages_env)
    typer_way = run_cli_inproc(*words, env=fake_stages_env)  # cli/app.main: typer's way
    assert fast.returncode == typer_way.code == (1 if behaviour else 0), (fast, typer_way)
    assert json.loads(fast.stdout) == typer_way.json()  # nothing in it varies by run
    assert fast.stderr == typer_way.err
    assert (ws / "ran.log").read_text().split() == ["build", "build"]


def test_a_stage_process_refuses_as_the_typer_application_does(
        tmp_path: Path, fake_stages_env: dict[str, str]) -> None:
    for words in (["--json", "run", "--serial", "--from", "nosuch", "--to", "nosuch",
                   "--force", "nosuch"],
                  ["--set", "serve.port=-1", "--json", "run", "--serial", "--from", "build",
                   "--to", "build", "--force", "build"]):
        argv = ["--workspace", str(tmp_path / "ws"), "--recipe", str(SMALL_RECIPE), *words]
        assert stage_call(argv) is not None
        fast = _as_a_stage_process(*argv, env=fake_stages_env)
        typer_way = run_cli_inproc(*argv, env=fake_stages_env)
        assert fast.returncode == typer_way.code == 2, (fast, typer_way)
        assert fast.stdout == typer_way.out and fast.stderr == typer_way.err
        assert len(fast.stderr.strip().splitlines()) == 1 and "Traceback" not in fast.stderr
