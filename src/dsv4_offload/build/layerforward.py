"""The real-layer check (the guide's appendix D): a converted layer through kt-kernel.

One layer file the converter wrote is loaded by the built kt-kernel, whole (every expert,
the real offsets), and a few tokens are run through it in a child process with a timeout;
the output must agree with a numpy reference computed from the *source* safetensors (the
native MXFP4 tensors dequantized), cosine >= ``selftest.real_layer.min_cosine`` (0.9999,
appendix D). Activations go through Q8_0 inside kt-kernel, the only loss.

Cost on the real dims (256 experts, hidden 4096, intermediate 2048, 6 per token): the
tokens are routed to ``experts`` experts spread over the layer, first and last included
(8 by default: the two ends of each tensor and six between); kt-kernel maps the file and
aliases it (one subpool), so only those experts' 8 x 13.4 MB are read, and the reference
dequantizes only those 8 (96 MB each in float32, one at a time). A forward of 16 tokens is
16 x 6 x 25 M multiply-adds.

Where it runs: verify-gguf's level 4 on the target (``level4``), and the selftest stage
of the rehearsals on a synthetic checkpoint of the real layout (``rehearse``).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.build.moerun import built_features, extension_files, module_dir, run_forward
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import Problem
from dsv4_offload.workspace.context import StageContext

if TYPE_CHECKING:
    import numpy as np

    from dsv4_offload.build.moecheck import Verdict
    from dsv4_offload.weights.checkpoint import Checkpoint, MoeDims

# an isolated call needs the synchronous submit, or its output stays zero: the delivery's
# appendix D script sets it (scripts/tools/cpu_moe_reference_check_mxfp4.py:57 at 1a7fbd34);
# kt-kernel reads it in kt-kernel/python/experts_base.py:154 (d7b5b49 + main_repo/0002)
FORCE_SYNC = {"KT_FORCE_SYNC_SUBMIT": "1"}
# E8M0 bytes of the rehearsal's synthetic layer: as the selftest's, the MoE's sums stay in
# bf16's range and away from the E8M0 0/1 values kt-kernel flushes to zero
EXPONENTS = (119, 125)
MADE = "made.json"


def work_dir(ctx: StageContext) -> Path:
    return ctx.workspace.root / "real-layer"  # not under selftest/, which selftest rewrites


# --- inputs and reference -------------------------------------------------------------------


def pick_experts(total: int, count: int) -> list[int]:
    """``count`` experts evenly spread over ``0..total-1``, the first and last included."""
    count = max(1, min(count, total))
    if count == 1:
        return [0]
    return sorted({round(i * (total - 1) / (count - 1)) for i in range(count)})


def routed_inputs(hidden: int, chosen: list[int], top_k: int, tokens: int, seed: int
                  ) -> dict[str, np.ndarray]:
    """bf16 activations, top-k distinct experts of ``chosen`` per token, softmax weights.

    Token t takes chosen[(t*k + j) % n] for j < k, shuffled: distinct within a token, and
    every chosen expert is used once tokens x k reaches n.
    """
    import numpy as np

    from dsv4_offload.build.moecheck import to_bf16_bits

    rng = np.random.default_rng([seed, tokens])
    n = len(chosen)
    k = min(top_k, n)
    x = to_bf16_bits(rng.standard_normal((tokens, hidden), dtype=np.float32))
    ids = np.array([rng.permutation([chosen[(t * k + j) % n] for j in range(k)])
                    for t in range(tokens)], dtype=np.int64)
    logits = rng.standard_normal((tokens, k)).astype(np.float32)
    weights = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return {"x": x, "ids": ids, "weights": weights.astype(np.float32)}


def dequantized_expert(ckpt: Checkpoint, layer: int, expert: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """gate [I,H], up [I,H], down [H,I] of one expert, float32, from the source tensors."""
    import numpy as np

    from dsv4_offload.weights import mxfp4

    out = []
    for projection in ("w1", "w3", "w2"):
        rows, k = ckpt.dims.projection_shape(projection)
        w_entry = ckpt.expert_tensor(layer, expert, projection, "weight")
        s_entry = ckpt.expert_tensor(layer, expert, projection, "scale")
        with ckpt.mapped(w_entry) as weight, ckpt.mapped(s_entry) as scale:
            out.append(mxfp4.dequantize_native(
                np.array(weight).reshape(rows, k // 2),
                np.array(scale).reshape(rows, k // mxfp4.BLOCK_ELEMENTS)))
    return out[0], out[1], out[2]


def references(ckpt: Checkpoint, layer: int, runs: list[dict[str, np.ndarray]]
               ) -> list[np.ndarray]:
    """The float32 MoE output of each run, one routed expert dequantized at a time."""
    import numpy as np

    from dsv4_offload.build.moecheck import from_bf16_bits

    xs = [from_bf16_bits(r["x"]) for r in runs]
    outs = [np.zeros_like(x) for x in xs]
    for expert in sorted({int(e) for r in runs for e in r["ids"].ravel()}):
        gate, up, down = dequantized_expert(ckpt, layer, expert)
        for run, x, out in zip(runs, xs, outs, strict=True):
            rows, cols = np.nonzero(run["ids"] == expert)
            if not rows.size:
                continue
            g, u = x[rows] @ gate.T, x[rows] @ up.T
            act = g / (1.0 + np.exp(-g)) * u  # silu(gate) * up
            np.add.at(out, rows, run["weights"][rows, cols][:, None] * (act @ down.T))
    return outs


# --- one check ------------------------------------------------------------------------------


@dataclass
class LayerCheck:
    layer: int
    gguf: Path
    source: Path
    dims: dict[str, int]
    experts: list[int]
    verdicts: list[Verdict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    def figures(self) -> str:
        return "; ".join(v.reason for v in self.verdicts)

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "gguf": str(self.gguf), "source": str(self.source),
                "dims": self.dims, "experts": self.experts, "seconds": round(self.seconds, 2),
                "runs": [v.as_dict() for v in self.verdicts]}


def check_layer(ctx: StageContext, gguf: Path, source: Path, layer: int,
                python: str | None = None) -> LayerCheck:
    """Run ``gguf`` (layer ``layer``) through kt-kernel against ``source``; one child per
    entry of ``selftest.real_layer.tokens`` (``python``: the stage's --python)."""
    from dsv4_offload.weights.checkpoint import Checkpoint

    cfg = ctx.recipe.selftest.real_layer
    t0 = time.monotonic()
    with Checkpoint.open(source) as ckpt:
        dims = ckpt.dims
        chosen = pick_experts(dims.experts, max(cfg.experts, dims.experts_per_token))
        check = LayerCheck(layer, gguf, source, dims.as_dict(), chosen)
        runs = [routed_inputs(dims.hidden, chosen, dims.experts_per_token, tokens, cfg.seed)
                for tokens in cfg.tokens]
        with ctx.task(f"real layer {layer}: the numpy reference ({len(chosen)} experts)"):
            refs = references(ckpt, layer, runs)
    built = built_features(ctx)
    work = work_dir(ctx) / f"layer{layer}"
    for tokens, arrays, ref in zip(cfg.tokens, runs, refs, strict=True):
        spec = {"gguf": str(gguf), "layer": layer, "experts": dims.experts,
                "top_k": int(arrays["ids"].shape[1]), "hidden": dims.hidden,
                "intermediate": dims.intermediate, "tokens": tokens, "threads": cfg.threads,
                "api": ctx.recipe.selftest.api}
        with ctx.task(f"real layer {layer}: {tokens} tokens through kt-kernel"):
            check.verdicts.append(run_forward(
                ctx, work / f"run-{tokens}", spec, arrays, ref, timeout_s=cfg.timeout_s,
                min_cosine=cfg.min_cosine, max_rel_l2=cfg.max_rel_l2, built=built,
                log=ctx.log_dir / "real-layer.log", env=FORCE_SYNC, python=python))
    check.seconds = time.monotonic() - t0
    return check


# --- verify-gguf level 4 --------------------------------------------------------------------


def level4(ctx: StageContext, paths: dict[int, Path], source: Path | None, *,
           kernel: bool = True, python: str | None = None
           ) -> tuple[str, list[Problem], dict[str, Any]]:
    """(level verdict, problems, data) of the check on one of the verified layer files;
    ``kernel`` false (--no-kernel) turns it off."""
    cfg = ctx.recipe.selftest.real_layer
    if not cfg.enabled or not kernel:
        # the user's choice, shown as "L4 off" in the summary
        why = "--no-kernel" if cfg.enabled else "selftest.real_layer.enabled: false"
        return "off", [], {"kernel_check": {"off": why}}
    if source is None:
        return "skipped", [Problem(
            "warning", "level 4: no source checkpoint to compute the reference from; the "
            "layer was not run through kt-kernel", "pass --source DIR (the native MXFP4 "
            "checkpoint)", "level4")], {}
    try:
        where = module_dir(ctx)
    except InputError as exc:
        return "skipped", [Problem("warning", f"level 4: {exc}", "", "level4")], {}
    if not extension_files(where):
        return "skipped", [Problem(
            "warning", f"level 4: kt-kernel is not built in this workspace (no kt_kernel_ext "
            f"in {where}); no converted layer went through it", "run `dsv4-offload build "
            "kt-kernel`; verify-gguf then runs again (the module is part of its "
            "fingerprint)", "level4")], {}
    layers = sorted(paths)
    layer = cfg.layer if cfg.layer in paths else layers[len(layers) // 2]
    check = check_layer(ctx, paths[layer], source, layer, python)
    problems = [Problem("error", f"level 4: layer {layer} through kt-kernel: {v.reason}",
                        v.fix, "level4") for v in check.verdicts if not v.ok]
    return ("ok" if check.ok else "failed"), problems, {"kernel_check": check.as_dict()}


# --- the rehearsals: a synthetic layer of the real layout -------------------------------------


def synthetic_dims(ctx: StageContext) -> MoeDims:
    from dsv4_offload.weights.checkpoint import MoeDims
    from dsv4_offload.weights.gguf_io import recipe_dims

    if ctx.recipe.selftest.real_layer.synthetic_dims == "conversion":
        return recipe_dims(ctx.recipe.conversion)
    test = ctx.recipe.selftest
    return MoeDims(1, test.experts, test.top_k, test.hidden, test.intermediate)


def synthetic_layer(ctx: StageContext, dims: MoeDims | None = None) -> tuple[Path, Path, int]:
    """(checkpoint, GGUF file, layer) of a synthetic layer in the real layout, converted
    (``dims``: these instead of ``selftest.real_layer.synthetic_dims``'s).

    Written once per (dims, seed, layer) under ``real-layer/synthetic`` (a real
    layer is ~3.2 GB of source and as much of GGUF, ~20 s): a tmp directory renamed into
    place when both are whole, so an interrupted write is never reused.
    """
    from dsv4_offload.weights.checkpoint import write_synthetic_checkpoint
    from dsv4_offload.weights.conversion import convert_layer
    from dsv4_offload.weights.gguf_io import LayerLayout

    cfg, conv = ctx.recipe.selftest.real_layer, ctx.recipe.conversion
    dims = dims or synthetic_dims(ctx)
    layer = cfg.layer if cfg.layer < dims.layers else dims.layers // 2
    root = work_dir(ctx) / "synthetic"
    made = {"dims": dims.as_dict(), "seed": cfg.seed, "layer": layer,
            "exponents": list(EXPONENTS), "file": conv.file_name(layer)}
    checkpoint, gguf = root / "checkpoint", root / "gguf" / conv.file_name(layer)
    try:
        if json.loads((root / MADE).read_text(encoding="utf-8")) == made and gguf.is_file():
            return checkpoint, gguf, layer
    except (OSError, ValueError):
        pass
    tmp = root.with_name(root.name + ".tmp")
    for stale in (tmp, root):
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir(parents=True)
    with ctx.task(f"real layer: writing a synthetic layer {layer} of the real layout"):
        write_synthetic_checkpoint(tmp / "checkpoint", dims, seed=cfg.seed, layers=[layer],
                                   exponents=EXPONENTS)
        (tmp / "gguf").mkdir()
        convert_layer(tmp / "checkpoint", LayerLayout.for_layer(layer, dims, conv),
                      tmp / "gguf" / conv.file_name(layer))
    (tmp / MADE).write_text(json.dumps(made, indent=1) + "\n", encoding="utf-8")
    tmp.rename(root)
    return checkpoint, gguf, layer


def rehearse(ctx: StageContext, python: str | None = None) -> LayerCheck:
    """The check on a synthetic converted layer (the rehearsals have no weights)."""
    checkpoint, gguf, layer = synthetic_layer(ctx)
    return check_layer(ctx, gguf, checkpoint, layer, python)
