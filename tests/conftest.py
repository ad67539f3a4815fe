"""Shared fixtures: running the CLI (as a process, or in this one), and fresh workspaces."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import pytest

# Bytecode caches are written, as a default Python writes them: under a PYTHONDONTWRITEBYTECODE
# set by the environment (this sandbox's is), each of the suite's ~1,500 Python processes (stage
# children, CLI runs, stand-ins) compiled our modules from source again, ~0.1 CPU-s apiece.
# No test depends on the caches; child processes inherit the setting from os.environ.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Ctrl-C as a terminal sends it: a pytest started in the background by a non-interactive shell
# (`pytest &` in a script, nohup) inherits SIGINT ignored, and so would every command the tests
# start, and the Ctrl-C they send would be lost. A handler of ours here is reset to the
# default at each exec, where Python installs its own.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

TESTS = Path(__file__).parent
REPO = TESTS.parent
CLI = [sys.executable, "-m", "dsv4_offload"]
# the 910B recipe with every stage on the host; the file says which tests mean that
HOST_RECIPE = TESTS / "fixtures" / "recipes" / "host-910b.yaml"
# the same with weight and GGUF sets of a few KiB: for `run` with instrumented stages, which
# write none of them, past the disk preflight of a pipelined run (the file says why)
SMALL_RECIPE = TESTS / "fixtures" / "recipes" / "host-910b-small.yaml"


class CliResult:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr

    def json(self) -> Any:
        return json.loads(self.out)

    def __repr__(self) -> str:
        return f"<exit {self.code}\nstdout:\n{self.out}\nstderr:\n{self.err}>"


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 120) -> CliResult:
    """Run `python -m dsv4_offload ARGS` as a user would, and capture its output."""
    full_env = dict(os.environ)
    full_env.pop("DSV4_WORKSPACE", None)
    full_env.update(env or {})
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)
    return CliResult(proc)


def run_cli_inproc(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                   timeout: float = 120, whole_env: bool = False) -> CliResult:
    """Run the typer application's entry point (`dsv4_offload.cli.app.main`; the console
    script's reads a stage process's line without it first: cli/serial.py, whose tests run it
    as a process) in this process, as `run_cli` would run the console script: ``env`` applied
    to os.environ (with ``whole_env``, os.environ is ``env`` alone, as in a process started
    with that environment), ``cwd`` entered, stdin empty, the output of file descriptors 1
    and 2 captured (children the command starts write there too) and all of it restored
    afterwards; SystemExit gives the exit code, an escaped exception a traceback on stderr and
    code 1, as a process would.

    Not covered: anything that is the process's own (signals sent to it, its lifetime, detach,
    what another process sees of it, the console script's start-up) and ``timeout``; `run_cli`
    stays for those. What a call leaves in this process is forgotten between calls
    (`forget_call_state`); stage child processes the command starts are real processes.
    """
    from dsv4_offload.cli.app import forget_call_state, main

    saved_env = dict(os.environ)
    saved_cwd = os.getcwd()
    saved_streams = (sys.stdin, sys.stdout, sys.stderr)
    for stream in saved_streams[1:]:
        stream.flush()
    saved_fds = (os.dup(0), os.dup(1), os.dup(2))
    code: int = 0
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file, \
            open(os.devnull, "rb") as null:
        try:
            os.dup2(null.fileno(), 0)
            os.dup2(out_file.fileno(), 1)
            os.dup2(err_file.fileno(), 2)
            sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, encoding="utf-8",  # noqa: SIM115
                              closefd=False)
            os.environ.pop("DSV4_WORKSPACE", None)
            if whole_env:
                os.environ.clear()
            os.environ.update(env or {})
            if cwd is not None:
                os.chdir(cwd)
            forget_call_state()
            try:
                main(list(args))
            except SystemExit as exc:
                code = _exit_code(exc)
            except BaseException:  # what a process prints, then exits 1
                traceback.print_exc()
                code = 1
        finally:
            for stream in (sys.stdin, sys.stdout, sys.stderr):
                if stream not in saved_streams:
                    stream.close()  # flushes the two outputs into the files
            for fd, saved in enumerate(saved_fds):
                os.dup2(saved, fd)
                os.close(saved)
            sys.stdin, sys.stdout, sys.stderr = saved_streams
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            forget_call_state()
        out = _read_back(out_file)
        err = _read_back(err_file)
    return CliResult(subprocess.CompletedProcess(["dsv4-offload", *args], code, out, err))


def _exit_code(exc: SystemExit) -> int:
    """The code a process exiting with ``exc`` would have (a message goes to stderr: 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    sys.stderr.write(f"{exc.code}\n")
    return 1


def _read_back(file: Any) -> str:
    file.seek(0)
    return io.TextIOWrapper(file, encoding="utf-8", errors="replace").read()


@pytest.fixture
def cli(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """`run_cli`, or `run_cli_inproc` for a module that says ``CLI_IN_PROCESS = True`` (its
    tests are about the commands' behaviour, not the process)."""
    return run_cli_inproc if getattr(request.module, "CLI_IN_PROCESS", False) else run_cli


@pytest.fixture
def fake_stages_env() -> dict[str, str]:
    """Environment selecting the instrumented stage package for pipeline tests."""
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # where the stages run is the recipe's to say: tests that mean the host use HOST_RECIPE
    return {"DSV4_STAGE_PACKAGE": "fakestages", "PYTHONPATH": path}


@pytest.fixture(scope="session", autouse=True)
def isolated_git_config(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A private global git config: an identity for test commits, file:// allowed.

    CI runs as root on a clean machine with no ~/.gitconfig; the user's own config must
    not leak into the tests either.
    """
    path = tmp_path_factory.mktemp("gitconfig") / "gitconfig"
    path.write_text(
        "[user]\n\tname = dsv4 test\n\temail = dsv4-test@localhost\n"
        "[init]\n\tdefaultBranch = main\n"
        "[protocol \"file\"]\n\tallow = always\n"
        "[safe]\n\tdirectory = *\n"
        "[advice]\n\tdetachedHead = false\n"
    )
    old = {k: os.environ.get(k) for k in ("GIT_CONFIG_GLOBAL", "GIT_CONFIG_NOSYSTEM")}
    os.environ["GIT_CONFIG_GLOBAL"] = str(path)
    os.environ["GIT_CONFIG_NOSYSTEM"] = "1"
    yield path
    for key, value in old.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def no_leftovers(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A tag for the server processes a test starts; none may remain afterwards."""
    from serve_helpers import leftover_guard

    yield from leftover_guard(tmp_path)


@pytest.fixture(autouse=True)
def recipe_reads():  # type: ignore[no-untyped-def]
    """Every stage run in this process records the recipe fields it reads; the test fails
    when its registry row does not account for one (tests/recipe_reads.py says why)."""
    from recipe_reads import uncovered, watch

    from dsv4_offload.core.registry import spec

    found: dict[str, set[str]] = {}
    unwrap = watch(found)
    yield found
    unwrap()
    missing = {name: uncovered(spec(name), reads) for name, reads in found.items()}
    missing = {name: fields for name, fields in missing.items() if fields}
    assert not missing, ("recipe fields a stage read that its registry row (recipe_fields, "
                         "exclude, reads, or its needs' recipe_fields) does not name: "
                         f"{missing}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real peer's tests last (a stable sort: the others keep their order): on a fresh
    machine its wheel is still being built in the background (.ci/run) while the default tier
    and the rest of the long one run, and a worker that reached the peer early would wait for
    it idle."""
    items.sort(key=lambda item: "peer_python" in getattr(item, "fixturenames", ()))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): two workers a core. A fifth of a worker's time is spent
    waiting (stand-in servers starting, timeouts that are the thing tested, children's exit),
    during which another worker computes: on the 2-core machine the default tier's wall time
    went from 370 s to 303 s with the same CPU time (four workers against two)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 2 * (cores or 1)
