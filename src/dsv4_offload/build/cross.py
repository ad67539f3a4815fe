"""Cross builds for an aarch64 rehearsal on another machine: the sysroot and the CMake side.

1. The sysroot: Debian packages of the target architecture, downloaded with ``apt-get
   download`` and unpacked with ``dpkg -x`` (never installed), plus pure wheels of the
   target platform (numpy) unpacked onto the emulated interpreter's path. Each unpacked
   package leaves a mark, and a stamp naming the whole request is written only once all is
   there, so a rerun skips what is done and an interrupted one resumes.
2. The CMake side: a toolchain file (cross compilers, find-root into the sysroot, pkg-config
   into the sysroot, rpath-link) and the ``-D`` options kt-kernel's setup.py would forward on
   the target, computed from the same ``CPUINFER_*`` environment variables.

Pure functions return plans, file texts and argv lists; running them is the caller's (see
``dsv4_offload.cli.cross``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from dsv4_offload.core.errors import InputError

MARKS_DIR = ".dsv4"  # inside the sysroot: unpack marks, the stamp, the downloads
STAMP_NAME = "sysroot.json"
TOOLCHAIN_NAME = "toolchain.cmake"
PYTHON_LAUNCHER = "target-python"
# where Debian's python3.11 looks for packages that are not in its stdlib (site.py, Debian)
DEFAULT_SITE_DIR = "usr/lib/python3/dist-packages"


# --- the sysroot ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SysrootRequest:
    """What a sysroot must hold: packages of ``arch`` and wheels for ``wheel_platform``."""

    sysroot: Path
    arch: str
    packages: tuple[str, ...]
    wheels: tuple[str, ...] = ()
    wheel_platform: str = "manylinux2014_aarch64"
    python_version: str = "3.11"
    site_dir: str = DEFAULT_SITE_DIR

    def as_dict(self) -> dict[str, object]:
        return {"arch": self.arch, "packages": list(self.packages), "wheels": list(self.wheels),
                "wheel_platform": self.wheel_platform, "python_version": self.python_version,
                "site_dir": self.site_dir}


@dataclass
class SysrootPlan:
    request: SysrootRequest
    add_architecture: bool = False  # dpkg does not know the architecture yet
    packages: list[str] = field(default_factory=list)  # still to download and unpack
    wheels: list[str] = field(default_factory=list)  # still to download and unpack

    @property
    def complete(self) -> bool:
        return not (self.add_architecture or self.packages or self.wheels)


def marks_dir(sysroot: Path) -> Path:
    return sysroot / MARKS_DIR


def stamp_path(sysroot: Path) -> Path:
    return marks_dir(sysroot) / STAMP_NAME


def _mark(sysroot: Path, kind: str, name: str) -> Path:
    return marks_dir(sysroot) / kind / f"{name}.done"


def read_stamp(sysroot: Path) -> dict[str, object] | None:
    try:
        data = json.loads(stamp_path(sysroot).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def plan_sysroot(request: SysrootRequest, foreign_archs: list[str], native_arch: str
                 ) -> SysrootPlan:
    """What is left to do; a stamp that names this very request means nothing is."""
    plan = SysrootPlan(request)
    stamp = read_stamp(request.sysroot)
    if stamp is not None and stamp.get("request") == request.as_dict():
        return plan
    plan.add_architecture = (request.arch != native_arch
                             and request.arch not in foreign_archs)
    plan.packages = [p for p in request.packages
                     if not _mark(request.sysroot, "debs", p).exists()]
    plan.wheels = [w for w in request.wheels
                   if not _mark(request.sysroot, "wheels", w).exists()]
    return plan


def apt_download_argv(plan: SysrootPlan) -> list[str]:
    return ["apt-get", "download", *(f"{p}:{plan.request.arch}" for p in plan.packages)]


def pip_download_argv(python: str, plan: SysrootPlan, dest: Path,
                      find_links: Path | None = None) -> list[str]:
    """pip's download of the target platform's binary wheels (``find_links``: offline)."""
    r = plan.request
    local = ["--no-index", "--find-links", str(find_links)] if find_links else []
    return [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--platform", r.wheel_platform, "--python-version", r.python_version,
            *local, "--dest", str(dest), *plan.wheels]


def deb_for(package: str, arch: str, files: list[Path]) -> Path | None:
    """The ``apt-get download`` file of a package (``NAME_VERSION_ARCH.deb``; ARCH may be all)."""
    for f in sorted(files):
        name, _, rest = f.name.partition("_")
        if name == package and rest.endswith((f"_{arch}.deb", "_all.deb")):
            return f
    return None


def wheel_for(project: str, files: list[Path]) -> Path | None:
    """The downloaded wheel of a project (wheel names normalise '-' to '_')."""
    want = project.lower().replace("-", "_")
    for f in sorted(files):
        if f.suffix == ".whl" and f.name.split("-", 1)[0].lower() == want:
            return f
    return None


def unpack_wheel(wheel: Path, site: Path) -> None:
    """Unpack a wheel onto a site dir (what pip does for a pure unpack, without RECORD work)."""
    import zipfile

    site.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            target = (site / info.filename).resolve()
            if not target.is_relative_to(site.resolve()):
                raise InputError(f"{wheel}: member '{info.filename}' escapes the site dir; "
                                 "refusing this wheel")
        zf.extractall(site)
        # zipfile drops the mode bits: keep executables (e.g. numpy's f2py) executable
        for info in zf.infolist():
            mode = info.external_attr >> 16
            if mode & 0o111:
                os.chmod(site / info.filename, mode & 0o777)


def mark_done(sysroot: Path, kind: str, name: str, what: str) -> None:
    mark = _mark(sysroot, kind, name)
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(what + "\n", encoding="utf-8")


def write_stamp(request: SysrootRequest) -> Path:
    """Written last, once every package and wheel is unpacked."""
    from dsv4_offload.core.clock import now_iso
    from dsv4_offload.workspace.store import atomic_write_json

    path = stamp_path(request.sysroot)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"schema": 1, "written": now_iso(), "request": request.as_dict()})
    return path


# --- the CMake side -------------------------------------------------------------------------


@dataclass(frozen=True)
class CrossTarget:
    """A GNU cross toolchain (``<triple>-gcc``) and the sysroot it links against."""

    triple: str  # aarch64-linux-gnu
    processor: str  # CMAKE_SYSTEM_PROCESSOR: aarch64
    sysroot: Path
    compiler_dir: Path = Path("/usr/bin")

    @property
    def cc(self) -> Path:
        return self.compiler_dir / f"{self.triple}-gcc"

    @property
    def cxx(self) -> Path:
        return self.compiler_dir / f"{self.triple}-g++"

    @property
    def cross_prefix(self) -> Path:
        # Debian's cross packages put the target's libc and libstdc++ here
        return Path("/usr") / self.triple

    def lib_dirs(self) -> list[Path]:
        # bookworm's libc6 still ships /lib/<triple>; newer packages use /usr/lib/<triple>
        return [self.sysroot / "lib" / self.triple, self.sysroot / "usr" / "lib" / self.triple]

    def include_dirs(self) -> list[Path]:
        # after the toolchain's own dirs (-idirafter), so its libc headers keep priority and
        # only what it lacks (hwloc.h, numa.h, the python headers) comes from the sysroot
        return [self.sysroot / "usr" / "include", self.sysroot / "usr" / "include" / self.triple]

    def pkg_config_libdir(self) -> list[Path]:
        return [self.sysroot / "usr" / "lib" / self.triple / "pkgconfig",
                self.sysroot / "usr" / "share" / "pkgconfig"]


def _cmake_quote(value: str | Path) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def toolchain_file(target: CrossTarget) -> str:
    """The text of a CMake toolchain file for ``target``."""
    roots = " ".join(_cmake_quote(p) for p in (target.cross_prefix, target.sysroot))
    rpath_link = ",".join(f"-rpath-link,{d}" for d in target.lib_dirs())
    idirafter = " ".join(f"-idirafter {d}" for d in target.include_dirs())
    pc_libdir = os.pathsep.join(str(p) for p in target.pkg_config_libdir())
    lines = [
        "# Written by dsv4-offload (crossbuild.toolchain_file); regenerated on every build.",
        "set(CMAKE_SYSTEM_NAME Linux)",
        f"set(CMAKE_SYSTEM_PROCESSOR {target.processor})",
        f"set(CMAKE_C_COMPILER {_cmake_quote(target.cc)})",
        f"set(CMAKE_CXX_COMPILER {_cmake_quote(target.cxx)})",
        f"set(CMAKE_LIBRARY_ARCHITECTURE {target.triple})",
        f"set(CMAKE_FIND_ROOT_PATH {roots})",
        "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)",
        # hwloc is found through pkg-config (kt-kernel CMakeLists: pkg_search_module(HWLOC))
        f"set(ENV{{PKG_CONFIG_LIBDIR}} {_cmake_quote(pc_libdir)})",
        f"set(ENV{{PKG_CONFIG_SYSROOT_DIR}} {_cmake_quote(target.sysroot)})",
        'set(ENV{PKG_CONFIG_PATH} "")',
        f"set(CMAKE_C_FLAGS_INIT {_cmake_quote(idirafter)})",
        f"set(CMAKE_CXX_FLAGS_INIT {_cmake_quote(idirafter)})",
    ]
    for kind in ("EXE", "SHARED", "MODULE"):
        lines.append(f"set(CMAKE_{kind}_LINKER_FLAGS_INIT {_cmake_quote('-Wl,' + rpath_link)})")
    return "\n".join(lines) + "\n"


def python_launcher(target: CrossTarget, python: str, emulator: str) -> str:
    """A host-runnable stand-in for the target python (CMake runs PYTHON_EXECUTABLE to ask it
    for its paths and EXT_SUFFIX), so the configure works with or without binfmt_misc."""
    import shlex

    return ("#!/bin/sh\n# Written by dsv4-offload: the target python under user-mode emulation.\n"
            f"exec {shlex.quote(emulator)} -L {shlex.quote(str(target.sysroot))} "
            f"{shlex.quote(str(target.sysroot / python))} \"$@\"\n")


# kt-kernel/setup.py (d7b5b49 + main_repo/0001): _env_get_bool, lines 72-81
_TRUE = ("1", "on", "true", "yes", "y", "enable", "enabled")
_FALSE = ("0", "off", "false", "no", "n", "disable", "disabled")
# kt-kernel/setup.py (d7b5b49 + main_repo/0001), lines 726-732: the ARM toggles it forwards
# on an aarch64 host, env -> -D
ARM_FEATURE_FORWARDS = (
    ("CPUINFER_ARM_DOTPROD", "LLAMA_ARM_DOTPROD"),
    ("CPUINFER_ARM_FP16", "LLAMA_ARM_FP16"),
    ("CPUINFER_ARM_SVE", "LLAMA_ARM_SVE"),
    ("CPUINFER_ARM_BF16", "LLAMA_ARM_BF16"),
    ("CPUINFER_ARM_I8MM", "LLAMA_ARM_I8MM"),
)
# kt-kernel/setup.py lines 572 and 580 (BLIS, KML), 702-703 (Ascend, forwarded only when on)
VENDOR_FORWARDS = (
    ("CPUINFER_ENABLE_BLIS", "KTRANSFORMERS_CPU_MOE_AMD"),
    ("CPUINFER_ENABLE_KML", "KTRANSFORMERS_CPU_USE_KML"),
    ("CPUINFER_USE_ASCEND_NPU", "KTRANSFORMERS_USE_ASCEND_NPU"),
)
# kt-kernel/setup.py lines 113-118 and 136-138: CPUINFER_CPU_INSTRUCT (default NATIVE)
CPU_INSTRUCT_FLAGS = {
    "FANCY": "-DLLAMA_NATIVE=OFF -DLLAMA_FMA=ON -DLLAMA_F16C=ON -DLLAMA_AVX=ON -DLLAMA_AVX2=ON "
             "-DLLAMA_AVX512=ON -DLLAMA_AVX512_FANCY_SIMD=ON",
    "AVX512": "-DLLAMA_NATIVE=OFF -DLLAMA_FMA=ON -DLLAMA_F16C=ON -DLLAMA_AVX=ON -DLLAMA_AVX2=ON "
              "-DLLAMA_AVX512=ON",
    "AVX2": "-DLLAMA_NATIVE=OFF -DLLAMA_FMA=ON -DLLAMA_F16C=ON -DLLAMA_AVX=ON -DLLAMA_AVX2=ON",
    "NATIVE": "-DLLAMA_NATIVE=ON",
}


def env_bool(env: dict[str, str], name: str) -> bool | None:
    """setup.py's reading of a switch: None when unset or not a recognised word."""
    value = env.get(name)
    if value is None:
        return None
    word = value.strip().lower()
    return True if word in _TRUE else False if word in _FALSE else None


