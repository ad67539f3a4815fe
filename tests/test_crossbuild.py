"""The aarch64 rehearsal's build side: the sysroot step, the toolchain file, the -D forwards.

The sysroot step runs for real (``python -m dsv4_offload.cli.cross sysroot``) against a fake
``apt-get`` and ``dpkg`` on PATH that record their argv and make small .deb stand-ins, and a
real ``pip download`` from a local wheel directory: never the network. The toolchain file is
tried by a real CMake configure with the aarch64 cross compiler when it is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsv4_offload.build import cross as crossbuild
from dsv4_offload.recipe import load_recipe, load_recipe_and_series, load_series
from dsv4_offload.workspace.store import Workspace

CROSS = "aarch64-linux-gnu"

# a dpkg and an apt-get that only record and pretend: `apt-get download P:A` leaves
# P_1.0_A.deb (a text file naming P) in the cwd, `dpkg -x DEB DIR` copies it to
# DIR/usr/share/doc/P/unpacked; FAKE_DPKG_FAIL=P makes the unpack of P fail
FAKE_DPKG = r"""#!/bin/sh
echo "dpkg $*" >> "$FAKE_LOG"
case "$1" in
  --print-architecture) echo amd64 ;;
  --print-foreign-architectures) cat "$FAKE_STATE/foreign" 2>/dev/null || true ;;
  --add-architecture) echo "$2" >> "$FAKE_STATE/foreign" ;;
  -x) pkg=$(cat "$2"); [ "$pkg" = "$FAKE_DPKG_FAIL" ] && exit 2
      mkdir -p "$3/usr/share/doc/$pkg" && cp "$2" "$3/usr/share/doc/$pkg/unpacked" ;;
  *) exit 9 ;;
esac
"""
FAKE_APT = r"""#!/bin/sh
echo "apt-get $*" >> "$FAKE_LOG"
case "$1" in
  update) ;;
  download) shift; for spec in "$@"; do
      pkg=${spec%%:*}; arch=${spec#*:}; echo "$pkg" > "${pkg}_1.0_${arch}.deb"; done ;;
  *) exit 9 ;;
