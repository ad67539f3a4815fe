"""Stage convert: the native MXFP4 experts into one GGUF file per layer.

1. Read config.json (dims) and the safetensors index of the source; validate every
   tensor of the selected layers (names, dtypes, shapes, shard sizes) before writing.
2. Skip layers whose final file exists with the exact expected size and was made from
   this very source (shard names, sizes, digests of header and sampled data, recorded
   beside the files in `.dsv4-layer-sources.json`), unless --force.
3. Check free disk for the rest, then convert `--jobs` layers at once (processes). Each
   layer streams expert by expert: map the native bytes, repack them into 17-byte
   blocks, pwrite them into a preallocated `<name>.tmp`; fsync; rename. A killed run
   leaves at most a `.tmp`, never a partial file at a final name.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import multiprocessing
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.options import FollowOptions, PathText
from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.weights.conversion import (
    DISK_FIX,
    Bars,
    LayerOutcome,
    claim_layer_files,
    convert_layer,
    default_jobs,
    disk_shortfall,
    file_size,
    gguf_dir,
    init_worker,
    layer_source,
    make_out_dir,
    parse_layers,
    read_layer_sources,
    record_layer_source,
    source_change,
    source_dir,
    worker_progress,
)
from dsv4_offload.workspace.context import StageContext

# a pipelined `run` may start this stage beside a running download and hand it
# follow=True (pipeline/schedule.py): each layer converts as its shards arrive
FOLLOWS = True


class ConvertOptions(FollowOptions):
    source: PathText | None = None  # the MXFP4 checkpoint (default: the workspace's download)
    gguf_dir: PathText | None = None  # where the layer files go (default: the workspace's)
    layers: str | None = None  # '0-42', '3,5,7' (default: every layer)
    jobs: int | None = None  # layers at once (default: from the cores and memory)
    force: bool = False  # redo layers whose files are present


Options = ConvertOptions

# --- worker processes ----------------------------------------------------------------------


def _worker(source: str, layout: Any, final: str) -> LayerOutcome:
    return convert_layer(Path(source), layout, Path(final), worker_progress(layout.layer))


def _run_parallel(jobs: int, work: list[tuple[Any, Path]], source: Path,
                  bars: Bars, done: Callable[[LayerOutcome], None]) -> list[LayerOutcome]:
    mp = multiprocessing.get_context("spawn")  # fork is unsafe beside the progress thread
    progress_queue, stop = mp.Queue(), mp.Event()
    outcomes: list[LayerOutcome] = []
    with cf.ProcessPoolExecutor(jobs, mp_context=mp, initializer=init_worker,
                                initargs=(progress_queue, stop, os.getpid())) as pool:
        futures = {}
        for layout, final in work:
            futures[pool.submit(_worker, str(source), layout, str(final))] = layout
        try:
            remaining = set(futures)
            while remaining:
                try:
                    layer, nbytes = progress_queue.get(timeout=0.2)
                    if layer not in bars.layers:
                        bars.open(layer, _layout_of(futures, layer).file_bytes)
                    bars.advance(layer, nbytes)
                except queue.Empty:
                    pass
                for future in [f for f in remaining if f.done()]:
                    remaining.discard(future)
                    outcomes.append(future.result())  # the first failure raises here
                    done(outcomes[-1])
                    bars.finish(futures[future].layer)
        except BaseException:
            stop.set()  # running layers stop at their next expert and clean up
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return outcomes


def _layout_of(futures: dict[Any, Any], layer: int) -> Any:
    return next(layout for layout in futures.values() if layout.layer == layer)


# --- the stage -----------------------------------------------------------------------------


def fingerprint_inputs(ctx: StageContext) -> dict[str, str]:
    """The source's config and index (size and mtime) and the gguf package version."""
    from importlib.metadata import PackageNotFoundError, version

    from dsv4_offload.weights.checkpoint import CONFIG_FILE, INDEX_FILE

    out = {}
    src = _source_used(ctx)
    out["source"] = str(src)
    for name in (CONFIG_FILE, INDEX_FILE):
        try:
            st = (src / name).stat()
            out[f"source.{name}"] = f"{st.st_size}:{st.st_mtime_ns}"
        except OSError:
            out[f"source.{name}"] = "absent"
    try:
        out["tool.gguf"] = version("gguf")
    except PackageNotFoundError:
        out["tool.gguf"] = "absent"
    return out


