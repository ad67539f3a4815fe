"""Real SIGILLs under qemu-aarch64, judged by the selftest stage of the ARM rehearsal recipe.

The emulated "guest python" is a tiny static aarch64 program cross-compiled here: it prints
the line selftest_child prints first (``SELFTEST cpu`` with the AT_HWCAP words of the CPU it
runs on), then executes SDOT (dotprod) or an SVE instruction, like kt-kernel's MXFP4 kernel
built for a Kunpeng-920 or with ``+sve``. The stage runs it with the recipe's emulator
argv (``qemu-aarch64 -cpu CPU -L SYSROOT SYSROOT/PYTHON child.py spec.json``); the build's
``-march`` comes from the real configure output of each build (fixtures/arm-rehearsal).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_offload.core.results import Status
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.stages import selftest
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
RECIPE = "dsv4-flash-arm-rehearsal"
FIXTURES = Path(__file__).parent / "fixtures" / "arm-rehearsal"

pytestmark = pytest.mark.skipif(
    shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None,
    reason=f"needs {CROSS_CC} and {QEMU}: apt-get install gcc-aarch64-linux-gnu qemu-user",
)

GUEST_C = r"""
#include <stdio.h>
#include <sys/auxv.h>
#ifdef USE_SVE
#include <arm_sve.h>
#else
#include <arm_neon.h>
#endif
int main(void) {
    /* selftest_child's first line: the CPU's AT_HWCAP/AT_HWCAP2, before the kernel runs */
    printf("SELFTEST cpu {\"hwcap\": %lu, \"hwcap2\": %lu, \"machine\": \"aarch64\"}\n",
           getauxval(AT_HWCAP), getauxval(AT_HWCAP2));
    fflush(stdout);
#ifdef USE_SVE
    volatile int n = (int)svcntb();  /* RDVL */
    printf("%d\n", n);
#else
    int8_t a[16], b[16];
    for (int i = 0; i < 16; i++) { a[i] = (int8_t)(i - 8); b[i] = (int8_t)(3 * i - 20); }
    volatile int32_t zero = 0;
    int32x4_t acc = vdotq_s32(vdupq_n_s32(zero), vld1q_s8(a), vld1q_s8(b));  /* SDOT */
    printf("%d\n", vaddvq_s32(acc));
#endif
    return 0;
}
"""
# the -march of each real build (kt-kernel/CMakeLists.txt line 234 prints it)
MARCH = {"kunpeng920": "armv8.2-a+fp16+dotprod", "sve": "armv8.2-a+fp16+dotprod+sve"}


def stage_for(tmp_path: Path, build: str, cpu: str) -> StageContext:
    """The rehearsal's selftest with a guest program standing in for the emulated python."""
    root = tmp_path / "ws"
    guest = root / "sysroot/usr/bin/guest"
    guest.parent.mkdir(parents=True)
    source = tmp_path / "guest.c"
    source.write_text(GUEST_C)
    flags = ["-DUSE_SVE"] if build == "sve" else []
    subprocess.run([CROSS_CC, "-O2", "-static", f"-march={MARCH[build]}", *flags,
                    str(source), "-o", str(guest)], check=True, capture_output=True,
                   timeout=120)
    recipe, series = load_recipe_and_series(RECIPE, [
        "selftest.experts=4", "selftest.hidden=64", "selftest.intermediate=64",
        "selftest.tokens=[4]", "selftest.timeout_s=60", "selftest.emulator.sysroot=sysroot",
        "selftest.emulator.python=usr/bin/guest", f"selftest.emulator.cpu={cpu}"])
    ctx = StageContext(recipe=recipe, series=series, workspace=Workspace(root),
                       options={"python": sys.executable}, stage="selftest")
    module = selftest.module_dir(ctx) / "kt_kernel_ext.cpython-311-aarch64-linux-gnu.so"
    module.parent.mkdir(parents=True)
    module.write_bytes(b"")  # the guest never imports it; the stage only looks for a build
    log = ctx.workspace.log_dir("build") / "kt-kernel.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / f"configure-{build}.log", log)
    return ctx


def test_kunpeng920_build_on_a_cpu_without_dotprod_is_named(tmp_path: Path) -> None:
    result = selftest.run(stage_for(tmp_path, "kunpeng920", "cortex-a53"))
    assert result.status is Status.FAILED
    (problem,) = result.problems
    assert problem.message == ("forward_one (4 tokens): SIGILL: this CPU lacks dotprod "
                               "(asimddp); the MXFP4 kernel's SDOT needs it")
    assert "cortex-a76" in problem.fix


def test_sve_build_on_the_kunpeng920_class_cpu_is_named(tmp_path: Path) -> None:
    result = selftest.run(stage_for(tmp_path, "sve", "cortex-a76"))
    assert result.status is Status.FAILED
    (problem,) = result.problems
    assert problem.message == ("forward_one (4 tokens): SIGILL: kt-kernel was built with "
                               "+sve but this CPU lacks sve")
    assert "CPUINFER_ARM_SVE" in problem.fix


def test_the_kunpeng920_build_runs_on_cortex_a76(tmp_path: Path) -> None:
    """The control: the same SDOT program is no SIGILL on the Kunpeng-920 class CPU (it then
    fails for want of a result, as a guest that computes nothing must)."""
    result = selftest.run(stage_for(tmp_path, "kunpeng920", "cortex-a76"))
    assert result.status is Status.FAILED
    (problem,) = result.problems
    assert problem.message == "forward_one (4 tokens): exit 0 without a result"
