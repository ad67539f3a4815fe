"""The selftest's numbers and verdicts: a numpy MoE reference and the judgement of one run.

The reference dequantizes the checkpoint's own MXFP4 tensors (``mxfp4.dequantize_native``)
and computes ``sum_k w_k * down_e(silu(gate_e x) * up_e x)`` in float32 on the bf16 input.
kt-kernel quantizes activations to Q8_0 (MXFP4's vec_dot_type), so ~1-1.5 % relative L2 is
normal and the cosine stays >= 0.9999. The judge turns a child's exit (signal, timeout,
output) into one verdict with a one-line reason and fix; pure functions, no I/O.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

GROUP_MIN_LEN = 10  # kt-kernel: qlen < group_min_len -> forward_one (utils/llamafile.py)
UNSUPPORTED = "llamafile not supported"  # moe.hpp forward_one's throw (delivery 0002)

# arm64 uapi <asm/hwcap.h>: AT_HWCAP and AT_HWCAP2 bits
HWCAP_BITS = {"asimd": (1, 1), "asimdhp": (1, 10), "asimddp": (1, 20), "sve": (1, 22),
              "i8mm": (2, 13), "bf16": (2, 14)}
# -march feature -> the hwcap name that says the CPU has it
MARCH_TO_HWCAP = {"dotprod": "asimddp", "sve": "sve", "bf16": "bf16", "i8mm": "i8mm",
                  "fp16": "asimdhp"}
OPTIONAL_EXTENSIONS = ("sve", "bf16", "i8mm")  # never on a Kunpeng-920 build


def regime(tokens: int) -> str:
    """The kt-kernel code path a forward of this many tokens takes."""
    return "forward_one" if tokens < GROUP_MIN_LEN else "forward_many"


# --- bf16 -----------------------------------------------------------------------------------


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounded to nearest even."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exactly."""
    import numpy as np

    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# --- the reference --------------------------------------------------------------------------


def reference_moe(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, gate: np.ndarray,
                  up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """x [T,H], ids/weights [T,k], gate/up [E,I,H], down [E,H,I] -> out [T,H] (float32)."""
    import numpy as np

    g = np.einsum("tkih,th->tki", gate[ids], x, optimize=True)
    u = np.einsum("tkih,th->tki", up[ids], x, optimize=True)
    act = g / (1.0 + np.exp(-g)) * u  # silu(gate) * up
    d = np.einsum("tkhi,tki->tkh", down[ids], act, optimize=True)
    return np.einsum("tk,tkh->th", weights, d, optimize=True).astype(np.float32)


@dataclass
class Agreement:
    cosine: float
    rel_l2: float
    max_abs: float
    finite: bool
    all_zero: bool

    def as_dict(self) -> dict[str, Any]:
        return {"cosine": round(self.cosine, 6), "rel_l2": round(self.rel_l2, 6),
                "max_abs": self.max_abs, "finite": self.finite, "all_zero": self.all_zero}


def agreement(out: np.ndarray, ref: np.ndarray) -> Agreement:
    import numpy as np

    o = np.asarray(out, dtype=np.float64).ravel()
    r = np.asarray(ref, dtype=np.float64).ravel()
    finite = bool(np.isfinite(o).all())
    all_zero = bool(finite and not o.any())
    if not finite or all_zero:
        return Agreement(0.0, 1.0, float("nan") if not finite else 0.0, finite, all_zero)
    denom = float(np.linalg.norm(o) * np.linalg.norm(r)) or 1.0
    return Agreement(float(o @ r / denom),
                     float(np.linalg.norm(o - r) / (np.linalg.norm(r) or 1.0)),
                     float(np.abs(o - r).max()), finite, all_zero)


# --- what the child said --------------------------------------------------------------------

_LINE = re.compile(r"^SELFTEST (\w+) (\{.*\})\s*$")


def child_messages(lines: list[str]) -> dict[str, dict[str, Any]]:
    """The child's ``SELFTEST <kind> {json}`` lines, by kind (the last of each wins)."""
    out: dict[str, dict[str, Any]] = {}
    for line in lines:
        m = _LINE.match(line.strip())
        if m:
            try:
                out[m.group(1)] = json.loads(m.group(2))
            except ValueError:
                continue
    return out


def cpu_features(cpu: dict[str, Any]) -> set[str] | None:
    """Feature names from the child's AT_HWCAP/AT_HWCAP2 (None when not aarch64 or unknown)."""
    if cpu.get("machine") not in ("aarch64", "arm64") or cpu.get("hwcap") is None:
        return None
    words = {1: int(cpu.get("hwcap") or 0), 2: int(cpu.get("hwcap2") or 0)}
    return {name for name, (word, bit) in HWCAP_BITS.items() if words[word] >> bit & 1}


def march_features(text: str) -> set[str] | None:
    """The ``+ext`` of kt-kernel's ``ARM target: -march=...`` configure line, if any."""
    found = re.findall(r"ARM target: -march=(\S+)", text)
    if not found:
        return None
    return {part for part in found[-1].split("+")[1:] if part}


# --- the verdict ----------------------------------------------------------------------------


@dataclass
class RunFacts:
    """What one child run produced, as the stage observed it."""

    tokens: int
    returncode: int | None  # None: killed after the timeout
    lines: list[str]
    timeout_s: float
    seconds: float = 0.0
    out: np.ndarray | None = None  # float32 [T,H], when the child saved one
    built: set[str] | None = None  # -march features of the build, when known


@dataclass
class Verdict:
    tokens: int
    regime: str
    ok: bool
    reason: str
    fix: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "regime": self.regime, "ok": self.ok,
                "reason": self.reason, "fix": self.fix, **self.figures}


