"""`selftest --bench`: what kt-kernel's MoE reads per second on this host, in a child.

A full-size synthetic layer (the real layout and dims, ``build/layerforward``) is loaded by the
built kt-kernel with the serve plan's pools (subpool i on NUMA node i, equal threads), then
decode forwards of one token are timed, each routed to ``top_k`` distinct experts drawn at
random so that each forward reads its experts from memory, not from a cache. Bytes read per
forward are the routed experts' (gate, up and down in MXFP4); over the median forward they
give the kernel's rate. The low-level API is used everywhere (no torch needed), as the
rehearsals' selftest does.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_offload.build.moerun import child_argv
from dsv4_offload.workspace.context import StageContext

WARMUP = 2  # forwards not timed: the first ones fault the pages of the pools in
SEED = 7


def expert_bytes(hidden: int, intermediate: int) -> int:
    """One expert's gate, up and down in MXFP4 (17-byte blocks of 32 elements)."""
    from dsv4_offload.weights.mxfp4 import BLOCK_BYTES, BLOCK_ELEMENTS

    return 3 * hidden * intermediate // BLOCK_ELEMENTS * BLOCK_BYTES


@dataclass
class BenchRun:
    """The timed forwards of one bench, or why there are none."""

    experts: int
    top_k: int
    expert_bytes: int
    pools: int
    threads: int
    seconds: list[float] = field(default_factory=list)
    reason: str = ""  # why it failed; empty when it ran
    log: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason and bool(self.seconds)

    @property
    def forward_s(self) -> float | None:
        return statistics.median(self.seconds) if self.seconds else None

    @property
    def gb_s(self) -> float | None:
        """Bytes of the routed experts over the median forward, in GB/s (10^9 bytes)."""
        median = self.forward_s
        if not median:
            return None
        return self.expert_bytes * self.top_k / median / 1e9

    def as_dict(self) -> dict[str, Any]:
        return {"experts": self.experts, "top_k": self.top_k, "expert_bytes": self.expert_bytes,
                "pools": self.pools, "threads": self.threads,
                "seconds": [round(s, 6) for s in self.seconds],
                "forward_s": self.forward_s, "gb_s": None if self.gb_s is None
                else round(self.gb_s, 3), "reason": self.reason, "log": self.log}


def run_bench(ctx: StageContext, gguf: Path, layer: int, dims: dict[str, int], pools: int,
              threads: int, *, repeats: int, timeout_s: float, python: str | None = None
              ) -> BenchRun:
    """Time ``repeats`` decode forwards of ``gguf``'s layer ``layer`` through kt-kernel with
    ``pools`` subpools sharing ``threads`` threads, in a child with a timeout."""
    from dsv4_offload.core.runner import run_command

    per_pool = max(1, threads // max(1, pools))
    run = BenchRun(dims["experts"], dims["experts_per_token"],
                   expert_bytes(dims["hidden"], dims["intermediate"]), pools, per_pool * pools)
    work = ctx.workspace.root / "bench"
    work.mkdir(parents=True, exist_ok=True)
    out = work / "bench-out.json"
    out.unlink(missing_ok=True)  # a result of an earlier run is no result of this one
    spec = {"gguf": str(gguf), "layer": layer, "experts": dims["experts"],
            "top_k": dims["experts_per_token"], "hidden": dims["hidden"],
            "intermediate": dims["intermediate"], "tokens": 1, "threads": per_pool,
            "api": "low-level", "out": str(out),
            "bench": {"pools": pools, "threads_per_pool": per_pool, "repeats": repeats,
                      "warmup": WARMUP, "seed": SEED}}
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec, indent=1), encoding="utf-8")
    argv, env = child_argv(ctx, spec_file, python)
    log = ctx.log_dir / "bench.log"
    run.log = str(log)
    result = run_command(argv, log=log, cwd=work, env=env, timeout=timeout_s, check=False)
    if result.returncode != 0:
        last = (result.tail or [f"exit {result.returncode}"])[-1]
        run.reason = (f"kt-kernel's bench child ended with exit {result.returncode} "
                      f"(timeout {timeout_s:.0f}s): {last}")
        return run
    try:
        doc = json.loads(out.read_text(encoding="utf-8"))
        run.seconds = [float(s) for s in doc["seconds"]]
    except (OSError, ValueError, KeyError, TypeError):
        run.reason = f"the bench child wrote no result to {out}"
        return run
    if not doc.get("output_nonzero"):
        # the delivered x86 code's forward_many returns zeros in no time: no figure at all
        run.reason = "the forwards left their output all zeros: the kernel did no work"
    return run
