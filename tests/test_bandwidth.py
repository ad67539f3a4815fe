"""The memory bandwidth of this host: sysbench's output read, the readers laid out as the serve
plan's pools, a real measurement on this machine against a plain memory copy timed here, and
doctor's row (measured once, cached, measured again on request, in provenance)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4_offload.core.host import probe_host
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.serving import bandwidth as bw
from dsv4_offload.serving.rules import cpu_plan

HOSTS = Path(__file__).parent / "fixtures" / "hosts"
SCRIPT = Path(sys.executable).parent / "dsv4-offload"
# sysbench 1.0.20's memory test, as it prints it (captured on the development machine)
SYSBENCH_OUT = """\
Running memory speed test with the following options:
  block size: 262144KiB
  total size: 4096MiB
  operation: read
  scope: global

Initializing worker threads...

Threads started!

Total operations: 16 (   42.93 per second)

4096.00 MiB transferred (10990.10 MiB/sec)
"""
needs_sysbench = pytest.mark.skipif(shutil.which("sysbench") is None,
                                    reason="sysbench is not installed (.ci/run installs it)")


def test_the_rate_is_read_in_gb_per_second() -> None:
    assert bw.parse_rate(SYSBENCH_OUT) == pytest.approx(10990.10 * 2**20 / 1e9)
    assert bw.parse_rate("FATAL: unable to allocate memory") is None


def test_kunpeng_readers_are_the_serve_plans_pools_one_per_node() -> None:
    facts = probe_host(root=HOSTS / "kunpeng920-910b")
    recipe, _ = load_recipe_and_series("dsv4-flash-910b", [])
    plan = cpu_plan(recipe.serve, facts.numa_nodes, facts.cores)
    readers = bw.layout(facts.numa_cpulists, plan.pools, plan.threads)
    assert [r.node for r in readers] == list(range(8))  # subpool i on node i
    assert {r.threads for r in readers} == {plan.threads // 8}
    assert readers[1].cpus == facts.numa_cpulists[1]
    argv = bw.reader_argv(readers[3], numactl=True)
    assert argv[:3] == ["numactl", "--cpunodebind=3", "--membind=3"]
    assert f"--threads={plan.threads // 8}" in argv and "--memory-oper=read" in argv
    # no NUMA visible (a container without /sys): one unbound reader with every thread
    alone = bw.layout({}, 1, 6)
    assert alone == [bw.Reader(None, "", 6)]
    assert bw.reader_argv(alone[0], numactl=True)[0] == "sysbench"


def _copy_gb_s(seconds: float = 1.0) -> float:
    """A plain memory copy timed here: GB/s read (the copy also writes as much), the best of
    short rounds into a buffer made once (no page faults in the figure; a round taken while
    other tests run on the cores counts less than the best one)."""
    src, dst = bytearray(64 * 2**20), bytearray(64 * 2**20)
    dst[:] = src  # every page of both touched once, before timing
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        copies, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.1:
            dst[:] = src  # one read and one write of the block
            copies += 1
        best = max(best, copies * len(src) / (time.perf_counter() - t0) / 1e9)
    return best


@needs_sysbench
def test_the_measurement_agrees_with_a_memory_copy_timed_here(tmp_path: Path) -> None:
    facts = probe_host(root=Path("/"))
    readers = bw.layout(facts.numa_cpulists, 1, 1)
    found, how = bw.measured(tmp_path / "bandwidth.json", readers)
    assert found is not None, how
    copy = _copy_gb_s()
    total = found.total_gb_s or 0.0
    # not a fixed figure: the same order of magnitude as the copy timed in this test
    assert copy / 10 < total < copy * 10, (total, copy)
    assert how == "measured now"
    again, how = bw.measured(tmp_path / "bandwidth.json", readers)
    assert how.startswith("cached") and again is not None and again.total_gb_s == total
    # another layout is another measurement
    assert bw.cached(tmp_path / "bandwidth.json", [bw.Reader(0, "0", 7)]) is None


def _doctor(ws: Path, *args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV4_", "ASCEND_"))}
    if path is not None:
        env["PATH"] = path
    # the rows of the build's libraries off: this doctor passes, so provenance is written
    return subprocess.run([str(SCRIPT), "--workspace", str(ws), "--recipe", "dsv4-flash-x86-dev",
                           "--set", "host.libraries=[]", "--set", "host.pkg_config=[]",
                           "--json", "doctor", *args], capture_output=True, text=True, env=env,
                          timeout=180, stdin=subprocess.DEVNULL)


def _row(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    doc = json.loads(proc.stdout)
    return next(c for c in doc["data"]["data"]["checks"] if c["name"] == "bandwidth")


@needs_sysbench
def test_doctor_measures_once_then_shows_the_cache_and_measures_again_on_request(
        tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    first = _row(_doctor(ws))
    assert first["status"] == "ok" and "GB/s in all" in first["observed"]
    assert first["observed"].endswith("measured now") and first["guards"] == []
    cache = json.loads((ws / ".dsv4" / "bandwidth.json").read_text())
    second = _row(_doctor(ws))
    assert f"cached {cache['when']}" in second["observed"]
    provenance = json.loads((ws / "provenance.json").read_text())
    assert provenance["doctor"]["host"]["memory_bandwidth"]["total_gb_s"] == cache["total_gb_s"]
    third = _row(_doctor(ws, "--bandwidth"))
    assert third["observed"].endswith("measured now")


def test_without_sysbench_the_row_names_the_packages_and_fails_nothing(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    # the doctor's other tools stay on PATH; sysbench and numactl are hidden
    for tool in ("git", "cmake", "gcc", "g++", "cc", "pkg-config", "as", "ld", "docker"):
        found = shutil.which(tool)
        if found:
            (bare / tool).symlink_to(found)
    row = _row(_doctor(tmp_path / "ws", path=str(bare)))
    assert row["status"] == "skip"
    assert row["observed"] == "not measured: sysbench is not installed"
    assert "apt-get install sysbench numactl" in row["fix"] and "yum install" in row["fix"]
    assert row["guards"] == []  # no stage waits on it


@needs_sysbench
def test_two_nodes_are_read_alone_then_together_and_summed(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # this VM has one NUMA node: a numactl that records its binding and runs the real
    # sysbench unbound stands in for the second node; the readers' orchestration is real
    calls = tmp_path / "calls"
    shim = tmp_path / "bin" / "numactl"
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\n"
                    f"echo \"$1 $2 $(date +%s.%N)\" >> {calls}\n"
                    "shift 2\nexec \"$@\"\n")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    readers = bw.layout({0: "0", 1: "1"}, 2, 2)
    found = bw.measure(readers)
    bound = [line.split()[:2] for line in calls.read_text().splitlines()]
    # each node alone, in turn; then both at once (started together: either may log first)
    assert bound[:2] == [["--cpunodebind=0", "--membind=0"], ["--cpunodebind=1", "--membind=1"]]
    assert sorted(bound[2:]) == [["--cpunodebind=0", "--membind=0"],
                                 ["--cpunodebind=1", "--membind=1"]]
    assert set(found.nodes) == {0, 1} and found.pinned
    assert found.total_gb_s is not None and found.total_gb_s > 0
    assert "node 0 " in found.shown() and "node 1 " in found.shown()
