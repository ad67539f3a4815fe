"""Where the measured decode stands between its two ceilings: the CPU MoE kernel's and the
memory's.

Per decoded token each of the ``layers`` MoE layers routes to ``top_k`` experts; the resident
experts on the NPU take ``share`` of those activations, the CPU reads the rest from DRAM.
So the CPU reads ``expert_bytes x top_k x layers x (1 - share)`` bytes per token, and

- the memory roofline is the host's measured bandwidth (serving/bandwidth) over those bytes;
- the kernel's projection is what kt-kernel's MoE achieved on this host (`selftest --bench`,
  bytes of the routed experts read per second of forward) over the same bytes.

Both count only the CPU's part: attention, the dense layers and the resident experts on the
NPU, and the hand-overs between the two, come on top. A figure that is missing (no bench run
yet, no bandwidth measured, no share in the server's log) is said as such, never zero.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.workspace.store import atomic_write_json, read_json

if TYPE_CHECKING:
    from dsv4_offload.recipe import Conversion, Recipe
    from dsv4_offload.workspace.store import Workspace

# delivery sglang/0003 (hicann/cann-recipes-infer 1a7fbd34, integration/sglang/
# dsv4-flash-single-npu-moe-offload/sglang/0003-sglang-streaming-prefill-depool.patch
# lines 997-998, kt_stream_prefill.py:991): print(f"[KT_STREAM] inline resident: top-{K}
# x {n} layers folded into prefill, share={share_sum / max(n, 1):.3f}"); and lines 1070-1072
# (_apply_dynamic_residency): "[KT_STREAM] dynamic resident applied: top-%d x %d layers in
# %.1fs, prefill top-K activation share=%.3f". The last one printed is the one in force.
SHARE = re.compile(r"\[KT_STREAM\] (?:inline resident: top-(\d+) x \d+ layers folded into "
                   r"prefill, share=|dynamic resident applied: top-(\d+) x \d+ layers in "
                   r"[0-9.]+s, prefill top-K activation share=)([0-9.]+)")
BENCH_SCHEMA = 1
# below this share of its ceiling, the rest of the time most likely goes elsewhere
NEAR = 0.8


def server_share(log_text: str | None) -> tuple[float | None, int | None]:
    """(share, resident top-K) of the last residency line the server printed, or Nones."""
    found = None
    for found in SHARE.finditer(log_text or ""):  # noqa: B007 - the last one counts
        pass
    if found is None:
        return None, None
    top = found.group(1) or found.group(2)
    return float(found.group(3)), int(top)


def expert_bytes(gguf_bytes: int, layers: int, experts: int) -> float:
    """Bytes of one expert (gate, up and down) from the GGUF set's size: the set is
    ``layers x experts`` experts (its headers are noise: a few KiB per ~3.4 GB layer)."""
    return gguf_bytes / (layers * experts)


def bytes_per_token(per_expert: float, top_k: int, layers: int, share: float) -> float:
    """What the CPU reads per decoded token: the routed experts not resident on the NPU."""
    return per_expert * top_k * layers * (1.0 - min(max(share, 0.0), 1.0))


def tok_s(gb_s: float | None, per_token: float) -> float | None:
    """Tokens per second a reader of ``gb_s`` GB/s allows at ``per_token`` bytes each."""
    if gb_s is None or per_token <= 0:
        return None
    return gb_s * 1e9 / per_token


@dataclass(frozen=True)
class KernelBench:
    """What `selftest --bench` measured: kt-kernel's MoE on a full-size synthetic layer."""

    gb_s: float  # bytes of the routed experts read per second of forward
    forward_s: float  # median seconds of one decode forward (one token, top_k experts)
    expert_bytes: int
    top_k: int
    experts: int
    pools: int
    threads: int
    rehearsal: str | None  # the rehearsal recipe it ran in: a figure of that machine
    recipe: str
    when: str

    def as_dict(self) -> dict[str, Any]:
        return {"schema": BENCH_SCHEMA, **asdict(self)}

    @classmethod
    def read(cls, path: Path) -> KernelBench | None:
        doc = read_json(path, None)
        if not isinstance(doc, dict) or doc.get("schema") != BENCH_SCHEMA:
            return None
        try:
            return cls(**{k: v for k, v in doc.items() if k != "schema"})
        except TypeError:
            return None

    def write(self, path: Path) -> None:
        atomic_write_json(path, self.as_dict())


