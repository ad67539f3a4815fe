"""The build stage on a workspace laid out by the test, with steps that are tiny real programs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from kernel_standin import EXT_NAME, compile_extension, write_loader

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import Status
from dsv4_offload.recipe import BUNDLED_RECIPES, load_recipe_and_series
from dsv4_offload.stages import build
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

KT = "src/ktransformers/kt-kernel"
SGL = "src/ktransformers/third_party/sglang/python"
ASCENDC = "src/cann-recipes-infer/ascendc_mxfp4"

# stands in for kt-kernel's setup.py on a Kunpeng-920 with CANN: it prints the configure
# lines of the patched kt-kernel (ktransformers d7b5b49 + main_repo/0001+0002) in their real
# formats: setup.py:94 (the CPUINFER_ARM_* forwards, pairs of setup.py:727-731), setup.py:738
# (dotprod detected), CMakeLists.txt:217-234 (the ARM target, CMake adds '-- '), :486 and
# :506; it leaves the extension (a real shared object, compiled by the test: $KT_EXT_FROM) in
# the package dir, as `build_ext --inplace` does
KT_BUILD = """\
import os, shutil, sys
ARM = (("CPUINFER_ARM_SVE", "LLAMA_ARM_SVE", "+sve"), ("CPUINFER_ARM_BF16", "LLAMA_ARM_BF16",
       "+bf16"), ("CPUINFER_ARM_I8MM", "LLAMA_ARM_I8MM", "+i8mm"))
def on(env_name): return os.environ.get(env_name, "OFF").lower() in ("1", "on", "true")
arch = "armv8.2-a" + "+fp16" + "+dotprod"
for env_name, cmake_flag, feature in ARM:
    if env_name in os.environ:
        print(f"-- Forward {env_name} -> -D{cmake_flag}={'ON' if on(env_name) else 'OFF'}")
    arch += feature if on(env_name) else ""
print("-- aarch64 ARM_DOTPROD detected; -DLLAMA_ARM_DOTPROD=ON")
print("-- ARM target: -march=" + arch)
print("-- Ascend NPU (CANN) backend selected")
ACL = "/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so"
print(os.environ.get("KT_EXTRA_LINE", "-- Ascend CL library: " + ACL))
shutil.copyfile(os.environ["KT_EXT_FROM"], "python/kt_kernel_ext.cpython-311-aarch64-linux-gnu.so")
open("cc-seen.txt", "w").write(os.environ.get("CC", "") + " " + sys.executable)
sys.exit(int(os.environ.get("KT_EXIT", "0")))
"""
ARM_OFF = {"CPUINFER_ARM_SVE": "OFF", "CPUINFER_ARM_BF16": "OFF", "CPUINFER_ARM_I8MM": "OFF"}


def bundled_kt_step() -> dict[str, Any]:
    doc = yaml.safe_load((BUNDLED_RECIPES / "dsv4-flash-910b.yaml").read_text())
    return next(s for s in doc["build"]["steps"] if s["name"] == "kt-kernel")


def kt_step(**extra: Any) -> dict[str, Any]:
    """The bundled recipe's kt-kernel markers, run against the stand-in setup.py."""
    real = bundled_kt_step()
    step = {"name": "kt-kernel", "workdir": KT, "command": ["{python}", "fake_setup.py"],
            "env": dict(ARM_OFF), "log_sources": real["log_sources"],
            "expect_markers": real["expect_markers"], "forbid_markers": real["forbid_markers"],
            "check_import": "kt_kernel"}
    step.update(extra)
    return step


def sglang_step(**extra: Any) -> dict[str, Any]:
    step = {"name": "sglang", "workdir": SGL,
            "command": ["{python}", "-c", "print('Successfully installed sglang')"],
            # pip prints it, not sglang's code: no tree to audit
            "expect_markers": ["Successfully installed"], "log_sources": [],
            "check_import": "sglang"}
    step.update(extra)
    return step


