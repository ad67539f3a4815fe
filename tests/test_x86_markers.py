"""The x86-dev recipe's kt-kernel markers against a real configure log.

tests/fixtures/build-logs/kt-kernel-x86-configure.log holds the `-- ` lines of the real
x86 rehearsal build (2026-12-03: `dsv4-offload --recipe dsv4-flash-x86-dev run --to
selftest` on ktransformers d7b5b49 + the delivery's 0001/0002 + our x86 patch, setup.py
build_ext), workspace and venv paths replaced by placeholders; nothing else edited.
"""

from __future__ import annotations

import re
from pathlib import Path

from dsv4_offload.build.bringup import KT_KERNEL_STEP
from dsv4_offload.recipe import load_recipe

LOG = Path(__file__).parent / "fixtures" / "build-logs" / "kt-kernel-x86-configure.log"


def test_every_expected_marker_is_printed_and_no_forbidden_one() -> None:
    text = LOG.read_text()
    step = next(s for s in load_recipe("dsv4-flash-x86-dev").build.steps
                if s.name == KT_KERNEL_STEP)
    assert len(step.expect_markers) >= 5
    for marker in step.expect_markers:
        assert re.search(marker, text, re.MULTILINE), marker
    for marker in step.forbid_markers:
        assert not re.search(marker, text, re.MULTILINE), marker


def test_forbidden_markers_catch_an_avx512_or_cuda_configure() -> None:
    step = next(s for s in load_recipe("dsv4-flash-x86-dev").build.steps
                if s.name == KT_KERNEL_STEP)
    # the same lines as an AVX512 + CUDA configure prints them (CMakeLists.txt:299, :433)
    bad = LOG.read_text().replace("-- ARCH_FLAGS: -mf16c;", "-- ARCH_FLAGS: -mavx512f;-mf16c;")
    bad += "-- CUDA detected\n"
    hits = [m for m in step.forbid_markers if re.search(m, bad, re.MULTILINE)]
    assert hits == ["^-- CUDA detected", "^-- ARCH_FLAGS: .*-mavx512"]
