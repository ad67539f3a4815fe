"""`selftest --bench`: the plumbing through the kernel stand-in (a real child process, a real
synthetic layer of the recipe's dims, the serve plan's pools), the figures it prints and the
cache accept reads. The real kernel's figures come from a run of the real x86 build."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from dsv4_offload.acceptance.ceilings import KernelBench
from dsv4_offload.build import moerun
from dsv4_offload.build.moebench import expert_bytes
from dsv4_offload.core.results import Status
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.stages import selftest
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

STANDIN = Path(__file__).parent / "standin_kt_kernel_ext.py"
RECIPE = "dsv4-flash-x86-dev"
# the stand-in computes the MoE in numpy: small dims stand for the real 256 x 4096 x 2048
SMALL = ["selftest.experts=4", "selftest.hidden=64", "selftest.intermediate=64",
         "selftest.top_k=2", "selftest.tokens=[4]", "selftest.timeout_s=60",
         "selftest.real_layer.rehearse=false", "conversion.experts=16",
         "conversion.hidden_size=64", "conversion.moe_intermediate_size=64",
         "conversion.experts_per_token=4"]


def _ctx(root: Path, **options: object) -> StageContext:
    recipe, series = load_recipe_and_series(RECIPE, SMALL)
    ctx = StageContext(recipe=recipe, series=series, workspace=Workspace(root),
                       options={"python": sys.executable, **options}, stage="selftest")
    target = moerun.module_dir(ctx) / "kt_kernel_ext.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(STANDIN, target)
    return ctx


def test_an_expert_is_its_three_projections_in_mxfp4() -> None:
    assert expert_bytes(4096, 2048) == 13_369_344  # 12.75 MiB: ~138 GiB over 43 x 256


def test_the_bench_times_decode_forwards_and_caches_the_figure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_STANDIN_MODE", "right")
    ctx = _ctx(tmp_path / "ws", bench=True, repeats=5, share=0.25)
    result = selftest.run(ctx)
    assert result.status is Status.OK, result.as_dict()
    bench = result.data["bench"]
    assert len(bench["seconds"]) == 5 and bench["gb_s"] > 0
    assert (bench["experts"], bench["top_k"]) == (16, 4)
    assert bench["expert_bytes"] == expert_bytes(64, 64)
    assert bench["rehearsal"] == RECIPE  # the x86 rehearsal: its figure is said as such
    # the child was given the serve plan's pools (one per NUMA node here)
    spec = json.loads((tmp_path / "ws" / "bench" / "spec.json").read_text())
    assert spec["bench"]["pools"] == bench["pools"] and spec["tokens"] == 1
    lines = result.data["lines"]
    assert lines[0].startswith("kt-kernel MoE, full-size synthetic layer (16 experts, 64x64, "
                               "top-4), ")
    assert "GB/s read" in lines[0]
    assert lines[1].startswith("this host's memory bandwidth: ")
    assert "at resident share 0.25" in lines[3] and "43 layers" in lines[3]
    assert lines[-1] == f"a rehearsal's figure ({RECIPE}): this machine's, not the serving host's"
    cached = KernelBench.read(ctx.workspace.bench_file)
    assert cached is not None and cached.gb_s == round(bench["gb_s"], 3)
    # the projection: bytes of the routed experts over the kernel's rate, 43 layers
    per_token = expert_bytes(64, 64) * 4 * 43 * 0.75
    assert bench["projected_tok_s"][1] == pytest.approx(bench["gb_s"] * 1e9 / per_token,
                                                        rel=1e-2)
    assert "bench: " in result.summary and "GB/s read by kt-kernel" in result.summary


def test_a_kernel_that_does_no_work_gets_no_figure(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # the right numbers for the selftest's 4 tokens, zeros for the bench's decode: as the
    # delivered x86 code's forward_many (ktkernel-x86-notes §5.2), a lie in no time at all
    monkeypatch.setenv("KT_STANDIN_MODE", "decode-zeros")
    ctx = _ctx(tmp_path / "ws", bench=True, repeats=2)
    result = selftest.run(ctx)
    assert result.status is Status.FAILED
    assert result.summary.startswith("selftest passed in ")
    assert result.summary.endswith("; but the bench failed: the forwards left their output "
                                   "all zeros: the kernel did no work")
    assert result.problems[0].check == "bench"
    assert not ctx.workspace.bench_file.exists()  # no figure for accept


def test_the_cli_prints_the_figures_beside_the_bandwidth(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ctx = _ctx(ws)  # the stand-in where the build puts the module
    assert ctx.workspace.root == ws
    sets = [a for s in [*SMALL, f"build.python={sys.executable}"] for a in ("--set", s)]
    result = run_cli("-w", str(ws), "-r", RECIPE, *sets, "selftest", "--bench",
                     "--repeats", "3", "--share", "0.4", env={"KT_STANDIN_MODE": "right"},
                     timeout=300)
    assert result.code == 0, result
    assert "kt-kernel MoE, full-size synthetic layer (16 experts, 64x64, top-4)" in result.out
    assert "this host's memory bandwidth: " in result.out
    assert "at resident share 0.40" in result.out
    assert "a rehearsal's figure (dsv4-flash-x86-dev)" in result.out


# a real x86 kt-kernel build (the x86 rehearsal's, ~110 s of C++ on 2 idle cores; no source
# host is reachable from the tests, so the build is made beforehand): its python/ directory
KT_BUILT = os.environ.get("KT_KERNEL_PYTHON_DIR")


@pytest.mark.slow
@pytest.mark.skipif(not KT_BUILT, reason="KT_KERNEL_PYTHON_DIR names no real x86 kt-kernel "
                    "build (kt-kernel/python with kt_kernel_ext*.so)")
def test_the_real_x86_kernel_reads_the_full_size_layer(tmp_path: Path) -> None:
    """`selftest --bench` through the real kernel of an x86 build (KT_KERNEL_PYTHON_DIR).
    The fast tier's seam, the bench's child, its timing and the figures through the CLI,
    is tests/test_selftest_bench.py::test_the_bench_times_decode_forwards_and_caches_the_figure
    and tests/test_selftest_bench.py::test_the_cli_prints_the_figures_beside_the_bandwidth
    (the kernel stand-in)."""
    ws = tmp_path / "ws"
    recipe, series = load_recipe_and_series(RECIPE, [])
    ctx = StageContext(recipe=recipe, series=series, workspace=Workspace(ws), options={},
                       stage="selftest")
    target = moerun.module_dir(ctx)
    target.parent.mkdir(parents=True)
    shutil.copytree(str(KT_BUILT), target)
    result = run_cli("-w", str(ws), "-r", RECIPE, "--set", f"build.python={sys.executable}",
                     "--set", "selftest.real_layer.rehearse=false", "selftest", "--bench",
                     "--repeats", "8", timeout=900)
    assert result.code == 0, result
    assert "full-size synthetic layer (256 experts, 4096x2048, top-6)" in result.out
    bench = KernelBench.read(Workspace(ws).bench_file)
    assert bench is not None and bench.gb_s > 0 and bench.rehearsal == RECIPE
    assert "this host's memory bandwidth: " in result.out
