"""The runtime container of recipes whose NPU side runs in an image (the 910B image).

1. ``plan_container``: the ``docker run`` argv of the delivery's
   ``scripts/launch_dsv4_singleCard_cann8.5.0_910b.sh`` (cann-recipes-infer @ 1a7fbd3), flag
   for flag, with three deliberate differences: ``-d`` (it runs in the background, not as an
   interactive shell), a label holding the digest of what defines it, and the workspace (and
   any weights directory outside it) mounted at the same path as on the host instead of
   ``/workspace/code`` and ``/workspace/models``, so every absolute path in the state file
   means the same file on both sides.
2. ``container_up``: a container of that name carrying the same digest is reused; one with
   another digest is replaced (with the reason); the image is pulled when missing. Then the
   packages the image lacks (hwloc, pkg-config) and this tool (a wheel of the running
   install) are checked, and installed when missing: both are lost when it is recreated.
3. ``exec_argv`` / ``run_stage_inside``: a stage run in the container by this same tool, on
   the same workspace; the host lends it the workspace lock for that time. `run` and the
   stand-alone stage commands both come here when ``workspace.placement`` says so. Variables
   cross by name (``docker exec -e NAME``, the value in the client's own environment): the
   launcher knobs the serve plan reads (``env_read``) and the recipe's env
   names, when exported; never a value on argv.
4. The ``docker exec`` client is this process's child in a process group of its own, stopped
   with it: on Ctrl-C, SIGTERM, SIGHUP or an exception the group is killed, and the kernel
   sends it SIGTERM if this process dies without a word (SIGKILL).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core import childrun
from dsv4_offload.core.childrun import IN_CONTAINER_ENV, LENDER_PIPE_ENV
from dsv4_offload.core.digests import file_sha256
from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.runner import (
    CommandFailed,
    capture,
    run_attached,
    run_command,
    start,
)
from dsv4_offload.core.states import StageState
from dsv4_offload.recipe import BUNDLED_RECIPES, Recipe, resolve_recipe_path
from dsv4_offload.workspace.store import Workspace

if TYPE_CHECKING:
    from dsv4_offload.core.options import StageOptions
    from dsv4_offload.core.results import StageResult, Task
    from dsv4_offload.workspace.context import StageContext

LABEL = "dsv4-offload.config"
DOCKER_FIX = "install the Docker client and engine (apt-get install docker.io) and make sure " \
             "`docker ps` works for this user"
DAEMON_FIX = "start the docker service (systemctl start docker), then check `docker ps`"
DENIED_FIX = ("let this user reach the daemon: sudo usermod -aG docker $USER, then log in "
              "again (or run as root); check with `docker ps`")
_DAEMON_DOWN = re.compile(r"Cannot connect to the Docker daemon|Is the docker daemon running",
                          re.I)
_DENIED = re.compile(r"permission denied.*docker", re.I)


class EngineUnavailable(Dsv4Error):
    """The container engine cannot be asked: no client on PATH, its daemon down or refusing
    this user, or no answer; the stage hand-over names `--runtime host` beside the fix."""


def docker_fix(stderr: str) -> str | None:
    """The next step for a docker client's error: a stopped daemon is started, a refused
    socket is a group membership, not a missing install. None: not a daemon problem."""
    if _DAEMON_DOWN.search(stderr):
        return DAEMON_FIX
    if _DENIED.search(stderr):
        return DENIED_FIX
    return None


def daemon_problem() -> tuple[str, str] | None:
    """(what docker said, the fix) when the client is there but its daemon cannot be used;
    None when `docker info` answers (or there is no client: that is DOCKER_FIX's case)."""
    try:
        proc = capture(["docker", "info", "--format", "{{.ServerVersion}}"],
                       timeout=_QUICK_TIMEOUT_S)
    except FileNotFoundError:
        return None
    except subprocess.TimeoutExpired:
        return (f"`docker info` did not answer in {_QUICK_TIMEOUT_S:.0f}s", DAEMON_FIX)
    if proc.returncode == 0:
        return None
    said = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return said, docker_fix(proc.stderr) or DAEMON_FIX
# the three control nodes of the launch script (lines 31-33), each only when present
CONTROL_NODES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
_DAVINCI = re.compile(r"^davinci(\d+)$")
_QUICK_TIMEOUT_S = 120.0
# guide G78/G105 and setup_dsv4_env_from_clean_cann.sh lines 108-112: build time needs
# hwloc.pc (pkg-config), run time libhwloc.so.15
PACKAGES_CHECK = "pkg-config --exists hwloc && ldconfig -p | grep -q libhwloc.so.15"


# --- the plan: what `docker run` the recipe asks for -----------------------------------------


@dataclass
class ContainerPlan:
    name: str
    image: str
    devices: list[str]
    mounts: list[str]  # HOST:CONTAINER, the driver mounts then ours
    port: int
    shm_size: str
    python: str
    packages: list[str]
    install_timeout: float

    @property
    def digest(self) -> str:
        """What defines the container: a reused one must carry the same."""
        blob = json.dumps([self.image, self.devices, self.mounts, self.port, self.shm_size])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def run_argv(self) -> list[str]:
        """The launch script's `docker run` (lines 57-65), detached and labelled."""
        argv = ["docker", "run", "-d", "--rm", "-it", "--name", self.name]
        for device in self.devices:
            argv += ["--device", device]
        for mount in self.mounts:
            argv += ["-v", mount]
        argv += ["--cap-add=SYS_PTRACE", "--security-opt", "seccomp=unconfined",
                 "--ipc=host", "--privileged=true",
                 "--ulimit", "memlock=-1", "--ulimit", "stack=67108864",
                 "--shm-size", self.shm_size,
                 "-p", f"{self.port}:{self.port}",
                 "--label", f"{LABEL}={self.digest}",
                 self.image, "bash"]
        return argv

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "image": self.image, "devices": self.devices,
                "mounts": self.mounts, "port": self.port, "shm_size": self.shm_size,
                "digest": self.digest}