def kt_kernel_defines(env: dict[str, str], *, output_dir: Path, python_executable: Path,
                      python_include_dir: Path) -> list[str]:
    """The -D options kt-kernel's setup.py passes on an aarch64 host, from the same env.

    Unset ARM toggles are OFF: setup.py would turn them on from the build host's cpuinfo,
    which in a cross build is not the target's, so only what the recipe says counts.
    """
    build_type = env.get("CPUINFER_BUILD_TYPE", "Release")  # setup.py line 121-122
    defines = [f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={output_dir}/",  # setup.py lines 557-561
               f"-DPYTHON_EXECUTABLE={python_executable}",
               f"-DCMAKE_BUILD_TYPE={build_type}"]
    mode = env.get("CPUINFER_CPU_INSTRUCT", "NATIVE").upper()
    defines += CPU_INSTRUCT_FLAGS.get(mode, CPU_INSTRUCT_FLAGS["NATIVE"]).split()
    for env_name, flag in VENDOR_FORWARDS:
        on = env_bool(env, env_name)
        if on is not None:
            defines.append(f"-D{flag}={'ON' if on else 'OFF'}")
    for env_name, flag in ARM_FEATURE_FORWARDS:
        defines.append(f"-D{flag}={'ON' if env_bool(env, env_name) else 'OFF'}")
    # the python the module binds to is the target's: its headers, not the build host's
    defines += [f"-DPYTHON_INCLUDE_DIR={python_include_dir}",
                "-DPYBIND11_PYTHONLIBS_OVERWRITE=OFF"]
    extra = env.get("CMAKE_ARGS")  # setup.py lines 743-745 (CMAKE_ARGS)
    if extra:
        defines += [a for a in extra.split() if a]
    return defines


def parallel_jobs(env: dict[str, str]) -> str:
    """setup.py's detect_parallel_jobs (lines 125-133)."""
    return env.get("CPUINFER_PARALLEL") or str(os.cpu_count() or 1)
