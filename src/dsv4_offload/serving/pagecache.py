"""Page-cache residency and warm-up of the GGUF set, so the server loads from memory.

The guide's 2-3.5 min load assumes the 43 GGUF files (~138 GiB) already sit in the page
cache; a cold set is read by kt-kernel's mmap page by page. Residency is measured the way
util-linux ``fincore`` does it: mmap the file and ask ``mincore(2)`` which pages are in
memory. That is two libc calls, so ctypes rather than a dependency: no maintained PyPI
package wraps mincore, and parsing ``fincore``'s output would add a util-linux
requirement inside containers that may not ship it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

READ_CHUNK = 8 << 20  # sequential reads of 8 MiB keep the disk streaming
DEFAULT_WORKERS = 4  # a few files at once: enough to fill NVMe queues, not to thrash HDDs

_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value
# mincore sets bit 0 of each page's byte; the other bits are reserved (mincore(2))
_RESIDENT_BIT = bytes(b & 1 for b in range(256))
_libc: Any = None


def _c() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_ubyte)]
        _libc = libc
    return _libc


def page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


def resident_bytes(path: Path) -> tuple[int, int]:
    """(bytes of ``path`` in the page cache, file size), from mincore over a shared mmap."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    libc = _c()
    page = page_size()
    pages = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap failed: {os.strerror(err)}", str(path))
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore failed: {os.strerror(err)}", str(path))
            resident = bytes(vec).translate(_RESIDENT_BIT).count(1)
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    # the last page is partial: never report more than the file holds
    return min(resident * page, size), size


def drop_from_cache(path: Path) -> None:
    """Ask the kernel to forget ``path``'s clean pages (POSIX_FADV_DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None when unreadable)."""
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class FileWarmth:
    path: str
    size: int
    resident_before: int
    read: int = 0  # bytes this warm-up read (0: already resident, skipped)


@dataclass
class WarmReport:
    """What a warm-up did: per file, totals, time, and whether it ran at all."""

    files: list[FileWarmth] = field(default_factory=list)
    seconds: float = 0.0
    skipped_reason: str = ""  # set when the warm-up did not run (memory too small, ...)

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def resident_before(self) -> int:
        return sum(f.resident_before for f in self.files)

    @property
    def read(self) -> int:
        return sum(f.read for f in self.files)

    @property
    def resident_share(self) -> float:
        """Share of the set that was in the page cache before the warm-up (0..1)."""
        return self.resident_before / self.total if self.total else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"files": len(self.files), "total_bytes": self.total,
                "resident_before_bytes": self.resident_before,
                "resident_share": round(self.resident_share, 4), "read_bytes": self.read,
                "seconds": round(self.seconds, 2), "skipped_reason": self.skipped_reason}


def survey(paths: Sequence[Path]) -> list[FileWarmth]:
    """Residency of every file (missing files are left out: the caller checks presence)."""
    out = []
    for p in paths:
        if p.is_file():
            resident, size = resident_bytes(p)
            out.append(FileWarmth(str(p), size, resident))
    return out


def fits(files: Sequence[FileWarmth], mem_available: int | None) -> tuple[bool, int]:
    """(whether MemAvailable can take the part of the set not yet cached, bytes needed)."""
    need = sum(f.size - f.resident_before for f in files)
    if mem_available is None:
        return False, need
    return need <= mem_available, need


def _read_through(path: str, on_bytes: Callable[[int], None], stop: threading.Event) -> int:
    done = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        # tell the kernel the whole file is read once, in order: bigger readahead
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buf = bytearray(READ_CHUNK)  # one buffer per file: no 8 MiB allocation per read
        while not stop.is_set():
            n = os.readv(fd, [buf])
            if n == 0:
                break
            done += n
            on_bytes(n)
    finally:
        os.close(fd)
    return done


def warm(paths: Sequence[Path], *, workers: int = DEFAULT_WORKERS,
         mem_available: int | None = None,
         on_progress: Callable[[int, int], None] | None = None) -> WarmReport:
    """Read the files not fully resident, a few in parallel, each sequentially.

    Skipped (``skipped_reason`` set) when MemAvailable cannot hold what is missing: reading
    more than fits would only evict the first files again. ``on_progress(done, total)``
    gets bytes read so far and bytes to read.
    """
    start = time.monotonic()
    files = survey(paths)
    report = WarmReport(files=files)
    avail = mem_available if mem_available is not None else mem_available_bytes()
    ok, need = fits(files, avail)
    if not ok:
        report.skipped_reason = (
            f"{need / 2**30:.1f} GiB not yet cached, MemAvailable "
            + (f"{avail / 2**30:.1f} GiB" if avail is not None else "unknown"))
        report.seconds = time.monotonic() - start
        return report
    todo = [f for f in files if f.resident_before < f.size]
    lock = threading.Lock()
    done = [0]

    def count(n: int) -> None:
        with lock:
            done[0] += n
            if on_progress is not None:
                on_progress(done[0], need)

    stop = threading.Event()

    def one(f: FileWarmth) -> None:
        f.read = _read_through(f.path, count, stop)

    if todo:
        pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo))))
        try:
            for fut in [pool.submit(one, f) for f in todo]:
                fut.result()
        except BaseException:  # Ctrl-C: stop the readers at their next chunk
            stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    report.seconds = time.monotonic() - start
    return report
