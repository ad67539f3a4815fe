"""The kt-kernel the server will load, checked after the build step (issue 24, item 4), and the
.run packages a step installs. The extensions are real ELF shared objects compiled by gcc."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from kernel_standin import EXT_NAME, compile_extension, write_loader
from test_build import KT, SGL, errors, kt_step, lay_out, make_ctx

from dsv4_offload.build import kernelcheck
from dsv4_offload.build.bringup import StepFailed
from dsv4_offload.core.results import Status
from dsv4_offload.stages import build


@pytest.fixture(scope="module")
def exts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Extensions as builds leave them: the delivery's (Ascend worker, ggml's MXFP4), one
    configured without the Ascend backend, one against an unpatched llama.cpp, one whose ggml
    symbols are hidden, and the delivery's stripped."""
    root = tmp_path_factory.mktemp("exts")
    return {"ascend": compile_extension(root / "ascend" / EXT_NAME),
            "cpu": compile_extension(root / "cpu" / EXT_NAME, ascend=False),
            "no-mxfp4": compile_extension(root / "no-mxfp4" / EXT_NAME, mxfp4=False),
            "hidden": compile_extension(root / "hidden" / EXT_NAME, ggml=False),
            "stripped": compile_extension(root / "stripped" / EXT_NAME, strip=True)}


