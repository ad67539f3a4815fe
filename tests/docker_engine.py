"""A real Docker engine for the container tests: dockerd started by the test, a small image.

TEST FIXTURE ONLY. On a real 910B host none of this is used: the tool calls the host's
own `docker`. Here (see shared/design/docker-engine-notes.md) the engine runs as root with
vfs storage and no iptables, and the delivery's `docker run` line needs two adjustments
that this module makes *outside* the line, so the line itself stays unchanged:

- ``--privileged`` asks for capabilities this sandbox's bounding set lacks, and ``--ulimit
  memlock=-1`` for more than its hard limit: runc refuses both. An OCI runtime shim
  (registered with ``--add-runtime`` / ``--default-runtime``) intersects the spec's
  capability lists with the sandbox's bounding set and lowers each rlimit to the current
  hard limit, then runs runc with its original arguments.
- There is no registry: the image is a Debian minbase made with debootstrap from the
  mirror apt is configured with, imported with ``docker import`` and cached between runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from testcache import cache_dir

ENGINE_CLIENT = "/usr/bin/docker"  # the client that came with docker.io (matches dockerd)
# hwloc and pkg-config are what the 910B image lacks and `container up` installs: they are
# baked in here, because a container has no network on this machine (the test of the
# missing-packages path uses an image without them); automake because debootstrap does not
# resolve libltdl-dev's `automake | automaken`
IMAGE_PACKAGES = ("python3", "python3-venv", "python3-pip", "libhwloc-dev", "libhwloc15",
                  "pkg-config", "procps", "automake")
SUITE = "bookworm"  # the 910B image's python is 3.11, as bookworm's

SHIM = r'''#!/usr/bin/env python3
"""TEST FIXTURE ONLY (tests/docker_engine.py): an OCI runtime shim for this sandbox.

