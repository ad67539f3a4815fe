"""Every command over a workspace this user may not read (another user's 0700 directory, or
a path through a file): the one-line access error, and with --json the error document;
never a traceback. Run as a non-root user (root reads everything)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import typer.main
from conftest import REPO, run_cli

from dsv4_offload.cli.app import app
from dsv4_offload.core.envelope import Envelope


def leaf_commands() -> list[str]:
    """Every command of the CLI, subcommands included (``serve`` runs a server itself)."""
    found: list[str] = ["serve"]

    def walk(cmd: object, path: list[str]) -> None:
        for name, sub in getattr(cmd, "commands", {}).items():
            if hasattr(sub, "commands"):
                walk(sub, [*path, name])
            else:
                found.append(" ".join([*path, name]))

    walk(typer.main.get_command(app), [])
    return found


def _as_nobody() -> list[str]:
    if os.geteuid() != 0:
        return []  # already not root: a directory of mode 0000 is unreadable to its owner too
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to run the CLI as another user")
    return ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]


@pytest.fixture(scope="module")
def places() -> Iterator[dict[str, Path]]:
    """A workspace of someone else (a real one, mode 0700), and a path through a file; in a
    directory every user can reach (pytest's tmp_path is 0700 to root)."""
    top = Path(tempfile.mkdtemp(prefix="dsv4-access-"))
    try:
        top.chmod(0o755)
        ws = top / "ws"
        made = run_cli("-w", str(ws), "run", "--to", "doctor")
        assert (ws / ".dsv4").is_dir(), made
        (ws / ".dsv4" / "sources.lock.json").write_text("{}")
        ws.chmod(0o700 if os.geteuid() == 0 else 0)
        (top / "notes.txt").write_text("a file\n")
        (top / "cwd").mkdir(mode=0o777)
        (top / "cwd").chmod(0o777)  # where `report` writes its bundle
        yield {"other user's 0700 workspace": ws, "path through a file": top / "notes.txt" / "ws",
               "cwd": top / "cwd"}
    finally:
        ws.chmod(0o700)
        shutil.rmtree(top, ignore_errors=True)


def _cli_as_nobody(*args: str, cwd: Path = Path("/")) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DSV4_WORKSPACE"}
    env["HOME"] = "/tmp"
    env["PYTHONPATH"] = str(REPO / "src")
    return subprocess.run([*_as_nobody(), sys.executable, "-m", "dsv4_offload", *args],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=60,
                          stdin=subprocess.DEVNULL)


def _judged(args: list[str], where: str, cwd: Path) -> str | None:
    """What is wrong with one command's answer over an unreadable workspace (None: right)."""
    res = _cli_as_nobody(*args, cwd=cwd)
    err = res.stderr.strip().splitlines()
    said = f"{' '.join(args[2:])}: exit {res.returncode}, stderr {res.stderr[-300:]!r}"
    if "Traceback" in res.stderr or len(err) > 1:
        return said
    if "--json" in args[2:3]:
        try:
            doc = Envelope.parse(res.stdout)
        except Exception:  # any unparsable stdout is the failure
            return f"{said}; stdout {res.stdout[:200]!r} is no JSON document"
        if doc.status == "error" and doc.data.get("exit_code") != res.returncode:
            return f"{said}; the document's exit code differs"
    if res.returncode == 0:
        return None  # a command that reads no workspace (recipe list, ...)
    line = err[0] if err else ""
    expected = ("cannot read" in line and "is owned by" in line) if "0700" in where \
        else ("is a file, not a directory" in line)
    return None if expected else said


def _sweep(places: dict[str, Path], where: str, commands: list[str]) -> list[str]:
    """What is wrong with each command's answer, --json and not, over ``where``."""
    ws = places[where]
    runs = [["-w", str(ws), *(["--json"] if as_json else []), *command.split()]
            for command in commands for as_json in (True, False)]
    # each command is its own process, mostly interpreter start-up: a few at a time
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(lambda args: _judged(args, where, places["cwd"]), runs))
    return [said for said in answers if said is not None]


WHERE = ["other user's 0700 workspace", "path through a file"]
# one command of each kind of entry: the pipeline's, a stage's, an area's, the report's
SAMPLE = ["status", "run", "convert", "serve status", "patch status", "report"]


@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
def test_every_command_says_the_workspace_is_not_readable_in_one_line(
        places: dict[str, Path], where: str) -> None:
    """Every command of the CLI. The fast tier's seam (the same check at the CLI's edge,
    one command of each kind, as another user):
    tests/test_access.py::test_each_kind_of_command_says_the_workspace_is_not_readable."""
    wrong = _sweep(places, where, leaf_commands())
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("where", WHERE)
def test_each_kind_of_command_says_the_workspace_is_not_readable(
        places: dict[str, Path], where: str) -> None:
    assert set(SAMPLE) <= set(leaf_commands())
    wrong = _sweep(places, where, SAMPLE)
    assert not wrong, "\n".join(wrong)


def test_status_over_an_unreadable_workspace_is_the_access_error(
        places: dict[str, Path]) -> None:
    """The reported case: `status` read the lock with is_file() and raised."""
    res = _cli_as_nobody("-w", str(places["other user's 0700 workspace"]), "--json", "status")
    assert res.returncode == 2, res
    doc = Envelope.parse(res.stdout)
    assert doc.status == "error" and "cannot read it" in doc.error_message
    assert res.stderr.startswith("error: workspace directory ") and "Traceback" not in res.stderr
