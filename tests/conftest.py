"""Shared fixtures: running the real console script, and fresh workspaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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


@pytest.fixture
def cli():  # type: ignore[no-untyped-def]
    return run_cli


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
