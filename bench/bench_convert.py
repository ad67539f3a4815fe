"""Benchmark: one real-size MXFP4 layer through `convert` and `verify-gguf`, against coreutils.

Usage: .venv/bin/python bench/bench_convert.py [--dir DIR] [--repeats N] [--warmup N]
                                              [--warm] [--keep]

1. Writes a synthetic native checkpoint of one real-size layer (256 experts, hidden 4096,
   moe intermediate 2048: 3.27 GB of I8 + F8_E8M0 tensors) under a temp dir.
2. Conversion: `cp SHARD DIR && sync FILE` against our converter (fsync included) in a
   child process, alternating, median of --repeats after --warmup untimed rounds (the
   first round is always the slowest, for both); the child's peak RSS from wait4.
   The source shard is evicted from the page cache before each run (cold, as in reality;
   --warm keeps it cached, which favours cp: it then does one in-kernel copy).
3. Level 2: sha256 of the same files with `sha256sum` against ours (hashlib, files in
   parallel threads). Level 3: GB/s of the bit-exact comparison with the source.
Level 2 and 3 read warm page cache (the files were just written), as in a verification
right after a conversion. Prints the ratios and the targets; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsv4_offload.recipe import load_recipe
from dsv4_offload.weights.checkpoint import MoeDims, write_synthetic_checkpoint
from dsv4_offload.weights.gguf_io import LayerLayout
from dsv4_offload.weights.layerverify import compare_with_source, hash_files

REAL_LAYER = MoeDims(layers=1, experts=256, experts_per_token=6, hidden=4096, intermediate=2048)
NEEDED_BYTES = 12 * 10**9  # source 3.3 GB + its cp copy 3.3 GB + our layer 3.4 GB + slack
CHILD = """
import sys, time
from pathlib import Path
from dsv4_offload.weights.checkpoint import MoeDims
from dsv4_offload.weights.gguf_io import LayerLayout
from dsv4_offload.recipe import load_recipe
from dsv4_offload.weights.conversion import convert_layer
dims = MoeDims(*map(int, sys.argv[3:8]))
layout = LayerLayout.for_layer(0, dims, load_recipe().conversion)
t0 = time.perf_counter()
convert_layer(Path(sys.argv[1]), layout, Path(sys.argv[2]))
print(time.perf_counter() - t0)
"""


def timed(args: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    _pid, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    out = proc.stdout.read() if proc.stdout else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{args[0]} failed ({status})")
    inner = out.strip().splitlines()[-1] if out.strip() else ""
    return (float(inner) if inner else seconds), usage.ru_maxrss * 1024


def flush(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    """Drop one file from the page cache (not the whole cache: the machine is shared).

    A real conversion reads a layer out of a 150 GB checkpoint that is not in memory, so
    both cp and the converter start from a cold source.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to put the ~10 GB of temp files")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--keep", action="store_true", help="keep the temp files")
    parser.add_argument("--warm", action="store_true",
                        help="leave the source in the page cache (default: evict it per run)")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="dsv4-bench-", dir=args.dir))
    free = shutil.disk_usage(base).free
    if free < NEEDED_BYTES:
        shutil.rmtree(base)
        raise SystemExit(f"{base}: {free / 1e9:.1f} GB free, the benchmark needs "
                         f"{NEEDED_BYTES / 1e9:.0f} GB; pass --dir on a bigger disk")
    from dsv4_offload.weights.mxfp4 import kernel_status

    print(f"repack: {kernel_status()}")
    print(f"bench dir {base}; cores {os.cpu_count()}; load average at start "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    try:
        run(base, args.repeats, args.warm, args.warmup)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(f"load average at end {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


def run(base: Path, repeats: int, warm: bool, warmup: int) -> None:
    dims = REAL_LAYER
    t0 = time.perf_counter()
    source = write_synthetic_checkpoint(base / "DeepSeek-V4-Flash", dims, seed=1)
    shard = next(source.glob("*.safetensors"))
    flush(shard)  # its writeback must not land in the first measured round
    source_bytes = shard.stat().st_size
    print(f"wrote the synthetic layer: {source_bytes / 1e9:.2f} GB in "
          f"{time.perf_counter() - t0:.1f} s")
    layout = LayerLayout.for_layer(0, dims, load_recipe().conversion)
    out = base / "gguf" / "dsv4_layer0_mxfp4.gguf"
    out.parent.mkdir()
    copy = base / "copy.safetensors"

    cp_s, cp_sync_s, ours_s, rss = [], [], [], []
    for round_ in range(warmup + repeats):
        copy.unlink(missing_ok=True)
        if not warm:
            evict(shard)
        t = time.perf_counter()
        subprocess.run(["cp", str(shard), str(copy)], check=True)
        cp_s.append(time.perf_counter() - t)
        subprocess.run(["sync", str(copy)], check=True)
        cp_sync_s.append(time.perf_counter() - t)
        out.unlink(missing_ok=True)
        if not warm:
            evict(shard)
        seconds, peak = timed([sys.executable, "-c", CHILD, str(source), str(out),
                               *(str(getattr(dims, k)) for k in
                                 ("layers", "experts", "experts_per_token", "hidden",
                                  "intermediate"))])
        if round_ < warmup:  # the first round here is always slow, for cp and for us
            print(f"warm-up round: cp + sync {cp_sync_s.pop():.2f} s, convert {seconds:.2f} s")
            cp_s.pop()
            continue
        ours_s.append(seconds)
        rss.append(peak)
    cp_med, cp_sync_med, ours_med = (statistics.median(x) for x in (cp_s, cp_sync_s, ours_s))
    assert out.stat().st_size == layout.file_bytes

    files = [out, copy]
    total = sum(p.stat().st_size for p in files)
    sums, ours_hash = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
        sums.append(time.perf_counter() - t)
        t = time.perf_counter()
        hash_files(files, jobs=min(len(files), os.cpu_count() or 1))
        ours_hash.append(time.perf_counter() - t)
    sums_med, hash_med = statistics.median(sums), statistics.median(ours_hash)

    deep = []
    from dsv4_offload.weights.checkpoint import Checkpoint

    data_bytes = layout.file_bytes - layout.data_offset
    for threads in (1, os.cpu_count() or 1):
        with Checkpoint.open(source) as ckpt:
            t = time.perf_counter()
            problems = compare_with_source(out, layout, ckpt, threads)
            deep.append((threads, time.perf_counter() - t))
        assert not problems, problems

    gb = 1e9
    print()
    print(f"conversion, {source_bytes / gb:.2f} GB of {'warm' if warm else 'cold'} source -> "
          f"{layout.file_bytes / gb:.2f} GB (median of {repeats}):")
    print(f"  cp              {cp_med:6.2f} s  {source_bytes / cp_med / gb:5.2f} GB/s")
    print(f"  cp + sync       {cp_sync_med:6.2f} s  {source_bytes / cp_sync_med / gb:5.2f} GB/s")
    print(f"  dsv4 convert    {ours_med:6.2f} s  {source_bytes / ours_med / gb:5.2f} GB/s "
          f"(fsync included; runs {', '.join(f'{s:.2f}' for s in ours_s)} s)")
    print(f"  ratio vs cp + sync {cp_sync_med / ours_med:.2f}x, vs cp {cp_med / ours_med:.2f}x "
          f"(target >= 0.7x)")
    print(f"  peak RSS        {max(rss) / 2**20:6.0f} MiB (target <= 1024 MiB)")
    print(f"level 2, sha256 of {len(files)} files, {total / gb:.2f} GB (median of {repeats}):")
    print(f"  sha256sum       {sums_med:6.2f} s  {total / sums_med / gb:5.2f} GB/s")
    print(f"  dsv4 (hashlib)  {hash_med:6.2f} s  {total / hash_med / gb:5.2f} GB/s")
    print(f"  ratio {sums_med / hash_med:.2f}x (target >= 3x)")
    print(f"level 3, bit-exact comparison of {data_bytes / gb:.2f} GB with the source:")
    for threads, seconds in deep:
        print(f"  {threads} thread(s)     {seconds:6.2f} s  {data_bytes / seconds / gb:5.2f} GB/s "
              "(target >= 1 GB/s)")


if __name__ == "__main__":
    main()