@dataclass(frozen=True)
class Ceilings:
    """The measured decode between the kernel's projection and the memory roofline."""

    measured_tok_s: float | None
    share: float | None
    per_token_bytes: float | None
    kernel_tok_s: float | None
    roofline_tok_s: float | None
    missing: tuple[str, ...]

    def fraction(self, ceiling: float | None) -> float | None:
        if self.measured_tok_s is None or not ceiling:
            return None
        return self.measured_tok_s / ceiling

    def lines(self) -> list[str]:
        """What the report says: the three figures, the fractions, where the rest goes."""
        def fig(value: float | None, ceiling: float | None = None) -> str:
            if value is None:
                return "unknown"
            frac = self.fraction(ceiling) if ceiling is not None else None
            return f"{value:.1f} tok/s" + (f" (measured = {frac:.0%} of it)" if frac else "")

        share = "unknown" if self.share is None else f"{self.share:.3f}"
        out = [f"measured decode: {fig(self.measured_tok_s)}",
               f"CPU kernel's projection at resident share {share}: "
               f"{fig(self.kernel_tok_s, self.kernel_tok_s)}",
               f"memory roofline at resident share {share}: "
               f"{fig(self.roofline_tok_s, self.roofline_tok_s)}"]
        out += [f"not known: {m}" for m in self.missing]
        out.append(self.where_the_rest_goes())
        return out

    def short(self) -> str:
        """The summary's phrase: the fraction of each ceiling, or what is missing."""
        parts = []
        for name, ceiling in (("kernel's projection", self.kernel_tok_s),
                              ("memory roofline", self.roofline_tok_s)):
            frac = self.fraction(ceiling)
            parts.append(f"{frac:.0%} of the {name} ({ceiling:.1f})" if frac and ceiling
                         else f"{name} unknown")
        return "; ".join(parts)

    def where_the_rest_goes(self) -> str:
        """One line: the most likely place of the time between the measure and its ceilings."""
        kernel, memory = self.fraction(self.kernel_tok_s), self.fraction(self.roofline_tok_s)
        if kernel is None and memory is None:
            return "where the time goes: not known without the ceilings"
        if kernel is not None and kernel < NEAR:
            return ("the rest of the time is outside the CPU MoE: the NPU's attention and "
                    "dense layers, CPU<->NPU hand-overs that do not overlap, the scheduler")
        if (kernel is not None and self.kernel_tok_s and self.roofline_tok_s
                and self.kernel_tok_s < NEAR * self.roofline_tok_s):
            return ("decode runs at the CPU kernel's pace and the kernel reads below the "
                    "memory's bandwidth: threads per pool, one pool per NUMA node, NUMA "
                    "binding (see the guide), or more hot experts on the NPU")
        return ("decode is near the memory roofline: only fewer bytes per token help (more "
                "resident experts on the NPU, a higher resident share)")

    def as_dict(self) -> dict[str, Any]:
        return {"measured_tok_s": self.measured_tok_s, "share": self.share,
                "bytes_per_token": self.per_token_bytes, "kernel_tok_s": _r(self.kernel_tok_s),
                "roofline_tok_s": _r(self.roofline_tok_s),
                "kernel_fraction": _r(self.fraction(self.kernel_tok_s), 3),
                "roofline_fraction": _r(self.fraction(self.roofline_tok_s), 3),
                "missing": list(self.missing), "where": self.where_the_rest_goes()}


def _r(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def place(measured: float | None, share: float | None, per_expert: float | None, top_k: int,
          layers: int, bandwidth_gb_s: float | None, kernel: KernelBench | None) -> Ceilings:
    """The ceilings of a measured decode; each missing input named in ``missing``."""
    missing = []
    if measured is None:
        missing.append("the measured decode (no throughput bucket ran)")
    if share is None:
        missing.append("the resident share (no '[KT_STREAM] inline resident ... share=' line "
                       "in the server's log)")
    if bandwidth_gb_s is None:
        missing.append("this host's bandwidth: run `dsv4-offload doctor` (with sysbench)")
    if kernel is None:
        missing.append("the kernel's rate: run `dsv4-offload selftest --bench`")
    if per_expert is None or share is None:
        return Ceilings(measured, share, None, None, None, tuple(missing))
    per_token = bytes_per_token(per_expert, top_k, layers, share)
    return Ceilings(measured, share, per_token, tok_s(kernel.gb_s if kernel else None, per_token),
                    tok_s(bandwidth_gb_s, per_token), tuple(missing))


def gguf_set_bytes(gguf_dir: Path, conversion: Conversion) -> tuple[int, str]:
    """(bytes of the GGUF set, where the figure comes from): the converted files when every
    layer is there, else the recipe's exact size of one layer file times the layers (an
    empty file is no converted layer: it would make the bytes per token 0)."""
    sizes = []
    for layer in range(conversion.layers):
        try:
            sizes.append((gguf_dir / conversion.file_name(layer)).stat().st_size)
        except OSError:
            break
    if len(sizes) == conversion.layers and all(sizes):
        return sum(sizes), f"the GGUF set in {gguf_dir}"
    return (conversion.expected_file_bytes * conversion.layers,
            "conversion.expected_file_bytes x conversion.layers")


def for_accept(workspace: Workspace, recipe: Recipe, measured: float | None,
               log_path: Path | None) -> Ceilings:
    """accept's ceilings: the share its server printed, the cached bandwidth and bench."""
    from dsv4_offload.serving.bandwidth import cached

    conv = recipe.conversion
    text = None
    if log_path is not None:
        try:
            text = log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = None
    share, _ = server_share(text)
    total, _ = gguf_set_bytes(workspace.gguf_dir(recipe), conv)
    found = cached(workspace.bandwidth_file)
    kernel = KernelBench.read(workspace.bench_file)
    if kernel is not None and kernel.rehearsal and kernel.rehearsal != recipe.name:
        kernel = None  # a rehearsal's machine is not this server's host
    return place(measured, share, expert_bytes(total, conv.layers, conv.experts),
                 conv.experts_per_token, conv.layers, found.total_gb_s if found else None,
                 kernel)
