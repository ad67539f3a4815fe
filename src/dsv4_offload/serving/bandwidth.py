"""The memory bandwidth of this host, read the way kt-kernel's pools read it: one reader per
NUMA node, pinned to that node's CPUs and memory, with the serve plan's threads per pool.

The tool is sysbench's memory test (``--memory-oper=read``) under ``numactl --cpunodebind=N
--membind=N``: both are packaged on Debian/Ubuntu and openEuler alike and run the same way on
x86_64 and Kunpeng-920, where likwid-bench's ARMv8 support depends on the CPU model. Its read
loop is a plain word loop, not the kernel's NEON loads, so the figure is what the memory
gives a simple reader: a ceiling to compare the kernel with, never a promise.

Each node is measured alone, then every node at once (one sysbench per node, as the pools
run, summed). The result is cached in the workspace (``Workspace.bandwidth_file``); doctor
measures when there is none, for another layout, or when asked (``doctor --bandwidth``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import Dsv4Error
from dsv4_offload.core.host import HOST_ROOT_ENV, HostFacts
from dsv4_offload.core.results import Check, CheckStatus
from dsv4_offload.workspace.store import atomic_write_json, read_json

if TYPE_CHECKING:
    from dsv4_offload.recipe import Serve

TOOLS = ("sysbench", "numactl")
INSTALL = ("apt-get install sysbench numactl (openEuler, CentOS: yum install sysbench "
           "numactl)")
# one buffer per node (--memory-scope=global), far larger than a node's last-level cache
# (Kunpeng-920: 32 MiB per 24-core die), so the reads come from DRAM
BLOCK_MIB = 256
PASSES = 16  # passes over the buffer per run: ~4 GiB, under a second at 5 GB/s or more
RUN_TIMEOUT_S = 120
# sysbench 1.0.20 memory test: "8192.00 MiB transferred (17791.28 MiB/sec)"
_RATE = re.compile(r"MiB transferred \(([0-9.]+) MiB/sec\)")
MIB = 2**20
SCHEMA = 1


def parse_rate(text: str) -> float | None:
    """GB/s (10^9 bytes) of a sysbench memory run's output; None when it printed none."""
    found = _RATE.search(text)
    return float(found.group(1)) * MIB / 1e9 if found else None


@dataclass(frozen=True)
class Reader:
    """One node's reader: its node, the node's CPUs, the threads the pool runs there."""

    node: int | None  # None: no NUMA visible, one unbound reader
    cpus: str
    threads: int


def layout(numa_cpulists: Mapping[int, str], pools: int, threads: int) -> list[Reader]:
    """The readers of the serve plan's layout: pool i on node i, threads split evenly (as
    kt-kernel's WorkerPoolConfig: subpool_numa_map[i] = i, subpool_thread_count equal)."""
    each = max(1, threads // max(1, pools))
    nodes = sorted(numa_cpulists)[:pools]
    if not nodes:
        return [Reader(None, "", max(1, threads))]
    return [Reader(n, numa_cpulists[n], each) for n in nodes]


def reader_argv(reader: Reader, numactl: bool) -> list[str]:
    """sysbench's memory read over one buffer of the reader's node, pinned with numactl."""
    argv = ["sysbench", "memory", "--memory-oper=read", "--memory-scope=global",
            f"--memory-block-size={BLOCK_MIB}M",
            f"--memory-total-size={BLOCK_MIB * PASSES * reader.threads}M",
            f"--threads={reader.threads}", "--time=0", "run"]
    if numactl and reader.node is not None:
        return ["numactl", f"--cpunodebind={reader.node}", f"--membind={reader.node}", *argv]
    return argv


@dataclass
class Bandwidth:
    """What was measured: per node alone and all nodes at once, GB/s; how and when."""

    nodes: dict[int, float]  # node -> GB/s, read alone
    total_gb_s: float | None  # every node at once (the sum of their readers)
    readers: list[Reader]
    tool: str
    pinned: bool  # numactl bound each reader to its node
    when: str = field(default_factory=now_iso)

    def key(self) -> list[list[Any]]:
        """The layout it was measured for: a cache for another layout is not this one's."""
        return [[r.node, r.cpus, r.threads] for r in self.readers]

    def shown(self) -> str:
        per = ", ".join(f"node {n} {v:.1f}" for n, v in sorted(self.nodes.items()))
        threads = sum(r.threads for r in self.readers)
        how = "pinned per node" if self.pinned else "unpinned (no numactl)"
        total = f"{self.total_gb_s:.1f} GB/s in all" if self.total_gb_s else "no total"
        return f"{total} ({per} GB/s; {threads} thread(s), {how}, {self.tool})"

    def as_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "nodes": {str(k): round(v, 2) for k, v in self.nodes.items()},
                "total_gb_s": None if self.total_gb_s is None else round(self.total_gb_s, 2),
                "readers": [asdict(r) for r in self.readers], "tool": self.tool,
                "pinned": self.pinned, "when": self.when}

    @classmethod
    def from_dict(cls, doc: Any) -> Bandwidth | None:
        """The cached measurement, or None when the file is not one (then measure again)."""
        try:
            if doc.get("schema") != SCHEMA:
                return None
            readers = [Reader(r["node"], str(r["cpus"]), int(r["threads"]))
                       for r in doc["readers"]]
            total = doc.get("total_gb_s")
            return cls({int(k): float(v) for k, v in doc["nodes"].items()},
                       None if total is None else float(total), readers, str(doc["tool"]),
                       bool(doc["pinned"]), str(doc["when"]))
        except (AttributeError, KeyError, TypeError, ValueError):
            return None


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def _run_together(argvs: Sequence[list[str]]) -> list[str]:
    """Start every reader at once (the pools run together) and return their outputs."""
    from dsv4_offload.core.runner import Child, start, stop_children

    children: list[Child] = []
    outputs = []
    try:
        children += [start(argv) for argv in argvs]
        for child in children:
            out, _ = child.proc.communicate(timeout=RUN_TIMEOUT_S)
            outputs.append((out or b"").decode("utf-8", errors="replace"))
    except subprocess.TimeoutExpired:
        stop_children(children)
        raise RuntimeError(f"sysbench did not finish in {RUN_TIMEOUT_S}s") from None
    except BaseException:  # Ctrl-C, a reader that could not start: none is left running
        stop_children(children)
        raise
    return outputs


