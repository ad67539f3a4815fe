"""`python -m dsv4_offload.cli.cross`: the cross-build steps a recipe's build section runs.

``sysroot``: make (or finish) a foreign-architecture sysroot from Debian packages and wheels.
``cmake``: configure and build a CMake project (kt-kernel) for the target with a generated
toolchain file and the -D options its setup.py would forward there.

The build stage runs these like any step (``{tool_python} -m dsv4_offload.cli.cross ...``)
and keeps their output in the step's log; a failure exits non-zero with a one-line reason.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from dsv4_offload.build import cross as crossbuild
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.runner import capture, run_attached
from dsv4_offload.workspace.store import atomic_write_bytes


def _say(line: str) -> None:
    print(line, flush=True)


def _run(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    _say(f"+ {shlex.join(argv)}")
    code = run_attached(argv, cwd=cwd, env=env, stdin=False)
    if code != 0:
        raise SystemExit(f"error: {shlex.join(argv[:3])} ... exited {code}")


def _capture(argv: list[str]) -> str:
    try:
        proc = capture(argv, timeout=None)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, argv)
        return proc.stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"error: {shlex.join(argv)} failed ({exc}); is dpkg installed? "
                         "(a Debian or Ubuntu build host is needed for the sysroot)") from None


def _require(tools: list[str], fix: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"error: {', '.join(missing)} not found on PATH; {fix}")


def cmd_sysroot(args: argparse.Namespace) -> int:
    sysroot = Path(args.dir).resolve()
    request = crossbuild.SysrootRequest(
        sysroot=sysroot, arch=args.arch, packages=tuple(args.package), wheels=tuple(args.wheel),
        wheel_platform=args.wheel_platform, python_version=args.python_version,
        site_dir=args.site_dir)
    _require(["dpkg", "apt-get"], "the sysroot is made from Debian packages: build on Debian "
             "or Ubuntu (apt-get install dpkg apt)")
    native = _capture(["dpkg", "--print-architecture"]).strip()
    foreign = _capture(["dpkg", "--print-foreign-architectures"]).split()
    plan = crossbuild.plan_sysroot(request, foreign, native)
    if plan.complete:
        _say(f"sysroot {sysroot}: complete ({len(request.packages)} packages, "
             f"{len(request.wheels)} wheels); nothing to do")
        return 0
    if plan.add_architecture and os.geteuid() != 0:
        raise SystemExit(
            f"error: dpkg does not know the {request.arch} architecture yet and adding it needs "
            f"root: run `sudo dpkg --add-architecture {request.arch} && sudo apt-get update`, "
            "then this step again")
    downloads = crossbuild.marks_dir(sysroot) / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    if plan.add_architecture:
        _run(["dpkg", "--add-architecture", request.arch])
    if plan.packages:
        for stale in downloads.glob("*.deb"):  # an interrupted run's, maybe half-written
            stale.unlink()
        _run(["apt-get", "update"])
        _run(crossbuild.apt_download_argv(plan), cwd=downloads)
        debs = list(downloads.glob("*.deb"))
        for package in plan.packages:
            deb = crossbuild.deb_for(package, request.arch, debs)
            if deb is None:
                raise SystemExit(f"error: apt-get download left no .deb for {package}:"
                                 f"{request.arch} in {downloads}")
            _run(["dpkg", "-x", str(deb), str(sysroot)])
            crossbuild.mark_done(sysroot, "debs", package, deb.name)
            deb.unlink()
    if plan.wheels:
        for stale in downloads.glob("*.whl"):
            stale.unlink()
        links = Path(args.find_links).resolve() if args.find_links else None
        _run(crossbuild.pip_download_argv(sys.executable, plan, downloads, links))
        wheels = list(downloads.glob("*.whl"))
        site = sysroot / request.site_dir
        for project in plan.wheels:
            wheel = crossbuild.wheel_for(project, wheels)
            if wheel is None:
                raise SystemExit(f"error: pip download left no wheel for {project} in "
                                 f"{downloads}")
            _say(f"+ unpack {wheel.name} -> {site}")
            crossbuild.unpack_wheel(wheel, site)
            crossbuild.mark_done(sysroot, "wheels", project, wheel.name)
            wheel.unlink()
    stamp = crossbuild.write_stamp(request)
    _say(f"sysroot {sysroot}: complete; stamp {stamp}")
    return 0


def cmd_cmake(args: argparse.Namespace) -> int:
    source = Path(args.source).resolve()
    build_dir = Path(args.build_dir).resolve()
    target = crossbuild.CrossTarget(triple=args.triple, processor=args.processor,
                                    sysroot=Path(args.sysroot).resolve())
    python = target.sysroot / args.python
    for what, path in (("the sysroot", crossbuild.stamp_path(target.sysroot)),
                       ("the target python", python)):
        if not path.exists():
            raise SystemExit(f"error: {what} is not there ({path}); run the recipe's sysroot "
                             "build step first (`dsv4-offload build sysroot-arm64`)")
    _require([str(target.cc), str(target.cxx)],
             f"apt-get install gcc-{args.triple} g++-{args.triple}")
    _require([args.emulator, "cmake", "pkg-config"],
             "apt-get install qemu-user cmake pkg-config")
    build_dir.mkdir(parents=True, exist_ok=True)
    toolchain = build_dir / crossbuild.TOOLCHAIN_NAME
    atomic_write_bytes(toolchain, crossbuild.toolchain_file(target).encode())
    launcher = build_dir / crossbuild.PYTHON_LAUNCHER
    atomic_write_bytes(launcher,
                       crossbuild.python_launcher(target, args.python, args.emulator).encode())
    launcher.chmod(0o755)
    env = dict(os.environ)
    # kt-kernel's CMakeLists forces CMAKE_<LANG>_COMPILER from CC/CXX when both are set
    # (lines 65-68): make them the cross compilers so it cannot pick the host's
    env["CC"], env["CXX"] = str(target.cc), str(target.cxx)
    include = target.sysroot / "usr" / "include" / f"python{args.python_version}"
    defines = crossbuild.kt_kernel_defines(
        env, output_dir=Path(args.output).resolve(), python_executable=launcher,
        python_include_dir=include)
    _say(f"toolchain file: {toolchain}")
    _run(["cmake", "-S", str(source), "-B", str(build_dir),
          f"-DCMAKE_TOOLCHAIN_FILE={toolchain}", *defines, *args.extra], env=env)
    _run(["cmake", "--build", str(build_dir), "--parallel", crossbuild.parallel_jobs(env)],
         env=env)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsv4_offload.cli.cross",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sysroot", help="download and unpack a foreign-architecture sysroot")
    s.add_argument("--dir", required=True, help="the sysroot directory")
    s.add_argument("--arch", required=True, help="Debian architecture, e.g. arm64")
    s.add_argument("--package", action="append", default=[], help="a Debian package")
    s.add_argument("--wheel", action="append", default=[], help="a PyPI project (binary)")
    s.add_argument("--wheel-platform", default="manylinux2014_aarch64")
    s.add_argument("--python-version", default="3.11")
    s.add_argument("--site-dir", default=crossbuild.DEFAULT_SITE_DIR,
                   help="where wheels go, relative to the sysroot")
    s.add_argument("--find-links", help="take wheels from this directory only (offline)")
    s.set_defaults(func=cmd_sysroot)
    c = sub.add_parser("cmake", help="cross-configure and build a CMake project")
    c.add_argument("--source", default=".", help="the CMakeLists.txt directory")
    c.add_argument("--build-dir", required=True)
    c.add_argument("--output", required=True, help="CMAKE_LIBRARY_OUTPUT_DIRECTORY")
    c.add_argument("--sysroot", required=True)
    c.add_argument("--triple", default="aarch64-linux-gnu")
    c.add_argument("--processor", default="aarch64")
    c.add_argument("--python", default="usr/bin/python3.11", help="relative to the sysroot")
    c.add_argument("--python-version", default="3.11")
    c.add_argument("--emulator", default="qemu-aarch64")
    c.add_argument("extra", nargs="*", help="more CMake arguments (after --)")
    c.set_defaults(func=cmd_cmake)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except InputError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
