"""Global options before or after any command, with one meaning (issue 11)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main

from dsv4_offload.cli.app import app, main
from dsv4_offload.cli.argv import GlobalOptionsGroup, global_option_names, hoist_globals

# the commands in this process (conftest.run_cli_inproc): what they answer is the point
CLI_IN_PROCESS = True


def _commands(group: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every runnable command of the app: leaves, and groups that run without a subcommand."""
    out = []
    for name, cmd in sorted(group.commands.items()):
        sub = (*path, name)
        if hasattr(cmd, "commands"):
            if cmd.invoke_without_command:
                out.append((sub, cmd))
            out.extend(_commands(cmd, sub))
        else:
            out.append((sub, cmd))
    return out


ROOT = typer.main.get_command(app)
# nothing leaves the machine: git may use file:// only, HTTP goes to a closed local port
OFFLINE = {"GIT_ALLOW_PROTOCOL": "file", "HTTPS_PROXY": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
           "HF_HUB_OFFLINE": "1"}
COMMANDS = _commands(ROOT)


def _required_args(cmd: Any) -> list[str]:
    """A placeholder for each required positional argument, so click gets past them."""
    return ["x" for p in cmd.params if p.param_type_name == "argument" and p.required]


# a report's default name holds the second it was made: two runs a second apart differ there
# and nowhere else, so both write the same named file
FIXED_ARGS = {("report",): ["--out", "report.tar.gz"]}


@pytest.fixture
def no_daemons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Container runtimes on PATH answer 'unavailable': no command here may start or pull one."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name in ("docker", "podman"):
        tool = fake_bin / name
        tool.write_text("#!/bin/sh\necho 'no container runtime in this test' >&2\nexit 1\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ.get('PATH', '')}")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(argv)
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def test_the_app_has_the_commands_this_test_is_about() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"status", "doctor", "run", "build", "serve", "serve status", "patch check",
            "accept", "recipe show"} <= names, names


def test_no_command_redefines_a_global_option() -> None:
    """A command option named like a global would shadow it after that command."""
    names = global_option_names(ROOT)
    assert {"--json", "-w", "--workspace", "-r", "--recipe", "--set", "-v", "-q"} <= names
    for path, cmd in COMMANDS:
        own = {o for p in cmd.params if p.param_type_name == "option"
               for o in [*p.opts, *p.secondary_opts]}
        assert not own & names, f"'{' '.join(path)}' redefines global {sorted(own & names)}"


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_command_takes_the_globals_before_and_after(
    path: tuple[str, ...], cmd: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], no_daemons: None,
) -> None:
    """Same exit code, stdout and stderr either way; --json gives one document; -w/-r apply."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DSV4_WORKSPACE", raising=False)
    ws = tmp_path / "ws"
    missing = tmp_path / "no-such-recipe.yaml"  # recipe readers stop on it, the same either way
    glob = ["--json", "-w", str(ws), "-r", str(missing), "--set", "serve.port=8123", "-q"]
    own = [*_required_args(cmd), *FIXED_ARGS.get(path, [])]
    before = _run([*glob, *path, *own], capsys)
    after = _run([*path, *own, *glob], capsys)
    assert before == after, f"{path}: before {before}\nafter {after}"
    code, out, err = after
    assert "No such option" not in err and "Traceback" not in err, err
    doc = json.loads(out)  # --json took effect: exactly one JSON document
    assert doc["schema"] == 1 and doc["command"] == " ".join(path), doc
    if doc["status"] == "error":
        assert str(missing) in doc["data"]["error"], doc  # -r took effect
    assert not (tmp_path / "dsv4-work").exists()  # -w took effect (no default workspace)


# `digest`: container status hashes its configuration, which holds the workspace path
_VOLATILE = re.compile(r"started|ended|duration|elapsed|seconds|_s$|pid|time|^digest$")
# clock readings inside text: ISO times, 20261203-043015 report names, "0.3s", git's
# "Failed to connect to 127.0.0.1 port 9 after 0 ms" (1 ms the next time)
_CLOCK = re.compile(r"\d{4}-\d\d-\d\dT[\d:.+-]+|\d{8}-\d{6}|\d+(\.\d+)?\s?m?s\b")


def _stable(value: Any, ws: Path) -> Any:
    """A result document without its clock readings, with the workspace path as 'WS'."""
    if isinstance(value, dict):
        return {k: _stable(v, ws) for k, v in value.items() if not _VOLATILE.search(str(k))}
    if isinstance(value, list):
        return [_stable(v, ws) for v in value]
    if not isinstance(value, str):
        return value
    return _CLOCK.sub("T", value.replace(str(ws), "WS"))


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_command_does_the_same_work_with_the_globals_after(
    path: tuple[str, ...], cmd: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], fake_stages_env: dict[str, str], no_daemons: None,
) -> None:
    """With the bundled recipe on the host, instrumented stages, no network: the same document."""
    from conftest import HOST_RECIPE

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DSV4_WORKSPACE", raising=False)
    for key, value in {**fake_stages_env, **OFFLINE}.items():
        monkeypatch.setenv(key, value)
    results = []
    for way, ws in (("before", tmp_path / "ws-a"), ("after", tmp_path / "ws-b")):
        glob = ["--json", "-w", str(ws), "-r", str(HOST_RECIPE), "--set", "serve.port=8123"]
        argv = [*path, *_required_args(cmd)]
        code, out, err = _run([*glob, *argv] if way == "before" else [*argv, *glob], capsys)
        assert "No such option" not in err and "Traceback" not in err, err
        if path in (("run",), ("tune",)):  # they stream one JSON event a line, a refusal too
            doc = {"command": path[0], "events": [json.loads(x) for x in out.splitlines()]}
        else:
            doc = json.loads(out)
        assert " ".join(path).startswith(doc["command"]), doc  # `patch apply` runs `patch`
        results.append((code, _stable(doc, ws), ws.exists()))
    assert results[0] == results[1]
    assert not (tmp_path / "dsv4-work").exists()  # -w took effect


def _toy() -> Any:
    """A small app shaped like the real one's hard cases."""
    toy = typer.Typer(cls=GlobalOptionsGroup)

    @toy.callback()
    def root(ctx: typer.Context, workspace: str = typer.Option("", "--workspace", "-w"),
             overrides: list[str] = typer.Option([], "--set"),
             json_out: bool = typer.Option(False, "--json"),
             verbose: bool = typer.Option(False, "--verbose", "-v"),
             quiet: bool = typer.Option(False, "--quiet", "-q")) -> None:
        ctx.obj = {"w": workspace, "set": overrides, "json": json_out, "v": verbose, "q": quiet}

    @toy.command("run")
    def run(ctx: typer.Context, force: list[str] = typer.Option([], "--force"),
            nums: int = typer.Option(0, "-n"),
            pair: tuple[str, str] = typer.Option(("", ""), "--pair")) -> None:
        print(json.dumps({**ctx.find_root().obj, "force": force, "n": nums, "pair": pair}))

    @toy.command("exec", context_settings={"allow_interspersed_args": False,
                                           "ignore_unknown_options": True})
    def exec_(ctx: typer.Context, argv: list[str] = typer.Argument(None)) -> None:
        print(json.dumps({**ctx.find_root().obj, "argv": argv}))

    serve = typer.Typer()

    @serve.callback(invoke_without_command=True)
    def serve_main(detach: bool = typer.Option(False, "--detach")) -> None:
        pass

    @serve.command("status")
    def serve_status(ctx: typer.Context) -> None:
        print(json.dumps(ctx.find_root().obj))

    toy.add_typer(serve, name="serve")
    return toy