esac
"""


@pytest.fixture
def fake_debian(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("dpkg", FAKE_DPKG), ("apt-get", FAKE_APT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    state = tmp_path / "dpkg-state"
    state.mkdir()
    env = dict(os.environ)
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_LOG=str(tmp_path / "argv.log"),
               FAKE_STATE=str(state), FAKE_DPKG_FAIL="")
    return env


def make_wheel(where: Path, project: str = "tinyarm", version: str = "1.0") -> Path:
    """A minimal valid wheel (pure, so pip accepts it for the aarch64 platform too)."""
    where.mkdir(parents=True, exist_ok=True)
    wheel = where / f"{project}-{version}-py3-none-any.whl"
    info = f"{project}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{project}/__init__.py", "VALUE = 42\n")
        zf.writestr(f"{info}/METADATA",
                    f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                    "Tag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


def run_sysroot(env: dict[str, str], sysroot: Path, packages: list[str], *extra: str
                ) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "dsv4_offload.cli.cross", "sysroot", "--dir", str(sysroot),
            "--arch", "arm64", *(f"--package={p}" for p in packages), *extra]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def calls(env: dict[str, str]) -> list[str]:
    log = Path(env["FAKE_LOG"])
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return [x for x in lines if "--print-" not in x]  # the queries are not work


def test_sysroot_step_downloads_unpacks_and_stamps_then_skips(
        tmp_path: Path, fake_debian: dict[str, str]) -> None:
    sysroot = tmp_path / "ws" / "sysroot-arm64"
    links = tmp_path / "wheels"
    make_wheel(links)
    wheel_args = ("--wheel=tinyarm", f"--find-links={links}")
    proc = run_sysroot(fake_debian, sysroot, ["python3.11", "libnuma-dev"], *wheel_args)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert calls(fake_debian) == [
        "dpkg --add-architecture arm64",
        "apt-get update",
        "apt-get download python3.11:arm64 libnuma-dev:arm64",
        f"dpkg -x {sysroot}/.dsv4/downloads/python3.11_1.0_arm64.deb {sysroot}",
        f"dpkg -x {sysroot}/.dsv4/downloads/libnuma-dev_1.0_arm64.deb {sysroot}",
    ]
    assert (sysroot / "usr/share/doc/libnuma-dev/unpacked").read_text() == "libnuma-dev\n"
    # the wheel went onto the emulated interpreter's path, the downloads are gone
    site = sysroot / crossbuild.DEFAULT_SITE_DIR
    assert (site / "tinyarm/__init__.py").read_text() == "VALUE = 42\n"
    assert not list((sysroot / ".dsv4/downloads").iterdir())
    stamp = json.loads(crossbuild.stamp_path(sysroot).read_text())
    assert stamp["request"]["packages"] == ["python3.11", "libnuma-dev"]
    assert stamp["request"]["wheels"] == ["tinyarm"]

    again = run_sysroot(fake_debian, sysroot, ["python3.11", "libnuma-dev"], *wheel_args)
    assert again.returncode == 0
    assert calls(fake_debian) == []  # complete: not even an apt-get update
    assert "nothing to do" in again.stdout


def test_sysroot_step_interrupted_resumes_with_what_is_missing(
        tmp_path: Path, fake_debian: dict[str, str]) -> None:
    sysroot = tmp_path / "sysroot"
    fake_debian["FAKE_DPKG_FAIL"] = "libhwloc15"
    proc = run_sysroot(fake_debian, sysroot, ["libc6", "libhwloc15", "libgomp1"])
    assert proc.returncode != 0
    assert "dpkg -x" in proc.stderr and "exited 2" in proc.stderr
    assert not crossbuild.stamp_path(sysroot).exists()  # never a stamp for half a sysroot
    calls(fake_debian)

    fake_debian["FAKE_DPKG_FAIL"] = ""
    # what an interrupted download may leave: never unpacked in place of the fresh one
    (sysroot / ".dsv4/downloads/libhwloc15_0.9_arm64.deb").write_text("half-written\n")
    proc = run_sysroot(fake_debian, sysroot, ["libc6", "libhwloc15", "libgomp1"])
    assert proc.returncode == 0, proc.stderr
    done = calls(fake_debian)
    # the architecture is known now and libc6 is unpacked: only the rest is fetched
    assert done[:2] == ["apt-get update", "apt-get download libhwloc15:arm64 libgomp1:arm64"]
    assert [c.split()[2].rsplit("/", 1)[1] for c in done[2:]] == [
        "libhwloc15_1.0_arm64.deb", "libgomp1_1.0_arm64.deb"]
    assert crossbuild.stamp_path(sysroot).exists()
    assert (sysroot / "usr/share/doc/libhwloc15/unpacked").read_text() == "libhwloc15\n"

    # a longer list later: the stamp no longer names the request, only the new one is fetched
    proc = run_sysroot(fake_debian, sysroot, ["libc6", "libhwloc15", "libgomp1", "zlib1g"])
    assert proc.returncode == 0
    assert calls(fake_debian)[:2] == ["apt-get update", "apt-get download zlib1g:arm64"]


def test_sysroot_step_says_when_apt_left_no_deb(tmp_path: Path,
                                                fake_debian: dict[str, str]) -> None:
    quiet_apt = Path(fake_debian["PATH"].split(os.pathsep)[0]) / "apt-get"
    quiet_apt.write_text('#!/bin/sh\necho "apt-get $*" >> "$FAKE_LOG"\n')
    proc = run_sysroot(fake_debian, tmp_path / "s", ["libnuma1"])
    assert proc.returncode != 0
    assert "left no .deb for libnuma1:arm64" in proc.stderr


def test_deb_and_wheel_file_matching() -> None:
    files = [Path("libc6-dev_2.36_arm64.deb"), Path("libc6_2.36-9+deb12u14_arm64.deb"),
             Path("gcc-12-base_12.2.0_amd64.deb"), Path("tzdata_2024a_all.deb")]
    assert crossbuild.deb_for("libc6", "arm64", files) == files[1]
    assert crossbuild.deb_for("gcc-12-base", "arm64", files) is None  # wrong architecture
    assert crossbuild.deb_for("tzdata", "arm64", files) == files[3]
    wheels = [Path("numpy-2.2.6-cp311-cp311-manylinux_2_17_aarch64.manylinux2014_aarch64.whl")]
    assert crossbuild.wheel_for("numpy", wheels) == wheels[0]
    assert crossbuild.wheel_for("numpy-quaternion", wheels) is None


def test_a_wheel_that_escapes_its_site_dir_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / "evil-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("../../outside.py", "x = 1\n")
    with pytest.raises(Exception, match="escapes the site dir"):
        crossbuild.unpack_wheel(wheel, tmp_path / "site")
    assert not (tmp_path.parent / "outside.py").exists()


# --- the CMake side -------------------------------------------------------------------------


KUNPENG_ENV = {"CPUINFER_ARM_DOTPROD": "ON", "CPUINFER_ARM_FP16": "ON", "CPUINFER_ARM_SVE": "OFF",
               "CPUINFER_ARM_BF16": "OFF", "CPUINFER_ARM_I8MM": "OFF",
               "CPUINFER_USE_ASCEND_NPU": "0", "CPUINFER_ENABLE_KML": "OFF",
               "CPUINFER_ENABLE_BLIS": "OFF"}


def defines(env: dict[str, str]) -> list[str]:
    return crossbuild.kt_kernel_defines(env, output_dir=Path("/w/python"),
                                        python_executable=Path("/w/target-python"),
                                        python_include_dir=Path("/s/usr/include/python3.11"))


def test_kunpeng_env_gives_the_defines_setup_py_forwards() -> None:
    got = defines(KUNPENG_ENV)
    for want in ("-DLLAMA_ARM_DOTPROD=ON", "-DLLAMA_ARM_FP16=ON", "-DLLAMA_ARM_SVE=OFF",
                 "-DLLAMA_ARM_BF16=OFF", "-DLLAMA_ARM_I8MM=OFF",
                 "-DKTRANSFORMERS_USE_ASCEND_NPU=OFF", "-DKTRANSFORMERS_CPU_USE_KML=OFF",
                 "-DKTRANSFORMERS_CPU_MOE_AMD=OFF", "-DLLAMA_NATIVE=ON",
                 "-DCMAKE_BUILD_TYPE=Release", "-DPYTHON_EXECUTABLE=/w/target-python",
                 "-DCMAKE_LIBRARY_OUTPUT_DIRECTORY=/w/python/",
                 "-DPYTHON_INCLUDE_DIR=/s/usr/include/python3.11"):
        assert want in got, want
    # setup.py's spellings of a switch (_env_get_bool); an unknown word is no decision
    assert "-DLLAMA_ARM_SVE=ON" in defines({**KUNPENG_ENV, "CPUINFER_ARM_SVE": "yes"})
    assert "-DLLAMA_ARM_DOTPROD=OFF" in defines({**KUNPENG_ENV, "CPUINFER_ARM_DOTPROD": "maybe"})
    assert not any("ASCEND" in d for d in defines({"CPUINFER_ARM_DOTPROD": "ON"}))
    assert defines({"CMAKE_ARGS": "-DFOO=1  -DBAR=2"})[-2:] == ["-DFOO=1", "-DBAR=2"]


def test_the_sve_switch_is_settable_from_the_command_line() -> None:
    recipe = load_recipe("dsv4-flash-arm-rehearsal",
                         ["build.steps.1.env.CPUINFER_ARM_SVE=ON"])
    step = recipe.build.steps[1]
    assert step.name == "kt-kernel"
    assert "-DLLAMA_ARM_SVE=ON" in defines(dict(step.env))
    assert "-DLLAMA_ARM_SVE=OFF" in defines(dict(load_recipe(
        "dsv4-flash-arm-rehearsal").build.steps[1].env))


def test_the_rehearsal_applies_the_deliverys_kt_kernel_patches_alone() -> None:
    recipe, series = load_recipe_and_series("dsv4-flash-arm-rehearsal")
    assert [s.name for s in recipe.sources] == [
        "ktransformers", "llama.cpp", "pybind11", "cann-recipes-infer"]
    production = load_series(crossbuild_series_path("dsv4-flash"))
    wanted = [p for p in production.patches if p.target in ("ktransformers", "llama.cpp")]
    assert series.patches == wanted  # same files, same digests, same order; no patch of ours
    assert all(p.origin.source == "cann-recipes-infer" for p in series.patches)
    assert [s.name for s in recipe.build.steps] == ["sysroot-arm64", "kt-kernel"]


def crossbuild_series_path(name: str) -> Path:
    from dsv4_offload.recipe import BUNDLED_SERIES

    return BUNDLED_SERIES / f"{name}.yaml"


def test_step_commands_name_the_tool_python_and_the_workspace(tmp_path: Path) -> None:
    from dsv4_offload.build.bringup import Placeholders
    from dsv4_offload.recipe import load_recipe
    from dsv4_offload.workspace.store import Workspace

    places = Placeholders(load_recipe("dsv4-flash-arm-rehearsal"), Workspace(tmp_path),
                          "/usr/bin/python3.11")
    argv = places.argv(["{tool_python}", "-m", "x", "--dir", "{workspace}/sysroot", "{python}"],
                       tmp_path)
    assert argv == [sys.executable, "-m", "x", "--dir", f"{tmp_path}/sysroot",
                    "/usr/bin/python3.11"]


def test_toolchain_file_names_the_cross_compilers_and_the_sysroot(tmp_path: Path) -> None:
    target = crossbuild.CrossTarget(triple=CROSS, processor="aarch64", sysroot=tmp_path / "s")
    text = crossbuild.toolchain_file(target)
    for line in ("set(CMAKE_SYSTEM_NAME Linux)", "set(CMAKE_SYSTEM_PROCESSOR aarch64)",
                 f'set(CMAKE_C_COMPILER "/usr/bin/{CROSS}-gcc")',
                 f'set(CMAKE_CXX_COMPILER "/usr/bin/{CROSS}-g++")',
                 f'set(CMAKE_FIND_ROOT_PATH "/usr/{CROSS}" "{tmp_path}/s")',
                 "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)",
                 "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)",
                 "set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)",
                 "set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)",
                 f'set(ENV{{PKG_CONFIG_SYSROOT_DIR}} "{tmp_path}/s")'):
        assert line in text.splitlines(), line
    assert f"-Wl,-rpath-link,{tmp_path}/s/lib/{CROSS},-rpath-link,{tmp_path}/s/usr/lib/{CROSS}" \
        in text


TOY_CMAKE = """cmake_minimum_required(VERSION 3.16)
project(toy C)
find_package(PkgConfig REQUIRED)
pkg_search_module(TOY REQUIRED IMPORTED_TARGET toylib)
find_library(TOY_LIBRARY NAMES toylib)
message(STATUS "toy processor: ${CMAKE_SYSTEM_PROCESSOR}")
message(STATUS "toy library: ${TOY_LIBRARY}")
message(STATUS "toy cflags: ${TOY_CFLAGS}")
add_executable(toy main.c)
target_link_libraries(toy PRIVATE PkgConfig::TOY)
"""


@pytest.mark.skipif(shutil.which(f"{CROSS}-gcc") is None or shutil.which("cmake") is None
                    or shutil.which("pkg-config") is None,
                    reason=f"needs {CROSS}-gcc, cmake and pkg-config (.ci/run installs them)")
def test_toolchain_file_finds_the_sysroots_library_through_pkg_config(tmp_path: Path) -> None:
    """A real configure + build: pkg-config and find_library reach into the sysroot, a header
    that only the sysroot has is found, and the result is an aarch64 executable."""
    sysroot = tmp_path / "sysroot"
    libdir = sysroot / "usr/lib" / CROSS
    (libdir / "pkgconfig").mkdir(parents=True)
    (sysroot / "usr/include/toy").mkdir(parents=True)
    # one header on the pkg-config -I path, one only in the sysroot's /usr/include (the way
    # numa.h and the python headers are found: -idirafter)
    (sysroot / "usr/include/toy/toy_config.h").write_text("#define TOY_SEVEN 7\n")
    (sysroot / "usr/include/toylib.h").write_text("int toy(void);\n")
    src = tmp_path / "toylib.c"
    src.write_text("int toy(void) { return 7; }\n")
    subprocess.run([f"{CROSS}-gcc", "-shared", "-fPIC", str(src), "-o",
                    str(libdir / "libtoylib.so")], check=True, timeout=120)
    (libdir / "pkgconfig/toylib.pc").write_text(
        "prefix=/usr\nlibdir=${prefix}/lib/" + CROSS + "\nincludedir=${prefix}/include/toy\n"
        "Name: toylib\nDescription: t\nVersion: 1\nLibs: -L${libdir} -ltoylib\n"
        "Cflags: -I${includedir}\n")
    project = tmp_path / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(TOY_CMAKE)
    (project / "main.c").write_text("#include <toylib.h>\n#include <toy_config.h>\n"
                                    "int main(void) { return toy() - TOY_SEVEN; }\n")
    target = crossbuild.CrossTarget(triple=CROSS, processor="aarch64", sysroot=sysroot)
    toolchain = tmp_path / "toolchain.cmake"
    toolchain.write_text(crossbuild.toolchain_file(target))
    build = tmp_path / "build"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PKG_CONFIG")}
    conf = subprocess.run(["cmake", "-S", str(project), "-B", str(build),
                           f"-DCMAKE_TOOLCHAIN_FILE={toolchain}"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert conf.returncode == 0, conf.stdout + conf.stderr
    assert "-- toy processor: aarch64" in conf.stdout
    assert f"-- toy library: {libdir}/libtoylib.so" in conf.stdout
    assert f"-- toy cflags: -I{sysroot}/usr/include/toy" in conf.stdout  # sysroot-prefixed
    made = subprocess.run(["cmake", "--build", str(build)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    with open(build / "toy", "rb") as fh:
        header = fh.read(20)
    assert header[:4] == b"\x7fELF" and header[18] == 0xB7  # e_machine EM_AARCH64


# --- the recipe's markers against the real configure output ----------------------------------

# the `-- ` lines of the real configure of the delivery-patched kt-kernel by this recipe
# (`dsv4-offload --recipe dsv4-flash-arm-rehearsal build kt-kernel`, 2026-12-03, captured;
# see fixtures/arm-rehearsal/README.md)
CONFIGURE_LOG = Path(__file__).parent / "fixtures/arm-rehearsal/configure-kunpeng920.log"


def markers_missing(text: str, recipe_overrides: list[str] | None = None) -> list[str]:
    import re

    step = load_recipe("dsv4-flash-arm-rehearsal", recipe_overrides).build.steps[1]
    return [m for m in step.expect_markers if not re.search(m, text, re.MULTILINE)]


def test_the_markers_match_the_real_kunpeng920_configure() -> None:
    text = CONFIGURE_LOG.read_text()
    assert markers_missing(text) == []


def test_an_sve_or_bf16_or_i8mm_target_line_fails_the_exact_marker() -> None:
    exact = r"^-- ARM target: -march=(armv8\.2-a)(\+fp16)(\+dotprod)$"
    # the real configure with CPUINFER_ARM_SVE=ON (captured)
    sve = (CONFIGURE_LOG.parent / "configure-sve.log").read_text()
    assert "-- ARM target: -march=armv8.2-a+fp16+dotprod+sve\n" in sve
    assert markers_missing(sve) == [exact]
    # +bf16 and +i8mm: the same line as CMakeLists.txt lines 227-232 append them
    text = CONFIGURE_LOG.read_text()
    line = "-- ARM target: -march=armv8.2-a+fp16+dotprod"
    assert line + "\n" in text
    for extra in ("+bf16", "+i8mm"):
        assert markers_missing(text.replace(line + "\n", line + extra + "\n")) == [exact]


def test_the_forbidden_markers_name_the_sve_build_and_spare_the_right_one() -> None:
    import re

    step = load_recipe("dsv4-flash-arm-rehearsal").build.steps[1]
    right = CONFIGURE_LOG.read_text()
    sve = (CONFIGURE_LOG.parent / "configure-sve.log").read_text()
    assert [m for m in step.forbid_markers if re.search(m, right, re.MULTILINE)] == []
    assert [m for m in step.forbid_markers if re.search(m, sve, re.MULTILINE)] == [
        r"^-- ARM target: -march=\S*\+(sve|bf16|i8mm)"]


def test_a_step_in_the_workspaces_own_dir_gets_it_made_a_checkout_never(tmp_path: Path) -> None:
    from dsv4_offload.stages import build
    from dsv4_offload.workspace.context import StageContext
    from dsv4_offload.workspace.store import Workspace

    recipe, series = load_recipe_and_series("dsv4-flash-arm-rehearsal", [
        'build.steps.0.command=["sh", "-c", "pwd > where.txt"]',
        'build.steps.1.command=["sh", "-c", "pwd > where.txt"]'])
    ctx = StageContext(recipe=recipe, series=series, workspace=Workspace(tmp_path),
                       options={}, stage="build")
    sysroot_step, kt_step = recipe.build.steps
    report = build.run_step(ctx, sysroot_step, sys.executable, None)
    assert report.status == "ok", report.message
    assert (tmp_path / "sysroot-arm64/where.txt").read_text().strip() == \
        str(tmp_path / "sysroot-arm64")
    report = build.run_step(ctx, kt_step, sys.executable, None)
    assert report.status == "failed"
    assert report.message == f"{tmp_path}/src/ktransformers/kt-kernel does not exist"
    assert "dsv4-offload fetch" in report.fix
    assert not (tmp_path / "src").exists()


def test_the_sve_configure_fails_the_build_with_the_fix(tmp_path: Path) -> None:
    """The kt-kernel step fed the real SVE configure output: failed, and the fix names it."""
    from dsv4_offload.stages import build
    from dsv4_offload.workspace.context import StageContext
    from dsv4_offload.workspace.store import Workspace

    sve_log = CONFIGURE_LOG.parent / "configure-sve.log"
    recipe, series = load_recipe_and_series("dsv4-flash-arm-rehearsal", [
        f'build.steps.1.command=["cat", "{sve_log}"]'])
    (tmp_path / "src/ktransformers/kt-kernel").mkdir(parents=True)
    ctx = StageContext(recipe=recipe, series=series, workspace=Workspace(tmp_path),
                       options={}, stage="build")
    report = build.run_step(ctx, recipe.build.steps[1], sys.executable, None)
    assert report.status == "failed"
    assert "ARM target" in report.message
    assert "CPUINFER_ARM_SVE" in build._fix_for(recipe.build.steps[1], report)


@pytest.mark.parametrize("cpu", [None, "cortex-a53"])
def test_the_rehearsals_selftest_child_runs_under_qemu_with_the_sysroot_python(
        tmp_path: Path, cpu: str | None) -> None:
    from dsv4_offload.stages import selftest
    from dsv4_offload.workspace.context import StageContext

    overrides = [f"selftest.emulator.cpu={cpu}"] if cpu else []
    recipe, series = load_recipe_and_series("dsv4-flash-arm-rehearsal", overrides)
    ctx = StageContext(recipe=recipe, series=series, workspace=Workspace(tmp_path),
                       options={}, stage="selftest")
    argv, env = selftest.child_argv(ctx, tmp_path / "spec.json")
    sysroot = tmp_path / "sysroot-arm64"
    assert argv == ["qemu-aarch64", "-cpu", cpu or "cortex-a76", "-L", str(sysroot),
                    str(sysroot / "usr/bin/python3.11"), str(selftest.CHILD),
                    str(tmp_path / "spec.json")]
    # the aarch64 module the cross build wrote comes first on the guest's path
    assert env["PYTHONPATH"].split(os.pathsep)[0] == \
        str(tmp_path / "src/ktransformers/kt-kernel/python")
    # the sysroot step writes where the emulator reads (one directory, named twice)
    assert "{workspace}/sysroot-arm64" in recipe.build.steps[0].command
    assert recipe.selftest.emulator is not None
    assert recipe.selftest.emulator.sysroot == "sysroot-arm64"


PROBE_CMAKE = """cmake_minimum_required(VERSION 3.16)
project(probe C)
message(STATUS "probe: SVE=${LLAMA_ARM_SVE} DOTPROD=${LLAMA_ARM_DOTPROD} "
               "ASCEND=${KTRANSFORMERS_USE_ASCEND_NPU} TYPE=${CMAKE_BUILD_TYPE}")