def ascendc_step(**extra: Any) -> dict[str, Any]:
    step = {"name": "ascendc-op", "workdir": ASCENDC, "optional": True,
            "command": ["bash", "-c", "bisheng -O2 k.cpp -o libmxfp4fused.so"]}
    step.update(extra)
    return step


def lay_out(root: Path) -> None:
    """The checkouts the fetch and patch stages would leave, reduced to what builds touch."""
    kt = root / KT
    (kt / "python").mkdir(parents=True)
    (kt / "python" / "__init__.py").write_text("from pathlib import Path\nHERE = Path(__file__)\n")
    (kt / "fake_setup.py").write_text(KT_BUILD)
    write_loader(kt / "python")
    sgl = root / SGL / "sglang"
    sgl.mkdir(parents=True)
    (sgl / "__init__.py").write_text("VERSION = 'test'\n")
    (root / ASCENDC).mkdir(parents=True)
    # sglang is its own checkout inside the ktransformers tree, as the fetch stage lays it out
    for repo in (root / "src/ktransformers/third_party/sglang", root / "src/ktransformers"):
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "tree"]):
            subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def make_ctx(root: Path, recipe_steps: list[dict[str, Any]], *, sets: dict[str, Any] | None = None,
             **options: Any) -> StageContext:
    doc = yaml.safe_load((BUNDLED_RECIPES / "dsv4-flash-910b.yaml").read_text())
    doc["build"] = {"python": sys.executable, "steps": recipe_steps}
    doc["series"] = str(BUNDLED_RECIPES.parent / "patches" / "dsv4-flash.yaml")
    # the steps build fixture trees with this host's compilers: the build stage on the host
    doc["runtime"]["kind"] = "host"
    for dotted, value in (sets or {}).items():
        node = doc
        *parents, last = dotted.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    path = root.parent / f"{root.name}-recipe.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    recipe, series = load_recipe_and_series(str(path))
    return StageContext(recipe=recipe, series=series, workspace=Workspace(root),
                        options=options, stage="build")