def measure(readers: Sequence[Reader]) -> Bandwidth:
    """Each node alone, then all at once. Raises OSError when sysbench cannot run and
    RuntimeError when it prints no rate (its output's last line said)."""
    from dsv4_offload.core.runner import capture

    pinned = shutil.which("numactl") is not None
    nodes: dict[int, float] = {}
    for reader in readers:
        try:
            proc = capture(reader_argv(reader, pinned), timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"sysbench did not finish in {RUN_TIMEOUT_S}s") from None
        rate = parse_rate(proc.stdout)
        if rate is None:
            last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["?"]
            raise RuntimeError(f"sysbench printed no rate (exit {proc.returncode}): {last[0]}")
        nodes[reader.node if reader.node is not None else 0] = rate
    if len(readers) > 1:
        rates = [parse_rate(o) for o in _run_together([reader_argv(r, pinned) for r in readers])]
        total = sum(r for r in rates if r is not None) if all(rates) else None
    else:
        total = next(iter(nodes.values()))
    # rounded as the cache keeps them: a cached figure reads back the same
    return Bandwidth({n: round(v, 2) for n, v in nodes.items()},
                     None if total is None else round(total, 2), list(readers),
                     "sysbench memory read", pinned)


def cached(path: Path, readers: Sequence[Reader] | None = None) -> Bandwidth | None:
    """The workspace's measurement (for this layout, when ``readers`` is given), or None."""
    found = Bandwidth.from_dict(read_json(path, None))
    if found is None or (readers is not None
                         and found.key() != [[r.node, r.cpus, r.threads] for r in readers]):
        return None
    return found


def measured(path: Path, readers: Sequence[Reader], again: bool = False
             ) -> tuple[Bandwidth | None, str]:
    """(the measurement, what happened): the cached one, else a new one written to ``path``;
    (None, why) when the tools are missing or sysbench failed."""
    if not again and (found := cached(path, readers)) is not None:
        return found, f"cached {found.when}"
    if "sysbench" in missing_tools():
        return None, "sysbench is not installed"
    try:
        result = measure(readers)
    except (OSError, RuntimeError) as exc:
        return None, f"sysbench failed: {exc}"
    atomic_write_json(path, result.as_dict())
    return result, "measured now"


def check(found: Bandwidth | None, how: str, path: Path) -> Check:
    """doctor's ``bandwidth`` row: the figure, or why there is none and what installs the
    tool. A host without the tool still serves: the row never fails."""
    required = "measured once per layout (sysbench under numactl), for accept's ceilings"
    if found is None:
        fix = (INSTALL if "not installed" in how
               else "run `dsv4-offload doctor --bandwidth` again; read sysbench's message")
        return Check("bandwidth", CheckStatus.SKIP, f"not measured: {how}", required, fix)
    note = "" if found.pinned else "; install numactl to pin the readers per node"
    return Check("bandwidth", CheckStatus.OK, f"{found.shown()}, {how}{note}", required,
                 f"`dsv4-offload doctor --bandwidth` measures again (cache: {path})")


def plan_readers(facts: HostFacts, serve: Serve) -> list[Reader]:
    """The readers of the serve plan's pools and threads on this host (serving/rules)."""
    from dsv4_offload.serving.rules import cpu_plan

    try:
        plan = cpu_plan(serve, facts.numa_nodes, facts.cores)
        pools, threads = plan.pools, plan.threads
    except Dsv4Error:  # fewer CPUs than nodes: the cores row says so; read with what there is
        pools, threads = max(1, min(facts.cores, len(facts.numa_nodes))), max(1, facts.cores)
    return layout(facts.numa_cpulists, pools, threads)


def host_rows(path: Path, facts: HostFacts, serve: Serve, again: bool = False
              ) -> tuple[list[Check], Bandwidth | None]:
    """doctor's row and the measurement, for the serve plan's pools on this host; a captured
    host (DSV4_HOST_ROOT) has the row only from a cache: its memory is not this machine's."""
    readers = plan_readers(facts, serve)
    if os.environ.get(HOST_ROOT_ENV):
        found = cached(path, readers)
        return ([check(found, f"cached {found.when}", path)] if found else []), found
    found, how = measured(path, readers, again)
    return [check(found, how, path)], found
