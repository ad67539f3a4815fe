"""Messages that send the user the right way (issue 21)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dsv4_offload.core.errors import Dsv4Error
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.serving import container
from dsv4_offload.stages import doctor

HOSTS = Path(__file__).parent / "fixtures" / "hosts"
DAEMON_DOWN = ("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
               "Is the docker daemon running?")


def _fake_docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "docker"
    tool.write_text("#!/bin/sh\n"
                    'if [ "$1" = "--version" ]; then echo "Docker version 27.5.1, build x"; '
                    "exit 0; fi\n"
                    f"echo '{error}' >&2\nexit 1\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


@pytest.mark.parametrize(("error", "fix"), [
    (DAEMON_DOWN, "systemctl start docker"),
    ("permission denied while trying to connect to the docker API at "
     "unix:///var/run/docker.sock", "usermod -aG docker"),
])
def test_a_stopped_or_refused_daemon_is_not_a_missing_install(
    error: str, fix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_docker(tmp_path, monkeypatch, error)
    with pytest.raises(Dsv4Error) as exc:
        container.docker_query(["ps"])
    assert fix in exc.value.message and "apt-get install docker.io" not in exc.value.message
    # doctor's row says the same, from the same function
    recipe, _ = load_recipe_and_series("dsv4-flash-910b")
    from dsv4_offload.core.host import probe_host

    facts = probe_host(Path("/nonexistent-ws"), root=HOSTS / "kunpeng920-910b", tools=[])
    facts = dataclasses.replace(facts, tools={**facts.tools, "docker": "27.5.1"})
    rows = {c.name: c for c in doctor.check_toolchain(recipe, facts,
                                                      container.daemon_problem())}
    assert rows["docker"].status in ("warn", "fail")
    assert fix in rows["docker"].fix and "docker.io" not in rows["docker"].fix, rows["docker"]
    assert "daemon:" in rows["docker"].observed


def test_no_client_is_still_an_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(Dsv4Error) as exc:
        container.docker_query(["ps"])
    assert "apt-get install docker.io" in exc.value.message
