"""The `selftest` stage: the built kt-kernel runs a tiny MXFP4 MoE layer, checked by numbers.

1. A synthetic native-layout MXFP4 checkpoint (the real tensor names and dtypes, small dims
   from the recipe's ``selftest`` section) is written and converted with the code `convert`
   uses, into ``<workspace>/selftest/``.
2. For each entry of ``selftest.tokens``, a child process (``selftest_child.py``; stdlib,
   numpy and kt-kernel only) loads that GGUF into kt-kernel's MoE and runs one forward:
   fewer than 10 tokens take ``forward_one``, 10 or more ``forward_many``. It runs the build
   python, or an emulated one (``selftest.emulator``), with a timeout.
3. Each output is compared with a numpy reference computed from the checkpoint's tensors:
   cosine >= ``min_cosine`` and rel-L2 <= ``max_rel_l2``. A crash (SIGILL, SIGABRT), a hang,
   all zeros or a low cosine fails with a one-line reason and fix; exit 0 alone proves
   nothing.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.build.moerun import CHILD as CHILD
from dsv4_offload.build.moerun import (
    built_features,
    extension_files,
    module_fingerprint,
    run_forward,
)
from dsv4_offload.build.moerun import child_argv as child_argv
from dsv4_offload.build.moerun import module_dir as module_dir
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.options import PathText, StageOptions
from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.workspace.context import StageContext

if TYPE_CHECKING:
    import numpy as np

    from dsv4_offload.build.moecheck import Verdict
    from dsv4_offload.recipe import Recipe, Selftest

class SelftestOptions(StageOptions):
    real_layer: bool = False  # then a synthetic layer of the real layout, as level 4
    python: PathText | None = None  # the build python that runs kt-kernel
    bench: bool = False  # then time kt-kernel's MoE on a full-size layer (build/moebench)
    share: float = 0.5  # the resident share the bench's projection is stated at
    repeats: int = 16  # timed decode forwards of the bench


Options = SelftestOptions

LAYER = 0
# E8M0 bytes of the synthetic layer: scales 2^-8 .. 2^-3 keep the MoE's sums near 1, far
# from bf16 overflow and from the E8M0 0/1 values kt-kernel flushes to zero (fast-math)
EXPONENTS = (119, 125)


def selftest_dir(ctx: StageContext) -> Path:
    return ctx.workspace.root / "selftest"


def fingerprint_inputs(ctx: StageContext) -> dict[str, str]:
    """The built extension (size and mtime) and the child script's bytes."""
    return {"child": hashlib.sha256(CHILD.read_bytes()).hexdigest()[:16],
            **module_fingerprint(ctx)}


# --- the synthetic layer and the reference --------------------------------------------------


def write_layer(recipe: Recipe, test: Selftest, root: Path) -> tuple[Path, Path]:
    """(checkpoint dir, GGUF file) of the synthetic layer, written afresh under ``root``."""
    from dsv4_offload.weights.checkpoint import MoeDims, write_synthetic_checkpoint
    from dsv4_offload.weights.conversion import convert_layer
    from dsv4_offload.weights.gguf_io import LayerLayout

    dims = MoeDims(1, test.experts, test.top_k, test.hidden, test.intermediate)
    if root.exists():
        shutil.rmtree(root)
    source = write_synthetic_checkpoint(root / "checkpoint", dims, seed=test.seed,
                                        layers=[LAYER], exponents=EXPONENTS)
    gguf_dir = root / "gguf"
    gguf_dir.mkdir()
    layout = LayerLayout.for_layer(LAYER, dims, recipe.conversion)
    final = gguf_dir / recipe.conversion.file_name(LAYER)
    convert_layer(source, layout, final)
    return source, final