@pytest.fixture
def ws(tmp_path: Path, exts: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "ws"
    lay_out(root)
    monkeypatch.setenv("KT_EXT_FROM", str(exts["ascend"]))
    return root


def kernel_error(result: object) -> str:
    (msg,) = errors(result)
    assert "kernel check: " in msg, msg
    return msg


# --- the ELF reader --------------------------------------------------------------------------


def test_the_elf_reader_agrees_with_nm(exts: dict[str, Path]) -> None:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    import subprocess

    for name in ("ascend", "stripped"):
        out = subprocess.run([nm, "-D", str(exts[name])], capture_output=True, text=True,
                             check=True).stdout
        listed = {line.split()[-1]: line.split()[-2] != "U" for line in out.splitlines()
                  if line.split()[-2] in ("T", "U", "D", "B", "R")}
        symbols = kernelcheck.elf_symbols(exts[name])
        assert symbols is not None
        for sym, defined in listed.items():
            assert symbols[sym] is defined, sym
    assert kernelcheck.elf_symbols(exts["ascend"])["aclrtProcessReport"] is False  # imported
    assert "aclrtProcessReport" in kernelcheck.elf_symbols(exts["stripped"])  # .dynsym kept


def test_the_elf_reader_reads_an_aarch64_object_and_refuses_other_files(tmp_path: Path) -> None:
    cc = shutil.which("aarch64-linux-gnu-gcc")
    if cc is not None:
        import subprocess

        src = tmp_path / "k.c"
        src.write_text("extern int aclrtProcessReport(int);\n"
                       "int f(void) { return aclrtProcessReport(1); }\n")
        out = tmp_path / "k.so"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
        assert kernelcheck.elf_symbols(out)["aclrtProcessReport"] is False
    text = tmp_path / "not-elf.so"
    text.write_text("not an ELF file\n" * 10)
    assert kernelcheck.elf_symbols(text) is None
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes(b"\x7fELF\x02\x01\x01" + b"\0" * 60)
    assert kernelcheck.elf_symbols(truncated) in (None, {})


# --- through the build stage -------------------------------------------------------------------


def test_the_delivery_build_passes_and_says_what_the_server_loads(ws: Path) -> None:
    result = build.run(make_ctx(ws, [kt_step()]))
    assert result.status is Status.OK, result.problems
    kernel = result.data["steps"]["kt-kernel"]["kernel"]
    assert kernel["package"] == str((ws / KT / "python").resolve())
    assert kernel["extension"] == str((ws / KT / "python" / EXT_NAME).resolve())
    assert kernel["written"] == "written by this build"
    assert kernel["ascend_worker"].startswith("present (aclrtProcessReport")
    assert kernel["mxfp4"].startswith("GGMLQuantizationType.MXFP4 = 39")
    assert "ggml_vec_dot_mxfp4_q8_0 is in the extension" in kernel["notes"][0]
    assert "kernel check: the server imports kt_kernel" in \
        (ws / "logs" / "build" / "kt-kernel.log").read_text()


def test_two_extensions_fail_naming_both(ws: Path) -> None:
    other = ws / KT / "python" / "kt_kernel_ext.cpython-310-aarch64-linux-gnu.so"
    shutil.copyfile(os.environ["KT_EXT_FROM"], other)
    os.utime(other, (time.time() - 86400,) * 2)  # left by a build with another python
    result = build.run(make_ctx(ws, [kt_step()]))
    assert result.status is Status.FAILED
    msg = kernel_error(result)
    assert "2 extensions in" in msg
    assert str(other) in msg and str(ws / KT / "python" / EXT_NAME) in msg
    assert "_cpu_detect.py:201-217" in msg
    fix = result.problems[0].fix
    assert f"keep the one this build wrote ({EXT_NAME}" in fix and f"rm {other}" in fix


def test_an_extension_without_the_ascend_worker_fails_with_the_fix(
        ws: Path, exts: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_EXT_FROM", str(exts["cpu"]))
    result = build.run(make_ctx(ws, [kt_step()]))
    assert result.status is Status.FAILED
    msg = kernel_error(result)
    assert "was built without the Ascend backend (no aclrtProcessReport" in msg
    assert "experts_base.py:176-179" in msg
    assert "CPUINFER_USE_ASCEND_NPU=1" in result.problems[0].fix
    assert "--clean" in result.problems[0].fix


def test_a_cpu_only_recipe_does_not_ask_for_the_ascend_worker(
        ws: Path, exts: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_EXT_FROM", str(exts["cpu"]))
    facts = _check(ws, need_ascend=False, run_setup=True)
    assert facts.ascend_worker == "not required"


def test_a_stale_extension_fails_unless_cmake_had_nothing_to_relink(ws: Path) -> None:
    kt = ws / KT
    ext = kt / "python" / EXT_NAME
    shutil.copyfile(os.environ["KT_EXT_FROM"], ext)
    old = time.time() - 3600
    os.utime(ext, (old, old))
    with pytest.raises(StepFailed) as caught:
        _check(ws, need_ascend=True)
    assert f"{ext} was not written by this build" in caught.value.message
    assert "no build tree beside it" in caught.value.message
    assert "--clean" in caught.value.fix
    # object files newer than the extension: it was not linked from them
    obj = kt / "build" / "temp" / "moe.o"
    obj.parent.mkdir(parents=True)
    obj.write_bytes(b"")
    with pytest.raises(StepFailed, match="older than the build tree's object files"):
        _check(ws, need_ascend=True)
    # the same objects, older than the extension: a rebuild that relinked nothing
    os.utime(obj, (old - 60, old - 60))
    facts = _check(ws, need_ascend=True)
    assert facts.written.startswith("up to date: CMake relinked nothing")


def test_a_kt_kernel_earlier_on_the_servers_path_is_refused(ws: Path) -> None:
    shadow = ws / SGL / "kt_kernel"  # sglang/python comes first on the server's PYTHONPATH
    shadow.mkdir()
    (shadow / "__init__.py").write_text("")
    result = build.run(make_ctx(ws, [kt_step(check_import=None)]))
    assert result.status is Status.FAILED
    msg = kernel_error(result)
    assert f"imports kt_kernel from {shadow}, not from this build's" in msg
    assert "pip uninstall kt-kernel" in result.problems[0].fix


@pytest.mark.parametrize(("value", "words"), [
    (None, "has no GGMLQuantizationType.MXFP4"),
    (38, "gives GGMLQuantizationType.MXFP4 = 38; the GGUF files carry type 39"),
])
def test_a_loader_that_does_not_know_mxfp4_as_39_fails(ws: Path, value: int | None,
                                                      words: str) -> None:
    write_loader(ws / KT / "python", mxfp4=value)
    result = build.run(make_ctx(ws, [kt_step()]))
    assert result.status is Status.FAILED
    assert words in kernel_error(result)
    assert "patch apply" in result.problems[0].fix


def test_ggml_without_its_mxfp4_kernel_fails_and_hidden_ggml_is_a_note(
        ws: Path, exts: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_EXT_FROM", str(exts["no-mxfp4"]))
    result = build.run(make_ctx(ws, [kt_step()]))
    assert result.status is Status.FAILED
    assert "has ggml's kernels but not ggml_vec_dot_mxfp4_q8_0" in kernel_error(result)
    monkeypatch.setenv("KT_EXT_FROM", str(exts["hidden"]))
    hidden = build.run(make_ctx(ws, [kt_step()]))
    assert hidden.status is Status.OK, hidden.problems
    (note,) = hidden.data["steps"]["kt-kernel"]["kernel"]["notes"]
    assert "not visible" in note and "only the loader's type" in note
    monkeypatch.setenv("KT_EXT_FROM", str(exts["stripped"]))
    assert build.run(make_ctx(ws, [kt_step()])).status is Status.OK


def _check(ws: Path, *, need_ascend: bool, run_setup: bool = False) -> kernelcheck.KernelFacts:
    kt = ws / KT
    started = time.time() - 1
    if run_setup:
        shutil.copyfile(os.environ["KT_EXT_FROM"], kt / "python" / EXT_NAME)
    kernelcheck.link_kt_kernel_package(kt)
    return kernelcheck.check_kernel(sys.executable, ws / "src/ktransformers", kt,
                                    dict(os.environ), started, need_ascend=need_ascend,
                                    log=ws / "check.log")


# --- .run packages ---------------------------------------------------------------------------

PACKAGER = """\
import os, sys
os.makedirs("output", exist_ok=True)
for version in sys.argv[1:]:
    path = f"output/CANN-custom_ops-{version}-linux.aarch64.run"
    with open(path, "w") as fh:
        fh.write(f"#!/bin/sh\\necho {version} >> installed.txt\\n")
"""


def run_step(tmp_path: Path, versions: list[str]) -> tuple[object, Path]:
    root = tmp_path / "ws"
    lay_out(root)
    work = root / "ops"
    work.mkdir()
    (work / "pack.py").write_text(PACKAGER)
    # a package a build of last week left in output/: it sorts first
    stale = work / "output" / "CANN-custom_ops-0.9-linux.aarch64.run"
    stale.parent.mkdir()
    stale.write_text("#!/bin/sh\necho 0.9 >> installed.txt\n")
    old = time.time() - 7 * 86400
    os.utime(stale, (old, old))
    step = {"name": "vendor-customize", "workdir": "ops",
            "command": ["{python}", "pack.py", *versions],
            "install_run": {"glob": "output/CANN-custom_ops-*-linux.*.run", "args": []}}
    return build.run(make_ctx(root, [step])), work


def test_the_run_package_installed_is_the_one_the_step_wrote(tmp_path: Path) -> None:
    result, work = run_step(tmp_path, ["1.0"])
    assert result.status is Status.OK, result.problems
    assert (work / "installed.txt").read_text() == "1.0\n"  # never the stale 0.9
    log = (tmp_path / "ws" / "logs" / "build" / "vendor-customize.log").read_text()
    assert "ignoring 1 .run package(s) older than this step" in log
    assert "CANN-custom_ops-0.9-linux.aarch64.run" in log


def test_no_fresh_run_package_or_several_fail_naming_them(tmp_path: Path) -> None:
    result, work = run_step(tmp_path / "none", [])
    assert result.status is Status.FAILED
    (msg,) = errors(result)
    assert "produced in" in msg and "by this build (only older ones: CANN-custom_ops-0.9" in msg
    assert "rm " in result.problems[0].fix
    assert not (work / "installed.txt").exists()
    result, work = run_step(tmp_path / "two", ["1.0", "1.1"])
    assert result.status is Status.FAILED
    (msg,) = errors(result)
    assert "2 .run packages matching output/CANN-custom_ops-*-linux.*.run were produced" in msg
    assert "CANN-custom_ops-1.0-linux.aarch64.run" in msg
    assert "CANN-custom_ops-1.1-linux.aarch64.run" in msg
    assert not (work / "installed.txt").exists()
