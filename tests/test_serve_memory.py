"""The server's anonymous memory after ready against the plan's memory model (issue 24, item 1):
the /proc parser on captured status files, the rule, and the serve stage against the stand-in,
whose GGUF set is scaled down through the recipe's conversion numbers (the plan's own)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from serve_helpers import context, free_port, make_workspace, no_npu_host, standin_overrides

from dsv4_offload.core import procs
from dsv4_offload.core.results import Status
from dsv4_offload.recipe import load_recipe
from dsv4_offload.serving import supervisor as sv
from dsv4_offload.serving.rules import anon_memory_verdict
from dsv4_offload.stages import serve

PROC_FIXTURES = Path(__file__).parent / "fixtures" / "proc"
MIB = 2**20
# 43 layer files of 4 MiB: a 172 MiB GGUF set, the boundary between "little" and "about the
# set" at 86 MiB; the stand-in's own python holds about 10 MiB anonymous
SMALL_SET = "conversion.expected_file_bytes=4194304"


def test_rss_anon_is_read_from_a_captured_status_file() -> None:
    text = (PROC_FIXTURES / "status-python-64mib-anon.txt").read_text()
    assert procs.status_kib(text, "RssAnon") == 68436
    assert procs.status_kib(text, "RssFile") == 5844
    assert procs.status_kib(text, "NoSuchLine") is None
    kthread = (PROC_FIXTURES / "status-kthreadd.txt").read_text()
    assert procs.status_kib(kthread, "RssAnon") is None  # a kernel thread has no Rss lines
    assert procs.status_kib("RssAnon:\tgarbage kB\n", "RssAnon") is None


def test_the_tree_sums_this_process_and_its_children() -> None:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(32 << 20); "
                              "b[::4096] = b'x' * len(range(0, len(b), 4096)); print(1, "
                              "flush=True); time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "1"
        assert child.pid in procs.descendants(os.getpid())
        alone = procs.tree_kib(child.pid)
        total = procs.tree_kib(os.getpid())
        assert alone is not None and total is not None
        assert alone[0] >= 32 * 1024 and alone[1] == 1
        assert total[0] >= alone[0] and total[1] >= 2
    finally:
        child.kill()
        child.wait()
    assert procs.tree_kib(child.pid) is None  # gone


@pytest.mark.parametrize(("pools", "gib", "contradicts"), [
    (8, 137, False),  # 8 pools on the Kunpeng-920: each node's slice copied (issue 24)
    (8, 3, True),
    (1, 3, False),  # one pool: the experts alias the mmapped set
    (1, 130, True),
])
def test_the_rule_at_the_real_recipes_numbers(pools: int, gib: int, contradicts: bool) -> None:
    recipe = load_recipe()
    figures, warning = anon_memory_verdict(recipe, pools, gib * 2**20, 3)
    assert figures["gguf_set_gib"] == pytest.approx(43 * 3422552640 / 2**30, abs=0.01)
    assert (warning is not None) is contradicts
    assert figures["verdict"].startswith("contradicts") is contradicts
    if contradicts and pools == 1:
        assert "moe.hpp:393-431" in warning[0] and "main_repo/0002" in warning[0]
        assert "build kt-kernel --clean" in warning[1]
    if contradicts and pools > 1:
        assert "each NUMA node's slice" in warning[0]


def _serve(tmp_path: Path, tag: str, *args: str, numa: int = 1):
    ws = make_workspace(tmp_path / "ws")
    ctx = context(ws, [*standin_overrides(tag, free_port(), "--tag", tag, *args), SMALL_SET],
                  "serve", detach=True)
    ctx.host_facts = no_npu_host(numa=numa, cores=64)
    return ctx


def test_one_pool_with_the_experts_copied_is_a_warning_in_the_record(tmp_path, no_leftovers):
    ctx = _serve(tmp_path, no_leftovers, "--anon-mib", "64", "--child-anon-mib", "64")
    try:
        result = serve.run(ctx)
        assert result.status is Status.OK, result.as_dict()
        (warning,) = [p for p in result.problems if p.check == "serve.memory"]
        assert warning.severity == "warning"
        assert "with 1 CPU threadpool, where the plan expects the experts to stay" in \
            warning.message
        assert "moe.hpp:393-431" in warning.message and "--clean" in warning.fix
        record = sv.read_record(ctx.workspace.serve_record)
        assert record is not None
        memory = record.extra["memory"]
        assert memory["processes"] >= 2  # the stand-in and its child, summed
        assert memory["rss_anon_gib"] * 1024 >= 128
        assert memory["threadpool_count"] == 1
        assert memory["gguf_set_gib"] == pytest.approx(172 / 1024, abs=1e-3)
        assert result.outputs["memory"] == memory
    finally:
        sv.stop_recorded(ctx.workspace.serve_record, 3)


def test_one_pool_with_little_anonymous_memory_is_as_planned(tmp_path, no_leftovers):
    ctx = _serve(tmp_path, no_leftovers)
    try:
        result = serve.run(ctx)
        assert result.status is Status.OK, result.as_dict()
        assert not [p for p in result.problems if p.check == "serve.memory"]
        assert result.outputs["memory"]["verdict"] == "as planned"
        assert result.outputs["memory"]["rss_anon_gib"] * 1024 < 86
    finally:
        sv.stop_recorded(ctx.workspace.serve_record, 3)


def test_several_pools_without_the_copy_is_a_warning(tmp_path, no_leftovers):
    ctx = _serve(tmp_path, no_leftovers, numa=2)
    try:
        result = serve.run(ctx)
        assert result.status is Status.OK, result.as_dict()
        (warning,) = [p for p in result.problems if p.check == "serve.memory"]
        assert "with 2 CPU threadpools, where the plan expects each NUMA node's slice" in \
            warning.message
    finally:
        sv.stop_recorded(ctx.workspace.serve_record, 3)


def test_the_supervisor_keeps_what_serve_added_to_the_record(tmp_path, no_leftovers):
    ctx = _serve(tmp_path, no_leftovers)
    try:
        result = serve.run(ctx)
        assert result.status is Status.OK, result.as_dict()
        record = sv.read_record(ctx.workspace.serve_record)
        assert record is not None and {"startup", "memory"} <= set(record.extra)
        os.kill(record.server_pid, signal.SIGTERM)  # the server dies: the supervisor closes
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            closed = sv.read_record(ctx.workspace.serve_record)
            if closed is not None and closed.state == "exited":
                break
            time.sleep(0.05)
        assert closed is not None and closed.state == "exited", closed
        assert closed.extra["startup"] == record.extra["startup"]
        assert closed.extra["memory"] == record.extra["memory"]
        assert closed.extra["derived"] == record.extra["derived"]
    finally:
        sv.stop_recorded(ctx.workspace.serve_record, 3)