@pytest.mark.parametrize(("argv", "expect"), [
    (["run", "--json", "-w", "W"], {"json": True, "w": "W"}),
    (["run", "--workspace=W", "-vq"], {"w": "W", "v": True, "q": True}),
    (["run", "-wW", "--set", "a=1", "--set=b=2"], {"w": "W", "set": ["a=1", "b=2"]}),
    (["--set", "a=1", "run", "--set", "b=2"], {"set": ["a=1", "b=2"]}),
    (["-w", "A", "run", "-w", "B"], {"w": "B"}),  # the later one wins, as click does
    # an option's value is never taken for a global, even when it looks like one
    (["run", "--force", "--json", "-n", "3", "-q"], {"force": ["--json"], "n": 3, "q": True}),
    (["run", "--set", "--json"], {"set": ["--json"], "json": False}),
    (["run", "--pair", "--json", "-q", "-v"], {"pair": ["--json", "-q"], "v": True, "q": False}),
    (["serve", "status", "--json", "-w", "W"], {"json": True, "w": "W"}),
    (["serve", "--detach", "status", "-q"], {"q": True}),
    # after `--`, or once a pass-through command has its program, the rest is the program's
    (["exec", "--json", "--", "ls", "-q", "--json"],
     {"json": True, "argv": ["ls", "-q", "--json"]}),
    (["exec", "ls", "-v", "--set", "x"], {"v": False, "argv": ["ls", "-v", "--set", "x"]}),
])
def test_hoisting_respects_values_separators_and_pass_through(
    argv: list[str], expect: dict[str, Any]
) -> None:
    from typer.testing import CliRunner

    res = CliRunner().invoke(_toy(), argv)
    assert res.exit_code == 0, res.output
    got = json.loads(res.output.strip().splitlines()[-1])
    assert {k: got[k] for k in expect} == expect


def test_hoist_reports_the_globals_it_saw() -> None:
    root = typer.main.get_command(_toy())
    args, found = hoist_globals(root, ["run", "--force", "--json", "--json"])
    assert args == ["--json", "run", "--force", "--json"] and found == ["--json"]
    args, found = hoist_globals(root, ["exec", "--", "--json"])
    assert args == ["exec", "--", "--json"] and found == []


def test_json_errors_after_the_command_are_json(cli, tmp_path: Path) -> None:
    """main() reads --json wherever it stands to format a failure as a document."""
    res = cli("recipe", "validate", "--set", "serve.prot=1", "--json", "-w", str(tmp_path))
    assert res.code == 2, res
    assert "did you mean port" in res.json()["data"]["error"]
    res = cli("status", "--set", "x=--json", "-w", str(tmp_path))  # a value, not the flag
    assert res.code == 2 and not res.out.startswith("{"), res


def test_every_command_help_mentions_the_global_options(cli) -> None:
    for path, cmd in COMMANDS:
        assert cmd.epilog and "--json" in cmd.epilog, path
    res = cli("serve", "status", "--help")
    assert res.code == 0 and "Global options (-w/--workspace" in res.out, res
