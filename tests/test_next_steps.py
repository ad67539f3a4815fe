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


def test_accept_with_nothing_started_says_to_serve(tmp_path: Path) -> None:
    from conftest import HOST_RECIPE
    from conftest import run_cli_inproc as run_cli  # the answer is the point
    from serve_helpers import free_port

    ws = tmp_path / "ws"
    res = run_cli("--json", "-w", str(ws), "-r", str(HOST_RECIPE), "--set",
                  "serve.host=127.0.0.1", "--set", f"serve.port={free_port()}", "accept",
                  "--quick", env={"NO_PROXY": "127.0.0.1", "HTTPS_PROXY": "", "HTTP_PROXY": ""})
    assert res.code == 1, res
    assert "dsv4-offload serve --detach" in res.out, res
    assert "hung or died" not in res.out


def test_a_series_given_as_the_recipe_says_what_it_is(tmp_path: Path) -> None:
    from conftest import run_cli_inproc as run_cli  # the answer is the point

    series = Path(__file__).parents[1] / "src/dsv4_offload/data/patches"
    path = sorted(series.glob("*.yaml"))[0]
    res = run_cli("-r", str(path), "status", "-w", str(tmp_path))
    assert res.code == 2, res
    assert "is a patch series, not a recipe" in res.err and "--set series=" in res.err, res


def test_cann_hints_follow_the_recipe_cann(tmp_path: Path) -> None:
    from dsv4_offload.stages.serve import toolkit_example

    r910, _ = load_recipe_and_series("dsv4-flash-910b")
    a3, _ = load_recipe_and_series("dsv4-flash-a3")
    assert "cann-9" not in toolkit_example(r910.platform.cann)
    assert toolkit_example(a3.platform.cann).endswith(f"cann-{a3.platform.cann}")
    from dsv4_offload.core.host import probe_host

    facts = probe_host(Path("/nonexistent-ws"), root=HOSTS / "kunpeng920-910b", tools=[])
    old = dataclasses.replace(facts, cann_version="8.0.RC1")
    row = doctor.check_cann(r910, old)
    assert row.status == "fail" and "CANN 9" not in row.fix, row
    assert "CANN 9" in doctor.check_cann(a3, old).fix


def test_no_message_names_a_docs_path_the_wheel_lacks() -> None:
    """docs/ is not in the wheel (package-data is data/ and native/ only)."""
    import re

    src = Path(__file__).parents[1] / "src" / "dsv4_offload"
    said = re.compile(r"""(["'])[^"'\n]*\bdocs/[\w.-]+\.md[^"'\n]*\1""")
    for path in src.rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if said.search(code) and "REGENERATE" not in code and '"""' not in code:
                pytest.fail(f"{path}:{n}: {line.strip()}")