def _signal_of(returncode: int | None) -> int | None:
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if returncode > 128 and returncode - 128 in (signal.SIGILL, signal.SIGABRT, signal.SIGSEGV,
                                                 signal.SIGBUS, signal.SIGKILL):
        return returncode - 128  # via a shell or an emulator that exits instead of dying
    return None


def _sigill(facts: RunFacts, cpu: dict[str, Any]) -> tuple[str, str]:
    has = cpu_features(cpu)
    if has is None:
        return ("SIGILL: the build uses instructions this CPU lacks",
                "build for this CPU (x86: CPUINFER_CPU_INSTRUCT=AVX2 with CPUINFER_ENABLE_AMX "
                "and CPUINFER_ENABLE_AVX512*=OFF), then `dsv4-offload build kt-kernel --clean`")
    built = facts.built or set()
    extra = [f for f in OPTIONAL_EXTENSIONS if f in built and MARCH_TO_HWCAP[f] not in has]
    if extra:
        plus = "+".join(extra)
        return (f"SIGILL: kt-kernel was built with +{plus} but this CPU lacks "
                f"{', '.join(extra)}",
                "keep CPUINFER_ARM_SVE, CPUINFER_ARM_BF16 and CPUINFER_ARM_I8MM OFF (a "
                "Kunpeng-920 has none of them), then `dsv4-offload build kt-kernel --clean`")
    if "asimddp" not in has:
        return ("SIGILL: this CPU lacks dotprod (asimddp); the MXFP4 kernel's SDOT needs it",
                "run on an ARMv8.2-A CPU with dotprod such as Kunpeng-920 (under qemu: "
                "-cpu cortex-a76)")
    return ("SIGILL: an instruction this CPU lacks (the build's -march features are "
            f"{'+'.join(sorted(built)) or 'unknown'}; the CPU has {', '.join(sorted(has))})",
            "compare the kt-kernel step's `ARM target:` line with `dsv4-offload doctor`")


