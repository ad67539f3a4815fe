"""Converting one layer of the native MXFP4 checkpoint into its GGUF file, and the
options that choose layers and parallel jobs (the ``convert`` and ``verify-gguf`` stages and
the selftest use them).

A layer streams expert by expert: map the native bytes, repack them into 17-byte blocks,
pwrite them into a preallocated ``<name>.tmp``; fsync; rename. A killed run leaves at most a
``.tmp``, never a partial file at a final name.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.workspace.store import create_exclusive

if TYPE_CHECKING:
    from dsv4_offload.workspace.context import StageContext

GIB = 2**30
JOB_MEMORY_BYTES = 2 * GIB  # per parallel layer: buffers + the dirty page cache it keeps busy


class DiskFullError(Dsv4Error):
    """The output filesystem ran out of space (or hit a file-size limit) mid-write."""


@dataclass(frozen=True)
class LayerOutcome:
    layer: int
    path: str
    bytes: int
    seconds: float


# --- options -------------------------------------------------------------------------------


def parse_layers(spec: str | None, count: int) -> list[int]:
    """'0-42', '3,5,7' or '0-3,7' -> sorted layer numbers, each checked against count."""
    if spec is None or str(spec).strip() in ("", "all"):
        return list(range(count))
    layers: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
            else:
                lo = hi = int(part)
        except ValueError:
            raise InputError(
                f"--layers '{spec}': '{part}' is not a number or a range; write e.g. 0-42 or 3,5,7"
            ) from None
        if lo > hi or lo < 0 or hi >= count:
            raise InputError(
                f"--layers '{spec}': '{part}' is outside 0..{count - 1} (the checkpoint has "
                f"{count} layers); write e.g. 0-{count - 1}"
            )
        layers.update(range(lo, hi + 1))
    return sorted(layers)


def mem_available_bytes(meminfo: str) -> int | None:
    """MemAvailable from /proc/meminfo text, in bytes."""
    from dsv4_offload.core.host import parse_meminfo

    kib = parse_meminfo(meminfo).get("MemAvailable")
    return None if kib is None else kib * 1024


def default_jobs(layers_todo: int) -> int:
    """Parallel layers: bounded by cores, by MemAvailable / 2 GiB and by the work left."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        available = mem_available_bytes(Path("/proc/meminfo").read_text())
    except OSError:
        available = None
    by_memory = (available // JOB_MEMORY_BYTES) if available else 1
    return max(1, min(cores or 1, by_memory, layers_todo))


# --- paths and dims ------------------------------------------------------------------------


def source_dir(ctx: StageContext, value: str | None = None) -> Path:
    """``value`` (the stage's --source), else the workspace's MXFP4 download."""
    return Path(value).absolute() if value else ctx.workspace.weights_dir(ctx.recipe, "mxfp4")


def gguf_dir(ctx: StageContext, value: str | None = None) -> Path:
    """``value`` (the stage's --gguf-dir), else the workspace's GGUF set."""
    return Path(value).absolute() if value else ctx.workspace.gguf_dir(ctx.recipe)


def temp_path(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def file_size(path: Path) -> int:
    """The size of ``path``, 0 when it is absent (or under a file: said at mkdir)."""
    try:
        return path.stat().st_size
    except (FileNotFoundError, NotADirectoryError):
        return 0


DISK_FIX = "free space or pass --gguf-dir on a bigger disk"


def make_out_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{out_dir}: cannot create it ({exc.strerror}); pass --gguf-dir "
                         "on a writable disk") from None


def disk_shortfall(out_dir: Path, work: list[tuple[Any, Path]]) -> str | None:
    """What is short when the layer files of ``work`` (layout, final path) do not fit in
    the free space of ``out_dir`` plus their temp files (O_TRUNC reuses those); None when
    they fit."""
    import shutil

    need = sum(layout.file_bytes for layout, _final in work)
    free = shutil.disk_usage(out_dir).free + sum(file_size(temp_path(f)) for _l, f in work)
    if free >= need:
        return None
    return (f"{out_dir}: {len(work)} layer files need {need / GIB:.1f} GiB, "
            f"{free / GIB:.1f} GiB free")


# --- what each layer file was made from ----------------------------------------------------

# beside the layer files: file name -> the fingerprint of the source it was converted from
SOURCES_FILE = ".dsv4-layer-sources.json"


def layer_source(ckpt: Any, layer: int, header_digests: dict[Path, str]) -> dict[str, Any]:
    """The fingerprint of the source of one layer: the shards that hold its tensors (name,
    size, digest of header and sampled data) and the tensors' places in them.
    ``header_digests`` is a cache per shard."""
    import hashlib
    import json

    from dsv4_offload.weights.checkpoint import safetensors_digest

    entries = [e for _proj, pairs in ckpt.layer_tensors(layer) for pair in pairs for e in pair]
    shards: dict[str, dict[str, Any]] = {}
    for shard in sorted({e.shard for e in entries}):
        if shard not in header_digests:
            header_digests[shard] = safetensors_digest(shard)
        shards[shard.name] = {"size": shard.stat().st_size, "digest": header_digests[shard]}
    places = json.dumps([(e.name, e.shard.name, e.dtype, list(e.shape), e.offset, e.nbytes)
                         for e in entries])
    return {"shards": shards, "tensors": hashlib.sha256(places.encode()).hexdigest()[:16]}


def read_layer_sources(out_dir: Path) -> dict[str, Any]:
    from dsv4_offload.workspace.store import read_json

    if not out_dir.is_dir():  # nothing converted there yet (or not a directory: said later)
        return {}
    doc = read_json(out_dir / SOURCES_FILE, {})
    return doc if isinstance(doc, dict) else {}


def record_layer_source(out_dir: Path, name: str, fingerprint: dict[str, Any] | None) -> None:
    """Set (or with None, drop) the recorded source of one layer file."""
    from dsv4_offload.workspace.store import atomic_write_json

    doc = read_layer_sources(out_dir)
    if fingerprint is None:
        if doc.pop(name, None) is None:
            return
    else:
        doc[name] = fingerprint
    try:
        atomic_write_json(out_dir / SOURCES_FILE, doc)
    except OSError as exc:
        raise _disk_error(exc, out_dir / SOURCES_FILE, 0) from None


def claim_layer_files(out_dir: Path, claims: dict[str, dict[str, Any]]) -> None:
    """Before layer files are (re)written: each old file (and temp file) goes, then the
    source each new one is made of is recorded, in one write. A file taking its final name
    is then vouched for from its first instant, and a kill at any point leaves no file or a
    complete one on record: a rerun checks it, never writes it again."""
    from dsv4_offload.workspace.store import atomic_write_json

    for name in claims:
        for path in (out_dir / name, temp_path(out_dir / name)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    doc = read_layer_sources(out_dir)
    doc.update(claims)
    try:
        atomic_write_json(out_dir / SOURCES_FILE, doc)
    except OSError as exc:
        raise _disk_error(exc, out_dir / SOURCES_FILE, 0) from None


def source_change(recorded: Any, current: dict[str, Any]) -> str | None:
    """None when ``recorded`` is ``current``; otherwise what differs, in a few words."""
    if not isinstance(recorded, dict):
        return "no record of the source it was converted from"
    if recorded == current:
        return None
    old, new = recorded.get("shards") or {}, current["shards"]
    for name in sorted(set(old) | set(new)):
        if name not in new:
            return f"its tensors are no longer in {name}"
        if name not in old:
            return f"its tensors are now in {name}"
        if old[name] != new[name]:
            what = "size" if old[name].get("size") != new[name]["size"] else "content"
            return f"source shard {name} changed ({what})"
    return "its tensors moved within the source shards"


# --- one layer -----------------------------------------------------------------------------


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _write_behind(fd: int, data: memoryview, offset: int) -> None:
    """pwrite, then start writeback of that range at once (Linux: FADV_DONTNEED does).

    Without it a layer's 3.4 GB sit dirty until the final fsync: the writer stalls in
    dirty-page throttling and the fsync waits for all of it; measured here the layer
    takes ~15% less wall time with it and the fsync becomes free.
    """
    _pwrite_all(fd, data, offset)
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)


def _disk_error(exc: OSError, path: Path, need: int) -> Dsv4Error:
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        size = f"{need / 1e9:.2f} GB" if need >= 10**7 else f"{need} B"
        return DiskFullError(
            f"{path}: {exc.strerror} while writing a {size} layer file; nothing was "
            "left at the final name: free space there or pass --gguf-dir on a bigger disk"
        )
    return Dsv4Error(f"{path}: {exc.strerror}; check the GGUF directory is writable")


def _preallocate(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        # filesystems without fallocate still get the size; ENOSPC then shows at write time
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def convert_layer(source: Path, layout: Any, final: Path,
                  report: Callable[[int], None] | None = None) -> LayerOutcome:
    """Write one layer file from the checkpoint at `source`; atomic at `final`."""
    from dsv4_offload.weights.checkpoint import Checkpoint

    t0 = time.monotonic()
    tmp = temp_path(final)
    size = layout.file_bytes
    with Checkpoint.open(source) as ckpt:
        if ckpt.dims != layout.dims:
            raise InputError(f"{source}: config.json changed during the conversion; rerun")
        entries = ckpt.layer_tensors(layout.layer)
        try:
            # inside the try that removes it: a Ctrl-C landing just after the temp file
            # was created (before any byte) leaves nothing behind either
            fd = create_exclusive(tmp)
            try:
                _preallocate(fd, size)
                _pwrite_all(fd, memoryview(layout.header), 0)
                if report is not None:
                    report(len(layout.header))
                _stream_experts(ckpt, entries, layout, fd, report)
                written = os.fstat(fd).st_size
                if written != size:
                    raise Dsv4Error(f"{tmp}: {written} B after writing, expected {size} B")
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise _disk_error(exc, final, size) from None
            raise
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return LayerOutcome(layout.layer, str(final), size, time.monotonic() - t0)


def _stream_experts(ckpt: Any, entries: list[Any], layout: Any, fd: int,
                    report: Callable[[int], None] | None) -> None:
    """Read, repack and write every expert of the layer, in file order."""
    import numpy as np

    from dsv4_offload.weights import mxfp4

    max_out = max(t.expert_bytes for t in layout.tensors)
    # two output buffers: the write of one expert overlaps the repack of the next
    slots = [np.empty(max_out, np.uint8) for _ in range(2)]
    repacker = mxfp4.Repacker()
    pending: list[cf.Future[None] | None] = [None, None]
    ahead = iter([pair for _p, pairs in entries for pair in pairs][1:])
    # leaving the with-block waits for a write in flight: the fd stays open until then
    with cf.ThreadPoolExecutor(1, thread_name_prefix="gguf-write") as writer:
        i = 0
        for tensor, (_projection, pairs) in zip(layout.tensors, entries, strict=True):
            for expert, (w_entry, s_entry) in enumerate(pairs):
                for entry in next(ahead, ()):  # the next expert, while we work on this one
                    ckpt.prefetch(entry)
                slot = i % 2
                previous = pending[slot]
                if previous is not None:
                    previous.result()
                out = slots[slot][: tensor.expert_bytes]
                # mapped, not read: the repack reads the page cache directly (one copy less)
                with ckpt.mapped(w_entry) as weight, ckpt.mapped(s_entry) as scale:
                    repacker.repack_into(weight, scale, out)
                    del weight, scale  # let the maps close
                pending[slot] = writer.submit(_write_behind, fd, out.data,
                                              tensor.expert_offset(expert))
                if report is not None:
                    report(tensor.expert_bytes)
                i += 1
        for future in pending:
            if future is not None:
                future.result()


# --- worker processes and progress (both convert modes) ------------------------------------

_progress_queue: Any = None
_stop: Any = None


def init_worker(progress_queue: Any, stop: Any, parent: int | None = None) -> None:
    """Workers leave Ctrl-C to the parent, which sets `stop`; they check it per expert.
    ``parent``: the converting process's pid, to see whether it died before we armed."""
    import signal

    global _progress_queue, _stop
    _progress_queue, _stop = progress_queue, stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if parent is not None and os.getppid() != parent:
        # killed while we were starting: no death signal will come, and the queue we hold
        # both ends of never ends; a worker with no parent has nothing to do
        os._exit(1)


def _die_with_parent() -> None:
    """A SIGKILLed `convert` must not leave workers finishing layers behind its back."""
    import ctypes
    import signal
    import sys

    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))


