"""One kt-kernel MoE forward in a child process, judged against a numpy reference.

What the `selftest` stage and the real-layer check (verify-gguf level 4, `build/layerforward`)
share: where the built ``kt_kernel_ext`` is, the child's command line (the build python, or
an emulated one), and one run: write the inputs and the spec, start ``selftest_child.py``
with a timeout through the runner, read its output back and judge it (``moecheck.judge``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.build import bringup
from dsv4_offload.core.errors import InputError
from dsv4_offload.workspace.context import StageContext

if TYPE_CHECKING:
    import numpy as np

    from dsv4_offload.build.moecheck import Verdict

CHILD = Path(__file__).resolve().parent / "selftest_child.py"
KT_PYTHON_DIR = "python"  # kt-kernel/python: kt_kernel_ext*.so of an in-place build


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


def module_fingerprint(ctx: StageContext) -> dict[str, str]:
    """Size and mtime of each built extension file (``module: missing`` when none is)."""
    try:
        found = extension_files(module_dir(ctx))
    except InputError:
        found = []
    out = {}
    for path in found:
        st = path.stat()
        out[f"module.{path.name}"] = f"{st.st_size}:{st.st_mtime_ns}"
    if not found:
        out["module"] = "missing"
    return out


def child_argv(ctx: StageContext, spec_file: Path, python: str | None = None
               ) -> tuple[list[str], dict[str, str]]:
    """The child's command line and environment: native build python (``python``: the
    stage's --python), or emulated."""
    from dsv4_offload.build.interpreter import build_python

    test = ctx.recipe.selftest
    env = dict(os.environ)
    # the module's dir (`import kt_kernel_ext`), then its parent, where the build links
    # `kt_kernel -> python` (`from kt_kernel import KTMoEWrapper`)
    paths = [str(module_dir(ctx)), str(module_dir(ctx).parent)]
    emu = test.emulator
    if emu is None:
        argv = [build_python(ctx, python), str(CHILD), str(spec_file)]
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


def run_forward(ctx: StageContext, work: Path, spec: dict[str, Any],
                arrays: dict[str, np.ndarray], ref: np.ndarray, *, timeout_s: float,
                min_cosine: float, max_rel_l2: float, built: set[str] | None, log: Path,
                env: dict[str, str] | None = None, python: str | None = None) -> Verdict:
    """One forward of ``spec`` (gguf, layer, dims, tokens, threads, api) in a child, judged.

    ``arrays`` are the inputs (x as bf16 bits, ids, weights); ``ref`` the float32 reference
    [tokens, hidden]. ``env`` adds variables to the child's environment; ``python`` is the
    stage's --python.
    """
    import numpy as np

    from dsv4_offload.build.moecheck import RunFacts, from_bf16_bits, judge
    from dsv4_offload.core.runner import run_command

    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, value in arrays.items():
        files[name] = str(work / f"{name}.npy")
        np.save(files[name], value)
    out_file = work / "out.npy"
    out_file.unlink(missing_ok=True)  # a result of an earlier run is no result of this one
    spec = {**spec, "arrays": files, "out": str(out_file)}
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec, indent=1), encoding="utf-8")
    argv, child_env = child_argv(ctx, spec_file, python)
    child_env.update(env or {})
    t0 = time.monotonic()
    result = run_command(argv, log=log, cwd=work, env=child_env, timeout=timeout_s, check=False)
    seconds = time.monotonic() - t0
    timed_out = seconds >= timeout_s and result.returncode != 0
    tokens, hidden = int(spec["tokens"]), int(spec["hidden"])
    out = None
    if out_file.is_file():
        out = from_bf16_bits(np.load(out_file))
        if out.size == tokens * hidden:  # else the judge names the wrong shape
            out = out.reshape(tokens, hidden)
    facts = RunFacts(tokens, None if timed_out else result.returncode, result.tail, timeout_s,
                     seconds, out, built)
    return judge(facts, min_cosine, max_rel_l2, ref)
