"""Doctor on the aarch64 rehearsal recipe: what a cross build and an emulated self-test need.

The host is the captured x86 machine plus captured `--version` outputs of the cross tools
(taken on a Debian 12 machine, 2026-12-03) and, when a test says so, a binfmt_misc entry in
the kernel's format (linux fs/binfmt_misc.c, bm_entry_read: "enabled", "interpreter ...").
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsv4_offload.core.host import probe_host
from dsv4_offload.recipe import load_recipe
from dsv4_offload.stages import doctor

HOSTS = Path(__file__).parent / "fixtures" / "hosts"
RECIPE = "dsv4-flash-arm-rehearsal"
CAPTURED = {
    "qemu-aarch64": "qemu-aarch64 version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\n"
                    "Copyright (c) 2003-2022 Fabrice Bellard and the QEMU Project developers",
    "pkg-config": "1.8.1",
    "dpkg": "Debian 'dpkg' package management program version 1.21.22 (amd64).",
    "apt-get": "apt 2.6.1 (amd64)",
    "aarch64-linux-gnu-gcc": "aarch64-linux-gnu-gcc (Debian 12.2.0-14) 12.2.0",
    "aarch64-linux-gnu-g++": "aarch64-linux-gnu-g++ (Debian 12.2.0-14) 12.2.0",
}
BINFMT_ENABLED = """enabled
interpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P
flags: PF
offset 0
magic 7f454c460201010000000000000000000200b700
mask ffffffffffffff00fffffffffffffffffeffffff
"""


def x86_host(tmp_path: Path, without: tuple[str, ...] = (), binfmt: str | None = None) -> Path:
    root = tmp_path / "host"
    shutil.copytree(HOSTS / "x86-no-npu", root, symlinks=True)
    for tool, text in CAPTURED.items():
        if tool in without:
            continue
        script = root / "usr/bin" / tool
        script.write_text(f"#!/bin/sh\ncat <<'CAPTURED'\n{text}\nCAPTURED\n")
        script.chmod(0o755)
    if binfmt is not None:
        entry = root / doctor.BINFMT_DIR / "qemu-aarch64"
        entry.parent.mkdir(parents=True, exist_ok=True)
        entry.write_text(binfmt)
    return root


def cross_checks(root: Path) -> dict[str, doctor.Check]:
    recipe = load_recipe(RECIPE)
    tools = [t for t in (recipe.platform.cc, recipe.platform.cxx) if t]
    facts = probe_host(Path("/nonexistent-ws"), root=root, npu_smi=None,
                       tools=tools + doctor.cross_tools(recipe))
    checks, _ = doctor.evaluate(recipe, facts, binfmt=doctor.binfmt_state(str(root)))
    return {c.name: c for c in checks}


def test_the_rehearsal_needs_the_sysroot_and_emulator_tools() -> None:
    assert doctor.cross_tools(load_recipe(RECIPE)) == [
        "dpkg", "apt-get", "pkg-config", "qemu-aarch64"]
    assert doctor.cross_tools(load_recipe("dsv4-flash-910b")) == []


def test_everything_there_passes_and_binfmt_is_only_a_warning(tmp_path: Path) -> None:
    checks = cross_checks(x86_host(tmp_path))
    for tool in ("dpkg", "apt-get", "pkg-config", "qemu-aarch64"):
        assert checks[f"cross-{tool}"].status == "ok", tool
    assert checks["cross-qemu-aarch64"].observed == "7.2.22"
    assert checks["aarch64-linux-gnu-gcc"].status == "ok"
    assert checks["binfmt-aarch64"].status == "warn"
    assert "qemu-user-static binfmt-support" in checks["binfmt-aarch64"].fix

    checks = cross_checks(x86_host(tmp_path / "b", binfmt=BINFMT_ENABLED))
    assert checks["binfmt-aarch64"].status == "ok"


@pytest.mark.parametrize(("tool", "fix"), [
    ("qemu-aarch64", "apt-get install qemu-user"),
    ("pkg-config", "apt-get install pkg-config"),
    ("dpkg", "Debian or Ubuntu"),
])
def test_a_missing_tool_fails_with_the_install_command(tmp_path: Path, tool: str,
                                                       fix: str) -> None:
    checks = cross_checks(x86_host(tmp_path, without=(tool,)))
    assert checks[f"cross-{tool}"].status == "fail"
    assert checks[f"cross-{tool}"].observed == "not found"
    assert fix in checks[f"cross-{tool}"].fix


def test_missing_cross_compilers_name_their_packages(tmp_path: Path) -> None:
    checks = cross_checks(x86_host(tmp_path, without=("aarch64-linux-gnu-gcc",
                                                      "aarch64-linux-gnu-g++")))
    assert checks["aarch64-linux-gnu-gcc"].status == "fail"
    assert "apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu" in \
        checks["aarch64-linux-gnu-gcc"].fix
    assert doctor.compiler_package("gcc-13") == "gcc-13"


def test_binfmt_entry_parsing() -> None:
    assert doctor.parse_binfmt_entry(BINFMT_ENABLED) == "enabled"
    assert doctor.parse_binfmt_entry("disabled\ninterpreter /x\n") == "disabled"
    assert doctor.parse_binfmt_entry("") == "absent"


def test_the_doctor_stage_reads_binfmt_from_the_host(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from dsv4_offload.recipe import load_recipe_and_series
    from dsv4_offload.workspace.context import StageContext
    from dsv4_offload.workspace.store import Workspace

    root = x86_host(tmp_path, binfmt=BINFMT_ENABLED)
    monkeypatch.setenv("DSV4_HOST_ROOT", str(root))
    monkeypatch.delenv("DSV4_NPU_SMI", raising=False)
    recipe, series = load_recipe_and_series(RECIPE)
    result = doctor.run(StageContext(recipe=recipe, series=series,
                                     workspace=Workspace(tmp_path / "ws"), options={},
                                     stage="doctor"))
    checks = {c["name"]: c for c in result.data["checks"]}
    assert checks["binfmt-aarch64"]["status"] == "ok"
    assert checks["cross-qemu-aarch64"]["status"] == "ok"
    assert "npu-smi" not in checks  # a recipe without an NPU checks none