def source_experts(checkpoint: Path) -> dict[str, np.ndarray]:
    """gate/up [E,I,H] and down [E,H,I] in float32, dequantized from the checkpoint."""
    import numpy as np

    from dsv4_offload.weights import mxfp4
    from dsv4_offload.weights.checkpoint import PROJECTIONS, Checkpoint

    roles = dict(PROJECTIONS)
    out: dict[str, np.ndarray] = {}
    with Checkpoint.open(checkpoint) as ckpt:
        for projection, pairs in ckpt.layer_tensors(LAYER):
            rows, k = ckpt.dims.projection_shape(projection)
            mats = []
            for w_entry, s_entry in pairs:
                with ckpt.mapped(w_entry) as weight, ckpt.mapped(s_entry) as scale:
                    mats.append(mxfp4.dequantize_native(
                        np.array(weight).reshape(rows, k // 2),
                        np.array(scale).reshape(rows, k // mxfp4.BLOCK_ELEMENTS)))
            out[roles[projection]] = np.stack(mats)
    return out


def make_inputs(test: Selftest, tokens: int, seed: int) -> dict[str, np.ndarray]:
    """bf16 activations, distinct top-k expert ids and positive routing weights."""
    import numpy as np

    from dsv4_offload.build.moecheck import to_bf16_bits

    rng = np.random.default_rng([test.seed, seed, tokens])
    x = to_bf16_bits(rng.standard_normal((tokens, test.hidden), dtype=np.float32))
    ids = np.stack([rng.permutation(test.experts)[: test.top_k] for _ in range(tokens)])
    logits = rng.standard_normal((tokens, test.top_k)).astype(np.float32)
    weights = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return {"x": x, "ids": ids.astype(np.int64), "weights": weights.astype(np.float32)}


# --- one run --------------------------------------------------------------------------------


def run_one(ctx: StageContext, tokens: int, index: int, root: Path, gguf: Path,
            experts: dict[str, np.ndarray], built: set[str] | None) -> Verdict:
    from dsv4_offload.build.moecheck import from_bf16_bits, reference_moe

    test = ctx.recipe.selftest
    arrays = make_inputs(test, tokens, index)
    ref = reference_moe(from_bf16_bits(arrays["x"]), arrays["ids"], arrays["weights"],
                        experts["gate"], experts["up"], experts["down"])
    spec = {"gguf": str(gguf), "layer": LAYER, "experts": test.experts, "top_k": test.top_k,
            "hidden": test.hidden, "intermediate": test.intermediate, "tokens": tokens,
            "threads": test.threads, "api": test.api}
    return run_forward(ctx, root / f"run-{index}-{tokens}", spec, arrays, ref,
                       timeout_s=test.timeout_s, min_cosine=test.min_cosine,
                       max_rel_l2=test.max_rel_l2, built=built,
                       log=ctx.log_dir / "selftest.log",
                       python=ctx.options_as(SelftestOptions).python)


# --- the stage ------------------------------------------------------------------------------


def run(ctx: StageContext) -> StageResult:
    test = ctx.recipe.selftest
    where = module_dir(ctx)
    if not extension_files(where):
        return StageResult(Status.FAILED, "kt-kernel is not built", problems=[Problem(
            "error", f"no kt_kernel_ext module in {where}",
            "run `dsv4-offload build kt-kernel` first", "module")], log=str(ctx.log_dir))
    if test.emulator is not None:
        sysroot = ctx.workspace.root / test.emulator.sysroot
        python = sysroot / test.emulator.python
        missing = [str(p) for p in (python,) if not p.exists()]
        if shutil.which(test.emulator.command) is None:
            missing.insert(0, test.emulator.command)
        if missing:
            return StageResult(Status.FAILED, "the emulator is not ready", problems=[Problem(
                "error", f"selftest.emulator: {missing[0]} not found",
                "see `dsv4-offload doctor` for this recipe (qemu-user and the aarch64 sysroot)",
                "emulator")], log=str(ctx.log_dir))
    root = selftest_dir(ctx)
    t0 = time.monotonic()
    with ctx.task("selftest: writing the synthetic MXFP4 layer"):
        checkpoint, gguf = write_layer(ctx.recipe, test, root)
        experts = source_experts(checkpoint)
    built = built_features(ctx)
    verdicts = []
    for index, tokens in enumerate(test.tokens):
        with ctx.task(f"selftest: {tokens} tokens"):
            verdicts.append(run_one(ctx, tokens, index, root, gguf, experts, built))
    seconds = time.monotonic() - t0
    data: dict[str, Any] = {
        "dims": {"experts": test.experts, "hidden": test.hidden,
                 "intermediate": test.intermediate, "top_k": test.top_k},
        "min_cosine": test.min_cosine, "max_rel_l2": test.max_rel_l2,
        "emulator": test.emulator.model_dump() if test.emulator else None,
        "runs": [v.as_dict() for v in verdicts], "seconds": round(seconds, 2),
        "gguf": str(gguf)}
    failed = [v for v in verdicts if not v.ok]
    problems = [Problem("error", v.reason, v.fix, v.regime) for v in failed]
    log = str(ctx.log_dir / "selftest.log")
    if failed:
        return StageResult(Status.FAILED, f"selftest failed: {failed[0].reason}", data=data,
                           problems=problems, log=log)
    figures = "; ".join(v.reason for v in verdicts)
    outputs: dict[str, Any] = {"runs": [
        {k: v.as_dict()[k] for k in ("tokens", "regime", "cosine", "rel_l2")} for v in verdicts]}
    options = ctx.options_as(SelftestOptions)
    if test.real_layer.rehearse or options.real_layer:
        result = _real_layer(ctx, data, outputs, f"selftest passed in {seconds:.1f}s: {figures}")
    else:
        result = StageResult(Status.OK, f"selftest passed in {seconds:.1f}s: {figures}",
                             data=data, outputs=outputs, log=log)
    if options.bench and result.status is Status.OK:  # a wrong kernel's speed means nothing
        return _bench(ctx, result, options)
    return result


def _real_layer(ctx: StageContext, data: dict[str, Any], outputs: dict[str, Any],
                passed: str) -> StageResult:
    """The rehearsal of verify-gguf's level 4: a synthetic converted layer of the real layout
    through kt-kernel (the small layer passed: a kernel that fails it fails this too)."""
    from dsv4_offload.build.layerforward import rehearse

    check = rehearse(ctx, ctx.options_as(SelftestOptions).python)
    data["real_layer"] = check.as_dict()
    dims = check.dims
    what = (f"synthetic layer {check.layer} of the real layout ({dims['experts']} experts, "
            f"{dims['hidden']}x{dims['intermediate']}, experts {check.experts} routed)")
    log = str(ctx.log_dir / "real-layer.log")
    failed = [v for v in check.verdicts if not v.ok]
    if failed:
        problems = [Problem("error", f"{what}: {v.reason}", v.fix, "real-layer") for v in failed]
        return StageResult(Status.FAILED, f"{passed}; but the {what} failed: "
                           f"{failed[0].reason}", data=data, problems=problems, log=log)
    outputs["real_layer"] = [{k: v.as_dict()[k] for k in ("tokens", "cosine", "rel_l2")}
                             for v in check.verdicts]
    return StageResult(Status.OK, f"{passed}; {what} in {check.seconds:.1f}s: "
                       f"{check.figures()}", data=data, outputs=outputs, log=log)


def _bench(ctx: StageContext, passed: StageResult, options: SelftestOptions) -> StageResult:
    """kt-kernel's MoE timed on a full-size synthetic layer with the serve plan's pools, beside
    this host's bandwidth; the figure is cached for accept's ceilings (acceptance/ceilings)."""
    from dsv4_offload.acceptance import ceilings as cl
    from dsv4_offload.build.layerforward import synthetic_layer
    from dsv4_offload.build.moebench import run_bench
    from dsv4_offload.core.clock import now_iso
    from dsv4_offload.core.host import probe_host
    from dsv4_offload.serving import bandwidth
    from dsv4_offload.weights.gguf_io import recipe_dims

    if not 0.0 <= options.share < 1.0:
        raise InputError(f"--share {options.share}: the resident share is a fraction in [0, 1)")
    conv = ctx.recipe.conversion
    dims = replace(recipe_dims(conv), layers=1)  # the real dims: 256 experts, 4096 x 2048
    with ctx.task("bench: the full-size synthetic layer"):
        _, gguf, layer = synthetic_layer(ctx, dims)
    facts = ctx.host_facts or probe_host(ctx.workspace.root, toolchain=False)
    readers = bandwidth.plan_readers(facts, ctx.recipe.serve)
    pools, threads = len(readers), sum(r.threads for r in readers)
    with ctx.task(f"bench: {options.repeats} decode forwards, {pools} pool(s) x "
                  f"{threads // pools} thread(s)"):
        run = run_bench(ctx, gguf, layer, dims.as_dict(), pools, threads,
                        repeats=options.repeats, timeout_s=ctx.recipe.selftest.real_layer.timeout_s,
                        python=options.python)
    passed.data["bench"] = run.as_dict()
    if not run.ok or run.gb_s is None or run.forward_s is None:
        return StageResult(Status.FAILED, f"{passed.summary}; but the bench failed: {run.reason}",
                           data=passed.data, log=run.log, problems=[Problem(
                               "error", f"bench: {run.reason}", f"see the log: {run.log}",
                               "bench")])
    with ctx.task("bench: this host's memory bandwidth (sysbench, cached)"):
        found, how = bandwidth.measured(ctx.workspace.bandwidth_file, readers)
    rehearsal = ctx.recipe.name if "serve" in ctx.recipe.not_applicable else None
    emulated = ctx.recipe.selftest.emulator is not None
    cl.KernelBench(round(run.gb_s, 3), round(run.forward_s, 6), run.expert_bytes, run.top_k,
                   run.experts, pools, threads, rehearsal, ctx.recipe.name, now_iso()
                   ).write(ctx.workspace.bench_file)
    per_token = [cl.bytes_per_token(run.expert_bytes, run.top_k, conv.layers, s)
                 for s in (0.0, options.share)]
    projected = [cl.tok_s(run.gb_s, b) for b in per_token]
    memory = found.total_gb_s if found else None
    lines = [f"kt-kernel MoE, full-size synthetic layer ({run.experts} experts, {dims.hidden}x"
             f"{dims.intermediate}, top-{run.top_k}), {pools} pool(s) x {threads // pools} "
             f"thread(s): median forward {run.forward_s * 1e3:.2f} ms, {run.gb_s:.2f} GB/s read",
             "this host's memory bandwidth: " + (f"{found.shown()}, {how}" if found else
                                                  f"not measured ({how})"),
             (f"kernel / memory: {run.gb_s / memory:.0%}" if memory else
              "kernel / memory: unknown (no bandwidth figure)"),
             f"projected decode, CPU MoE alone, {conv.layers} layers: {projected[0] or 0:.1f} "
             f"tok/s with nothing resident, {projected[1] or 0:.1f} tok/s at resident share "
             f"{options.share:.2f} (`--share`)"]
    if rehearsal:
        lines.append(f"a rehearsal's figure ({rehearsal}"
                     + (", under qemu emulation" if emulated else "")
                     + "): this machine's, not the serving host's")
    passed.data["lines"] = lines
    passed.data["bench"].update(bandwidth_gb_s=memory, projected_tok_s=projected,
                                share=options.share, rehearsal=rehearsal)
    summary = (f"{passed.summary}; bench: {run.gb_s:.2f} GB/s read by kt-kernel"
               + (f" ({run.gb_s / memory:.0%} of this host's {memory:.1f} GB/s)" if memory
                  else " (this host's bandwidth not measured)"))
    return StageResult(Status.OK, summary, data=passed.data, outputs=passed.outputs,
                       log=passed.log)