def device_nodes(devices: str, root: Path | None = None) -> list[str]:
    """``--device`` paths as the launch script picks them (lines 30-42).

    The three control nodes when present; then every ``/dev/davinciN`` in version order for
    ``auto``, else the listed ids that exist. ``root`` is a captured sysroot (tests).
    """
    base = (root or Path("/")) / "dev"
    out = [node for node in CONTROL_NODES if (base / Path(node).name).exists()]
    if devices == "auto":
        found = sorted((int(m.group(1)) for p in _listdir(base)
                        if (m := _DAVINCI.match(p))), key=int)
        ids = [str(i) for i in found]
    else:
        ids = [i for i in devices.split(",") if (base / f"davinci{i}").exists()]
    return out + [f"/dev/davinci{i}" for i in ids]


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def workspace_mounts(workspace: Workspace, recipe: Recipe) -> list[str]:
    """The workspace at its own path, and any weights directory that resolves outside it."""
    root = workspace.root
    mounts = [f"{root}:{root}"]
    for which in ("w8a8", "mxfp4"):
        real = workspace.weights_dir(recipe, which).resolve()
        if not real.is_relative_to(root.resolve()) and f"{real}:{real}" not in mounts:
            mounts.append(f"{real}:{real}")
    return mounts


def plan_container(recipe: Recipe, workspace: Workspace, *, devices: str | None = None,
                   host_root: Path | None = None) -> ContainerPlan:
    runtime = recipe.runtime
    if runtime.kind != "container" or not runtime.image:
        raise InputError(f"recipe '{recipe.name}': runtime.kind is '{runtime.kind}', so there "
                         "is no container to run; use a recipe whose runtime is an image "
                         "(dsv4-flash-910b) or --set runtime.kind=container")
    chosen = devices or runtime.devices
    if not re.match(r"^(auto|\d+(,\d+)*)$", chosen):
        raise InputError(f"--devices {chosen!r}: expected 'auto' or NPU ids such as '0' or '0,3'")
    return ContainerPlan(
        name=runtime.name, image=runtime.image,
        devices=device_nodes(chosen, host_root),
        mounts=list(runtime.mounts) + workspace_mounts(workspace, recipe),
        port=recipe.serve.port, shm_size=runtime.shm_size, python=runtime.python,
        packages=list(runtime.packages),
        install_timeout=runtime.install_timeout)