def judge(facts: RunFacts, min_cosine: float, max_rel_l2: float,
          ref: np.ndarray | None) -> Verdict:
    """One run's verdict; exit 0 alone proves nothing, the numbers must agree."""
    name = regime(facts.tokens)
    msgs = child_messages(facts.lines)
    cpu = msgs.get("cpu", {})
    text = "\n".join(facts.lines)
    where = f"{name} ({facts.tokens} token{'' if facts.tokens == 1 else 's'})"

    def fail(reason: str, fix: str, **figures: Any) -> Verdict:
        return Verdict(facts.tokens, name, False, f"{where}: {reason}", fix, figures)

    if facts.returncode is None:
        stage = "forward" if "loaded" in msgs else ("load" if "imported" in msgs else "import")
        return fail(f"hang: no result after {facts.timeout_s:g} s (stuck in {stage})",
                    "look for a kt-kernel worker deadlock in the log; on a slow or emulated "
                    "CPU raise selftest.timeout_s")
    sig = _signal_of(facts.returncode)
    if sig == signal.SIGILL:
        reason, fix = _sigill(facts, cpu)
        return fail(reason, fix)
    if sig == signal.SIGABRT or UNSUPPORTED in text:
        if UNSUPPORTED in text:
            machine = cpu.get("machine", "")
            if machine in ("aarch64", "arm64"):
                return fail(f"SIGABRT '{UNSUPPORTED}': the MXFP4 GEMV is not compiled in (an "
                            "SVE build takes the generic llamafile path)",
                            "keep CPUINFER_ARM_SVE=OFF, then `dsv4-offload build kt-kernel "
                            "--clean`")
            return fail(f"SIGABRT '{UNSUPPORTED}': off aarch64 the delivered MXFP4 path has "
                        "no kernel (moe.hpp routes MXFP4 only in its aarch64 variant)",
                        "on x86 use the series dsv4-flash-x86 (recipe dsv4-flash-x86-dev), "
                        "which adds our MXFP4 dispatch")
        return fail("SIGABRT: kt-kernel aborted", f"read the log's last lines: "
                    f"{_last(facts.lines)}")
    if sig is not None:
        return fail(f"killed by {signal.Signals(sig).name}", f"read the log: {_last(facts.lines)}")
    if facts.returncode != 0 and "pin_memory=True requires" in text:
        return fail("KTMoEWrapper needs pinned memory, which this torch (CPU-only) lacks",
                    "set selftest.api: low-level off the target (the wrapper runs where "
                    "torch_npu provides pinned memory)")
    if facts.returncode != 0:
        return fail(f"exit code {facts.returncode}: {_last(facts.lines)}",
                    "check that the build python imports numpy and kt_kernel_ext "
                    "(`dsv4-offload build kt-kernel`)")
    if facts.out is None or "done" not in msgs:
        return fail("exit 0 without a result", "read the log; the child did not save its output")
    if ref is None or facts.out.shape != ref.shape:
        return fail(f"output shape {getattr(facts.out, 'shape', None)}, expected "
                    f"{getattr(ref, 'shape', None)}", "read the log")
    agree = agreement(facts.out, ref)
    figures = {**agree.as_dict(), "seconds": round(facts.seconds, 2),
               "forward_s": msgs.get("forward", {}).get("seconds"),
               "api": msgs.get("forward", {}).get("api")}
    if not agree.finite:
        return fail("non-finite output (NaN/inf)", "read the log; rebuild with --clean",
                    **figures)
    if agree.all_zero:
        return fail("all zeros: the MXFP4 GEMM did not run (forward_many ignores a failed "
                    "sgemm and keeps its zeroed buffers)",
                    "on x86 use the series dsv4-flash-x86 (recipe dsv4-flash-x86-dev); on "
                    "aarch64 keep CPUINFER_ARM_SVE=OFF and rebuild", **figures)
    if agree.cosine < min_cosine or agree.rel_l2 > max_rel_l2:
        return fail(f"low agreement with the numpy reference: cosine {agree.cosine:.6f} "
                    f"(>= {min_cosine:g} needed), rel-L2 {agree.rel_l2:.4f} "
                    f"(<= {max_rel_l2:g})",
                    "the kernel computes wrong numbers: check the patches (`dsv4-offload patch "
                    "status`) and the GGUF layout (`dsv4-offload verify-gguf`)", **figures)
    return Verdict(facts.tokens, name, True,
                   f"{where}: cosine {agree.cosine:.6f}, rel-L2 {agree.rel_l2:.4f}",
                   figures=figures)


def _last(lines: list[str]) -> str:
    useful = [x.strip() for x in lines if x.strip() and not x.startswith(("SELFTEST", "==="))]
    return useful[-1][:160] if useful else "(no output)"