def _source_used(ctx: StageContext) -> Path:
    """--source when given; else the one the recorded conversion used (a `convert --source`
    is done from that source, not stale because `status` has no --source); else the
    recipe's MXFP4 download."""
    given = ctx.options_as(ConvertOptions).source
    if given:
        return source_dir(ctx, given)
    recorded = ctx.workspace.state().outputs("convert").get("source")
    return Path(recorded) if isinstance(recorded, str) and recorded else source_dir(ctx, None)


def run(ctx: StageContext) -> StageResult:
    options = ctx.options_as(ConvertOptions)
    if options.follow:
        return _run_following(ctx)
    from dsv4_offload.weights.checkpoint import Checkpoint
    from dsv4_offload.weights.gguf_io import LayerLayout, forget_manifest_entries
    from dsv4_offload.weights.mxfp4 import kernel_status

    source, out_dir = source_dir(ctx, options.source), gguf_dir(ctx, options.gguf_dir)
    force = options.force
    conv = ctx.recipe.conversion
    digests: dict[Path, str] = {}
    with Checkpoint.open(source) as ckpt:
        dims = ckpt.dims
        layers = parse_layers(options.layers, dims.layers)
        # every tensor checked before any byte is written; each layer's source fingerprinted
        sources = {layer: layer_source(ckpt, layer, digests) for layer in layers}
    layouts = {layer: LayerLayout.for_layer(layer, dims, conv) for layer in layers}

    # a file of the right size is kept only when it was made from this very source
    recorded = read_layer_sources(out_dir)
    skipped, work, redone = [], [], {}
    for layer in layers:
        final = out_dir / conv.file_name(layer)
        change = source_change(recorded.get(final.name), sources[layer])
        if file_size(final) == layouts[layer].file_bytes and not force and change is None:
            skipped.append(layer)
            continue
        if file_size(final) == layouts[layer].file_bytes and not force and change:
            redone[str(layer)] = change
        work.append((layouts[layer], final))

    base = {"source": str(source), "gguf_dir": str(out_dir), "dims": dims.as_dict(),
            "layers": layers, "skipped": skipped, "redone_source_changed": redone}
    outputs = {"source": str(source), "gguf_dir": str(out_dir), "layers": layers,
               "dims": dims.as_dict(),
               "file_bytes": {str(k): v.file_bytes for k, v in layouts.items()}}
    if not work:
        return StageResult(Status.SKIPPED, f"all {len(layers)} layer files already present "
                           f"in {out_dir} (use --force to redo)",
                           data={**base, "converted": []}, outputs=outputs)

    need = sum(layout.file_bytes for layout, _final in work)
    make_out_dir(out_dir)
    for layout, final in work:
        if 0 < file_size(final) != layout.file_bytes:
            final.unlink()  # an incomplete file must not sit at a final name, even for a while
    short = disk_shortfall(out_dir, work)
    if short is not None:
        return StageResult(
            Status.FAILED, "not enough free disk for the conversion", data=base,
            problems=[Problem("error", short, DISK_FIX, check="disk")])

    jobs = int(ctx.options_as(ConvertOptions).jobs or default_jobs(len(work)))
    if jobs < 1:
        raise InputError(f"--jobs {jobs}: must be at least 1")
    jobs = min(jobs, len(work))
    t0 = time.monotonic()
    bars = Bars(ctx, need, t0)
    # the old files go and the new ones' sources are on record before any takes its final
    # name: a kill just after a rename leaves a complete file the rerun keeps
    claim_layer_files(out_dir, {final.name: sources[layout.layer] for layout, final in work})

    def done(outcome: LayerOutcome) -> None:
        record_layer_source(out_dir, Path(outcome.path).name, sources[outcome.layer])

    try:
        if jobs == 1:
            outcomes = []
            for layout, final in work:
                bars.open(layout.layer, layout.file_bytes)
                layer = layout.layer
                outcomes.append(convert_layer(source, layout, final,
                                              functools.partial(bars.advance, layer)))
                done(outcomes[-1])
                bars.finish(layer)
        else:
            outcomes = _run_parallel(jobs, work, source, bars, done)
    except BrokenProcessPool:
        raise Dsv4Error(f"a conversion worker died mid-layer (killed by the OS: out of memory "
                        f"with {jobs} jobs?); finished layers are kept",
                        hint="rerun `dsv4-offload convert` with fewer --jobs (or --jobs 1)",
                        ) from None
    finally:
        bars.close()
        # layers rewritten (or half-written) here are no longer what the manifest vouches for
        forget_manifest_entries(out_dir, [conv.file_name(layout.layer) for layout, _ in work])
    seconds = time.monotonic() - t0
    rate = need / max(seconds, 1e-9) / 1e9
    converted = sorted(o.layer for o in outcomes)
    return StageResult(
        Status.OK,
        f"converted {len(converted)} layer(s) into {out_dir} in {seconds:.1f} s "
        f"({rate:.2f} GB/s, {jobs} job(s)); {len(skipped)} already present",
        data={**base, "converted": converted, "jobs": jobs, "seconds": round(seconds, 3),
              "bytes": need, "gb_per_s": round(rate, 3), "repack": kernel_status()},
        outputs=outputs,
    )