def inside_container(root: Path | None = None) -> bool:
    """Whether this process runs in a container (ours says so; docker adds /.dockerenv), or,
    for a captured host ``root``, whether that host was one."""
    return bool(childrun.container_name()) or ((root or Path("/")) / ".dockerenv").exists()


# --- the docker client ----------------------------------------------------------------------


def require_docker() -> str:
    path = shutil.which("docker")
    if path is None:
        raise Dsv4Error(f"the docker client is not on PATH; {DOCKER_FIX}")
    return path


def docker_query(args: list[str]) -> tuple[int, str]:
    """A quick docker question (inspect, ps): exit code and stdout."""
    try:
        proc = capture(["docker", *args], timeout=_QUICK_TIMEOUT_S)
    except FileNotFoundError:
        raise EngineUnavailable(f"the docker client is not on PATH; {DOCKER_FIX}") from None
    except subprocess.TimeoutExpired:
        raise EngineUnavailable(f"`docker {' '.join(args[:2])}` did not answer in "
                                f"{_QUICK_TIMEOUT_S:.0f}s; is the Docker engine running?"
                                ) from None
    fix = docker_fix(proc.stderr) if proc.returncode != 0 else None
    if fix:
        raise EngineUnavailable(f"docker: {proc.stderr.strip().splitlines()[-1]}; {fix}")
    return proc.returncode, proc.stdout


def docker_run(args: list[str], log: Path, what: str, task: Task | None = None,
               timeout: float | None = None) -> None:
    """A docker command whose output goes to the log (and, a line at a time, to the progress
    line); a failure or a timeout names ``what`` failed."""

    def on_line(line: str) -> None:
        if task is not None:
            task.update(description=f"{what}: {line.strip()[:60]}")

    try:
        run_command(["docker", *args], log=log, on_line=on_line, check=True, timeout=timeout)
    except CommandFailed as exc:
        raise Dsv4Error(f"{what} failed: {exc.message}", log=str(log)) from None


def image_architecture(image: str) -> str | None:
    """The image's architecture when it is present locally, else None."""
    code, out = docker_query(["image", "inspect", "--format", "{{.Architecture}}", image])
    return (out.strip() or "unknown") if code == 0 else None


@dataclass
class Found:
    id: str
    image: str
    state: str
    digest: str


def find_container(name: str) -> Found | None:
    fmt = '{{.ID}}\t{{.Image}}\t{{.State}}\t{{.Label "' + LABEL + '"}}'
    code, out = docker_query(["ps", "-a", "--filter", f"name=^/{name}$", "--format", fmt])
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3:
            return Found(parts[0], parts[1], parts[2], parts[3] if len(parts) > 3 else "")
    return None


# --- this tool as a wheel -------------------------------------------------------------------


def build_self_wheel(dest_dir: Path) -> Path:
    """A wheel of the running install, byte for byte reproducible (its sha256 names it).

    Built from the installed package files and metadata rather than with `pip wheel`: that
    works offline, from an editable or a regular install, without build isolation.
    """
    import importlib.metadata as md

    import dsv4_offload

    dist = md.distribution("dsv4-offload")
    version = dist.version
    package = Path(dsv4_offload.__file__).parent
    info = f"dsv4_offload-{version}.dist-info"
    files: list[tuple[str, bytes]] = []
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package.parent).as_posix()
        if path.is_file() and "__pycache__" not in rel and not rel.endswith((".pyc", ".so")):
            files.append((rel, path.read_bytes()))
    files.append((f"{info}/METADATA", (dist.read_text("METADATA") or "").encode()))
    entry_points = dist.read_text("entry_points.txt")
    if entry_points:
        files.append((f"{info}/entry_points.txt", entry_points.encode()))
    files.append((f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: dsv4-offload\n"
                                    b"Root-Is-Purelib: true\nTag: py3-none-any\n"))
    record = "".join(f"{name},sha256={_b64sha(data)},{len(data)}\n" for name, data in files)
    files.append((f"{info}/RECORD", (record + f"{info}/RECORD,,\n").encode()))
    target = dest_dir / f"dsv4_offload-{version}-py3-none-any.whl"
    fd, tmp = tempfile.mkstemp(dir=dest_dir, suffix=".whl.tmp")
    os.close(fd)
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in files:
                entry = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                entry.external_attr = 0o644 << 16
                zf.writestr(entry, data, zipfile.ZIP_DEFLATED)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


