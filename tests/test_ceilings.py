"""accept's ceilings: the arithmetic (bytes per token, the two ceilings, the fractions), the
share the server prints, and accept placing a stand-in server's decode between them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_accept_stage import _cli_accept, _standin_elsewhere

from dsv4_offload.acceptance import ceilings as cl
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.serving.bandwidth import Bandwidth, Reader
from dsv4_offload.workspace.store import Workspace

# the real layer file: 3 projections of 256 experts, 4096 x 2048 in 17-byte MXFP4 blocks
EXPERT = 3 * 2048 * 4096 // 32 * 17  # 13,369,344 bytes


def _bench(gb_s: float) -> cl.KernelBench:
    return cl.KernelBench(gb_s=gb_s, forward_s=0.01, expert_bytes=EXPERT, top_k=6,
                          experts=256, pools=8, threads=128, rehearsal=None,
                          recipe="dsv4-flash-910b", when="2026-12-07T10:00:00+00:00")


def write_caches(ws: Workspace, bandwidth_gb_s: float, bench_gb_s: float) -> None:
    """This host's bandwidth and the kernel's rate as doctor and `selftest --bench` cache
    them, through their own classes."""
    ws.meta_dir.mkdir(parents=True, exist_ok=True)
    ws.bandwidth_file.write_text(json.dumps(
        Bandwidth({0: bandwidth_gb_s}, bandwidth_gb_s, [Reader(0, "0-1", 1)],
                  "sysbench memory read", True).as_dict()))
    _bench(bench_gb_s).write(ws.bench_file)


def test_bytes_per_token_are_the_routed_experts_not_resident() -> None:
    # 43 layers x 6 experts x 13.4 MB = 3.45 GB per token with nothing resident
    assert cl.bytes_per_token(EXPERT, 6, 43, 0.0) == 43 * 6 * EXPERT
    assert cl.bytes_per_token(EXPERT, 6, 43, 0.25) == pytest.approx(0.75 * 43 * 6 * EXPERT)
    assert cl.bytes_per_token(EXPERT, 6, 43, 1.0) == 0.0
    # the GGUF set's size over its experts: ~138 GiB / (43 x 256) ~ 12.8 MiB
    assert cl.expert_bytes(43 * 256 * EXPERT, 43, 256) == EXPERT


def test_the_ceilings_and_fractions_of_a_measured_decode() -> None:
    c = cl.place(15.0, 0.5, EXPERT, 6, 43, 200.0, _bench(100.0))
    per_token = 0.5 * 43 * 6 * EXPERT
    assert c.per_token_bytes == per_token
    assert c.roofline_tok_s == pytest.approx(200e9 / per_token)  # ~116.0 tok/s
    assert c.kernel_tok_s == pytest.approx(100e9 / per_token)  # ~58.0 tok/s
    assert c.fraction(c.kernel_tok_s) == pytest.approx(15.0 / (100e9 / per_token))
    assert c.missing == ()
    doc = c.as_dict()
    assert doc["roofline_tok_s"] == 115.97 and doc["kernel_tok_s"] == 57.98
    assert doc["kernel_fraction"] == 0.259 and doc["roofline_fraction"] == 0.129
    # 26 % of the kernel's pace: the time goes outside the CPU MoE
    assert "outside the CPU MoE" in c.where_the_rest_goes()
    lines = c.lines()
    assert lines[0] == "measured decode: 15.0 tok/s"
    assert lines[1] == ("CPU kernel's projection at resident share 0.500: 58.0 tok/s "
                        "(measured = 26% of it)")
    assert lines[2] == "memory roofline at resident share 0.500: 116.0 tok/s (measured = 13% of it)"


def test_where_the_rest_goes_follows_the_ratios() -> None:
    # decode at the kernel's pace, the kernel at a third of the memory: the kernel's knobs
    slow_kernel = cl.place(55.0, 0.5, EXPERT, 6, 43, 300.0, _bench(100.0))
    assert "threads per pool" in slow_kernel.where_the_rest_goes()
    # decode at the kernel's pace and the kernel at the memory's: only fewer bytes help
    at_memory = cl.place(55.0, 0.5, EXPERT, 6, 43, 100.0, _bench(95.0))
    assert "near the memory roofline" in at_memory.where_the_rest_goes()


def test_missing_figures_are_said_not_zero() -> None:
    c = cl.place(15.0, None, EXPERT, 6, 43, None, None)
    assert c.kernel_tok_s is None and c.roofline_tok_s is None
    assert c.lines()[1] == "CPU kernel's projection at resident share unknown: unknown"
    assert any("`dsv4-offload selftest --bench`" in m for m in c.missing)
    assert any("`dsv4-offload doctor`" in m for m in c.missing)
    assert any("share=' line" in m for m in c.missing)
    assert c.short() == "kernel's projection unknown; memory roofline unknown"
    # a bandwidth but no bench: the roofline alone
    only = cl.place(15.0, 0.3, EXPERT, 6, 43, 100.0, None)
    assert only.kernel_tok_s is None and only.roofline_tok_s is not None
    assert only.short().startswith("kernel's projection unknown; ")


def test_the_share_is_the_last_residency_line_the_server_printed() -> None:
    # sglang/0003 lines 997-998 and 1070-1072 (see acceptance/ceilings.py)
    log = ("[KT_STREAM] inline resident: top-32 x 43 layers folded into prefill, share=0.412\n"
           "noise\n[KT_STREAM] dynamic resident applied: top-48 x 43 layers in 2.5s, "
           "prefill top-K activation share=0.583\n")
    assert cl.server_share(log) == (0.583, 48)
    assert cl.server_share(log.splitlines()[0]) == (0.412, 32)
    assert cl.server_share("nothing here") == (None, None)
    assert cl.server_share(None) == (None, None)


def test_the_gguf_set_counts_when_whole_else_the_recipe(tmp_path: Path) -> None:
    recipe, _ = load_recipe_and_series("dsv4-flash-910b", [])
    conv = recipe.conversion
    total, source = cl.gguf_set_bytes(tmp_path, conv)
    assert total == 43 * conv.expected_file_bytes and "expected_file_bytes" in source
    for layer in range(42):
        (tmp_path / conv.file_name(layer)).write_bytes(b"x" * 1000)
    assert cl.gguf_set_bytes(tmp_path, conv)[0] == 43 * conv.expected_file_bytes  # one missing
    (tmp_path / conv.file_name(42)).touch()  # an empty file is no converted layer
    assert cl.gguf_set_bytes(tmp_path, conv)[0] == 43 * conv.expected_file_bytes
    (tmp_path / conv.file_name(42)).write_bytes(b"x" * 1001)
    assert cl.gguf_set_bytes(tmp_path, conv) == (43001, f"the GGUF set in {tmp_path}")


def test_accept_prints_the_three_figures_and_their_ratios(tmp_path: Path,
                                                          no_leftovers: str) -> None:
    ws = Workspace(tmp_path / "ws")
    write_caches(ws, 50.0, 20.0)
    proc, url, log = _standin_elsewhere(tmp_path, no_leftovers)
    try:
        result = _cli_accept(tmp_path, url, "--server-log", str(log), "--quick")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    doc = result.json()["data"]["data"]
    ceilings = doc["ceilings"]
    assert ceilings["share"] == 0.612  # the stand-in prints sglang/0003's line
    assert ceilings["missing"] == []
    measured = ceilings["measured_tok_s"]
    assert measured and ceilings["kernel_fraction"] == pytest.approx(
        measured / ceilings["kernel_tok_s"], rel=1e-2)
    assert ceilings["roofline_tok_s"] == pytest.approx(2.5 * ceilings["kernel_tok_s"], rel=1e-3)
    assert "of the kernel's projection" in result.json()["data"]["summary"]
    report = json.loads(Path(doc["report"]).read_text())
    assert report["ceilings"] == ceilings
    # the lines the terminal shows under the checks table
    assert doc["lines"][0] == f"measured decode: {measured:.1f} tok/s"
    assert doc["lines"][1].startswith("CPU kernel's projection at resident share 0.612: ")
    assert doc["lines"][-1] == ceilings["where"]


def test_a_rehearsals_bench_is_no_ceiling_of_the_server(tmp_path: Path) -> None:
    recipe, _ = load_recipe_and_series("dsv4-flash-910b", [])
    ws = Workspace(tmp_path / "ws")
    log = tmp_path / "server.log"
    log.write_text("[KT_STREAM] inline resident: top-32 x 43 layers folded into prefill, "
                   "share=0.500\n")
    replace(_bench(5.0), rehearsal="dsv4-flash-x86-dev").write(ws.bench_file)
    c = cl.for_accept(ws, recipe, 14.0, log)
    assert c.share == 0.5 and c.kernel_tok_s is None
    assert any("selftest --bench" in m for m in c.missing)
    _bench(5.0).write(ws.bench_file)  # measured on the serving host itself
    assert cl.for_accept(ws, recipe, 14.0, log).kernel_tok_s is not None
