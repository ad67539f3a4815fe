"""Host probes: what this machine is (CPU, NUMA, memory, disk, NPU, CANN, toolchain).

Pure parsers take captured text (``/proc/cpuinfo``, ``npu-smi info``, ``--version``
outputs) and return values; the readers at the edge (``probe_host``) read files and run
commands. ``root`` (env ``DSV4_HOST_ROOT``) points the readers at a captured sysroot and
``npu_smi`` (env ``DSV4_NPU_SMI``, a shell-quoted command) at a captured ``npu-smi info``,
so a whole host can be replayed from a directory. A captured sysroot may also hold
``df.txt`` (``df -P -B1 <workspace>`` output) for the free disk of the captured host.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.runner import capture

HOST_ROOT_ENV = "DSV4_HOST_ROOT"
NPU_SMI_ENV = "DSV4_NPU_SMI"
CAPTURED_DF_FILE = "df.txt"

# nodes the Ascend driver creates besides one /dev/davinciN per NPU
ASCEND_CONTROL_NODES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
DEFAULT_TOOLS = ("git", "cmake", "gcc", "g++", "docker")
DEFAULT_PYTHONS = ("python3", "python3.11")
# where the CANN toolkit lands with the .run installer (8.x) and the newer cann-<ver> layout
CANN_TOOLKIT_CANDIDATES = (
    "/usr/local/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/cann",
)
CANN_INSTALL_INFO = "ascend_toolkit_install.info"
LIBRARY_PROBES: dict[str, tuple[str, str]] = {
    # name -> (header, shared-library glob); the kt-kernel build needs both
    "hwloc": ("hwloc.h", "libhwloc.so*"),
    "numa": ("numa.h", "libnuma.so*"),
}
_LIB_DIRS = ("usr/lib", "usr/lib64", "lib", "lib64", "usr/local/lib", "usr/local/lib64",
             "usr/lib/aarch64-linux-gnu", "usr/lib/x86_64-linux-gnu")
_INCLUDE_DIRS = ("usr/include", "usr/local/include")
_PKG_CONFIG_DIRS = ("usr/lib/pkgconfig", "usr/lib64/pkgconfig", "usr/share/pkgconfig",
                    "usr/local/lib/pkgconfig", "usr/lib/x86_64-linux-gnu/pkgconfig",
                    "usr/lib/aarch64-linux-gnu/pkgconfig")
_BIN_DIRS = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin",
             "usr/local/Ascend/driver/tools")
_COMMAND_TIMEOUT_S = 60.0  # npu-smi can take tens of seconds on a loaded 8-NPU host

# (implementer, part) -> name, for aarch64 cpuinfo that has no "model name" line
_ARM_PARTS = {
    ("0x48", "0xd01"): "HiSilicon Kunpeng-920 (TaiShan v110)",
    ("0x48", "0xd02"): "HiSilicon Kunpeng (TaiShan v120)",
    ("0x41", "0xd0c"): "Arm Neoverse-N1",
    ("0x41", "0xd40"): "Arm Neoverse-V1",
    ("0x41", "0xd49"): "Arm Neoverse-N2",
    ("0x41", "0xd4f"): "Arm Neoverse-V2",
}


@dataclass(frozen=True)
class NpuProcess:
    pid: int
    name: str
    memory_mb: int | None


@dataclass(frozen=True)
class NpuInfo:
    npu_id: int  # the NPU index npu-smi prints (what ASCEND_RT_VISIBLE_DEVICES takes on 910B)
    chip: int
    model: str  # e.g. "910B3", "Ascend910_9382" as printed
    health: str  # "OK", "Warning", "Alarm", "Critical", ...
    hbm_total_mb: int | None
    hbm_used_mb: int | None
    aicore_pct: int | None
    bus_id: str | None = None
    phy_id: int | None = None  # printed on multi-die parts (A3): the device's physical id
    processes: tuple[NpuProcess, ...] = ()

    @property
    def device_id(self) -> int:
        """The id ASCEND_RT_VISIBLE_DEVICES takes: the die's Phy-ID on A3, else the NPU id."""
        return self.phy_id if self.phy_id is not None else self.npu_id

    @property
    def label(self) -> str:
        return f"NPU {self.npu_id}" + (f" chip {self.chip}" if self.phy_id is not None else "")

    @property
    def healthy(self) -> bool:
        """npu-smi says Health OK (doctor and serve's card choice share this test)."""
        return self.health.strip().upper() == "OK"


