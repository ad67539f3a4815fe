"""Shared by the serve and accept tests: a workspace ready to serve, the stand-in, leak checks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from dsv4_offload.core.host import HostFacts
from dsv4_offload.recipe import load_recipe, load_recipe_and_series
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

STANDIN = Path(__file__).parent / "standin_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def no_npu_host(numa: int = 1, cores: int = 8) -> HostFacts:
    return HostFacts(
        arch="x86_64", cpu_model="test", cpu_flags=frozenset(), cores=cores,
        numa_nodes=tuple(range(numa)), mem_total_kib=None, mem_available_kib=None, npus=(),
        npu_smi=None, device_nodes={}, cann_version=None, cann_toolkit=None,
        python_versions={}, tools={}, libraries={}, disk_free_bytes=None,
    )


def standin_overrides(tag: str, port: int, *args: str, timeout: float = 20) -> list[str]:
    """--set overrides that make the real launcher start the stand-in on 127.0.0.1:port."""
    command = [sys.executable, str(STANDIN), "--tag", tag, *args, "{flags}"]
    quoted = ", ".join(f"'{c}'" for c in command)
    return [f"serve.command=[{quoted}]", f"serve.port={port}", "serve.host=127.0.0.1",
            f"serve.readiness_timeout_s={timeout}", "serve.stop_timeout_s=3",
            "acceptance.request_timeout_s=5", "acceptance.throughput.prompt_buckets=[16, 64]",
            "acceptance.throughput.new_tokens=16", "acceptance.throughput.repeats=2"]


def make_op(ws: Workspace) -> Path:
    """The two files of the AscendC operator where serve points KT_MXFP4_OP_DIR (the build
    step's directory); empty, since serve only checks that they exist."""
    from dsv4_offload.serving.rules import OP_FILES, op_dir

    directory, _ = op_dir(ws, load_recipe(), {})
    directory.mkdir(parents=True, exist_ok=True)
    for name in OP_FILES:
        (directory / name).touch()
    return directory


def make_workspace(root: Path) -> Workspace:
    """A workspace whose GGUF layer files exist (empty: serve only checks their presence)."""
    ws = Workspace(root)
    recipe = load_recipe()
    gguf = ws.gguf_dir(recipe)
    gguf.mkdir(parents=True, exist_ok=True)
    for layer in range(recipe.conversion.layers):
        (gguf / recipe.conversion.file_name(layer)).touch()
    ws.ensure()
    return ws


def context(ws: Workspace, overrides: list[str], stage: str, **options: Any) -> StageContext:
    # the stand-in serves on this host: not in the 910B recipe's container
    recipe, series = load_recipe_and_series(None, ["runtime.kind=host", *overrides])
    return StageContext(recipe=recipe, series=series, workspace=ws, stage=stage,
                        host_facts=no_npu_host(), options=options)


def leftovers(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
        except (psutil.Error, TypeError):
            continue
        if tag in cmd and proc.pid != os.getpid() and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def standin_servers(tag: str) -> list[psutil.Process]:
    """The stand-in servers among ``leftovers(tag)``, by the command line read when they were
    listed (a server exiting meanwhile is a zombie whose cmdline() raises)."""
    return [p for p in leftovers(tag)
            if any(str(a).endswith("standin_server.py") for a in p.info["cmdline"][1:2])]


def leftover_guard(tmp_path: Path) -> Iterator[str]:
    """A tag for the processes a test starts; afterwards none may remain (they are killed).

    The `no_leftovers` fixture (conftest.py) wraps it.
    """
    tag = str(tmp_path)
    yield tag
    deadline = time.monotonic() + 5
    left = leftovers(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = leftovers(tag)
    for proc in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not left, f"processes left behind: {[p.info['cmdline'] for p in left]}"