def _b64sha(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


# --- up / status / down ---------------------------------------------------------------------


@dataclass
class UpReport:
    plan: ContainerPlan
    action: str = ""  # created | reused | replaced
    messages: list[str] = field(default_factory=list)
    pulled: bool = False
    packages: str = ""  # present | installed
    tool: str = ""  # present | installed
    tool_digest: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {**self.plan.as_dict(), "action": self.action, "messages": self.messages,
                "pulled": self.pulled, "packages": self.packages, "tool": self.tool,
                "tool_digest": self.tool_digest}


def container_up(plan: ContainerPlan, workspace: Workspace, *, task: Task | None = None
                 ) -> UpReport:
    """Reuse, replace or create the container, then make sure of its packages and the tool."""
    require_docker()
    log = workspace.log_dir("container") / "container.log"
    report = UpReport(plan)
    found = find_container(plan.name)
    if found is not None and found.digest == plan.digest and found.state == "running":
        report.action = "reused"
    else:
        if found is not None:
            if not found.digest:
                raise Dsv4Error(
                    f"a container named {plan.name} exists that dsv4-offload did not start "
                    f"(image {found.image}); keep it under another name or remove it "
                    f"(docker rm -f {plan.name}), or set runtime.name")
            why = (f"its image is {found.image}, the recipe wants {plan.image}"
                   if found.image != plan.image else
                   f"it is {found.state}" if found.digest == plan.digest else
                   "its mounts, devices, port or shm size differ from the recipe's")
            report.messages.append(f"replaced container {plan.name} ({found.id[:12]}): {why}")
            docker_run(["rm", "-f", plan.name], log, f"removing container {plan.name}", task)
            report.action = "replaced"
        else:
            report.action = "created"
        if image_architecture(plan.image) is None:
            report.messages.append(f"pulled {plan.image}")
            docker_run(["pull", plan.image], log, f"docker pull {plan.image}", task)
            report.pulled = True
        docker_run(plan.run_argv()[1:], log, f"docker run {plan.image}", task)
    report.packages = ensure_packages(plan, log, task)
    report.tool, report.tool_digest = ensure_tool(plan, workspace, log, task)
    return report


def _exec(plan: ContainerPlan, command: list[str]) -> list[str]:
    return ["exec", plan.name, *command]


PACKAGES_OFFLINE = ("the container has no network to the package mirror: bake them into the "
                    "image (a Dockerfile `FROM <image>` + `RUN apt-get install -y {pkgs}`) and "
                    "set runtime.image to it, or point apt inside at a reachable mirror")


def ensure_packages(plan: ContainerPlan, log: Path, task: Task | None = None) -> str:
    """hwloc and pkg-config inside: checked every time (lost when the container is new).

    The install streams apt's own output to the log and the progress line and stops after
    ``plan.install_timeout`` seconds: an image without a route to its mirror says so."""
    if not plan.packages:
        return "none asked"
    code, _ = docker_query(_exec(plan, ["sh", "-c", PACKAGES_CHECK]))
    if code == 0:
        return "present"
    wanted = " ".join(plan.packages)
    try:
        docker_run(_exec(plan, ["sh", "-c", f"apt-get update && apt-get install -y {wanted}"]),
                   log, f"installing {wanted} in {plan.name}", task,
                   timeout=plan.install_timeout)
    except Dsv4Error as exc:
        raise Dsv4Error(f"{exc.one_line()}; {PACKAGES_OFFLINE.format(pkgs=wanted)}",
                        log=str(log)) from None
    code, _ = docker_query(_exec(plan, ["sh", "-c", PACKAGES_CHECK]))
    if code != 0:
        raise Dsv4Error(f"{plan.name}: {wanted} installed but `{PACKAGES_CHECK}` still fails; "
                        "install them by hand in the container", log=str(log))
    return "installed"


# --- this tool inside: its own venv in the workspace, from a wheelhouse the host fills ------

# What the container's python is: the wheelhouse must match its version, machine and glibc.
_PROBE = ("import platform, sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}', "
          "platform.machine(), platform.libc_ver()[1] or '2.17')")


@dataclass(frozen=True)
class Target:
    """The interpreter the tool's venv is made from, inside the container."""

    python: str  # "3.11"
    machine: str  # "aarch64" | "x86_64"
    glibc: str  # "2.35"

    @property
    def key(self) -> str:
        return f"cp{self.python.replace('.', '')}-{self.machine}-glibc{self.glibc}"

    def pip_platform_args(self) -> list[str]:
        """``pip download`` options for binary wheels this interpreter can load."""
        major, minor = (int(x) for x in self.glibc.split(".")[:2])
        tags = [f"manylinux_{major}_{m}_{self.machine}" for m in range(minor, 16, -1)]
        tags += [f"manylinux2014_{self.machine}"]
        args = ["--only-binary=:all:", "--implementation", "cp", "--python-version",
                self.python, "--abi", f"cp{self.python.replace('.', '')}", "--abi", "abi3",
                "--abi", "none"]
        for tag in tags:
            args += ["--platform", tag]
        return args + ["--platform", "any"]


def container_target(plan: ContainerPlan) -> Target:
    code, out = docker_query(_exec(plan, [plan.python, "-c", _PROBE]))
    parts = out.split()
    if code != 0 or len(parts) != 3:
        raise Dsv4Error(f"{plan.name}: `{plan.python}` does not run inside the container; set "
                        "runtime.python to the image's python (e.g. python3.11)")
    return Target(*parts)


def tool_venv(workspace: Workspace) -> Path:
    """The tool's own venv, in the workspace (mounted at the same path inside): never the
    server's interpreter, so the image's packages (the patched gguf-py) stay as they are."""
    return workspace.meta_dir / "container-venv"


def tool_python(workspace: Workspace) -> str:
    return str(tool_venv(workspace) / "bin" / "python")


WHEELHOUSE_ENV = "DSV4_WHEELHOUSE"  # a wheelhouse prepared elsewhere (no PyPI on this host)


def fill_wheelhouse(wheel: Path, target: Target, workspace: Workspace, log: Path,
                    task: Task | None = None, timeout: float | None = None) -> Path:
    """Binary wheels of the tool's dependencies for ``target``, fetched on the host (the
    container may have no network); done once per dependency list and target.

    ``$DSV4_WHEELHOUSE`` names a directory filled elsewhere (an air-gapped site): its wheels
    are copied into the workspace (the container sees only the workspace) and nothing is
    downloaded; pip inside names any wheel that is missing."""
    house = workspace.meta_dir / "wheelhouse" / target.key
    house.mkdir(parents=True, exist_ok=True)
    given = os.environ.get(WHEELHOUSE_ENV)
    if given:
        if not Path(given).is_dir():
            raise InputError(f"{WHEELHOUSE_ENV}={given}: not a directory; fill one with "
                             f"`pip download --dest DIR {shlex.join(target.pip_platform_args())}"
                             " dsv4-offload` or unset it")
        for found in sorted(Path(given).glob("*.whl")):
            if not (house / found.name).exists():
                shutil.copyfile(found, house / found.name)
        return house
    requires = sorted(_requires_dist())
    stamp = house / "requirements.sha256"
    want = hashlib.sha256(json.dumps(requires).encode()).hexdigest()
    if stamp.exists() and stamp.read_text().strip() == want:
        return house
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check",
            "--no-input", "--dest", str(house), *target.pip_platform_args(), str(wheel)]
    try:
        run_command(argv, log=log, timeout=timeout,
                    on_line=(lambda line: task.update(description=f"wheelhouse: {line[:60]}"))
                    if task is not None else None)
    except CommandFailed as exc:
        raise Dsv4Error(
            f"fetching the tool's dependencies for the container ({target.key}) failed: "
            f"{exc.message}; on a host without PyPI, fill {house} elsewhere with "
            f"`pip download --dest DIR {shlex.join(target.pip_platform_args())} "
            f"dsv4-offload` and copy DIR there", log=str(log)) from None
    from dsv4_offload.workspace.store import atomic_write_bytes

    atomic_write_bytes(stamp, want.encode())
    return house