Before runc reads a process spec (create --bundle DIR: DIR/config.json; exec --process FILE)
it keeps only the capabilities of this process's bounding set and lowers every rlimit to
the current hard limit; then it runs runc with the same arguments.
"""
import json, os, resource, sys

CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
        "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
        "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
        "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
        "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
        "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
        "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
        "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
        "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE"]


def bounding():
    for line in open("/proc/self/status"):
        if line.startswith("CapBnd:"):
            mask = int(line.split()[1], 16)
            return {name for i, name in enumerate(CAPS) if mask >> i & 1}
    return set(CAPS)


def fix(process):
    allowed = bounding()
    caps = process.get("capabilities") or {}
    for key, names in list(caps.items()):
        caps[key] = [n for n in names if n in allowed]
    for entry in process.get("rlimits") or []:
        name = entry.get("type", "")
        if hasattr(resource, name):
            hard = resource.getrlimit(getattr(resource, name))[1]
            if hard != resource.RLIM_INFINITY:
                entry["hard"] = min(entry.get("hard", hard), hard)
                entry["soft"] = min(entry.get("soft", hard), entry["hard"])


def edit(path, key):
    with open(path) as fh:
        doc = json.load(fh)
    fix(doc.get(key, {}) if key else doc)
    with open(path, "w") as fh:
        json.dump(doc, fh)


args = sys.argv[1:]
if "create" in args or "run" in args:
    if "--bundle" in args:
        edit(os.path.join(args[args.index("--bundle") + 1], "config.json"), "process")
if "exec" in args and "--process" in args:
    edit(args[args.index("--process") + 1], None)
os.execv("/usr/sbin/runc", ["runc", *args])
'''


def unavailable() -> str | None:
    """Why no engine can start here (None when it can)."""
    if os.geteuid() != 0:
        return "the Docker engine test needs root (dockerd)"
    for tool in ("/usr/sbin/dockerd", ENGINE_CLIENT, "/usr/sbin/runc", "/usr/sbin/debootstrap"):
        if not os.path.exists(tool):
            return f"{tool} is missing: apt-get install docker.io debootstrap"
    return None


def apt_mirror() -> str:
    """The Debian mirror apt is configured with on this machine (deb822 or one-line form)."""
    candidates = sorted(Path("/etc/apt/sources.list.d").glob("*")) + [Path("/etc/apt/sources.list")]
    for path in candidates:
        with contextlib.suppress(OSError):
            text = path.read_text()
            for url in re.findall(r"^URIs:\s*(\S+)", text, re.M) + re.findall(
                    r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+", text, re.M):
                if "security" not in url:
                    return url
    raise RuntimeError("no Debian mirror in apt's sources (/etc/apt/sources.list*)")


def image_tarball(packages: tuple[str, ...] = IMAGE_PACKAGES) -> Path:
    """A minbase root filesystem tarball with ``packages``, made once and cached by its list."""
    key = hashlib.sha256(" ".join((SUITE, *packages)).encode()).hexdigest()[:12]
    tarball = cache_dir() / "images" / f"{SUITE}-{key}.tar"
    tarball.parent.mkdir(parents=True, exist_ok=True)
    # one maker at a time: `.ci/run` starts this file in the background (below) while the
    # suite's workers may reach the engine test before it is done
    with open(tarball.parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _make_tarball(tarball, packages)


def _make_tarball(tarball: Path, packages: tuple[str, ...]) -> Path:
    if tarball.exists():
        return tarball
    with tempfile.TemporaryDirectory(prefix="dsv4-rootfs-", dir=tarball.parent) as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
                        SUITE, str(rootfs), apt_mirror()], check=True, capture_output=True,
                       timeout=1200)
        part = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(part), "."], check=True,
                       timeout=600)
        os.replace(part, tarball)
    return tarball


class Engine:
    """A private dockerd; ``env`` points a client at it (``DOCKER_HOST``, and a PATH whose
    first ``docker`` is the engine's own client)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "docker.sock"
        self.bin = root / "bin"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        return {"DOCKER_HOST": f"unix://{self.socket}",
                "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', os.defpath)}"}

    def docker(self, *args: str, timeout: float = 120, check: bool = True,
               input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([ENGINE_CLIENT, *args], env={**os.environ, **self.env},
                              capture_output=True, timeout=timeout, check=check, input=input)

    def start(self) -> None:
        self.bin.mkdir(parents=True, exist_ok=True)
        (self.bin / "docker").symlink_to(ENGINE_CLIENT)
        shim = self.root / "oci-shim"
        shim.write_text(SHIM)
        shim.chmod(0o755)
        log = open(self.root / "dockerd.log", "wb")  # noqa: SIM115 (kept for the daemon)
        self.proc = subprocess.Popen(
            ["/usr/sbin/dockerd", "--storage-driver", "vfs", "--iptables=false",
             "--ip-masq=false", "--data-root", str(self.root / "data"),
             "--exec-root", str(self.root / "exec"), "--pidfile", str(self.root / "pid"),
             "-H", f"unix://{self.socket}", "--add-runtime", f"sandbox={shim}",
             "--default-runtime", "sandbox"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("dockerd exited: "
                                   + (self.root / "dockerd.log").read_text()[-2000:])
            if self.docker("info", check=False, timeout=10).returncode == 0:
                return
            time.sleep(0.5)
        raise RuntimeError("dockerd did not answer in 60 s: "
                           + (self.root / "dockerd.log").read_text()[-2000:])

    def load_image(self, name: str, tarball: Path) -> None:
        with open(tarball, "rb") as fh:
            subprocess.run([ENGINE_CLIENT, "import", "-", name], stdin=fh, check=True,
                           capture_output=True, env={**os.environ, **self.env}, timeout=600)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(subprocess.SubprocessError):
            ids = self.docker("ps", "-aq", check=False, timeout=30).stdout.split()
            if ids:  # killed, not removed: their vfs copies go with the data dir below
                self.docker("kill", *[i.decode() for i in ids], check=False, timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # vfs layers are plain directories: remove them so the next run starts clean
        shutil.rmtree(self.root / "data", ignore_errors=True)


@contextlib.contextmanager
def running_engine(root: Path) -> Iterator[Engine]:
    engine = Engine(root)
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()


if __name__ == "__main__":  # .ci/run: the image, made while the rest is installed
    if unavailable() is None:
        print(image_tarball())
