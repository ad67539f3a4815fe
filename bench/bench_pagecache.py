"""`serve`'s page-cache warm-up of the GGUF set against `cat` of the same files, cold cache.

Run: .venv/bin/python bench/bench_pagecache.py [--files N] [--size-mib M] [--runs R]
     [--dir DIR | --gguf-dir WORKSPACE/gguf]
Before each timed read the files are dropped from the page cache (`echo 1 >
/proc/sys/vm/drop_caches` after a sync when permitted, else posix_fadvise(DONTNEED) per
file) and checked cold with mincore; after it they are checked resident. Prints the median
of R runs of each method and the ratio cat/warm-up measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsv4_offload.serving import pagecache

MIB = 1 << 20


def drop(paths: list[Path]) -> str:
    """Empty the page cache of ``paths``; which way it was done."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        how = "drop_caches"
    except OSError:
        how = "fadvise"
    for p in paths:  # also after drop_caches: cheap, and covers pages it could not drop
        pagecache.drop_from_cache(p)
    return how


def resident_share(paths: list[Path]) -> float:
    done = [pagecache.resident_bytes(p) for p in paths]
    total = sum(size for _, size in done)
    return sum(r for r, _ in done) / total if total else 1.0


def timed(method: str, paths: list[Path], workers: int) -> float:
    t0 = time.perf_counter()
    if method == "cat":
        with open(os.devnull, "wb") as null:
            subprocess.run(["cat", *map(str, paths)], stdout=null, check=True)
    else:
        report = pagecache.warm(paths, workers=workers, mem_available=1 << 62)
        assert not report.skipped_reason, report.skipped_reason
    return time.perf_counter() - t0


def make_files(directory: Path, count: int, size: int) -> list[Path]:
    block = os.urandom(MIB)
    paths = []
    for i in range(count):
        p = directory / f"dsv4_layer{i}_mxfp4.gguf"
        with open(p, "wb") as fh:
            for _ in range(size // MIB):
                fh.write(block)
        paths.append(p)
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=pagecache.DEFAULT_WORKERS)
    parser.add_argument("--dir", type=Path, help="where to write the test files (a disk, "
                        "not tmpfs; default: a temporary directory)")
    parser.add_argument("--gguf-dir", type=Path, help="use these existing *.gguf files instead")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=opts.dir) as tmp:
        if opts.gguf_dir:
            paths = sorted(opts.gguf_dir.glob("*.gguf"))
        else:
            paths = make_files(Path(tmp), opts.files, opts.size_mib * MIB)
        total = sum(p.stat().st_size for p in paths)
        times: dict[str, list[float]] = {"cat": [], "warm-up": []}
        how = ""
        for _ in range(opts.runs):
            for method in times:  # alternate, so drift hits both alike
                how = drop(paths)
                cold = resident_share(paths)
                if cold > 0.01:
                    print(f"cannot empty the page cache here ({cold:.0%} still resident: "
                          "tmpfs?); pass --dir on a disk")
                    return 2
                times[method].append(timed(method, paths, opts.workers))
                assert resident_share(paths) > 0.99, f"{method} left files uncached"
        print(f"{len(paths)} files, {total / 2**30:.2f} GiB, cache emptied with {how}, "
              f"median of {opts.runs} runs:")
        med = {m: statistics.median(t) for m, t in times.items()}
        for method, seconds in med.items():
            print(f"  {method:8s} {seconds:7.2f} s  {total / seconds / 2**30:6.2f} GiB/s")
        print(f"  ratio cat / warm-up: {med['cat'] / med['warm-up']:.2f} "
              "(> 1: the warm-up is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
