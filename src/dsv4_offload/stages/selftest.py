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
import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.build import bringup
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.workspace.context import StageContext

if TYPE_CHECKING:
    import numpy as np

    from dsv4_offload.build.moecheck import Verdict
    from dsv4_offload.recipe import Recipe, Selftest

CHILD = Path(__file__).resolve().parent.parent / "build" / "selftest_child.py"
LAYER = 0
# E8M0 bytes of the synthetic layer: scales 2^-8 .. 2^-3 keep the MoE's sums near 1, far
# from bf16 overflow and from the E8M0 0/1 values kt-kernel flushes to zero (fast-math)
EXPONENTS = (119, 125)
KT_PYTHON_DIR = "python"  # kt-kernel/python: kt_kernel_ext*.so of an in-place build


# --- where things are -----------------------------------------------------------------------


def selftest_dir(ctx: StageContext) -> Path:
    return ctx.workspace.root / "selftest"


def module_dir(ctx: StageContext) -> Path:
    """Where ``kt_kernel_ext*.so`` is: ``selftest.module_dir``, else kt-kernel's python dir
    (the in-place build's)."""
    from dsv4_offload.build.bringup import KT_KERNEL_STEP

    if ctx.recipe.selftest.module_dir is not None:
        return ctx.workspace.root / ctx.recipe.selftest.module_dir
    step = next((s for s in ctx.recipe.build.steps if s.name == KT_KERNEL_STEP), None)
    if step is None:
        raise InputError(f"recipe '{ctx.recipe.name}' has no build step '{KT_KERNEL_STEP}'; "
                         "selftest runs the kt-kernel it builds")
    return bringup.step_workdir(ctx.workspace, step) / KT_PYTHON_DIR


def extension_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("kt_kernel_ext*") if p.suffix in (".so", ".py"))


def child_argv(ctx: StageContext, spec_file: Path) -> tuple[list[str], dict[str, str]]:
    """The child's command line and environment: native build python, or emulated."""
    from dsv4_offload.build.interpreter import build_python

    test = ctx.recipe.selftest
    env = dict(os.environ)
    # the module's dir (`import kt_kernel_ext`), then its parent, where the build links
    # `kt_kernel -> python` (`from kt_kernel import KTMoEWrapper`)
    paths = [str(module_dir(ctx)), str(module_dir(ctx).parent)]
    emu = test.emulator
    if emu is None:
        argv = [build_python(ctx), str(CHILD), str(spec_file)]
    else:
        sysroot = ctx.workspace.root / emu.sysroot
        paths += [p if os.path.isabs(p) else str(ctx.workspace.root / p) for p in emu.pythonpath]
        argv = [emu.command, "-cpu", emu.cpu, "-L", str(sysroot), str(sysroot / emu.python),
                str(CHILD), str(spec_file)]
        # a binfmt-registered qemu reads these for any aarch64 program the child starts
        env["QEMU_CPU"] = emu.cpu
        env["QEMU_LD_PREFIX"] = str(sysroot)
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return argv, env


# --- fingerprint ----------------------------------------------------------------------------


def fingerprint_inputs(ctx: StageContext) -> dict[str, str]:
    """The built extension (size and mtime) and the child script's bytes."""
    out = {"child": hashlib.sha256(CHILD.read_bytes()).hexdigest()[:16]}
    try:
        found = extension_files(module_dir(ctx))
    except InputError:
        found = []
    for path in found:
        st = path.stat()
        out[f"module.{path.name}"] = f"{st.st_size}:{st.st_mtime_ns}"
    if not found:
        out["module"] = "missing"
    return out


# --- the synthetic layer and the reference --------------------------------------------------


def write_layer(recipe: Recipe, test: Selftest, root: Path) -> tuple[Path, Path]:
    """(checkpoint dir, GGUF file) of the synthetic layer, written afresh under ``root``."""
    from dsv4_offload.weights.checkpoint import MoeDims, write_synthetic_checkpoint
    from dsv4_offload.weights.convert import convert_layer
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


def built_features(ctx: StageContext) -> set[str] | None:
    """The build's ``-march`` extensions: its configure line, else the step's ARM switches."""
    from dsv4_offload.build.bringup import KT_KERNEL_STEP
    from dsv4_offload.build.moecheck import march_features

    log = ctx.workspace.log_dir("build") / f"{KT_KERNEL_STEP}.log"
    if log.is_file():
        found = march_features(log.read_text(encoding="utf-8", errors="replace"))
        if found is not None:
            return found
    step = next((s for s in ctx.recipe.build.steps if s.name == KT_KERNEL_STEP), None)
    if step is None:
        return None
    text = " ".join([*step.command, *(f"{k}={v}" for k, v in step.env.items())])
    on = {name.lower() for name in ("SVE", "BF16", "I8MM", "DOTPROD")
          if f"ARM_{name}=ON" in text or f"ARM_{name}=1" in text}
    return on or None


def run_one(ctx: StageContext, tokens: int, index: int, root: Path, gguf: Path,
            experts: dict[str, np.ndarray], built: set[str] | None) -> Verdict:
    import numpy as np

    from dsv4_offload.build.moecheck import RunFacts, from_bf16_bits, judge, reference_moe
    from dsv4_offload.core.runner import run_command

    test = ctx.recipe.selftest
    work = root / f"run-{index}-{tokens}"
    work.mkdir(parents=True, exist_ok=True)
    arrays = make_inputs(test, tokens, index)
    files = {}
    for name, value in arrays.items():
        files[name] = str(work / f"{name}.npy")
        np.save(files[name], value)
    out_file = work / "out.npy"
    spec = {"gguf": str(gguf), "layer": LAYER, "experts": test.experts, "top_k": test.top_k,
            "hidden": test.hidden, "intermediate": test.intermediate, "tokens": tokens,
            "threads": test.threads, "api": test.api, "arrays": files, "out": str(out_file)}
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec, indent=1), encoding="utf-8")
    argv, env = child_argv(ctx, spec_file)
    log = ctx.log_dir / "selftest.log"
    t0 = time.monotonic()
    result = run_command(argv, log=log, cwd=work, env=env, timeout=test.timeout_s, check=False)
    seconds = time.monotonic() - t0
    timed_out = seconds >= test.timeout_s and result.returncode != 0
    out = None
    if out_file.is_file():
        out = from_bf16_bits(np.load(out_file)).reshape(tokens, test.hidden)
    x = from_bf16_bits(arrays["x"])
    ref = reference_moe(x, arrays["ids"], arrays["weights"], experts["gate"], experts["up"],
                        experts["down"])
    facts = RunFacts(tokens, None if timed_out else result.returncode, result.tail,
                     test.timeout_s, seconds, out, built)
    return judge(facts, test.min_cosine, test.max_rel_l2, ref)


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
    outputs = {"runs": [{k: v.as_dict()[k] for k in ("tokens", "regime", "cosine", "rel_l2")}
                        for v in verdicts]}
    return StageResult(Status.OK, f"selftest passed in {seconds:.1f}s: {figures}", data=data,
                       outputs=outputs, log=log)
