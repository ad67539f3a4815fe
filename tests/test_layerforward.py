"""The real-layer check (guide appendix D): a converted layer through kt-kernel against the
numpy reference from its source, as verify-gguf's level 4 and in the rehearsals' selftest.

kt-kernel is the stand-in ``tests/standin_kt_kernel_ext.py``, run in a real child process;
the layer files are converted by this tool from synthetic checkpoints of the real layout.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli_inproc as run_cli  # the commands in process: not the process

from dsv4_offload.build import layerforward, moecheck, moerun
from dsv4_offload.core.results import Status
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.stages import convert, selftest, verify_gguf
from dsv4_offload.weights.checkpoint import Checkpoint, MoeDims, write_synthetic_checkpoint
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

STANDIN = Path(__file__).parent / "standin_kt_kernel_ext.py"
# 16 experts, 6 per token as the model; small matrices: the stand-in computes in numpy
DIMS = MoeDims(layers=3, experts=16, experts_per_token=6, hidden=64, intermediate=64)


def make_ctx(root: Path, stage: str, recipe: str | None = None,
             overrides: list[str] | None = None, **options: object) -> StageContext:
    rec, series = load_recipe_and_series(recipe, overrides or [])
    return StageContext(recipe=rec, series=series, workspace=Workspace(root),
                        options={"python": sys.executable, **options}, stage=stage)


def install_standin(ctx: StageContext) -> Path:
    target = moerun.module_dir(ctx) / "kt_kernel_ext.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(STANDIN, target)
    return target


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", DIMS, seed=5,
                                      exponents=layerforward.EXPONENTS)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Path:
    ws = tmp_path_factory.mktemp("pristine")
    result = convert.run(make_ctx(ws, "convert", source=str(checkpoint), jobs=1))
    assert result.status is Status.OK
    return ws / "gguf"


@pytest.fixture
def workspace(tmp_path: Path, pristine: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "gguf")
    return tmp_path


# --- inputs and reference -------------------------------------------------------------------


def test_experts_spread_over_the_layer_ends_included() -> None:
    assert layerforward.pick_experts(256, 8) == [0, 36, 73, 109, 146, 182, 219, 255]
    assert layerforward.pick_experts(4, 8) == [0, 1, 2, 3]
    assert layerforward.pick_experts(256, 1) == [0]


def test_tokens_route_to_distinct_chosen_experts_and_use_them_all() -> None:
    chosen = layerforward.pick_experts(256, 8)
    run = layerforward.routed_inputs(4096, chosen, 6, 4, seed=1)
    ids = run["ids"]
    assert ids.shape == (4, 6) and run["x"].dtype == np.uint16
    assert all(len(set(row)) == 6 for row in ids.tolist())
    assert set(ids.ravel().tolist()) == set(chosen)  # 0 and 255: both ends of each tensor
    np.testing.assert_allclose(run["weights"].sum(axis=1), 1, rtol=1e-6)
    again = layerforward.routed_inputs(4096, chosen, 6, 4, seed=1)
    assert all(np.array_equal(run[k], again[k]) for k in run)  # deterministic


def test_reference_per_expert_equals_the_dense_reference(checkpoint: Path) -> None:
    chosen = layerforward.pick_experts(DIMS.experts, 8)
    runs = [layerforward.routed_inputs(DIMS.hidden, chosen, 6, t, seed=3) for t in (4, 16)]
    with Checkpoint.open(checkpoint) as ckpt:
        refs = layerforward.references(ckpt, 1, runs)
        mats = [layerforward.dequantized_expert(ckpt, 1, e) for e in range(DIMS.experts)]
    gate, up, down = (np.stack([m[i] for m in mats]) for i in range(3))
    for run, ref in zip(runs, refs, strict=True):
        want = moecheck.reference_moe(moecheck.from_bf16_bits(run["x"]), run["ids"],
                                      run["weights"], gate, up, down)
        np.testing.assert_allclose(ref, want, rtol=1e-4, atol=1e-4)


# --- verify-gguf level 4 --------------------------------------------------------------------


def verify(ws: Path, checkpoint: Path, *args: str, mode: str = "right"):  # type: ignore[no-untyped-def]
    return run_cli("-w", str(ws), "--json", "--set", f"build.python={sys.executable}",
                   "verify-gguf", "--source", str(checkpoint), *args,
                   env={"KT_STANDIN_MODE": mode, "PYTHON_BIN": sys.executable})


def test_level4_runs_the_middle_layer_through_kt_kernel(workspace: Path, checkpoint: Path
                                                        ) -> None:
    install_standin(make_ctx(workspace, "verify-gguf"))
    res = verify(workspace, checkpoint)
    assert res.code == 0, res
    doc = res.json()
    data = doc["data"]["data"]
    # level 2 warns: these dims have no published digests
    assert data["levels"] == {"1": "ok", "2": "recorded", "3": "ok", "4": "ok"}
    assert [p["check"] for p in doc["data"]["problems"]] == ["level2"]
    check = data["kernel_check"]
    # layer 16 (appendix D) is not among 0..2: the middle one runs
    assert check["layer"] == 1 and check["gguf"].endswith("dsv4_layer1_mxfp4.gguf")
    assert check["experts"] == [0, 2, 4, 6, 9, 11, 13, 15]
    assert [(r["tokens"], r["regime"]) for r in check["runs"]] == [(4, "forward_one"),
                                                                  (16, "forward_many")]
    assert all(r["ok"] and r["cosine"] >= 0.9999 for r in check["runs"])
    assert "L4 ok" in doc["data"]["summary"]


def test_the_isolated_call_gets_the_synchronous_submit(workspace: Path, checkpoint: Path
                                                       ) -> None:
    # the stand-in leaves zeros unless KT_FORCE_SYNC_SUBMIT=1, as appendix D's script warns
    install_standin(make_ctx(workspace, "verify-gguf"))
    res = verify(workspace, checkpoint, "--layers", "0", mode="needs-sync")
    assert res.code == 0, res
    assert res.json()["data"]["data"]["kernel_check"]["layer"] == 0


def test_wrong_numbers_of_the_kernel_fail_level4(workspace: Path, checkpoint: Path) -> None:
    install_standin(make_ctx(workspace, "verify-gguf"))
    res = verify(workspace, checkpoint, mode="noisy")
    assert res.code == 1, res
    doc = res.json()
    assert doc["data"]["data"]["levels"]["4"] == "failed"
    messages = [p["message"] for p in doc["data"]["problems"] if p["check"] == "level4"]
    assert messages[0].startswith("level 4: layer 1 through kt-kernel: forward_one (4 tokens): "
                                  "low agreement with the numpy reference: cosine 0.9")


def test_a_crash_in_kt_kernel_fails_level4_with_its_reason(workspace: Path, checkpoint: Path
                                                           ) -> None:
    install_standin(make_ctx(workspace, "verify-gguf"))
    res = verify(workspace, checkpoint, mode="delivered-x86")
    assert res.code == 1, res
    one, many = (p["message"] for p in res.json()["data"]["problems"] if p["check"] == "level4")
    assert "forward_one (4 tokens): SIGABRT 'llamafile not supported'" in one
    assert "forward_many (16 tokens): all zeros" in many


def test_without_kt_kernel_level4_is_skipped_with_a_warning(workspace: Path,
                                                           checkpoint: Path) -> None:
    res = verify(workspace, checkpoint)
    assert res.code == 0, res
    doc = res.json()
    assert doc["data"]["data"]["levels"]["4"] == "skipped"
    (problem,) = [p for p in doc["data"]["problems"] if p["check"] == "level4"]
    assert "kt-kernel is not built in this workspace" in problem["message"]
    assert "dsv4-offload build kt-kernel" in problem["fix"]
    off = verify(workspace, checkpoint, "--no-kernel")  # its own manifest now: level 2 ok
    assert off.code == 0 and off.json()["status"] == "ok", off
    assert off.json()["data"]["data"]["levels"] == {"1": "ok", "2": "ok", "3": "ok", "4": "off"}


def test_a_rebuilt_kt_kernel_makes_verify_gguf_stale(workspace: Path) -> None:
    ctx = make_ctx(workspace, "verify-gguf")
    before = verify_gguf.fingerprint_inputs(ctx)
    assert before["module"] == "missing"
    module = install_standin(ctx)
    after = verify_gguf.fingerprint_inputs(ctx)
    assert "module" not in after and f"module.{module.name}" in after


# --- the rehearsal: selftest on a synthetic layer of the real layout --------------------------

SMALL = ["selftest.experts=4", "selftest.hidden=64", "selftest.intermediate=64",
         "selftest.top_k=2", "selftest.tokens=[4]", "selftest.timeout_s=60",
         "selftest.real_layer.synthetic_dims=selftest", "selftest.real_layer.layer=0"]


def test_x86_rehearsal_runs_the_real_layer_check_after_the_selftest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_STANDIN_MODE", "right")
    ctx = make_ctx(tmp_path, "selftest", "dsv4-flash-x86-dev", SMALL)
    assert ctx.recipe.selftest.real_layer.rehearse  # the recipe asks for it
    install_standin(ctx)
    result = selftest.run(ctx)
    assert result.status is Status.OK, result.as_dict()
    check = result.data["real_layer"]
    assert check["dims"] == {"layers": 1, "experts": 4, "experts_per_token": 2, "hidden": 64,
                             "intermediate": 64}
    assert [r["tokens"] for r in check["runs"]] == [4, 16]
    assert all(r["cosine"] >= 0.9999 for r in check["runs"])
    assert "synthetic layer 0 of the real layout (4 experts, 64x64" in result.summary
    # the real layout: config, index, expert tensors by their checkpoint names
    made = tmp_path / "real-layer" / "synthetic"
    with Checkpoint.open(made / "checkpoint") as ckpt:
        assert ckpt.expert_tensor(0, 3, "w2", "scale").dtype == "F8_E8M0"
    stamp = json.loads((made / "made.json").read_text())
    gguf = made / "gguf" / "dsv4_layer0_mxfp4.gguf"
    mtime = gguf.stat().st_mtime_ns
    again = selftest.run(ctx)  # the synthetic layer is written once
    assert again.status is Status.OK and gguf.stat().st_mtime_ns == mtime
    assert json.loads((made / "made.json").read_text()) == stamp


def test_rehearsal_failure_is_the_stage_failure(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # right for the small layer (4 experts), then a bug that only the bigger layer meets:
    # the stand-in's noisy mode is global, so the layer's own tolerance decides here
    monkeypatch.setenv("KT_STANDIN_MODE", "noisy")
    ctx = make_ctx(tmp_path, "selftest", "dsv4-flash-x86-dev",
                   [*SMALL, "selftest.min_cosine=0.5", "selftest.max_rel_l2=1"])
    install_standin(ctx)
    result = selftest.run(ctx)
    assert result.status is Status.FAILED
    assert result.problems[0].message.startswith(
        "synthetic layer 0 of the real layout (4 experts, 64x64, experts [0, 1, 2, 3] routed): "
        "forward_one (4 tokens): low agreement")
    assert result.problems[0].check == "real-layer"


def test_the_selftest_option_runs_it_on_any_recipe(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_STANDIN_MODE", "right")
    ctx = make_ctx(tmp_path, "selftest", "dsv4-flash-x86-dev",
                   [*SMALL, "selftest.real_layer.rehearse=false"])
    install_standin(ctx)
    assert "real_layer" not in selftest.run(ctx).data
    ctx.options["real_layer"] = True
    assert selftest.run(ctx).data["real_layer"]["layer"] == 0
