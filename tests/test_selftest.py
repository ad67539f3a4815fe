"""The selftest stage: the numpy reference, every verdict through a stand-in kt_kernel_ext
run in a real child process, the emulator command line and the pipeline order."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from dsv4_offload import pipeline
from dsv4_offload.build import moecheck
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import Status
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.stages import selftest
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

# the commands in this process (conftest.run_cli_inproc): what they answer is the point
CLI_IN_PROCESS = True

RECIPE = "dsv4-flash-x86-dev"
STANDIN = Path(__file__).parent / "standin_kt_kernel_ext.py"
# small and quick: the stand-in computes the MoE in a python loop
SMALL = ["selftest.experts=4", "selftest.hidden=64", "selftest.intermediate=64",
         "selftest.top_k=2", "selftest.timeout_s=60", "selftest.real_layer.rehearse=false"]


def make_ctx(root: Path, overrides: list[str] | None = None, standin: bool = True
             ) -> StageContext:
    recipe, series = load_recipe_and_series(RECIPE, [*SMALL, *(overrides or [])])
    ctx = StageContext(recipe=recipe, series=series, workspace=Workspace(root),
                       options={"python": sys.executable}, stage="selftest")
    if standin:
        target = selftest.module_dir(ctx) / "kt_kernel_ext.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(STANDIN, target)
    return ctx


def run_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str,
             overrides: list[str] | None = None) -> tuple[StageContext, object]:
    monkeypatch.setenv("KT_STANDIN_MODE", mode)
    ctx = make_ctx(tmp_path / "ws", overrides)
    return ctx, selftest.run(ctx)


# --- the reference --------------------------------------------------------------------------


def test_bf16_rounding_is_nearest_even_and_exact_back() -> None:
    values = np.array([1.0, -2.5, 1 + 2**-8, 1 + 3 * 2**-8, 3.0e38, 0.0], np.float32)
    bits = moecheck.to_bf16_bits(values)
    # 1+2^-8 is a tie: rounds to even (1.0); 1+3*2^-8 rounds up to 1+2^-6... of the bf16 grid
    assert list(bits[:4]) == [0x3F80, 0xC020, 0x3F80, 0x3F82]
    back = moecheck.from_bf16_bits(bits)
    assert back[0] == 1.0 and back[1] == -2.5 and back[5] == 0.0
    assert np.array_equal(moecheck.to_bf16_bits(back), bits)  # bf16 values are fixed points


def test_reference_equals_a_per_token_loop() -> None:
    rng = np.random.default_rng(1)
    e, h, i, t, k = 5, 32, 64, 3, 2
    gate, up = rng.standard_normal((e, i, h)), rng.standard_normal((e, i, h))
    down = rng.standard_normal((e, h, i))
    x = rng.standard_normal((t, h))
    ids = np.array([[0, 3], [4, 1], [2, 2]])
    w = rng.random((t, k))
    got = moecheck.reference_moe(x, ids, w, gate, up, down)
    for tok in range(t):
        want = np.zeros(h)
        for j in range(k):
            ex = ids[tok, j]
            g, u = gate[ex] @ x[tok], up[ex] @ x[tok]
            want += w[tok, j] * (down[ex] @ (g * (1 / (1 + np.exp(-g))) * u))
        np.testing.assert_allclose(got[tok], want, rtol=2e-5, atol=1e-4)


def test_reference_reads_the_checkpoint_the_gguf_was_converted_from(tmp_path: Path) -> None:
    from dsv4_offload.weights import mxfp4

    ctx = make_ctx(tmp_path, standin=False)
    checkpoint, gguf_file = selftest.write_layer(ctx.recipe, ctx.recipe.selftest, tmp_path / "s")
    experts = selftest.source_experts(checkpoint)
    assert experts["gate"].shape == (4, 64, 64) and experts["down"].shape == (4, 64, 64)
    # the GGUF bytes decode to the same matrices (half-block order, E8M0 first)
    from dsv4_offload.build.selftest_child import gguf_tensors

    tensors = gguf_tensors(str(gguf_file))
    kind, offset, dims = tensors["blk.0.ffn_down_exps.weight"]
    assert kind == mxfp4.GGML_TYPE_MXFP4 and dims == [64, 64, 4]
    raw = np.fromfile(gguf_file, np.uint8)[offset:offset + 4 * 64 * 2 * 17]
    decoded = mxfp4.dequantize_blocks(raw).reshape(4, 64, 64)
    assert np.array_equal(decoded, experts["down"])
    assert np.isfinite(experts["up"]).all() and np.abs(experts["up"]).max() <= 6 * 2.0**-2


# --- verdicts, through a real child process and a stand-in extension --------------------------


def test_right_module_passes_both_regimes(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _, result = run_mode(tmp_path, monkeypatch, "right")
    assert result.status == Status.OK, result.as_dict()
    runs = result.data["runs"]
    assert [(r["tokens"], r["regime"]) for r in runs] == [(4, "forward_one"),
                                                           (16, "forward_many")]
    for r in runs:
        assert r["ok"] and r["cosine"] >= 0.9999 and r["rel_l2"] < 0.01 and r["api"] == "low-level"
    assert "cosine" in result.summary and result.outputs["runs"][0]["regime"] == "forward_one"


def test_all_zeros_fail_although_the_child_exits_0(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _, result = run_mode(tmp_path, monkeypatch, "zeros", ["selftest.tokens=[16]"])
    assert result.status == Status.FAILED
    (problem,) = result.problems
    assert problem.message.startswith("forward_many (16 tokens): all zeros")
    assert "dsv4-flash-x86" in problem.fix


def test_delivered_code_on_x86_aborts_then_returns_zeros(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _, result = run_mode(tmp_path, monkeypatch, "delivered-x86")
    assert result.status == Status.FAILED
    one, many = (p.message for p in result.problems)
    assert one.startswith("forward_one (4 tokens): SIGABRT 'llamafile not supported'")
    assert "off aarch64" in one
    assert many.startswith("forward_many (16 tokens): all zeros")


def test_sigill_names_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, result = run_mode(tmp_path, monkeypatch, "sigill", ["selftest.tokens=[4]"])
    (problem,) = result.problems
    assert problem.message.startswith("forward_one (4 tokens): SIGILL")
    assert "AVX2" in problem.fix  # this host is x86: the fix is the x86 build switches


def test_hang_is_killed_at_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, result = run_mode(tmp_path, monkeypatch, "hang",
                         ["selftest.tokens=[4]", "selftest.timeout_s=3"])
    (problem,) = result.problems
    assert problem.message == ("forward_one (4 tokens): hang: no result after 3 s (stuck in "
                               "forward)")


def test_low_cosine_fails_with_the_figures(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    _, result = run_mode(tmp_path, monkeypatch, "noisy", ["selftest.tokens=[12]"])
    (problem,) = result.problems
    assert problem.message.startswith("forward_many (12 tokens): low agreement with the numpy "
                                      "reference: cosine 0.9")
    assert result.data["runs"][0]["cosine"] < 0.9995


def test_no_module_is_a_build_first_error(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, standin=False)
    result = selftest.run(ctx)
    assert result.status == Status.FAILED
    assert result.problems[0].fix == "run `dsv4-offload build kt-kernel` first"


# --- aarch64 verdicts from the child's HWCAP line (the format selftest_child prints) ----------

A76 = 1 << 1 | 1 << 10 | 1 << 20  # asimd, asimdhp, asimddp; no sve
A53 = 1 << 1  # no dotprod


def _arm_facts(hwcap: int, built: set[str] | None, rc: int = -signal.SIGILL
               ) -> moecheck.RunFacts:
    line = "SELFTEST cpu " + json.dumps({"machine": "aarch64", "hwcap": hwcap, "hwcap2": 0})
    return moecheck.RunFacts(4, rc, [line, "qemu: uncaught target signal 4 (Illegal "
                                           "instruction) - core dumped"], 60, built=built)


def test_sigill_tells_an_sve_build_from_a_cpu_without_dotprod() -> None:
    sve = moecheck.judge(_arm_facts(A76, {"fp16", "dotprod", "sve"}), 0.9995, 0.03, None)
    assert sve.reason == ("forward_one (4 tokens): SIGILL: kt-kernel was built with +sve but "
                          "this CPU lacks sve")
    assert "CPUINFER_ARM_SVE" in sve.fix
    a53 = moecheck.judge(_arm_facts(A53, {"fp16", "dotprod"}), 0.9995, 0.03, None)
    assert a53.reason == ("forward_one (4 tokens): SIGILL: this CPU lacks dotprod (asimddp); "
                          "the MXFP4 kernel's SDOT needs it")
    assert "cortex-a76" in a53.fix


def test_sve_abort_on_aarch64_names_the_sve_switch() -> None:
    facts = _arm_facts(A76, {"fp16", "dotprod", "sve"}, rc=-signal.SIGABRT)
    facts.lines.append("  what():  llamafile not supported")
    verdict = moecheck.judge(facts, 0.9995, 0.03, None)
    assert "SIGABRT 'llamafile not supported'" in verdict.reason and "SVE" in verdict.reason


def test_march_line_of_the_build_log() -> None:
    text = "-- ARM detected\n-- ARM target: -march=armv8.2-a+fp16+dotprod\n"
    assert moecheck.march_features(text) == {"fp16", "dotprod"}
    assert moecheck.march_features("-- x86 detected\n") is None


# --- the emulator ---------------------------------------------------------------------------


def test_emulator_argv_and_set_of_the_cpu(tmp_path: Path) -> None:
    emu = ["selftest.emulator={sysroot: sysroot-arm64, python: usr/bin/python3.11, "
           "pythonpath: [py-arm64, /opt/numpy]}", "selftest.emulator.cpu=cortex-a53"]
    ctx = make_ctx(tmp_path, emu, standin=False)
    argv, env = selftest.child_argv(ctx, tmp_path / "spec.json")
    root = tmp_path
    assert argv == ["qemu-aarch64", "-cpu", "cortex-a53", "-L", f"{root}/sysroot-arm64",
                    f"{root}/sysroot-arm64/usr/bin/python3.11", str(selftest.CHILD),
                    f"{tmp_path}/spec.json"]
    assert env["PYTHONPATH"].split(os.pathsep) == [
        str(selftest.module_dir(ctx)), str(selftest.module_dir(ctx).parent), f"{root}/py-arm64",
        "/opt/numpy"]
    assert env["QEMU_CPU"] == "cortex-a53"


def test_child_runs_through_the_emulator_command(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # an "emulator" that checks its -cpu/-L arguments, then runs the guest python natively
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "fake-qemu"
    record = tmp_path / "argv.txt"
    fake.write_text(f'#!/bin/sh\necho "$@" > {record}\n[ "$1" = -cpu ] && [ "$3" = -L ] '
                    '|| exit 99\nshift 4\nexec "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "ws/sysroot/usr/bin").mkdir(parents=True)
    (tmp_path / "ws/sysroot/usr/bin/python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    _, result = run_mode(tmp_path, monkeypatch, "right", [
        "selftest.tokens=[4]", "selftest.emulator={command: fake-qemu, sysroot: sysroot, "
        "python: usr/bin/python3}"])
    assert result.status == Status.OK, result.as_dict()
    assert record.read_text().startswith("-cpu cortex-a76 -L ")


# --- the pipeline ---------------------------------------------------------------------------


def test_selftest_runs_between_build_and_download() -> None:
    names = list(pipeline.STAGE_NAMES)
    assert names.index("build") + 1 == names.index("selftest") == names.index("download") - 1
    assert pipeline.spec("selftest").needs == ("build",)


def test_x86_dev_recipe_ends_at_selftest(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, standin=False)
    items = {i.stage: i for i in pipeline.plan(ctx)}
    for name in ("download", "convert", "verify-gguf", "serve", "accept"):
        assert items[name].action == "skip" and "not applicable" in items[name].reason
    assert items["selftest"].action == "run"
    with pytest.raises(InputError, match="stage 'download' is not applicable to recipe "
                                         "dsv4-flash-x86-dev, which ends at selftest"):
        pipeline.run_stage(ctx, "download")
    states = {s.name: s.state for s in pipeline.pipeline_status(ctx)}
    assert states["serve"] == "n/a" and states["selftest"] == "pending"


def test_selftest_is_stale_when_the_built_module_changes(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    before = selftest.fingerprint_inputs(ctx)
    module = selftest.module_dir(ctx) / "kt_kernel_ext.py"
    module.write_text(module.read_text() + "\n# rebuilt\n")
    after = selftest.fingerprint_inputs(ctx)
    assert pipeline.changed_inputs(before, after) == ["module.kt_kernel_ext.py"]


def test_selftest_section_is_strict() -> None:
    with pytest.raises(InputError,
                       match=r"--set selftest\.colour: 'colour' is not a key of selftest"):
        load_recipe_and_series(RECIPE, ["selftest.colour=1"])
    with pytest.raises(InputError, match="hidden 100 must be a multiple of 32"):
        load_recipe_and_series(RECIPE, ["selftest.hidden=100"])


def test_module_dir_can_point_elsewhere(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, ["selftest.module_dir=build-arm64/lib"], standin=False)
    assert selftest.module_dir(ctx) == tmp_path / "build-arm64/lib"
    argv, env = selftest.child_argv(ctx, tmp_path / "spec.json")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "build-arm64/lib")


def test_wrapper_without_pinned_memory_says_use_the_low_level_api() -> None:
    # the RuntimeError text torch 2.13.0+cpu raises in KTMoEWrapper (experts_base.py)
    lines = ["SELFTEST cpu " + json.dumps({"machine": "x86_64", "hwcap": 1, "hwcap2": 0}),
             "RuntimeError: pin_memory=True requires a CUDA or other accelerator backend; no "
             "pinned memory allocator is available on this system."]
    verdict = moecheck.judge(moecheck.RunFacts(16, 1, lines, 60), 0.9995, 0.03, None)
    assert verdict.reason == ("forward_many (16 tokens): KTMoEWrapper needs pinned memory, "
                              "which this torch (CPU-only) lacks")
    assert "selftest.api: low-level" in verdict.fix


def test_cli_selftest_with_the_right_module_then_without_one(cli, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    base = ["-w", str(ws), "--recipe", RECIPE, *[x for s in SMALL for x in ("--set", s)],
            "--set", f"build.python={sys.executable}", "--set", "selftest.tokens=[3]"]
    target = ws / "src/ktransformers/kt-kernel/python/kt_kernel_ext.py"
    target.parent.mkdir(parents=True)
    shutil.copy(STANDIN, target)
    res = cli("--json", *base, "selftest", env={"KT_STANDIN_MODE": "right"})
    assert res.code == 0, res
    (run,) = res.json()["data"]["data"]["runs"]
    assert run["regime"] == "forward_one" and run["cosine"] > 0.9999
    target.unlink()
    res = cli(*base, "selftest")
    assert res.code == 1, res
    assert "no kt_kernel_ext module in" in res.out and "build kt-kernel` first" in res.out
