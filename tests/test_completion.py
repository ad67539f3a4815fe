"""Shell completion through the protocol the shells use (typer's scripts set these variables)."""

from __future__ import annotations

from pathlib import Path

import pytest

# the commands in this process (conftest.run_cli_inproc): what they answer is the point
CLI_IN_PROCESS = True

VAR = "_DSV4_OFFLOAD_COMPLETE"  # click: f"_{prog_name}_COMPLETE", '-' -> '_', upper case


def bash(cli, line: str, **env: str) -> list[str]:  # type: ignore[no-untyped-def]
    """What bash gets for `line<TAB>`: its script passes COMP_WORDS="${COMP_WORDS[*]}"."""
    words = line.split()
    cword = len(words) if line.endswith(" ") else len(words) - 1
    res = cli(env={VAR: "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(cword), **env})
    assert res.code == 0 and not res.err, res
    return res.out.split()


def test_bash_completes_commands_and_build_steps(cli) -> None:
    assert bash(cli, "dsv4-offload bu") == ["build"]
    assert bash(cli, "dsv4-offload build k") == ["kt-kernel"]
    assert bash(cli, "dsv4-offload serve st") == ["status", "stop"]


def test_names_come_from_the_recipe(cli, tmp_path: Path) -> None:
    assert bash(cli, "dsv4-offload build ") == ["kt-kernel", "gguf-py", "sglang", "ascendc-op"]
    assert bash(cli, "dsv4-offload download ") == ["w8a8", "mxfp4"]
    assert bash(cli, "dsv4-offload run --to v") == ["verify-gguf"]
    assert bash(cli, "dsv4-offload run --force ")[:3] == ["doctor", "fetch", "patch"]
    assert bash(cli, "dsv4-offload --recipe dsv4-flash-") == [
        "dsv4-flash-910b", "dsv4-flash-a3", "dsv4-flash-arm-rehearsal", "dsv4-flash-x86-dev"]
    assert bash(cli, "dsv4-offload --recipe dsv4-flash-a") == [
        "dsv4-flash-a3", "dsv4-flash-arm-rehearsal"]
    assert "sglang" in bash(cli, "dsv4-offload patch apply --only ")
    assert bash(cli, "dsv4-offload patch check --only ktransformers,sg") == [
        "ktransformers,sglang"]
    # a recipe of one's own, given after the command, and the one it extends
    own = tmp_path / "own.yaml"
    own.write_text("extends: dsv4-flash-910b\nname: own\nbuild:\n  steps:\n"
                   "    - name: ascendc-op\n      remove: true\n"
                   "    - name: my-step\n      workdir: x\n      command: [make]\n")
    assert bash(cli, f"dsv4-offload build -r {own} ") == [
        "kt-kernel", "gguf-py", "sglang", "my-step"]


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish(cli, shell: str) -> None:
    env = {VAR: f"complete_{shell}", "_TYPER_COMPLETE_ARGS": "dsv4-offload build k",
           "_TYPER_COMPLETE_FISH_ACTION": "get-args"}
    res = cli(env=env)
    assert res.code == 0 and "kt-kernel" in res.out, res


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_show_and_install_completion(cli, tmp_path: Path, shell: str) -> None:
    # typer finds the user's shell from the parent process (shellingham); its own switch
    # makes the options take the shell's name instead, so each shell can be asked for here
    named = {"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    res = cli("--show-completion", shell, env=named)
    assert res.code == 0 and f"{VAR}=complete_{shell}" in res.out, res
    home = tmp_path / "home"
    home.mkdir()
    res = cli("--install-completion", shell, env={"HOME": str(home), **named})
    assert res.code == 0, res
    installed = [p for p in home.rglob("*") if p.is_file()]
    assert any(VAR in p.read_text() for p in installed), installed