def _run_following(ctx: StageContext) -> StageResult:
    """`--follow`: each layer as soon as the download beside us has verified its shards,
    checked right after (weights/follow.py); returns once the download has ended."""
    from dsv4_offload.weights.follow import REFETCH_FIX, follow
    from dsv4_offload.weights.mxfp4 import kernel_status

    options = ctx.options_as(ConvertOptions)
    if options.source:
        raise InputError("convert --follow follows the workspace's MXFP4 download; drop "
                         "--source (or drop --follow for a checkpoint already whole)")
    source, out_dir = source_dir(ctx), gguf_dir(ctx, options.gguf_dir)
    done = follow(ctx, source, out_dir, layers_spec=options.layers, jobs=options.jobs,
                  force=options.force)
    layers = done.layers
    outputs = {"source": str(source), "gguf_dir": str(out_dir), "layers": layers,
               "dims": done.dims.as_dict(),
               "file_bytes": {str(k): v.file_bytes for k, v in done.layouts.items()}}
    data = {"source": str(source), "gguf_dir": str(out_dir), "dims": done.dims.as_dict(),
            "layers": layers, "followed": True, "converted": sorted(done.converted),
            "checked": sorted(done.checked), "skipped": sorted(done.skipped),
            "failed": {str(k): v[0] for k, v in sorted(done.failed.items())},
            "jobs": done.jobs, "seconds": round(done.seconds, 3), "bytes": done.bytes,
            "repack": kernel_status()}
    if done.failed:
        problems = [Problem("error", error, fix, check=f"layer {layer}")
                    for layer, (error, fix) in sorted(done.failed.items())]
        refetch = all(fix == REFETCH_FIX for _e, fix in done.failed.values())
        return StageResult(
            Status.FAILED, f"{len(done.failed)} of {len(layers)} layer(s) not converted"
            f"{' (their shards did not arrive whole)' if refetch else ''}; "
            f"{len(done.converted)} converted and verified as the download went",
            data=data, problems=problems)
    ready = len(done.converted) + len(done.checked)
    return StageResult(
        Status.OK, f"{ready} layer(s) converted and verified as their shards arrived, "
        f"{len(done.skipped)} already done, into {out_dir} ({done.jobs} job(s))",
        data=data, outputs=outputs)