def worker_progress(layer: int) -> Callable[[int], None]:
    """In a worker: bytes of ``layer`` done go to the parent; a stop set there ends the
    layer at its next expert (convert_layer removes its temp file on the way out)."""
    def report(nbytes: int) -> None:
        if _stop.is_set():
            raise KeyboardInterrupt
        _progress_queue.put((layer, nbytes))

    return report


@dataclass
class Bars:
    """One bar per running layer plus the overall bar with its rate in GB/s."""

    ctx: StageContext
    total: int
    started: float
    done: int = 0

    def __post_init__(self) -> None:
        self.overall = self.ctx.progress.task("convert (all layers)", self.total, "B")
        self.layers: dict[int, Any] = {}

    def open(self, layer: int, nbytes: int) -> None:
        self.layers[layer] = self.ctx.progress.task(f"layer {layer}", nbytes, "B")

    def advance(self, layer: int, nbytes: int) -> None:
        self.done += nbytes
        if layer in self.layers:
            self.layers[layer].advance(nbytes)
        rate = self.done / max(time.monotonic() - self.started, 1e-6) / 1e9
        # following a download, the pace is the link's: MB/s, not "0.00 GB/s"
        shown = f"{rate:.2f} GB/s" if rate >= 0.1 else f"{rate * 1000:.1f} MB/s"
        self.overall.update(completed=self.done, description=f"convert ({shown})")

    def finish(self, layer: int) -> None:
        task = self.layers.pop(layer, None)
        if task is not None:
            task.close()

    def close(self) -> None:
        for layer in list(self.layers):
            self.finish(layer)
        self.overall.close()