def _requires_dist() -> list[str]:
    import importlib.metadata as md

    return list(md.distribution("dsv4-offload").requires or [])


def ensure_tool(plan: ContainerPlan, workspace: Workspace, log: Path,
                task: Task | None = None) -> tuple[str, str]:
    """This tool inside, in its own venv in the workspace, from a wheel of the running
    install and a wheelhouse the host fills; reinstalled when the wheel differs."""
    wheels = workspace.meta_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = build_self_wheel(wheels)
    digest = file_sha256(wheel)
    venv = tool_venv(workspace)
    marker = venv / "dsv4-offload-wheel.sha256"
    code, out = docker_query(_exec(plan, ["cat", str(marker)]))
    if code == 0 and out.strip() == digest:
        return "present", digest
    target = container_target(plan)
    house = fill_wheelhouse(wheel, target, workspace, log, task, timeout=plan.install_timeout)
    if not (venv / "bin" / "python").exists():
        docker_run(_exec(plan, [plan.python, "-m", "venv", str(venv)]), log,
                   f"making the tool's venv in {plan.name}", task, timeout=plan.install_timeout)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-input",
           "--disable-pip-version-check", "--no-index", "--find-links", str(house)]
    # the version number does not change between builds of the tool: force its files in,
    # then the dependencies from the wheelhouse alone (no index, no network)
    docker_run(_exec(plan, [*pip, "--force-reinstall", "--no-deps", str(wheel)]), log,
               f"installing dsv4-offload in {plan.name}", task, timeout=plan.install_timeout)
    docker_run(_exec(plan, [*pip, str(wheel)]), log, "installing its dependencies", task,
               timeout=plan.install_timeout)
    docker_run(_exec(plan, ["sh", "-c", f"printf %s {digest} > {shlex.quote(str(marker))}"]),
               log, "recording the tool's digest", task)
    return "installed", digest