@dataclass(frozen=True)
class HostFacts:
    arch: str  # platform.machine() style: "aarch64", "x86_64"
    cpu_model: str
    cpu_flags: frozenset[str]  # from /proc/cpuinfo "Features"/"flags"
    cores: int  # logical CPUs
    numa_nodes: tuple[int, ...]  # node ids from /sys/devices/system/node/node*/
    mem_total_kib: int | None
    mem_available_kib: int | None
    npus: tuple[NpuInfo, ...]
    npu_smi: str | None  # None when npu-smi is absent; else "ok" or the error line
    device_nodes: dict[str, bool]  # path -> exists
    cann_version: str | None  # e.g. "8.5.0" (ascend_toolkit_install.info "version=")
    cann_toolkit: str | None  # ASCEND_TOOLKIT_HOME or the detected toolkit dir
    python_versions: dict[str, str]  # interpreter name -> version
    tools: dict[str, str | None]  # git, cmake, gcc, g++, docker -> version or None
    libraries: dict[str, bool]  # hwloc, numa -> found (header or .so)
    disk_free_bytes: int | None  # under the workspace
    numa_cpulists: dict[int, str] = field(default_factory=dict)  # node -> "0-23"
    npu_driver: str | None = None  # the version npu-smi prints in its banner
    root: str = "/"  # the sysroot the facts were read from ("/" = this machine)
    pkg_config: dict[str, bool] = field(default_factory=dict)  # module -> its .pc found
    # "python: module" -> version (None: does not import), for the recipe's build python
    python_modules: dict[str, str | None] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able facts, for reports and provenance."""
        out = asdict(self)
        out["cpu_flags"] = sorted(self.cpu_flags)
        out["numa_nodes"] = list(self.numa_nodes)
        out["numa_cpulists"] = {str(k): v for k, v in self.numa_cpulists.items()}
        return out


# --- pure parsers --------------------------------------------------------------------------


def parse_cpuinfo(text: str) -> tuple[str | None, str, frozenset[str], int]:
    """(arch hint, CPU model, feature flags, logical CPUs) from /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    processors = 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            processors += 1
        fields.setdefault(key, value)  # the first processor speaks for all
    if "Features" in fields or "CPU implementer" in fields:
        arch: str | None = "aarch64"
        flags = fields.get("Features", "")
        part = (fields.get("CPU implementer", "").lower(), fields.get("CPU part", "").lower())
        model = fields.get("model name") or _ARM_PARTS.get(part) or (
            f"arm implementer {part[0]} part {part[1]}" if part[0] else "unknown aarch64 CPU")
    elif "flags" in fields or "vendor_id" in fields:
        flags = fields.get("flags", "")
        arch = "x86_64" if " lm " in f" {flags} " else "i686"
        model = fields.get("model name", fields.get("vendor_id", "unknown x86 CPU"))
    else:
        arch, flags, model = None, "", "unknown CPU"
    return arch, model, frozenset(flags.split()), processors


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo (or a NUMA node's meminfo) as key -> kiB; node prefixes dropped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^(?:Node\s+\d+\s+)?([\w()]+):\s+(\d+)(?:\s+kB)?\s*$", line.strip())
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def parse_cpulist(text: str) -> tuple[int, ...]:
    """A sysfs cpulist such as "0-23,48-71" as the CPU ids."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


_SMI_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")


def _int_or_none(token: str) -> int | None:
    try:
        return int(float(token))
    except ValueError:
        return None


def parse_npu_smi_info(text: str) -> list[NpuInfo]:
    """The NPUs in `npu-smi info`'s box table (two rows per chip), with their processes."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    chips: list[dict[str, Any]] = []
    processes: dict[tuple[int, int], list[NpuProcess]] = {}
    in_process_table = False
    has_phy_id = False
    pending: dict[str, Any] | None = None
    for line in rows:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        head = cells[0].split()
        if "Process id" in line or "Process name" in line:
            in_process_table = True
            continue
        if cells[0].startswith("npu-smi") or cells[0].startswith("NPU ") or head[:1] == ["Chip"]:
            has_phy_id = has_phy_id or "Phy-ID" in cells[0]
            continue
        if in_process_table:
            if len(cells) >= 4 and len(head) >= 2 and head[0].isdigit() and cells[1].isdigit():
                mem = _int_or_none(cells[3].split()[0]) if cells[3] else None
                processes.setdefault((int(head[0]), int(head[1])), []).append(
                    NpuProcess(pid=int(cells[1]), name=cells[2], memory_mb=mem))
            continue
        if len(cells) < 3:
            continue
        if pending is None:
            # first row of a chip: "<npu> <name> | <health> | <power> <temp> <hugepages>"
            if len(head) >= 2 and head[0].isdigit():
                pending = {"npu_id": int(head[0]), "model": " ".join(head[1:]),
                           "health": cells[1]}
            continue
        # second row: "<chip> [<phy-id>] | <bus-id> | <aicore> <memory> <hbm>"
        if not head or not head[0].isdigit():
            pending = None
            continue
        pairs = _SMI_PAIR.findall(cells[2])
        numbers = cells[2].split()
        hbm = pairs[-1] if pairs else None
        pending.update(
            chip=int(head[0]),
            phy_id=int(head[1]) if len(head) > 1 and head[1].isdigit() else None,
            bus_id=cells[1] or None,
            aicore_pct=_int_or_none(numbers[0]) if numbers else None,
            hbm_used_mb=int(hbm[0]) if hbm else None,
            hbm_total_mb=int(hbm[1]) if hbm else None,
        )
        chips.append(pending)
        pending = None
    out = []
    for c in chips:
        if not has_phy_id:
            c["phy_id"] = None
        c["processes"] = tuple(processes.get((c["npu_id"], c["chip"]), ()))
        out.append(NpuInfo(**c))
    return out


def parse_npu_smi_version(text: str) -> str | None:
    """The driver version in `npu-smi info`'s banner ("npu-smi 24.1.rc2  Version: 24.1.rc2")."""
    m = re.search(r"Version:\s*(\S+)", text) or re.search(r"npu-smi\s+(\d\S*)", text)
    return m.group(1) if m else None


def parse_cann_install_info(text: str) -> str | None:
    """The "version=" of an ascend_toolkit_install.info file."""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() in ("version", "Version"):
            return value.strip().strip('"') or None
    return None


def parse_version(text: str) -> str | None:
    """The first dotted version in a tool's --version output ("gcc (Debian 12.2.0-14) 12.2.0")."""
    for line in text.splitlines():
        m = re.search(r"(?<![\w.])(\d+\.\d+(?:\.\d+)?)", line)
        if m:
            return m.group(1)
    return None


def parse_df(text: str) -> int | None:
    """Free bytes from `df -P -B1 PATH` output (the "Available" column of the data line)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        return None
    parts = lines[-1].split()
    return int(parts[3]) if len(parts) >= 4 and parts[3].isdigit() else None


def version_key(version: str) -> tuple[int, ...]:
    """A sortable key: "8.5.RC1" < "8.5.0" < "8.5.1" < "9.0.0" (RC/alpha/beta precede a release)."""
    pre = re.search(r"(?i)[.-]?(alpha|beta|rc)\.?(\d*)", version)
    release_part = version[: pre.start()] if pre else version
    numbers = [int(n) for n in re.findall(r"\d+", release_part)[:3]]
    tail = [0, int(pre.group(2) or 0)] if pre else [1, 0]
    return tuple((numbers + [0, 0, 0])[:3] + tail)


def version_at_least(version: str | None, minimum: str) -> bool:
    return version is not None and version_key(version) >= version_key(minimum)


# --- NPU selection (shared by doctor and serve) --------------------------------------------


def npu_model_matches(npu: NpuInfo, wanted: str) -> bool:
    """Loose model match: "910B" takes "910B3"/"910B4-1"; "A3" and "910_93" take Ascend910_93xx.

    npu-smi on A3 prints the dies as plain "Ascend910" with a Phy-ID column, and the part is
    sold as "910C": both are A3 too.
    """
    name = npu.model.upper().removeprefix("ASCEND")
    want = wanted.upper().removeprefix("ASCEND")
    if want == "A3":
        return (name.startswith(("910_93", "910C"))
                or (name == "910" and npu.phy_id is not None))
    return name.startswith(want)


def npu_is_idle(npu: NpuInfo, mem_fraction: float) -> bool:
    """True when the server can still claim `mem_fraction` of this NPU's HBM."""
    if npu.hbm_total_mb is None or npu.hbm_used_mb is None:
        return False
    return npu.hbm_used_mb <= (1.0 - mem_fraction) * npu.hbm_total_mb


def choose_npu(npus: Iterable[NpuInfo], models: Iterable[str], *, mem_fraction: float,
               device: int | None = None) -> NpuInfo | None:
    """The NPU to serve on: `device` when given, else a matching, healthy, idle one.

    Without a fully usable one, an idle one is preferred (its health is then the problem to
    report), then a healthy one, so doctor names the most relevant reason.
    """
    candidates = [n for n in npus if any(npu_model_matches(n, m) for m in models)]
    if device is not None:
        return next((n for n in npus if n.device_id == device), None)
    if not candidates:
        return None

    def rank(n: NpuInfo) -> tuple[int, int]:
        healthy, idle = n.healthy, npu_is_idle(n, mem_fraction)
        return (0 if healthy and idle else 1 if idle else 2 if healthy else 3,
                n.hbm_used_mb if n.hbm_used_mb is not None else 1 << 30)

    return min(candidates, key=rank)


def visible_device(env: Mapping[str, str]) -> int | None:
    """The first id of ASCEND_RT_VISIBLE_DEVICES, when the operator has set it."""
    first = env.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else None


# --- readers at the edge -------------------------------------------------------------------


def _under(root: Path, path: str | Path) -> Path:
    return root / str(path).lstrip("/")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _search_path(root: Path, env: Mapping[str, str]) -> str:
    if root == Path("/"):
        extra = [f"/{d}" for d in _BIN_DIRS]
        return os.pathsep.join([env.get("PATH", os.defpath), *extra])
    return os.pathsep.join(str(root / d) for d in _BIN_DIRS)


def _run_capture(args: list[str], env: Mapping[str, str]) -> tuple[int, str]:
    """Run a quick probe and return (exit code, combined output).

    Probes are read-only one-liners: captured, not written to a stage log.
    """
    run_env = dict(env)
    run_env["LC_ALL"] = "C"  # English, stable output for the parsers
    try:
        done = capture(args, env=run_env, timeout=_COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        return 127, f"{args[0]}: not found"
    except PermissionError:
        return 126, f"{args[0]}: permission denied"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(args)}: no answer after {_COMMAND_TIMEOUT_S:.0f} s"
    return done.returncode, (done.stdout or "") + (done.stderr or "")


def _tool_version(name: str, search: str, env: Mapping[str, str]) -> str | None:
    exe = shutil.which(name, path=search)
    if exe is None:
        return None
    code, out = _run_capture([exe, "--version"], env)
    return parse_version(out) if code == 0 else None


def _probe_npu_smi(command: list[str] | None, search: str, env: Mapping[str, str]
                   ) -> tuple[str | None, tuple[NpuInfo, ...], str | None]:
    if command is None:
        exe = shutil.which("npu-smi", path=search)
        if exe is None:
            return None, (), None
        command = [exe, "info"]
    code, out = _run_capture(command, env)
    if code != 0:
        last = next((x.strip() for x in reversed(out.splitlines()) if x.strip()), "no output")
        return f"`{' '.join(command)}` exited {code}: {last}", (), None
    npus = tuple(parse_npu_smi_info(out))
    if not npus:
        first = next((x.strip() for x in out.splitlines() if x.strip()), "no output")
        return f"`{' '.join(command)}` listed no NPU (first line: {first[:80]})", (), None
    return "ok", npus, parse_npu_smi_version(out)


def _probe_cann(root: Path, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    candidates = [env[k] for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH") if env.get(k)]
    candidates += list(CANN_TOOLKIT_CANDIDATES)
    # and the delivery launcher's user-home layouts (launch_ds4flash_npu.sh L141-144)
    home = env.get("HOME")
    patterns = [f"{home}/Ascend/ascend-toolkit/latest", f"{home}/Ascend/cann-*"] if home else []
    for pattern in [*patterns, "/home/*/Ascend/cann-*"]:
        found = sorted(_under(root, "/").glob(pattern.lstrip("/")))
        candidates += ["/" + str(p.relative_to(root)) for p in found]
    for toolkit in candidates:
        base = _under(root, toolkit)
        infos = [base / CANN_INSTALL_INFO, *sorted(base.glob(f"*/{CANN_INSTALL_INFO}"))]
        for info in infos:
            text = _read(info)
            version = parse_cann_install_info(text) if text else None
            if version:
                return version, toolkit
    return None, None


def _probe_numa(root: Path) -> dict[int, str]:
    base = root / "sys/devices/system/node"
    nodes: dict[int, str] = {}
    for d in base.glob("node[0-9]*"):
        if d.is_dir() and d.name[4:].isdigit():
            nodes[int(d.name[4:])] = (_read(d / "cpulist") or "").strip()
    return dict(sorted(nodes.items()))


def _probe_libraries(root: Path) -> dict[str, bool]:
    found: dict[str, bool] = {}
    for name, (header, lib_glob) in LIBRARY_PROBES.items():
        has_header = any(_under(root, d).joinpath(header).is_file() for d in _INCLUDE_DIRS)
        has_lib = any(any(_under(root, d).glob(lib_glob)) for d in _LIB_DIRS)
        found[name] = has_header and has_lib  # the build includes the one, links the other
    return found


def _probe_pkg_config(root: Path, modules: Iterable[str]) -> dict[str, bool]:
    """Whether each module's ``.pc`` file is where pkg-config looks by default."""
    return {m: any(_under(root, d).joinpath(f"{m}.pc").is_file() for d in _PKG_CONFIG_DIRS)
            for m in modules}


_MODULE_VERSIONS = (
    "import importlib, importlib.metadata as md, json, sys\n"
    "out = {}\n"
    "for name in sys.argv[1:]:\n"
    "    try:\n"
    "        importlib.import_module(name)\n"
    "    except Exception:\n"
    "        out[name] = None\n"
    "        continue\n"
    "    try:\n"
    "        out[name] = md.version(name)\n"
    "    except Exception:\n"
    "        out[name] = '0'\n"
    "print(json.dumps(out))\n"
)


def _probe_python_modules(python: str | None, modules: list[str], search: str,
                          env: Mapping[str, str]) -> dict[str, str | None]:
    """module -> version for what ``python`` imports (None: it does not, or no python)."""
    exe = shutil.which(python, path=search) if python else None
    if not modules:
        return {}
    if exe is None:
        return dict.fromkeys(modules)
    code, out = _run_capture([exe, "-c", _MODULE_VERSIONS, *modules], env)
    try:
        found = json.loads(out.strip().splitlines()[-1]) if code == 0 else {}
    except (ValueError, IndexError):
        found = {}
    return {m: found.get(m) for m in modules}


def nearest_existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists: where a directory still to be made
    will live (its free space, its filesystem)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_disk(root: Path, workspace: Path | None) -> int | None:
    if root != Path("/"):
        captured = _read(root / CAPTURED_DF_FILE)
        if captured is not None:
            return parse_df(captured)
    # the workspace may not exist yet: measure where it will be
    path = nearest_existing((workspace or Path.cwd()).absolute())
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def probe_host(workspace: Path | None = None, *, root: Path | None = None,
               npu_smi: list[str] | None = None, env: Mapping[str, str] | None = None,
               tools: Iterable[str] = (), pythons: Iterable[str] = (),
               device_nodes: Iterable[str] = (), pkg_config: Iterable[str] = (),
               python_modules: Iterable[str] = (), modules_python: str | None = None,
               toolchain: bool = True) -> HostFacts:
    """Read this host's facts (or a captured sysroot's: `root`, env DSV4_HOST_ROOT).

    `tools`, `pythons` and `device_nodes` add names to the default probes (e.g. gcc-13);
    `pkg_config` modules are looked up as .pc files, `python_modules` imported by
    `modules_python` (this machine only). Without `toolchain` no interpreter or tool is asked
    its version (`python_versions` and `tools` are empty): for a reader of the CPUs, memory
    and NPUs alone (serve's plan, the bench, tune), seven processes fewer.
    """
    env = dict(os.environ if env is None else env)
    if root is None:
        root = Path(env[HOST_ROOT_ENV]) if env.get(HOST_ROOT_ENV) else Path("/")
        if not root.is_dir():
            raise InputError(f"{HOST_ROOT_ENV}={root}: not a directory; point it at a captured "
                             "sysroot (with proc/cpuinfo) or unset it to probe this machine")
    if npu_smi is None and env.get(NPU_SMI_ENV):
        try:
            npu_smi = shlex.split(env[NPU_SMI_ENV])
        except ValueError as exc:
            raise InputError(f"{NPU_SMI_ENV}={env[NPU_SMI_ENV]!r}: {exc}; write a shell-quoted "
                             "command such as \"cat '/path/npu-smi-info.txt'\"") from None
    live = root == Path("/")
    search = _search_path(root, env)

    arch_hint, cpu_model, flags, processors = parse_cpuinfo(_read(root / "proc/cpuinfo") or "")
    if processors == 0:
        online = _read(root / "sys/devices/system/cpu/online")
        processors = len(parse_cpulist(online)) if online else (os.cpu_count() or 0) * live
    arch = platform.machine() if live else (arch_hint or "unknown")
    meminfo = parse_meminfo(_read(root / "proc/meminfo") or "")
    numa = _probe_numa(root)
    smi_state, npus, driver = _probe_npu_smi(npu_smi, search, env)

    node_paths = list(ASCEND_CONTROL_NODES)
    node_paths += sorted((f"/dev/{p.name}" for p in _under(root, "/dev").glob("davinci[0-9]*")),
                         key=lambda p: int(p.removeprefix("/dev/davinci")))
    node_paths += [f"/dev/davinci{n.device_id}" for n in npus]
    node_paths += list(device_nodes)
    nodes = {p: _under(root, p).exists() for p in dict.fromkeys(node_paths)}

    cann_version, cann_toolkit = _probe_cann(root, env)
    python_names = dict.fromkeys([*DEFAULT_PYTHONS, *pythons] if toolchain else [])
    python_versions = {name: v for name in python_names
                       if (v := _tool_version(name, search, env)) is not None}
    tool_versions = {name: _tool_version(name, search, env)
                     for name in dict.fromkeys([*DEFAULT_TOOLS, *tools] if toolchain else [])}

    return HostFacts(
        arch=arch,
        cpu_model=cpu_model,
        cpu_flags=flags,
        cores=processors,
        numa_nodes=tuple(numa),
        mem_total_kib=meminfo.get("MemTotal"),
        mem_available_kib=meminfo.get("MemAvailable"),
        npus=npus,
        npu_smi=smi_state,
        device_nodes=nodes,
        cann_version=cann_version,
        cann_toolkit=cann_toolkit,
        python_versions=python_versions,
        tools=tool_versions,
        libraries=_probe_libraries(root),
        disk_free_bytes=_probe_disk(root, workspace),
        numa_cpulists=numa,
        npu_driver=driver,
        root=str(root),
        pkg_config=_probe_pkg_config(root, pkg_config),
        python_modules=_probe_python_modules(modules_python if live else None,
                                             list(python_modules), search, env),
    )
