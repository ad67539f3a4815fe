"""Every check made before work starts, declared once: what it reads, the stages it guards,
where it is judged (the host, the recipe's image, or the recipe alone).

doctor's rows carry their declaration (``guards``, ``where``) in its report; `run` shows
doctor's table first and a failing row stops only the stages it guards (and what needs
them); `recipe validate` judges the rows declared ``RECIPE``. A row with no declaration is
a test failure (tests/test_first_hour.py), so a new check says what it guards.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dsv4_offload.core.states import Word


class Where(Word):
    """Where a check is judged."""

    HOST = "host"  # facts of this machine
    IMAGE = "image"  # the recipe's image, when the stages it guards run there
    RECIPE = "recipe"  # the recipe alone: recipe validate judges it too


@dataclass(frozen=True)
class PreCheck:
    pattern: str  # the row's name, or a glob of names (tool rows named by their tool)
    reads: str
    guards: tuple[str, ...]
    where: Where = Where.HOST


BUILD = ("build", "selftest", "serve")
SERVE = ("serve", "accept")
TOOLCHAIN = ("build",)

DECLARED: tuple[PreCheck, ...] = (
    PreCheck("arch", "/proc/cpuinfo, uname", BUILD),
    PreCheck("cpu-flags", "/proc/cpuinfo flags", BUILD),
    PreCheck("cpu-build-off", "/proc/cpuinfo flags, the build environment", TOOLCHAIN),
    PreCheck("cores", "/proc/cpuinfo", ("serve",)),
    PreCheck("numa", "/sys/devices/system/node", ("serve",)),
    PreCheck("memory", "/proc/meminfo", SERVE),
    PreCheck("disk", "free space under the workspace, the plan's disk sets",
             ("download", "convert")),
    PreCheck("npu-*", "npu-smi info", SERVE),
    PreCheck("device-nodes", "/dev/davinci*", SERVE),
    PreCheck("docker", "the docker client on PATH", ()),
    PreCheck("python", "the build and serve interpreter", ("build", "selftest", "serve"),
             Where.IMAGE),
    PreCheck("git", "git --version", ("fetch", "patch")),
    PreCheck("cmake", "cmake --version", TOOLCHAIN, Where.IMAGE),
    PreCheck("gcc*", "the C compiler", TOOLCHAIN, Where.IMAGE),
    PreCheck("g++*", "the C++ compiler", TOOLCHAIN, Where.IMAGE),
    PreCheck("cc-compiles", "the C compiler and assembler", TOOLCHAIN, Where.IMAGE),
    PreCheck("lib*", "headers and shared libraries", TOOLCHAIN, Where.IMAGE),
    PreCheck("pkg-config", "pkg-config --version", TOOLCHAIN, Where.IMAGE),
    PreCheck("hwloc.pc", "pkg-config hwloc", TOOLCHAIN, Where.IMAGE),
    PreCheck("py-*", "the build python's packages", ("build", "selftest"), Where.IMAGE),
    PreCheck("cann", "the CANN toolkit", ("build", "serve"), Where.IMAGE),
    PreCheck("cross-*", "the cross toolchain", TOOLCHAIN),
    PreCheck("aarch64-linux-gnu-*", "the cross compilers", TOOLCHAIN),
    PreCheck("binfmt-*", "/proc/sys/fs/binfmt_misc", ("selftest",)),
    PreCheck("page-cache", "/proc/meminfo against the GGUF set", ("serve",)),
    PreCheck("memory-plan", "/proc/meminfo against the serve plan", ("serve",)),
    PreCheck("shm", "/dev/shm, /proc/*/fd and /proc/*/maps, the serve record", ("serve",)),
    # a figure for accept's ceilings: a host without sysbench still serves
    PreCheck("bandwidth", "sysbench memory read under numactl, per NUMA node (cached)", ()),
    PreCheck("serve-bind", "serve.host, serve.api_key_file", (), Where.RECIPE),
    PreCheck("extra-args", "serve.extra_args against sglang's flags", ("serve",),
             Where.RECIPE),
    PreCheck("container", "/.dockerenv, the environment", ()),
    PreCheck("image", "the recipe's image through docker", ("build", "serve", "accept")),
)


def declaration(name: str) -> PreCheck | None:
    """The declaration of a row named ``name`` (the first that matches), or None."""
    return next((d for d in DECLARED if fnmatch.fnmatchcase(name, d.pattern)), None)


def annotate(row: Mapping[str, Any]) -> dict[str, Any]:
    """A check row with its declaration: the stages it guards and where it is judged."""
    found = declaration(str(row.get("name", "")))
    if found is None:
        return dict(row)
    return {**row, "guards": list(found.guards), "where": str(found.where)}


def recipe_only(names: Iterable[str]) -> list[str]:
    """Of ``names``, those judged from the recipe alone."""
    return [n for n in names if (d := declaration(n)) is not None and d.where is Where.RECIPE]


def guarded(data: Any, stage: str) -> list[str] | None:
    """The failing rows of a preflight's result data (its ``checks``) that guard ``stage``;
    None when the data holds no declared rows (then every failure guards everything)."""
    checks = data.get("checks") if isinstance(data, Mapping) else None
    if not isinstance(checks, list) or not any(
            isinstance(c, Mapping) and "guards" in c for c in checks):
        return None
    return [str(c["name"]) for c in checks if isinstance(c, Mapping)
            and c.get("status") == "fail" and stage in (c.get("guards") or [])]
