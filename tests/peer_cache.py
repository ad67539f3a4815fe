"""The real peer's cache, made with the standard library only: `.ci/run` starts
`python tests/peer_cache.py` in the background before the package and the test
dependencies are installed (the wheel is 4-6 min of C++ on 2 cores; the Docker engine
test's Debian image, tests/docker_engine.py, is made beside it), and tests/test_real_peer.py
reuses what it made. Every maker holds one file lock, so the suite's workers and the
background prebuild never make the same thing twice or at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from testcache import cache_dir

LLAMA_CPP_PYTHON = "0.3.36"
# the default (native) build crashes on the first request on these CPUs (ggml AMX path)
CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
              "-DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "
              "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF")


def _run(args: list[str], log: Path, env: dict[str, str] | None = None,
         timeout: float = 3600) -> None:
    with open(log, "a") as fh:
        fh.write(f"$ {shlex.join(args)}\n")
        fh.flush()
        proc = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{args[0]} failed (exit {proc.returncode}); see {log}:\n"
                           + "\n".join(tail))


@contextlib.contextmanager
def _cache_locked() -> Iterator[None]:
    """One process at a time makes the cache's wheel, venv and model: the suite's workers
    (pytest-xdist) and `.ci/run`'s background prebuild each start the session fixtures."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "cache.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes
        yield


def _built_wheel(wheels: Path) -> list[Path]:
    return list(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}-*.whl"))


def build_wheel(cache: Path) -> None:
    """The llama-cpp-python wheel, built from PyPI's source once into <cache>/wheels, the way
    a user keeps a wheel: `.ci/run` starts this in the background while the quick tests run
    (`python tests/peer_cache.py`), the fixture reuses it."""
    with _cache_locked():
        _build_wheel(cache)


def _build_wheel(cache: Path) -> None:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if _built_wheel(wheels):
        return
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    # --no-cache-dir: pip's wheel cache ignores CMAKE_ARGS and could hand back a native
    # build made earlier with other flags; a .part dir: a half-built wheel is never found
    part = cache / "wheels.part"
    shutil.rmtree(part, ignore_errors=True)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w",
          str(part), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], cache / "peer-build.log", env)
    for wheel in part.glob("*.whl"):
        wheel.replace(wheels / wheel.name)
    shutil.rmtree(part, ignore_errors=True)




if __name__ == "__main__":
    build_wheel(cache_dir())
