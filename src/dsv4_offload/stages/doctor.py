"""The `doctor` stage: check this host against the recipe's `host` section.

Every check is a row (name, status ok/warn/fail/skip, observed, required, fix). A failed
row fails the stage (the CLI exits 1); warnings leave it usable. The report also goes to
``<workspace>/reports/doctor.json`` and the host facts into the stage outputs (provenance).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import Dsv4Error
from dsv4_offload.core.host import (
    HOST_ROOT_ENV,
    HostFacts,
    NpuInfo,
    choose_npu,
    npu_is_idle,
    npu_model_matches,
    parse_cpulist,
    probe_host,
    version_at_least,
    visible_device,
)
from dsv4_offload.core.options import PathText, StageOptions
from dsv4_offload.core.preflight import annotate, recipe_only
from dsv4_offload.core.results import FAIL, OK, SKIP, WARN, Check, Problem, StageResult, Status
from dsv4_offload.recipe import Recipe
from dsv4_offload.serving import bandwidth, extra_args, shm
from dsv4_offload.serving import supervisor as sv
from dsv4_offload.serving.image_rows import image_side, in_image, judged_in_the_image
from dsv4_offload.weights import diskplan
from dsv4_offload.weights.diskplan import FsNeed
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import atomic_write_json

GIB = 1024**3
KIB_PER_GIB = 1024**2

# cpuinfo flag -> the kt-kernel build switch that must stay OFF when the CPU has it
BUILD_SWITCH_FOR_FLAG = {
    "sve": "CPUINFER_ARM_SVE",
    "bf16": "CPUINFER_ARM_BF16",
    "i8mm": "CPUINFER_ARM_I8MM",
}
TOOL_FIXES = {
    "git": "apt-get install git (yum install git)",
    "cmake": "apt-get install cmake, or `python3.11 -m pip install cmake` for a newer one",
    "gcc": "apt-get install gcc g++ (yum install gcc gcc-c++)",
    "docker": "install Docker Engine (apt-get install docker.io) and add your user to the "
              "docker group",
}
PKG_CONFIG_FIXES = {
    "hwloc": "apt-get install libhwloc-dev (yum install hwloc-devel): it ships hwloc.pc",
}
LIBRARY_FIXES = {
    "hwloc": "apt-get install libhwloc-dev (yum install hwloc-devel); kt-kernel links hwloc "
             "and the 910B sglang image ships none",
    "numa": "apt-get install libnuma-dev (yum install numactl-devel)",
}
# a recipe that cross-builds for aarch64 (dsv4-flash-arm-rehearsal) runs the tool's own steps
CROSS_STEP_MODULE = "dsv4_offload.cli.cross"
_DEBIAN_ONLY = ("the arm64 sysroot is made of Debian packages (apt-get download, dpkg -x): use "
                "a Debian or Ubuntu machine")
CROSS_TOOL_FIXES = {
    "dpkg": _DEBIAN_ONLY,
    "apt-get": _DEBIAN_ONLY,
    "pkg-config": "apt-get install pkg-config (kt-kernel's CMake finds hwloc through it)",
    "qemu-aarch64": "apt-get install qemu-user (qemu-user-static binfmt-support also let "
                    "aarch64 programs run directly): it runs the aarch64 python for CMake and "
                    "the self-test",
}
BINFMT_DIR = "proc/sys/fs/binfmt_misc"
DRIVER_FIX = (
    "install the Ascend NPU driver and firmware for this card so `npu-smi info` works; in a "
    "container add --device /dev/davinciN --device /dev/davinci_manager --device /dev/devmm_svm "
    "--device /dev/hisi_hdc and mount /usr/local/Ascend/driver and /usr/local/sbin/npu-smi"
)


class DoctorOptions(StageOptions):
    device: int | None = None  # the NPU to check (default: the idlest)
    python: PathText | None = None  # the interpreter build, selftest and serve are to use
    bandwidth: bool = False  # measure the memory bandwidth again (else the cached figure)


Options = DoctorOptions


def _device_option(ctx: StageContext) -> int | None:
    value = ctx.options_as(DoctorOptions).device
    if value is None:
        return visible_device(os.environ)
    return value


def probe(ctx: StageContext) -> HostFacts:
    """Host facts with the extra probes this recipe needs (its compilers and python)."""
    recipe = ctx.recipe
    tools = [t for t in (recipe.platform.cc, recipe.platform.cxx) if t]
    tools += [t for t in recipe.host.tools if t not in ("gcc", "g++")]
    tools += cross_tools(recipe)
    if recipe.host.pkg_config:
        tools.append("pkg-config")
    python = str(ctx.options_as(DoctorOptions).python or recipe.build.interpreter)
    return probe_host(ctx.workspace.root, tools=tools, pythons=[recipe.build.interpreter],
                      device_nodes=recipe.host.npu_device_nodes,
                      pkg_config=recipe.host.pkg_config,
                      python_modules=[module_requirement(m)[0] for m in recipe.host.python_modules],
                      modules_python=python)


def module_requirement(entry: str) -> tuple[str, str | None]:
    """'numpy' -> ('numpy', None); 'setuptools>=77' -> ('setuptools', '77')."""
    name, _, minimum = entry.partition(">=")
    return name.strip(), (minimum.strip() or None)


def has_npu(recipe: Recipe) -> bool:
    """A recipe names the NPUs it serves on; one without (x86 development) checks none."""
    return bool(recipe.host.npu_models)


# --- checks, one function per area ----------------------------------------------------------


def check_cpu(recipe: Recipe, facts: HostFacts) -> list[Check]:
    host = recipe.host
    checks = []
    arch_ok = facts.arch == host.arch
    checks.append(Check(
        "arch", OK if arch_ok else FAIL, f"{facts.arch} ({facts.cpu_model})", host.arch,
        "" if arch_ok else (
            f"run on the {host.arch} host that holds the NPU (e.g. Kunpeng-920): kt-kernel's "
            "MXFP4 MoE kernel is NEON + SDOT code; this machine can still run `patch check` "
            "and `convert`" if has_npu(recipe) else
            f"run on an {host.arch} machine, or pick the recipe for this one "
            "(`dsv4-offload recipe list`)"),
    ))
    missing = [f for f in host.cpu_flags_required if f not in facts.cpu_flags]
    arm = host.arch == "aarch64"
    checks.append(Check(
        "cpu-flags", FAIL if missing else OK,
        f"missing {', '.join(missing)}" if missing else ", ".join(host.cpu_flags_required),
        "CPU flags " + ", ".join(host.cpu_flags_required),
        "" if not missing else (
            "use an ARMv8.2-A CPU with NEON, dotprod and fp16 (asimddp and asimdhp in "
            "/proc/cpuinfo, e.g. Kunpeng-920); kt-kernel is built with -march=armv8.2-a+fp16"
            "+dotprod, so without them its kernels die with SIGILL" if arm else
            "use a CPU with these flags: the kt-kernel build targets them (e.g. AVX2 for "
            "CPUINFER_CPU_INSTRUCT=AVX2) and dies with SIGILL without them"),
    ))
    present = [f for f in host.cpu_flags_build_off if f in facts.cpu_flags]
    build_env = {k: v for step in recipe.build.steps for k, v in step.env.items()}
    not_off = [BUILD_SWITCH_FOR_FLAG[f] for f in present
               if f in BUILD_SWITCH_FOR_FLAG and build_env.get(BUILD_SWITCH_FOR_FLAG[f]) != "OFF"]
    if not host.cpu_flags_build_off:
        pass  # nothing the recipe keeps out of the build
    elif not present:
        checks.append(Check("cpu-build-off", OK, "none of " + ", ".join(
            host.cpu_flags_build_off), "kept out of the kt-kernel build"))
    elif not_off:
        checks.append(Check(
            "cpu-build-off", FAIL, f"CPU has {', '.join(present)}; build env leaves "
            f"{', '.join(not_off)} unset", "each of them OFF in the kt-kernel build",
            "set " + ", ".join(f"build.steps[kt-kernel].env.{s}: \"OFF\"" for s in not_off)
            + " in the recipe: with SVE compiled in the MoE fails with `llamafile not supported`",
        ))
    else:
        checks.append(Check(
            "cpu-build-off", WARN, f"CPU has {', '.join(present)}",
            "kept out of the kt-kernel build",
            "nothing to do while the recipe's kt-kernel build keeps "
            + ", ".join(BUILD_SWITCH_FOR_FLAG[f] for f in present if f in BUILD_SWITCH_FOR_FLAG)
            + "=OFF (it does); a build with SVE on fails at run time with "
            "`llamafile not supported`",
        ))
    cores_ok = facts.cores >= host.min_cores
    checks.append(Check(
        "cores", OK if cores_ok else FAIL, str(facts.cores), f">= {host.min_cores} logical CPUs",
        "" if cores_ok else "use a host with more cores: the CPU experts decode on "
        f"{recipe.serve.threads_per_numa} threads per NUMA node",
    ))
    return checks


def check_numa(recipe: Recipe, facts: HostFacts) -> Check:
    nodes = facts.numa_nodes
    if "serve" in recipe.not_applicable:
        observed = f"{len(nodes)} node(s)" if nodes else "not visible"
        return Check("numa", SKIP, observed, "only serving splits threads per NUMA node")
    from dsv4_offload.serving.rules import cpu_plan, numa_warning

    serve = recipe.serve
    required = "one kt-kernel subpool per NUMA node, one CPU-infer thread per pool or more"
    if not nodes:
        return Check("numa", WARN, "no /sys/devices/system/node/node*", required,
                     numa_warning(nodes) or "")
    sizes = {len(parse_cpulist(c)) for c in facts.numa_cpulists.values() if c}
    observed = (f"{len(nodes)} nodes ({nodes[0]}-{nodes[-1]})" if len(nodes) > 1
                else f"1 node ({nodes[0]})")
    if len(sizes) == 1:
        observed += f", {sizes.pop()} CPUs each"
    try:
        # the very function the serve plan sizes --kt-threadpool-count/--kt-cpuinfer with
        cpus = cpu_plan(serve, nodes, facts.cores)
    except Dsv4Error as exc:  # fewer CPUs than pools: serve fails (exit 1) as planned
        return Check("numa", FAIL, f"{observed}; {facts.cores} CPUs", required, exc.message)
    holes = numa_warning(nodes)
    if holes:
        return Check("numa", WARN, observed + " (ids not contiguous)", required, holes)
    if cpus.warning:  # a fact of this host: serve goes on, with this consequence
        return Check("numa", WARN, f"{observed}; {facts.cores} CPUs", required, cpus.warning)
    return Check("numa", OK, observed + f"; serve: {cpus.pools} pool(s) x "
                 f"{cpus.threads // cpus.pools} threads ({cpus.threads} of {facts.cores} CPUs)",
                 required)


def check_memory_and_disk(recipe: Recipe, facts: HostFacts,
                          disk: list[FsNeed] | None = None) -> list[Check]:
    host = recipe.host
    checks = []
    need = f">= {host.memory_min_gib:g} GiB available ({host.memory_recommended_gib:g} " \
           "recommended)"
    if facts.mem_available_kib is None:
        checks.append(Check("memory", FAIL, "no MemAvailable in /proc/meminfo", need,
                            "run on a Linux host with a readable /proc/meminfo"))
    else:
        avail = facts.mem_available_kib / KIB_PER_GIB
        total = (facts.mem_total_kib or 0) / KIB_PER_GIB
        observed = f"{avail:,.0f} GiB available of {total:,.0f} GiB"
        fix = ("stop other large memory users or use a host with more DRAM: the 43 MXFP4 GGUF "
               "files (~138 GiB) stay in the page cache while serving")
        status = FAIL if avail < host.memory_min_gib else (
            WARN if avail < host.memory_recommended_gib else OK)
        checks.append(Check("memory", status, observed, need, "" if status == OK else fix))
    checks.append(diskplan.disk_check(recipe, facts.disk_free_bytes, disk))
    return checks


def check_memory_plan(recipe: Recipe, facts: HostFacts) -> Check:
    """DRAM for the plan `serve` will run: the GGUF set once with one threadpool, twice with
    several (the threadpool count from serving.rules.cpu_threads, as the plan takes it)."""
    from dsv4_offload.serving.rules import cpu_threads, dram_advice, env_number

    try:
        exported = env_number(os.environ, "KT_THREADPOOL_COUNT", int)
        pools, _ = cpu_threads(recipe.serve, facts.numa_nodes, facts.cores,
                               int(exported) if exported else None)
    except Dsv4Error:
        pools = max(1, len(facts.numa_nodes))
    required = "MemAvailable >= GGUF set x (1 with one threadpool, 2 with several) + margin"
    if facts.mem_available_kib is None:
        return Check("memory-plan", SKIP, "MemAvailable unknown", required, "")
    status, said = dram_advice(recipe, pools, facts.mem_available_kib / KIB_PER_GIB)
    observed = f"{pools} threadpool(s): " + (said if status == "ok" else said.split(":")[0])
    return Check("memory-plan", {"ok": OK, "warn": WARN, "fail": FAIL}[status], observed,
                 required, "" if status == "ok" else said)


def check_page_cache(recipe: Recipe, facts: HostFacts) -> Check:
    """Can MemAvailable hold the GGUF set, so `serve` warms it and loads in 2-3.5 min?"""
    conv = recipe.conversion
    need = conv.layers * conv.expected_file_bytes / GIB
    required = f"MemAvailable >= the GGUF set ({conv.layers} x {conv.expected_file_bytes:,} B " \
               f"= {need:,.0f} GiB)"
    if facts.mem_available_kib is None:
        return Check("page-cache", SKIP, "MemAvailable unknown", required, "")
    avail = facts.mem_available_kib / KIB_PER_GIB
    if avail >= need:
        return Check("page-cache", OK, f"{avail:,.0f} GiB available", required, "")
    return Check("page-cache", WARN, f"{avail:,.0f} GiB available", required,
                 "free memory before `serve`: it cannot warm the GGUF set into the page cache, "
                 "so kt-kernel reads it from disk while loading (far beyond 2-3.5 min)")


def check_serve_bind(recipe: Recipe) -> Check:
    """The delivery binds 0.0.0.0 with no key; say so unless a key or loopback is set."""
    from dsv4_offload.serving.rules import is_loopback

    serve = recipe.serve
    required = "an API key (serve --api-key-file) or a loopback bind"
    if is_loopback(serve.host) or serve.api_key_file or serve.command is not None:
        how = "API key file set" if serve.api_key_file else serve.host
        return Check("serve-bind", OK, how, required, "")
    return Check("serve-bind", WARN, f"{serve.host}:{serve.port} with no API key", required,
                 "start the server with `dsv4-offload serve --api-key-file FILE` (or --set "
                 "serve.api_key_file=FILE), or bind loopback: --set serve.host=127.0.0.1")


def recipe_rows(recipe: Recipe) -> list[Check]:
    """The rows judged from the recipe alone (core/preflight's RECIPE declarations), which
    `recipe validate` shows too."""
    if "serve" in recipe.not_applicable:
        return []
    rows = [check_serve_bind(recipe), extra_args.recipe_row(recipe.serve)]
    return [r for r in rows if r is not None and recipe_only([r.name])]


def check_python(ctx: StageContext, facts: HostFacts) -> Check:
    """Which interpreter build, selftest and serve use, and why (python_env.sh's choice)."""
    from dsv4_offload.build.interpreter import FALLBACK_SOURCE, REQUIRED_MODULES, chosen_python
    from dsv4_offload.core.errors import InputError

    required = f"one python that imports {' '.join(REQUIRED_MODULES)}"
    if facts.root != "/":
        return Check("python", SKIP, f"host read from {facts.root}", required, "")
    try:
        choice = chosen_python(ctx, python=ctx.options_as(DoctorOptions).python, record=False)
    except InputError as exc:
        return Check("python", WARN, exc.one_line().split(";")[0], required,
                     "set PYTHON_BIN (or --python) to the image's python 3.11 with torch and "
                     "torch_npu; `build` falls back to the recipe's build.python until then")
    if choice.source == FALLBACK_SOURCE:  # never green: nothing imports the modules yet
        return Check("python", WARN, f"{choice.path} ({choice.reason})", required,
                     "set PYTHON_BIN (or --python) to the image's python 3.11 with torch and "
                     "torch_npu")
    return Check("python", OK, f"{choice.path} ({choice.source}: {choice.reason})", required, "")


def _npu_list(npus: list[NpuInfo]) -> str:
    return ", ".join(str(n.device_id) for n in npus) or "none"


def check_npu(recipe: Recipe, facts: HostFacts, device: int | None
              ) -> tuple[list[Check], NpuInfo | None]:
    host = recipe.host
    frac = recipe.serve.mem_fraction_static
    checks: list[Check] = []
    if facts.npu_smi is None:
        checks.append(Check("npu-smi", FAIL, "not found", "`npu-smi info` lists the NPUs",
                            DRIVER_FIX))
    elif facts.npu_smi != "ok":
        checks.append(Check("npu-smi", FAIL, facts.npu_smi, "`npu-smi info` lists the NPUs",
                            "fix the driver: dcmi errors usually mean missing /dev/davinci* "
                            "nodes or a driver/firmware mismatch; " + DRIVER_FIX))
    else:
        checks.append(Check("npu-smi", OK, f"driver {facts.npu_driver or '?'}, "
                            f"{len(facts.npus)} NPU dies", "`npu-smi info` lists the NPUs"))
    wanted = "one of " + ", ".join(host.npu_models)
    names = sorted({n.model for n in facts.npus})
    matching = [n for n in facts.npus if any(npu_model_matches(n, m) for m in host.npu_models)]
    if not facts.npus:
        for name in ("npu-model", "npu-health", "npu-hbm", "npu-hbm-free"):
            checks.append(Check(name, SKIP, "no NPU listed", wanted if name == "npu-model"
                                else "", "see npu-smi"))
        return checks, None
    if not matching:
        checks.append(Check("npu-model", FAIL, ", ".join(names), wanted,
                            "use the recipe for this NPU (`dsv4-offload recipe list`, --recipe "
                            "NAME) or run on a host with the NPU the recipe names"))
    else:
        checks.append(Check("npu-model", OK, f"{', '.join(names)} x{len(matching)}", wanted))
    chosen = choose_npu(facts.npus, host.npu_models, mem_fraction=frac, device=device)
    if chosen is None:
        why = f"device {device} is not listed" if device is not None else "no matching NPU"
        for name in ("npu-health", "npu-hbm", "npu-hbm-free"):
            checks.append(Check(name, FAIL if device is not None else SKIP, why, "",
                                f"pick one of {_npu_list(matching)} with --device N or "
                                "ASCEND_RT_VISIBLE_DEVICES" if device is not None else ""))
        return checks, None
    label = f"{chosen.label} (device {chosen.device_id}, {chosen.model})"
    healthy_idle = [n for n in matching if n.healthy and npu_is_idle(n, frac)
                    and n is not chosen]
    other = (f"; healthy idle alternatives: {_npu_list(healthy_idle)} (--device N)"
             if healthy_idle else "")
    health = chosen.health
    if chosen.healthy:
        checks.append(Check("npu-health", OK, f"{label}: OK", "Health OK"))
    else:
        checks.append(Check(
            "npu-health", WARN if health.upper() == "WARNING" else FAIL, f"{label}: {health}",
            "Health OK",
            f"read the alarm codes with `npu-smi info -t health -i {chosen.npu_id}`, clear them "
            f"or reset the NPU (`npu-smi set -t reset -i {chosen.npu_id} -c {chosen.chip}`), or "
            "reboot" + other,
        ))
    total_gib = (chosen.hbm_total_mb or 0) / 1024
    checks.append(Check(
        "npu-hbm", OK if total_gib >= host.hbm_min_gib else FAIL,
        f"{label}: {chosen.hbm_total_mb or '?'} MB", f">= {host.hbm_min_gib:g} GiB HBM",
        "" if total_gib >= host.hbm_min_gib else
        "this recipe needs a 64 GB HBM NPU (attention, KV cache and ~1 GB per resident expert)",
    ))
    limit = int((1.0 - frac) * (chosen.hbm_total_mb or 0))
    used = f"{chosen.hbm_used_mb if chosen.hbm_used_mb is not None else '?'} MB used"
    if npu_is_idle(chosen, frac):
        checks.append(Check("npu-hbm-free", OK, f"{label}: {used}",
                            f"<= {limit} MB used (mem fraction {frac:g})"))
    else:
        holders = ", ".join(f"pid {p.pid} {p.name} {p.memory_mb} MB" for p in chosen.processes)
        checks.append(Check(
            "npu-hbm-free", FAIL, f"{label}: {used}" + (f" by {holders}" if holders else ""),
            f"<= {limit} MB used (mem fraction {frac:g})",
            "stop what holds the NPU (`npu-smi info` lists its processes) or serve on an idle "
            "one with --device N / ASCEND_RT_VISIBLE_DEVICES" + other,
        ))
    return checks, chosen


def check_device_nodes(recipe: Recipe, facts: HostFacts, chosen: NpuInfo | None) -> Check:
    wanted = list(recipe.host.npu_device_nodes)
    if chosen is not None:
        wanted.append(f"/dev/davinci{chosen.device_id}")
    elif not any(p.startswith("/dev/davinci") and p[12:].isdigit() for p in facts.device_nodes
                 if facts.device_nodes[p]):
        wanted.append("/dev/davinci<N>")
    missing = [p for p in wanted if not facts.device_nodes.get(p, False)]
    return Check(
        "device-nodes", FAIL if missing else OK,
        f"missing {', '.join(missing)}" if missing else f"{len(wanted)} present",
        ", ".join(wanted),
        "" if not missing else "load the Ascend driver (the nodes appear with it; check "
        "`ls -l /dev/davinci* /dev/devmm_svm /dev/hisi_hdc`); in a container pass each with "
        "--device",
    )


def check_cann(recipe: Recipe, facts: HostFacts) -> Check:
    need = f"CANN toolkit >= {recipe.host.cann_min_version}"
    image = recipe.platform.image
    install = (f"install the CANN {recipe.platform.cann} toolkit (and its kernels/nnal packages) "
               "and `source <toolkit>/set_env.sh`, or set ASCEND_TOOLKIT_HOME")
    if image:
        install += f", or run inside {image} which ships it"
    if facts.cann_version is None:
        return Check("cann", FAIL, "no ascend_toolkit_install.info found", need, install)
    if not version_at_least(facts.cann_version, recipe.host.cann_min_version):
        return Check("cann", FAIL, f"{facts.cann_version} at {facts.cann_toolkit}", need,
                     install + (f"; this recipe needs CANN {recipe.platform.cann}"
                                + (" (single-state NSA compressor)"
                                   if recipe.platform.cann.startswith("9") else "")))
    return Check("cann", OK, f"{facts.cann_version} at {facts.cann_toolkit}", need)


def check_toolchain(recipe: Recipe, facts: HostFacts,
                    daemon: tuple[str, str] | None = None) -> list[Check]:
    """Docker (client, and its daemon when asked: `daemon` is container.daemon_problem()),
    the build python and the compilers."""
    host = recipe.host
    checks = []
    mode = host.docker
    if mode != "unused":
        version = facts.tools.get("docker")
        status = OK if version else (FAIL if mode == "required" else WARN)
        fix = "" if version else TOOL_FIXES["docker"] + (
            f"; the image path uses {recipe.platform.image}" if recipe.platform.image else "")
        observed = version or "not found"
        if version and daemon is not None:
            # the client is there, its daemon is not usable: the same words container.py
            # (which the container stages use) says, and its fix, not an install
            said, fix = daemon
            status = FAIL if mode == "required" else WARN
            observed = f"{version}; daemon: {said}"
        checks.append(Check("docker", status, observed, f"docker ({mode})", fix))
    py = recipe.build.interpreter
    version = facts.python_versions.get(py)
    ok = version is not None and version.split(".")[:2] == host.python.split(".")[:2]
    checks.append(Check(
        "python", OK if ok else FAIL, f"{py}: {version or 'not found'}",
        f"{py} {host.python}.x for the build",
        "" if ok else f"apt-get install python{host.python} python{host.python}-dev "
        f"python{host.python}-venv (or use the image): kt-kernel binds to the interpreter "
        "that builds it",
    ))
    binaries = {"gcc": recipe.platform.cc or "gcc", "g++": recipe.platform.cxx or "g++"}
    minimums = dict(host.tools)
    if "gcc" in minimums and "g++" not in minimums:
        minimums["g++"] = minimums["gcc"]  # C++ sources: the same compiler generation
    for tool, minimum in minimums.items():
        binary = binaries.get(tool, tool)
        version = facts.tools.get(binary)
        ok = version_at_least(version, minimum)
        fix = TOOL_FIXES.get(tool, f"install {binary} >= {minimum}")
        if tool in ("gcc", "g++") and binary != tool:
            fix = "apt-get install " + " ".join(
                compiler_package(c) for c in (recipe.platform.cc, recipe.platform.cxx) if c)
        checks.append(Check(
            binary, OK if ok else FAIL, version or "not found", f">= {minimum}",
            "" if ok else fix,
        ))
    for lib in host.libraries:
        found = facts.libraries.get(lib)
        checks.append(Check(
            f"lib{lib}", OK if found else FAIL,
            "found" if found else "header or shared library missing",
            f"lib{lib} (header and shared library)",
            "" if found else LIBRARY_FIXES.get(lib, f"install lib{lib} and its -dev package"),
        ))
    if host.pkg_config:
        pkg = facts.tools.get("pkg-config")
        checks.append(Check("pkg-config", OK if pkg else FAIL, pkg or "not found",
                            "pkg-config (kt-kernel's CMake finds hwloc through it)",
                            "" if pkg else "apt-get install pkg-config (yum install "
                            "pkgconf-pkg-config)"))
    for module in host.pkg_config:
        found = facts.pkg_config.get(module, False)
        checks.append(Check(
            f"{module}.pc", OK if found else FAIL, "found" if found else "no .pc file",
            f"pkg-config module {module}",
            "" if found else PKG_CONFIG_FIXES.get(module, f"install the -dev package of {module}"),
        ))
    for entry in host.python_modules:
        module_name, least = module_requirement(entry)
        module_version = facts.python_modules.get(module_name)
        ok = module_version is not None and (
            least is None or version_at_least(module_version, least))
        want = f"{module_name}" + (f" >= {least}" if least else "") + f" in {py}"
        observed = (f"{module_name} {module_version}" if module_version is not None
                    else f"{module_name} does not import")
        checks.append(Check(
            f"py-{module_name}", OK if ok else FAIL, observed, want,
            "" if ok else f"{py} -m pip install '{entry}' (or use a venv's python: "
            "--set build.python=/path/to/venv/bin/python)",
        ))
    return checks


def compiler_package(binary: str) -> str:
    """Debian's package of a compiler: gcc-13 is itself, aarch64-linux-gnu-g++ is
    g++-aarch64-linux-gnu."""
    triple, _, kind = binary.rpartition("-")
    if kind in ("gcc", "g++") and "-linux-" in triple:
        return f"{kind}-{triple}"
    return binary


def cross_tools(recipe: Recipe) -> list[str]:
    """The programs a recipe's cross-build steps and emulated self-test call (none for a
    native recipe)."""
    tools: list[str] = []
    for step in recipe.build.steps:
        if CROSS_STEP_MODULE not in step.command:
            continue
        if "sysroot" in step.command:
            tools += ["dpkg", "apt-get"]
        if "cmake" in step.command:
            emulator = next((a.split("=", 1)[1] for a in step.command
                             if a.startswith("--emulator=")), "qemu-aarch64")
            tools += ["pkg-config", emulator]
    if recipe.selftest.emulator is not None:
        tools.append(recipe.selftest.emulator.command)
    return list(dict.fromkeys(tools))


def binfmt_state(root: str, name: str = "qemu-aarch64") -> str:
    """'enabled', 'disabled' or 'absent': whether the kernel runs aarch64 ELF files itself."""
    from pathlib import Path

    try:
        text = (Path(root) / BINFMT_DIR / name).read_text(encoding="utf-8")
    except OSError:
        return "absent"
    return parse_binfmt_entry(text)


def parse_binfmt_entry(text: str) -> str:
    """The first line of a /proc/sys/fs/binfmt_misc entry says enabled or disabled."""
    first = text.strip().splitlines()[0].strip() if text.strip() else ""
    return first if first in ("enabled", "disabled") else "absent"


def check_cross(recipe: Recipe, facts: HostFacts, binfmt: str = "absent") -> list[Check]:
    """What a cross build and an emulated self-test need on this machine."""
    tools = cross_tools(recipe)
    checks = []
    for tool in tools:
        version = facts.tools.get(tool)
        checks.append(Check(f"cross-{tool}", OK if version else FAIL, version or "not found",
                            f"{tool} (aarch64 cross build and emulated self-test)",
                            "" if version else CROSS_TOOL_FIXES.get(tool, f"install {tool}")))
    if tools:
        checks.append(Check(
            "binfmt-aarch64", OK if binfmt == "enabled" else WARN, binfmt,
            "optional: aarch64 ELF files run directly",
            "" if binfmt == "enabled" else "nothing is needed (dsv4-offload calls qemu-aarch64 "
            "itself); for direct runs: apt-get install qemu-user-static binfmt-support"))
    return checks


@dataclass
class RuntimeFacts:
    """Where the tool runs and, for an image runtime, the image on this host."""

    inside: bool  # this process runs inside a container
    image_arch: str | None = None  # the local image's architecture; None: not present
    probe: str = "probed"  # or why the image was not asked about
    daemon: tuple[str, str] | None = None  # the docker daemon's problem and its fix


def probe_runtime(recipe: Recipe, facts: HostFacts) -> RuntimeFacts:
    """Ask docker about the recipe's image only on a live aarch64 host with a docker client
    (a captured sysroot has no engine to ask, and the image is arm64)."""
    from dsv4_offload.core import childrun
    from dsv4_offload.core.errors import Dsv4Error
    from dsv4_offload.core.host import HOST_ROOT_ENV
    from dsv4_offload.serving import container

    # a captured host says for itself whether it is a container (its own /.dockerenv); a
    # container that has a docker client of its own is a host to the containers it starts
    # (a CI runner, a dev container), unless our own exec marked this process as inside
    inside = bool(childrun.container_name()) or (
        container.inside_container(Path(facts.root)) and not facts.tools.get("docker"))
    rf = RuntimeFacts(inside=inside)
    if (recipe.host.docker != "unused" and facts.tools.get("docker")
            and not os.environ.get(HOST_ROOT_ENV)):
        rf.daemon = container.daemon_problem()  # what the container stages will meet
    runtime = recipe.runtime
    if runtime.kind != "container" or not runtime.image or rf.inside:
        rf.probe = "no image runtime here"
    elif os.environ.get(HOST_ROOT_ENV):
        rf.probe = "not probed: a captured host"
    elif facts.arch != "aarch64":
        rf.probe = f"not probed: {facts.arch} host"
    elif not facts.tools.get("docker"):
        rf.probe = "not probed: no docker client"
    else:
        try:
            rf.image_arch = container.image_architecture(runtime.image)
        except Dsv4Error as exc:
            rf.probe = f"not probed: {exc.message}"
    return rf


def check_runtime(recipe: Recipe, facts: HostFacts, rf: RuntimeFacts) -> list[Check]:
    """Whether this runs inside a container; for an image runtime, docker and the image."""
    checks = [Check("container", OK, "inside a container" if rf.inside else "on the host",
                    "either")]
    runtime = recipe.runtime
    if runtime.kind != "container" or not runtime.image or rf.inside:
        return checks
    need = f"{runtime.image} (arm64), where build, serve and accept run"
    if not facts.tools.get("docker"):
        checks.append(Check("image", FAIL, "no docker client", need, TOOL_FIXES["docker"]))
    elif rf.probe != "probed":
        checks.append(Check("image", SKIP, rf.probe, need))
    elif rf.image_arch is None:
        checks.append(Check("image", WARN, "not pulled yet", need,
                            "`dsv4-offload container up` pulls it (or `docker pull "
                            f"{runtime.image}`)"))
    elif rf.image_arch not in ("arm64", "aarch64"):
        checks.append(Check("image", FAIL, f"present, {rf.image_arch}", need,
                            f"docker pull --platform linux/arm64 {runtime.image}"))
    else:
        checks.append(Check("image", OK, f"present, {rf.image_arch}", need))
    return checks


def evaluate(recipe: Recipe, facts: HostFacts, device: int | None = None,
             binfmt: str = "absent", runtime: RuntimeFacts | None = None,
             disk: list[FsNeed] | None = None) -> tuple[list[Check], NpuInfo | None]:
    """All checks of the recipe's host section against these facts (pure: no probing).

    Each row is judged where its stage runs: with the build in the recipe's container, the
    toolchain and CANN rows belong to the image and are shown as such on the host."""
    checks = check_cpu(recipe, facts)
    checks.append(check_numa(recipe, facts))
    checks += check_memory_and_disk(recipe, facts, disk)
    chosen = None
    if has_npu(recipe):  # a recipe without an NPU needs no driver, device node or CANN
        npu_checks, chosen = check_npu(recipe, facts, device)
        checks += npu_checks
        checks.append(check_device_nodes(recipe, facts, chosen))
    image = image_side(recipe, runtime is not None and runtime.inside)
    toolchain = check_toolchain(recipe, facts, runtime.daemon if runtime is not None else None)
    if has_npu(recipe):
        toolchain.append(check_cann(recipe, facts))
    if image:
        toolchain = [c if c.name == "docker" else in_image(c, image) for c in toolchain]
    checks += toolchain
    checks += check_cross(recipe, facts, binfmt)
    if "serve" not in recipe.not_applicable:
        checks.append(check_page_cache(recipe, facts))
        checks.append(check_memory_plan(recipe, facts))
        checks += recipe_rows(recipe)
    if runtime is not None:
        checks += check_runtime(recipe, facts, runtime)
    return checks, chosen


# --- stage entry points --------------------------------------------------------------------


def check_compiler_works(recipe: Recipe) -> Check | None:
    """The build's C compiler turns a one-line file into an object: a `--version` answers
    even when the assembler is missing (binutils), and cmake then stops at its first test."""
    import subprocess

    from dsv4_offload.core.runner import capture

    cc = recipe.platform.cc or "gcc"
    required = f"{cc} compiles and assembles a C file (cmake's first test)"
    try:
        proc = capture([cc, "-x", "c", "-c", "-", "-o", os.devnull],
                       input="int main(void) { return 0; }\n", timeout=60)
    except FileNotFoundError:
        return None  # the compiler row already says it is missing
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("cc-compiles", FAIL, f"{cc}: {exc}", required, f"reinstall {cc}")
    if proc.returncode == 0:
        return Check("cc-compiles", OK, f"{cc}: an object was written", required)
    last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return Check("cc-compiles", FAIL, f"{cc}: {last}", required,
                 "apt-get install binutils build-essential (yum install binutils gcc): the "
                 "compiler needs the assembler and linker")


def run(ctx: StageContext) -> StageResult:
    """Probe the host, check it against the recipe, write reports/doctor.json."""
    with ctx.task("probing the host"):
        facts = probe(ctx)
    # the pipeline takes the fingerprint from this context right after the run: it reuses
    # these facts instead of running npu-smi and every --version a second time
    ctx.host_facts = facts
    binfmt = binfmt_state(facts.root) if cross_tools(ctx.recipe) else "absent"
    runtime = probe_runtime(ctx.recipe, facts)
    checks, chosen = evaluate(ctx.recipe, facts, _device_option(ctx), binfmt, runtime,
                              diskplan.run_disk(ctx.recipe, ctx.workspace, facts.disk_free_bytes))
    image = image_side(ctx.recipe, runtime.inside)
    if ctx.recipe.host.npu_models:  # the launcher's choice: a python with torch_npu and sglang
        python = check_python(ctx, facts)
        checks.append(in_image(python, image) if image else python)
    if not os.environ.get(HOST_ROOT_ENV):  # a live machine: its compiler can be asked
        compiles = check_compiler_works(ctx.recipe)
        if compiles is not None:
            checks.append(in_image(compiles, image) if image else compiles)
    if image and not os.environ.get(HOST_ROOT_ENV):
        checks = judged_in_the_image(ctx, checks)
    if "serve" not in ctx.recipe.not_applicable:  # what killed servers left in /dev/shm
        checks.append(shm.check(shm.last_start(sv.read_record(ctx.workspace.serve_record)),
                                shm.shm_dir(Path(facts.root))))
    rows, measured = bandwidth.host_rows(ctx.workspace.bandwidth_file, facts, ctx.recipe.serve,
                                         ctx.options_as(DoctorOptions).bandwidth)
    checks += rows
    failed = [c for c in checks if c.status == FAIL]
    warned = [c for c in checks if c.status == WARN]
    if failed:
        status = Status.FAILED
        summary = f"{len(failed)} check(s) failed: {', '.join(c.name for c in failed)}"
    elif warned:
        status = Status.WARN
        summary = f"host usable, {len(warned)} warning(s): {', '.join(c.name for c in warned)}"
    else:
        status = Status.OK
        summary = f"host ready: {len(checks)} checks passed"
    problems = [Problem("error" if c.status == FAIL else "warning",
                        f"{c.name}: {c.observed} (required: {c.required})", c.fix, c.name)
                for c in failed + warned]
    report_path = ctx.workspace.report_file("doctor")
    # provenance keeps the measured bandwidth with the host facts it was measured on
    host = {**facts.as_dict(), "memory_bandwidth": measured.as_dict() if measured else None}
    device = chosen.device_id if chosen is not None else None
    table = [annotate(c.as_dict()) for c in checks]
    atomic_write_json(report_path, {
        "schema": 1, "written": now_iso(), "recipe": ctx.recipe.name, "status": status.value,
        "summary": summary, "device": device, "checks": table, "host": host})
    data = {"checks": table, "host": host, "device": device, "report": str(report_path)}
    return StageResult(status, summary, data=data, problems=problems, log=str(report_path),
                       outputs={"host": host, "device": device, "report": str(report_path)})


def _digest(value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def fingerprint_inputs(ctx: StageContext) -> dict[str, str]:
    """Digests of the host facts doctor judges, minus what moves by itself (free memory,
    free disk, HBM in use), so a changed host makes doctor stale and names the area."""
    f = ctx.host_facts or probe(ctx)
    # and the outcome of every check (name, verdict, requirement): what doctor read beyond
    # the facts below (the container runtime, binfmt, the recipe's requirements) makes it
    # stale too, so `run` runs it again; the interpreter by its recorded choice and
    # PYTHON_BIN (probing its imports here would make `status` as slow as doctor itself)
    checks, _ = evaluate(ctx.recipe, f, _device_option(ctx),
                         binfmt_state(f.root) if cross_tools(ctx.recipe) else "absent",
                         probe_runtime(ctx.recipe, f))
    from dsv4_offload.build.interpreter import PYTHON_BIN_ENV, recorded_python

    return {
        # the disk row moves with every byte downloaded: free disk is no input, as above
        "checks": _digest(sorted((c.name, c.status, c.required) for c in checks
                                 if c.name != "disk")),
        "python": _digest([recorded_python(ctx), os.environ.get(PYTHON_BIN_ENV),
                           ctx.options_as(DoctorOptions).python]),
        "host.cpu": _digest([f.arch, sorted(f.cpu_flags), f.cores, f.cpu_model]),
        "host.numa": _digest(f.numa_cpulists),
        "host.memory": _digest(round((f.mem_total_kib or 0) / KIB_PER_GIB)),
        "host.npu": _digest([f.npu_smi, f.npu_driver,
                             [(n.device_id, n.model, n.health, n.hbm_total_mb) for n in f.npus]]),
        "host.devices": _digest(f.device_nodes),
        "host.cann": _digest([f.cann_version, f.cann_toolkit]),
        "host.toolchain": _digest([f.tools, f.python_versions, f.libraries]),
    }