@dataclass
class ContainerStatus:
    plan: ContainerPlan
    found: Found | None
    matches: bool
    tool_version: str | None = None
    tool_digest: str | None = None
    image_arch: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {**self.plan.as_dict(), "exists": self.found is not None,
                "id": self.found.id if self.found else None,
                "state": self.found.state if self.found else None,
                "running_image": self.found.image if self.found else None,
                "matches_recipe": self.matches, "tool_version": self.tool_version,
                "tool_digest": self.tool_digest, "image_arch": self.image_arch}


def container_status(plan: ContainerPlan, workspace: Workspace) -> ContainerStatus:
    require_docker()
    found = find_container(plan.name)
    status = ContainerStatus(plan, found, bool(found and found.digest == plan.digest),
                             image_arch=image_architecture(plan.image))
    if found is not None and found.state == "running":
        code, out = docker_query(_exec(plan, [tool_python(workspace), "-m", "dsv4_offload",
                                              "--version"]))
        status.tool_version = out.strip() if code == 0 else None
        code, out = docker_query(_exec(plan, ["cat", str(tool_venv(workspace)
                                                         / "dsv4-offload-wheel.sha256")]))
        status.tool_digest = out.strip() if code == 0 else None
    return status


def container_down(plan: ContainerPlan, workspace: Workspace) -> bool:
    """Remove the container (ours only); False when there was none."""
    require_docker()
    found = find_container(plan.name)
    if found is None:
        return False
    if not found.digest:
        raise Dsv4Error(f"container {plan.name} was not started by dsv4-offload; leaving it "
                        f"alone (docker rm -f {plan.name} removes it)")
    docker_run(["rm", "-f", plan.name], workspace.log_dir("container") / "container.log",
               f"removing container {plan.name}")
    return True


# --- running this tool inside ---------------------------------------------------------------


def recipe_argument(spec: str | None, plan: ContainerPlan) -> list[str]:
    """``--recipe`` for the inner command: a bundled name, or a file under a mounted path."""
    path = resolve_recipe_path(spec).absolute()
    if path.parent == BUNDLED_RECIPES:
        return ["--recipe", path.stem]
    for mount in plan.mounts:
        host, _, inside = mount.partition(":")
        if host.rstrip("/") == inside.rstrip("/") and path.is_relative_to(host):
            return ["--recipe", str(path)]
    raise InputError(f"recipe file {path} is not visible in the container (only the workspace "
                     "is mounted at its own path); copy it into the workspace and pass that "
                     "path to --recipe")