@pytest.fixture(scope="session")
def ascend_ext(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kt-kernel's extension as the 910B build makes it: the Ascend worker, ggml's MXFP4."""
    return compile_extension(tmp_path_factory.mktemp("ext") / EXT_NAME)


@pytest.fixture
def ws(tmp_path: Path, ascend_ext: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "ws"
    lay_out(root)
    monkeypatch.setenv("KT_EXT_FROM", str(ascend_ext))
    return root


def errors(result: Any) -> list[str]:
    return [p.message for p in result.problems if p.severity == "error"]


def test_steps_run_markers_match_products_import(ws: Path) -> None:
    ctx = make_ctx(ws, [kt_step(), sglang_step(), ascendc_step()])
    result = build.run(ctx)
    assert result.status is Status.WARN, result.problems  # the optional op is skipped
    steps = result.data["steps"]
    assert steps["kt-kernel"]["status"] == "ok"
    assert steps["sglang"]["status"] == "ok"
    assert steps["ascendc-op"]["status"] == "skipped"
    assert "'bisheng' is not on PATH; skipped" in steps["ascendc-op"]["message"]
    assert any("set_env.sh" in p.fix for p in result.problems if p.check == "ascendc-op")
    assert os.readlink(ws / KT / "kt_kernel") == "python"
    ext = "python/kt_kernel_ext.cpython-311-aarch64-linux-gnu.so"
    assert steps["kt-kernel"]["products"] == [ext]
    log = ws / "logs" / "build" / "kt-kernel.log"
    # the step's env reached the command
    assert "-- Forward CPUINFER_ARM_SVE -> -DLLAMA_ARM_SVE=OFF" in log.read_text()
    assert result.outputs["steps"].keys() == {"kt-kernel", "sglang"}
    assert [str(ws / KT), str(ws / SGL)] == result.outputs["pythonpath"]


def test_missing_marker_fails_naming_it_and_the_log(ws: Path, monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    monkeypatch.setenv("KT_EXTRA_LINE", "")  # CANN's libascendcl not reported
    result = build.run(make_ctx(ws, [kt_step(), sglang_step()]))
    assert result.status is Status.FAILED
    (msg,) = errors(result)
    assert "expected log marker 'Ascend CL library: \\S*ascendcl' not found" in msg
    assert "set_env.sh" in result.problems[0].fix  # the usual cause, named
    assert str(ws / "logs" / "build" / "kt-kernel.log") in msg
    assert "sglang" not in result.data["steps"]  # stops at the first failure


def test_sve_on_the_arm_target_line_fails_with_the_fix(ws: Path) -> None:
    result = build.run(make_ctx(ws, [kt_step(env={**ARM_OFF, "CPUINFER_ARM_SVE": "ON"})]))
    assert result.status is Status.FAILED
    (msg,) = errors(result)
    assert "forbidden log marker 'ARM target: -march=\\S*\\+(sve|bf16|i8mm)' found" in msg
    assert "'-- ARM target: -march=armv8.2-a+fp16+dotprod+sve'" in msg  # the line, quoted
    assert "CPUINFER_ARM_SVE=OFF" in result.problems[0].fix
    assert "--clean" in result.problems[0].fix


def test_forbidden_marker_fails_quoting_the_line(ws: Path, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    monkeypatch.setenv("KT_EXTRA_LINE", "-- ARM target: -march=armv8.2-a+fp16+dotprod+i8mm")
    result = build.run(make_ctx(ws, [kt_step()]))
    assert result.status is Status.FAILED
    (msg,) = errors(result)
    assert "forbidden log marker" in msg
    assert "'-- ARM target: -march=armv8.2-a+fp16+dotprod+i8mm'" in msg


def test_unprintable_required_marker_refuses_the_build(ws: Path) -> None:
    # the guide's marker, which no file of the patched tree prints (delivery-audit item 1)
    # (only ktransformers is laid out here: with llama.cpp absent it would be 'unchecked')
    step = kt_step(expect_markers=["Found Ascend CL library"], log_sources=["ktransformers"])
    result = build.run(make_ctx(ws, [step]))
    assert result.status is Status.FAILED
    assert result.summary.startswith("build refused")
    (problem,) = [p for p in result.problems if p.severity == "error"]
    assert "'Found Ascend CL library' cannot be printed" in problem.message
    assert "no file of ktransformers contains 'Found Ascend CL library'" in problem.message
    assert "recipe's marker is wrong" in problem.fix and "patch apply" in problem.fix
    assert "kt-kernel" not in result.data["steps"]  # nothing compiled
    assert not (ws / "logs" / "build" / "kt-kernel.log").exists()


def test_failing_command_shows_excerpt_and_log(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_EXIT", "3")
    monkeypatch.setenv("KT_EXTRA_LINE", "error: hwloc.h: No such file or directory")
    result = build.run(make_ctx(ws, [kt_step()]))
    assert result.status is Status.FAILED
    (msg,) = errors(result)
    assert "exit code 3: error: hwloc.h: No such file or directory" in msg
    assert "see the log: " + str(ws / "logs" / "build" / "kt-kernel.log") in msg
    assert result.log == str(ws / "logs" / "build" / "kt-kernel.log")
    assert result.problems[0].fix.startswith("apt-get install libhwloc-dev")


def test_optional_step_failing_is_a_warning(ws: Path) -> None:
    failing = ascendc_step(command=["bash", "-c", "echo 'op build error: no tikcfw'; exit 1"])
    result = build.run(make_ctx(ws, [failing, sglang_step()]))
    assert result.status is Status.WARN
    assert result.data["steps"]["ascendc-op"]["status"] == "warn"
    assert result.data["steps"]["sglang"]["status"] == "ok"  # later steps still run
    assert any("optional step" in p.message for p in result.problems)


def test_import_check_failing_fails(ws: Path) -> None:
    (ws / SGL / "sglang" / "__init__.py").write_text("import torch_npu_not_here\n")
    result = build.run(make_ctx(ws, [sglang_step()]))
    assert result.status is Status.FAILED
    (msg,) = errors(result)
    assert "`import sglang` fails" in msg
    assert "No module named 'torch_npu_not_here'" in msg
    assert "read the log" in result.problems[0].fix  # no known cause: no made-up hint


@pytest.mark.parametrize(("line", "fix"), [
    ("ModuleNotFoundError: No module named 'torch_npu'", "image's python"),
    ("error: externally-managed-environment", "PEP 668"),
    ("fatal error: Python.h: No such file or directory", "python3.11-dev"),
    ("CMake Error: Could NOT find OpenMP_C", "OpenMP"),
    ("ModuleNotFoundError: No module named 'sentencepiece'", "pip install sentencepiece"),
])
def test_known_pitfalls_get_their_fix(ws: Path, line: str, fix: str) -> None:
    step = sglang_step(command=["bash", "-c", f"echo \"{line}\"; exit 1"])
    result = build.run(make_ctx(ws, [step]))
    assert result.status is Status.FAILED
    assert fix in result.problems[0].fix


def test_missing_workdir_says_fetch_and_patch_first(tmp_path: Path) -> None:
    result = build.run(make_ctx(tmp_path / "empty", [sglang_step()]))
    assert result.status is Status.FAILED
    assert "src/ktransformers/third_party/sglang/python does not exist" in errors(result)[0]
    assert result.problems[0].fix == ("run `dsv4-offload fetch` and `dsv4-offload patch apply` "
                                      "first")


def test_wrong_python_version_fails_preflight(ws: Path) -> None:
    result = build.run(make_ctx(ws, [sglang_step()], sets={"host.python": "3.99"}))
    assert result.status is Status.FAILED
    assert "the recipe wants 3.99" in errors(result)[0]
    assert "--python" in result.problems[0].fix
    assert not (ws / "logs" / "build").exists()  # nothing ran


def test_markers_only_count_this_runs_output(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert build.run(make_ctx(ws, [kt_step()])).ok
    monkeypatch.setenv("KT_EXTRA_LINE", "")
    again = build.run(make_ctx(ws, [kt_step()]))
    assert again.status is Status.FAILED  # the first run's marker, still in the log, is ignored
    assert os.readlink(ws / KT / "kt_kernel") == "python"  # the link survived the rerun


def test_platform_compiler_and_python_option_reach_the_step(ws: Path) -> None:
    ctx = make_ctx(ws, [kt_step()], sets={"platform.cc": "gcc-13"}, python=sys.executable)
    assert build.run(ctx).ok
    cc, python = (ws / KT / "cc-seen.txt").read_text().split(" ", 1)
    assert cc == "gcc-13"
    assert Path(python).resolve() == Path(sys.executable).resolve()


def test_the_jobs_a_pipelined_run_hands_reach_the_compiles(ws: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """`jobs` (recipe pipeline:, handed by a pipelined run) becomes CPUINFER_PARALLEL (what
    kt-kernel's setup.py reads) and CMAKE_BUILD_PARALLEL_LEVEL; a step's own env wins."""
    for var in ("CPUINFER_PARALLEL", "CMAKE_BUILD_PARALLEL_LEVEL"):
        monkeypatch.delenv(var, raising=False)
    seen = ("import os; open('par.txt', 'a').write(os.environ.get('CPUINFER_PARALLEL', '-') + "
            "' ' + os.environ.get('CMAKE_BUILD_PARALLEL_LEVEL', '-') + '\\n')")
    step = sglang_step(command=["{python}", "-c", seen], expect_markers=[])
    assert build.run(make_ctx(ws, [step], jobs=3)).ok
    assert build.run(make_ctx(ws, [step])).ok  # alone: nothing set, setup.py's own default
    own = sglang_step(command=["{python}", "-c", seen], expect_markers=[],
                      env={"CPUINFER_PARALLEL": "2"})
    assert build.run(make_ctx(ws, [own], jobs=3)).ok
    assert (ws / SGL / "par.txt").read_text().splitlines() == ["3 3", "- -", "2 3"]


def test_hooks_installed_by_the_build_are_reported(ws: Path) -> None:
    script = KT_BUILD.replace(
        "sys.exit(", "open('../.git/hooks/pre-commit', 'w').write('#!/bin/sh\\n')\nsys.exit(")
    (ws / KT / "fake_setup.py").write_text(script)
    result = build.run(make_ctx(ws, [kt_step()]))
    assert result.status is Status.WARN
    hooks = [p for p in result.problems if p.check == "git-hooks"]
    assert hooks and "pre-commit" in hooks[0].message
    assert result.data["steps"]["kt-kernel"]["hooks_added"] == ["pre-commit"]
    again = build.run(make_ctx(ws, [kt_step()]))
    assert again.data["steps"]["kt-kernel"]["hooks_added"] == []  # reported once
    assert again.data["git_hooks"] == ["pre-commit"]  # but still listed


def test_fingerprint_follows_the_patched_heads(ws: Path) -> None:
    ctx = make_ctx(ws, [kt_step()])
    before = build.fingerprint_inputs(ctx)
    assert before["python"].startswith("3.11")
    tree = ws / "src/ktransformers"
    (tree / "NEW").write_text("patched\n")
    subprocess.run(["git", "-C", str(tree), "add", "NEW"], check=True)
    subprocess.run(["git", "-C", str(tree), "commit", "-q", "-m", "a patch"], check=True)
    after = build.fingerprint_inputs(ctx)
    assert after["head.ktransformers"] != before["head.ktransformers"]
    assert after["head.sglang"] == before["head.sglang"]
    assert after["head.llama.cpp"] == "missing"  # not fetched in this layout


def test_unknown_step_is_an_input_error(ws: Path) -> None:
    with pytest.raises(InputError, match="unknown step 'cuda'"):
        build.run(make_ctx(ws, [sglang_step()], steps=["cuda"]))


def test_compiler_is_asked_for_headers(tmp_path: Path) -> None:
    env = dict(os.environ)
    assert build.missing_headers("gcc", ["dsv4_not_a_header.h", "stdio.h"], env) == [
        "dsv4_not_a_header.h"]
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "dsv4_not_a_header.h").write_text("#define X 1\n")
    env["CPATH"] = str(inc)
    assert build.missing_headers("gcc", ["dsv4_not_a_header.h"], env) == []


def test_native_step_preflight_names_the_apt_packages(ws: Path, tmp_path: Path) -> None:
    # a PATH holding only gcc and a cmake stub, and no hwloc/numa headers anywhere it looks
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text("#!/bin/sh\necho cmake version 3.28\n")
    (bin_dir / "cmake").chmod(0o755)
    os.symlink("/usr/bin/gcc", bin_dir / "gcc")
    ctx = make_ctx(ws, [kt_step(command=["{python}", "setup.py", "build_ext", "--inplace"])])
    env = {"PATH": str(bin_dir), "C_INCLUDE_PATH": ""}
    problems = build.preflight(ctx, sys.executable, ctx.recipe.build.steps, env)
    found = {p.check: p.fix for p in problems}
    have = build.missing_headers("gcc", ["hwloc.h", "numa.h"], env)
    for header in have:
        assert header in found
    if "hwloc.h" in have:
        assert "libhwloc-dev" in found["hwloc.h"]
    if "numa.h" in have:
        assert "libnuma-dev" in found["numa.h"]
    assert "cmake" not in found and "gcc" not in found
    no_cmake = build.preflight(ctx, sys.executable, ctx.recipe.build.steps,
                               {"PATH": str(tmp_path / "nowhere")})
    assert any(p.check == "cmake" and "apt-get install cmake" in p.fix for p in no_cmake)


def test_pythonpath_is_the_sglang_and_kt_kernel_dirs(ws: Path) -> None:
    ctx = make_ctx(ws, [kt_step(), sglang_step(), ascendc_step()])
    assert build.runtime_pythonpath(ctx.workspace, ctx.recipe) == [ws / KT, ws / SGL]
    text = textwrap.dedent(str(build.__doc__))
    assert "regular expressions" in text  # the marker rule is documented where users look


def test_build_command_json_and_exit_codes(ws: Path) -> None:
    from conftest import run_cli_inproc as run_cli  # the answer is the point

    make_ctx(ws, [kt_step(), sglang_step(), ascendc_step()])  # writes the recipe file
    recipe = str(ws.parent / f"{ws.name}-recipe.yaml")
    res = run_cli("--workspace", str(ws), "--recipe", recipe, "--json", "build", "sglang")
    assert res.code == 0, res
    doc = res.json()
    assert doc["command"] == "build" and doc["status"] == "warn"  # kt-kernel not built yet
    assert list(doc["data"]["data"]["steps"]) == ["sglang"]
    broken = run_cli("--workspace", str(ws), "--recipe", recipe,
                     "--set", "host.python=3.99", "build")
    assert broken.code == 1
    assert "the recipe wants 3.99" in broken.out + broken.err
    unknown = run_cli("--workspace", str(ws), "--recipe", recipe, "build", "cuda")
    assert unknown.code == 2 and "unknown step 'cuda'" in unknown.err


def test_build_with_python_option_stays_done_in_status(ws: Path) -> None:
    from dsv4_offload import pipeline

    ctx = make_ctx(ws, [sglang_step()], sets={"build.python": "python-not-installed"})
    with ctx.workspace.lock("build"):
        result = pipeline.run_stage(ctx, "build", {"python": sys.executable})
    assert result.ok, result.problems
    status = {s.name: s for s in pipeline.pipeline_status(make_ctx(
        ws, [sglang_step()], sets={"build.python": "python-not-installed"}))}
    assert status["build"].state == "done", status["build"]


def test_steps_built_one_at_a_time_add_up(ws: Path) -> None:
    from dsv4_offload import pipeline

    ctx = make_ctx(ws, [kt_step(), sglang_step()])
    with ctx.workspace.lock("build"):
        first = pipeline.run_stage(ctx, "build", {"steps": ["sglang"]})
        assert first.status is Status.WARN
        assert "not built yet: kt-kernel" in first.problems[-1].message
        second = pipeline.run_stage(ctx, "build", {"steps": ["kt-kernel"]})
    assert second.status is Status.OK, second.problems
    assert set(second.outputs["steps"]) == {"kt-kernel", "sglang"}


NATIVE_SETUP = """\
from setuptools import Extension, setup
import runpy
runpy.run_path("print_lines.py")  # the configure lines of the patched kt-kernel
setup(name="kt_kernel", packages=["kt_kernel"], package_dir={"kt_kernel": "python"},
      ext_modules=[Extension("kt_kernel.kt_kernel_ext", ["ext.c"])])
"""
NATIVE_EXT = """\
#include <Python.h>
#include <hwloc.h>
#include <numa.h>
/* the Ascend worker's loop, weak so the module imports without libascendcl */
extern int aclrtProcessReport(int) __attribute__((weak));
const char *kt_binding_name = "init_ascend_callback_worker";
static PyObject *cores(PyObject *self, PyObject *args) {
    if (aclrtProcessReport) aclrtProcessReport(0);
    return PyLong_FromLong(TEST_CORES);
}
static PyMethodDef methods[] = {{"cores", cores, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "kt_kernel_ext", "", -1, methods};
PyMODINIT_FUNC PyInit_kt_kernel_ext(void) { return PyModule_Create(&mod); }
"""


def test_native_extension_builds_in_place_and_imports_through_the_link(
        ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a real `setup.py build_ext --inplace` of a C extension shaped like kt-kernel's; the
    # hwloc/numa headers come from CPATH here (the real ones on the target host)
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "hwloc.h").write_text("#define TEST_CORES 192\n")
    (inc / "numa.h").write_text("/* numa */\n")
    monkeypatch.setenv("CPATH", str(inc))
    kt = ws / KT
    (kt / "setup.py").write_text(NATIVE_SETUP)
    (kt / "print_lines.py").write_text(KT_BUILD.split('shutil.copyfile(')[0])
    (kt / "ext.c").write_text(NATIVE_EXT)
    (kt / "python" / "__init__.py").write_text("from .kt_kernel_ext import cores\n")
    step = kt_step(command=["{python}", "setup.py", "build_ext", "--inplace"])
    result = build.run(make_ctx(ws, [step]))
    assert result.status is Status.OK, result.problems
    (product,) = result.data["steps"]["kt-kernel"]["products"]
    assert product.startswith("python/kt_kernel_ext.cpython-311")
    probe = subprocess.run([sys.executable, "-c", "import kt_kernel; print(kt_kernel.cores())"],
                           env={**os.environ, "PYTHONPATH": str(kt)}, capture_output=True,
                           text=True, check=True)
    assert probe.stdout.strip() == "192"


CACHE_PROBE = """\
import os
import re
import shutil
shutil.copyfile(os.environ["KT_EXT_FROM"], "python/kt_kernel_ext.cpython-311-aarch64-linux-gnu.so")
print("cache: " + ("reused" if os.path.exists("build/CMakeCache.txt") else "fresh"))
os.makedirs("build", exist_ok=True)
open("build/CMakeCache.txt", "w").write(os.environ["CPUINFER_ARM_SVE"])
"""


def test_changed_build_settings_get_a_fresh_build_dir(ws: Path) -> None:
    from dsv4_offload import pipeline

    (ws / KT / "fake_setup.py").write_text(CACHE_PROBE)
    log = ws / "logs" / "build" / "kt-kernel.log"

    def build_with(sve: str, **options: Any) -> Any:
        # markers are not the point here (and SVE on would be forbidden)
        ctx = make_ctx(ws, [kt_step(env={"CPUINFER_ARM_SVE": sve}, expect_markers=[],
                                    forbid_markers=[])])
        with ctx.workspace.lock("build"):
            result = pipeline.run_stage(ctx, "build", options)
        assert result.ok, result.problems
        return result, log.read_text().rsplit("cache: ", 1)[1].split()[0]

    assert build_with("ON")[1] == "fresh"
    assert build_with("ON")[1] == "reused"  # same settings: the cache is kept
    result, cache = build_with("OFF")  # SVE flipped: CMake must configure again
    assert cache == "fresh"
    assert result.data["steps"]["kt-kernel"]["cleaned"].startswith("its command, env")
    assert build_with("OFF")[1] == "reused"
    assert build_with("OFF", clean=True)[1] == "fresh"


X86_CONFIGURE = (Path(__file__).parent / "fixtures" / "build-logs"
                 / "kt-kernel-x86-setup-configure.log")


def captured_x86_lines() -> str:
    return "".join(x for x in X86_CONFIGURE.read_text().splitlines(keepends=True)
                   if not x.startswith("# "))


def test_marker_formats_match_a_real_configure_log() -> None:
    # the same setup.py:94 print forwards the x86 switches; the ARM ones are not printed
    # on x86, so swap the pair and the bundled marker must match the captured line exactly
    log = captured_x86_lines()
    expect = bundled_kt_step()["expect_markers"]
    pairs = {"CPUINFER_ARM_SVE": ("CPUINFER_ENABLE_AMX", "KTRANSFORMERS_CPU_USE_AMX"),
             "CPUINFER_ARM_BF16": ("CPUINFER_ENABLE_AVX512_BF16", "LLAMA_AVX512_BF16"),
             "CPUINFER_ARM_I8MM": ("CPUINFER_ENABLE_AVX512_VNNI", "LLAMA_AVX512_VNNI")}
    for env_name, (x86_env, x86_flag) in pairs.items():
        (marker,) = [m for m in expect if f"({env_name})" in m]
        x86 = marker.replace(env_name, x86_env).replace(env_name.replace("CPUINFER_", "LLAMA_"),
                                                         x86_flag)
        hit = re.search(x86, log, re.MULTILINE)
        assert hit and hit.group(0) == f"-- Forward {x86_env} -> -D{x86_flag}=OFF", x86
    dotprod = next(m for m in expect if "LLAMA_ARM_DOTPROD" in m)
    assert re.search(dotprod.replace("LLAMA_ARM_DOTPROD", "LLAMA_AVX2"), log)  # '    -D...=ON'
    assert "-- No GPU support enabled, building for CPU only" in log.splitlines()


def test_the_npu_recipe_markers_fail_on_a_real_x86_configure_log(ws: Path) -> None:
    (ws / KT / "replay.txt").write_text(captured_x86_lines())
    (ws / KT / "replay.py").write_text("print(open('replay.txt').read(), end='')\n")
    result = build.run(make_ctx(ws, [kt_step(command=["{python}", "replay.py"])]))
    assert result.status is Status.FAILED
    (msg,) = errors(result)
    assert ("expected log marker '-- Forward (CPUINFER_ARM_SVE) -> -D(LLAMA_ARM_SVE)=(OFF)$' "
            "not found") in msg


def test_the_run_umask_holds_for_every_step_and_is_restored(ws: Path) -> None:
    probe = ["{python}", "-c", "import os; m = os.umask(0); print('umask %04o' % m)"]
    ctx = make_ctx(ws, [sglang_step(command=probe, expect_markers=["umask 0027"])],
                   sets={"build.umask": "0027"})
    before = os.umask(0o002)
    try:
        result = build.run(ctx)
        after = os.umask(0o002)
    finally:
        os.umask(before)
    assert result.ok, result.problems
    assert after == 0o002  # restored once the build is over
    assert result.data["umask"] == "0027"


def test_platform_compiler_is_kt_kernels_alone(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "cc-of-the-shell")
    probe = ["{python}", "-c", "import os; print('CC=' + os.environ['CC'])"]
    ctx = make_ctx(ws, [kt_step(), sglang_step(command=probe, expect_markers=[
        "CC=cc-of-the-shell"])], sets={"platform.cc": "gcc-13"})
    result = build.run(ctx)
    assert result.ok, result.problems
    assert (ws / KT / "cc-seen.txt").read_text().split(" ", 1)[0] == "gcc-13"


def test_a_missing_barrier_header_is_diagnosed_as_a_compiler_older_than_gcc_11():
    from dsv4_offload.stages.build import diagnose

    log = ("In file included from /ws/ktransformers/kt-kernel/cpu_backend/worker_pool.cpp:10:\n"
           "/ws/ktransformers/kt-kernel/cpu_backend/worker_pool.h:17:10: fatal error: barrier: "
           "No such file or directory\n   17 | #include <barrier>\ncompilation terminated.\n")
    fix = diagnose(log)
    assert fix is not None and "kt-kernel needs GCC 11 or newer" in fix
    assert "CXX=g++-13" in fix


@pytest.mark.parametrize(("line", "package"), [
    ("ImportError: libhwloc.so.15: cannot open shared object file: No such file or directory",
     "apt-get install libhwloc15"),
    ("ImportError: libnuma.so.1: cannot open shared object file: No such file or directory",
     "apt-get install libnuma1"),
])
def test_a_missing_runtime_library_names_the_package(line, package):
    from dsv4_offload.stages.build import diagnose

    fix = diagnose(f"Traceback (most recent call last):\n{line}\n")
    assert fix is not None and package in fix