message(STATUS "probe: python=${PYTHON_EXECUTABLE}")
message(STATUS "probe: out=${CMAKE_LIBRARY_OUTPUT_DIRECTORY}")
message(STATUS "probe: cc=${CMAKE_C_COMPILER} processor=${CMAKE_SYSTEM_PROCESSOR}")
"""


@pytest.mark.skipif(shutil.which(f"{CROSS}-gcc") is None or shutil.which(f"{CROSS}-g++") is None
                    or shutil.which("cmake") is None or shutil.which("pkg-config") is None
                    or shutil.which("qemu-aarch64") is None,
                    reason="needs the aarch64 cross compilers, cmake, pkg-config and qemu-user")
@pytest.mark.parametrize("sve", ["OFF", "ON"])
def test_the_cmake_step_hands_the_recipes_switches_to_cmake(tmp_path: Path, sve: str) -> None:
    """`cross cmake` on a probe project, with the recipe's kt-kernel env (and --set SVE)."""
    sysroot = tmp_path / "sysroot"
    crossbuild.write_stamp(crossbuild.SysrootRequest(sysroot=sysroot, arch="arm64",
                                                     packages=("python3.11",)))
    (sysroot / "usr/bin").mkdir(parents=True)
    (sysroot / "usr/bin/python3.11").write_text("")  # never run: the probe has no python
    project = tmp_path / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(PROBE_CMAKE)
    step = load_recipe("dsv4-flash-arm-rehearsal",
                       [f"build.steps.1.env.CPUINFER_ARM_SVE={sve}"]).build.steps[1]
    env = {**os.environ, **step.env}
    proc = subprocess.run(
        [sys.executable, "-m", "dsv4_offload.cli.cross", "cmake", "--source", str(project),
         "--sysroot", str(sysroot), "--build-dir", str(tmp_path / "build"),
         "--output", str(tmp_path / "out")], env=env, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith("-- probe: ")]
    assert lines == [
        f"-- probe: SVE={sve} DOTPROD=ON ASCEND=OFF TYPE=Release",
        f"-- probe: python={tmp_path}/build/target-python",
        f"-- probe: out={tmp_path}/out/",
        f"-- probe: cc=/usr/bin/{CROSS}-gcc processor=aarch64"]
    launcher = (tmp_path / "build/target-python").read_text()
    assert f"exec qemu-aarch64 -L {sysroot} {sysroot}/usr/bin/python3.11 \"$@\"" in launcher


def test_the_cmake_step_wants_the_sysroot_first(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dsv4_offload.cli.cross", "cmake", "--sysroot",
         str(tmp_path / "sysroot"), "--build-dir", str(tmp_path / "b"), "--output",
         str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"error: the sysroot is not there ({tmp_path}/sysroot/.dsv4/sysroot.json); run the "
        "recipe's sysroot build step first (`dsv4-offload build sysroot-arm64`)")
    assert not (tmp_path / "b").exists()