def env_read() -> frozenset[str]:
    """Every variable serving/plan.py reads from the environment: the launcher's knobs
    (ENV_KNOBS, FLAG_KNOBS) and the paths and choices it honours. HOME and PYTHONPATH are the
    container's own. tests/test_contexts.py checks plan.py reads no other."""
    from dsv4_offload.build.interpreter import PYTHON_BIN_ENV
    from dsv4_offload.serving.plan import ENV_KNOBS, FLAG_KNOBS, OP_DIR_ENV

    return frozenset({
        *ENV_KNOBS, *FLAG_KNOBS, "SKIP_WARMUP", "EXTRA_FLAGS", "KT_GGUF_TEMPLATE", OP_DIR_ENV,
        "ASCEND_RT_VISIBLE_DEVICES", "NPU_DEVICE_ID", "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH",
        "ATB_SET_ENV", PYTHON_BIN_ENV})


def crossing_names(recipe: Recipe) -> list[str]:
    """The variables that cross into the container: every one the serve plan reads and every
    name the recipe's serve and build env set, when this process has it."""
    names = set(env_read()) | set(recipe.serve.env) | {k for step in recipe.build.steps
                                                      for k in step.env}
    return sorted(name for name in names if name in os.environ)


def exec_argv(plan: ContainerPlan, workspace: Workspace, recipe_spec: str | None,
              overrides: list[str], args: list[str], names: Iterable[str] = (),
              lender_pipe: bool = False) -> list[str]:
    """``docker exec`` running this tool inside on the same workspace and recipe.

    ``names`` cross by name (``-e NAME``): docker takes each value from the client's own
    environment, so none is on argv (where `ps` and the log would show it). With
    ``lender_pipe`` the client's stdin stays open (``-i``) while this process lives: the
    tool inside stops its stage when it reads EOF there (core/childrun, LENDER_PIPE_ENV).
    """
    argv = ["docker", "exec", "-e", f"{IN_CONTAINER_ENV}={plan.name}"]
    if lender_pipe:
        argv += ["-i", "-e", f"{LENDER_PIPE_ENV}=1"]
    for name in dict.fromkeys(names):
        argv += ["-e", name]
    argv += ["-w", str(workspace.root), plan.name]
    tool = childrun.tool_argv(tool_python(workspace), workspace.root,
                              recipe_argument(recipe_spec, plan), overrides)
    return [*argv, *tool, *args]


def run_stage_inside(ctx: StageContext, stage: str, options: StageOptions,
                     standalone: StageOptions | None = None, before: Any = None
                     ) -> StageResult:
    """Run one stage in the container with the lock lent to it; its result from its JSON.
    The files it reads cross first (serving/crossing.py); the private copies made for it are
    removed after it, but a server's key, which lives as long as the server.

    The inner `run --from S --to S --force S` records the stage in the shared state file
    itself; the host only reads back what it printed. A stand-alone command (`build`,
    `serve`, ...) comes the same way, its own options in ``standalone``: they cross as JSON
    in DSV4_STAGE_OPTIONS and the inner `run` gives them to the stage. ``before(ctx, plan,
    options)``, the stage's own check of the running container, may refuse first.
    """
    from dsv4_offload.serving import crossing

    plan = plan_container(ctx.recipe, ctx.workspace)
    # every file a process inside must read, checked before any container work
    where = f"container {plan.name}"
    crossing.check_recipe_files(ctx.recipe, stage, plan.mounts, where)
    given = options
    options = crossing.cross(options, plan.mounts, ctx.workspace, where)
    made = crossing.copies(given, options)
    if standalone is not None:
        crossed = crossing.cross(standalone, plan.mounts, ctx.workspace, where)
        made += crossing.copies(standalone, crossed)
        standalone = crossed
    result = None
    try:
        result = _inside(ctx, stage, plan, options, standalone, before)
        return result
    finally:  # a server keeps its key until it stops (`serve stop` removes it then)
        if stage != "serve" or result is None or not result.ok:
            crossing.forget(ctx.workspace, *made)


