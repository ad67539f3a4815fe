"""The ARM facts the build relies on, checked on emulated CPUs (cross gcc + qemu-user).

kt-kernel's MXFP4 MoE kernel needs ARMv8.2 dotprod (SDOT) and must not need SVE: a
program using ``vdotq_s32`` built with ``-march=armv8.2-a+dotprod`` must run on a
Kunpeng-920-like core (cortex-a76: dotprod, no SVE) and die with SIGILL on a core
without dotprod (cortex-a53). A second program reports the kernel's hwcaps the way
/proc/cpuinfo does, and the doctor's parser must read them as the facts say.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dsv4_offload.core.host import parse_cpuinfo

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SIGILL_EXIT = 132  # 128 + SIGILL, as the shell reports a core without dotprod

pytestmark = pytest.mark.skipif(
    shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None,
    reason=f"needs {CROSS_CC} and {QEMU}: apt-get install gcc-aarch64-linux-gnu qemu-user",
)

DOT_C = r"""
#include <arm_neon.h>
#include <stdio.h>
int main(void) {
    int8_t a[16], b[16];
    for (int i = 0; i < 16; i++) { a[i] = (int8_t)(i - 8); b[i] = (int8_t)(3 * i - 20); }
    volatile int32_t zero = 0;  /* keeps the compiler from folding SDOT away */
    int32x4_t acc = vdupq_n_s32(zero);
    acc = vdotq_s32(acc, vld1q_s8(a), vld1q_s8(b));
    printf("%d\n", vaddvq_s32(acc));
    return 0;
}
"""

# prints a /proc/cpuinfo-shaped text from the hwcaps the kernel (here qemu) hands out:
# under qemu, /proc/cpuinfo shows the x86 host, but getauxval is the emulated CPU's
HWCAP_C = r"""
#include <stdio.h>
#include <sys/auxv.h>
#include <asm/hwcap.h>
int main(void) {
    unsigned long h = getauxval(AT_HWCAP), h2 = getauxval(AT_HWCAP2);
    printf("processor\t: 0\nFeatures\t:");
    if (h & HWCAP_FP) printf(" fp");
    if (h & HWCAP_ASIMD) printf(" asimd");
    if (h & HWCAP_ASIMDDP) printf(" asimddp");
    if (h & HWCAP_SVE) printf(" sve");
    if (h2 & HWCAP2_I8MM) printf(" i8mm");
    if (h2 & HWCAP2_BF16) printf(" bf16");
    printf("\nCPU implementer\t: 0x41\n");
    return 0;
}
"""


def build_static(tmp_path: Path, name: str, source: str, *flags: str) -> Path:
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / name
    subprocess.run([CROSS_CC, "-O2", "-static", *flags, str(src), "-o", str(out)], check=True,
                   capture_output=True, text=True, timeout=120)
    return out


def run_on(cpu: str, binary: Path) -> subprocess.CompletedProcess[str]:
    # through a shell, so a fatal signal shows up as the shell's 128 + signo exit code
    return subprocess.run(["sh", "-c", f'{QEMU} -cpu {cpu} "$0" 2>/dev/null', str(binary)],
                          capture_output=True, text=True, timeout=60)


def test_sdot_kernel_runs_on_dotprod_core_and_traps_without_it(tmp_path: Path) -> None:
    binary = build_static(tmp_path, "dot", DOT_C, "-march=armv8.2-a+dotprod")
    expected = sum((i - 8) * (3 * i - 20) for i in range(16))
    a76 = run_on("cortex-a76", binary)  # Kunpeng-920-like: dotprod, no SVE
    assert a76.returncode == 0, a76
    assert a76.stdout.strip() == str(expected)
    a53 = run_on("cortex-a53", binary)  # ARMv8.0: no SDOT
    assert a53.returncode == SIGILL_EXIT, a53


LOOP_C = r"""
#include <stdint.h>
int dot_loop(const int8_t *a, const int8_t *b, int n) {
    int s = 0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
"""


def sve_registers(asm: str) -> list[str]:
    return [tok for tok in asm.replace(",", " ").split()
            if tok.startswith("z") and tok[1:].split(".")[0].isdigit()]


def test_dotprod_build_vectorizes_with_sdot_and_no_sve(tmp_path: Path) -> None:
    # what CPUINFER_ARM_SVE=OFF must guarantee: an int8 dot loop compiled for the dotprod
    # target uses SDOT on NEON registers and no SVE z registers; with +sve it would
    src = tmp_path / "loop.c"
    src.write_text(LOOP_C)

    def asm(march: str) -> str:
        return subprocess.run([CROSS_CC, "-O3", f"-march={march}", "-S", "-o", "-", str(src)],
                              check=True, capture_output=True, text=True).stdout

    plain = asm("armv8.2-a+dotprod")
    assert "sdot" in plain
    assert sve_registers(plain) == []
    assert sve_registers(asm("armv8.2-a+dotprod+sve"))  # the detector does see SVE code


@pytest.mark.parametrize(("cpu", "has", "lacks"), [
    ("cortex-a76", {"asimd", "asimddp"}, {"sve", "i8mm", "bf16"}),
    ("cortex-a53", {"asimd"}, {"asimddp", "sve"}),
    ("max", {"asimddp", "sve"}, set()),  # why tests use cortex-a76: max hides SVE mistakes
])
def test_doctor_reads_hwcaps_as_the_cpu_has_them(tmp_path: Path, cpu: str, has: set[str],
                                                 lacks: set[str]) -> None:
    binary = build_static(tmp_path, "hwcap", HWCAP_C)
    proc = run_on(cpu, binary)
    assert proc.returncode == 0, proc
    arch, _model, flags, cpus = parse_cpuinfo(proc.stdout)
    assert arch == "aarch64" and cpus == 1
    assert has <= flags
    assert not lacks & flags