def _inside(ctx: StageContext, stage: str, plan: ContainerPlan, options: StageOptions,
            standalone: StageOptions | None, before: Any) -> StageResult:
    from dsv4_offload.core.results import Problem, StageResult, Status

    with ctx.task(f"container {plan.name}") as task:
        container_up(plan, ctx.workspace, task=task)
    refused = before(ctx, plan, options) if before is not None else None
    if refused is not None:
        return refused  # type: ignore[no-any-return]
    # --serial: the one stage, in this process inside (a pipelined run schedules on the host)
    # the inner `run` offers its --device to the stage as this one's `run` did
    args = childrun.stage_argv(stage, options.to_wire().get("device"))
    log = ctx.workspace.log_dir("container") / f"{stage}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    path = ctx.recipe.file
    spec = str(path) if path is not None else None
    overrides = list(ctx.recipe.overrides)
    with ctx.workspace.lend_lock() as token:
        # the lent lock, the handed options and a pipelined run's event file (under the
        # workspace, mounted) cross by name, beside the recipe's variables
        env = childrun.stage_env(os.environ, token,
                                 standalone.to_wire() if standalone is not None else None)
        names = [*childrun.passed_names(env), *crossing_names(ctx.recipe)]
        argv = exec_argv(plan, ctx.workspace, spec, overrides, args, names, lender_pipe=True)
        with ctx.task(f"{stage} in {plan.name}"):
            code, out = _run_capturing(
                argv, log, env=env,
                on_interrupt=lambda: _interrupt_inside(plan, ctx.workspace, stage))
    report = childrun.read_report(out, stage)
    if report.result is None:
        # an expected error inside (bad input, a locked workspace) prints {"error": ...}
        message = report.error or f"`docker exec {plan.name}` exited {code} without a result"
        return StageResult(Status.FAILED, f"{stage} in container {plan.name} failed",
                           problems=[Problem("error", message, fix=f"see the log: {log}",
                                             check="container")], log=str(log))
    result = report.result
    result.log = result.log or str(log)
    return result


def _interrupt_inside(plan: ContainerPlan, workspace: Workspace, stage: str) -> None:
    """Ctrl-C for the stage's process in the container: killing the `docker exec` client
    would leave it running (and writing the state) after the host let go of the lock."""
    record = workspace.state().record(stage)
    if record is not None and record.status == StageState.RUNNING and record.pid is not None:
        with contextlib.suppress(Dsv4Error):
            docker_query(_exec(plan, ["kill", "-INT", str(record.pid)]))


def _run_capturing(argv: list[str], log: Path, on_interrupt: Any = None,
                   grace: float = 60.0, env: dict[str, str] | None = None
                   ) -> tuple[int, str]:
    """Run ``argv``: stdout returned (the JSON), stderr appended to ``log``.

    On Ctrl-C (or SIGTERM/SIGHUP), ``on_interrupt`` stops the work inside first; the client
    gets ``grace`` seconds to come back with it before its group is killed.
    """
    with open(log, "ab") as err:
        err.write(f"\n=== $ {shlex.join(argv)}\n".encode())
        err.flush()
        # SIGTERM and SIGHUP reach the except below as KeyboardInterrupt (cli/app.main)
        # stdin: a pipe held open, never written, closed only by our end (or death)
        child = start(argv, env=env, stdout=subprocess.PIPE, stderr=err,
                      stdin=subprocess.PIPE)
        proc = child.proc
        try:
            assert proc.stdout is not None and proc.stdin is not None
            out = proc.stdout.read()
            proc.wait()
            proc.stdin.close()
        except BaseException:
            if on_interrupt is not None:
                on_interrupt()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
            child.stop()
            raise
        err.write(f"=== exit {proc.returncode}\n".encode())
    return proc.returncode, out.decode("utf-8", errors="replace")


def exec_attached(argv: list[str], env: dict[str, str] | None = None) -> int:
    """Run a `docker exec` with this terminal's stdout and stderr; its exit code.

    Stopped with this process (Ctrl-C, SIGTERM, SIGHUP, an exception, or its death)."""
    try:
        return run_attached(argv, env=env)
    except FileNotFoundError:
        raise Dsv4Error(f"the docker client is not on PATH; {DOCKER_FIX}") from None

