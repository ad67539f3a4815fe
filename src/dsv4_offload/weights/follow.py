"""`convert --follow`: convert each layer as soon as the download beside us has verified
every shard holding its experts, and check it right after, while the rest still arrives.

1. Wait until the download has verified ``config.json`` and the index (its per-set record,
   weights/downloads.py); read from the index which shards hold each layer's experts.
2. Every ``POLL_S``: look at the record again. A layer whose shards are all verified
   starts (in layer order, up to ``jobs`` at once: in this process with one job, else in
   worker processes); a layer whose shard failed in this download fails alone, naming the
   file, the reason and the fix, and the others go on.
3. Each layer is written (weights/conversion.py) and then checked (weights/layerverify.py:
   size and header, sha256 against the known digests, a bit-exact sample of its experts);
   what passed is recorded per layer (its source, its check), so a restart resumes where
   it was and `verify-gguf` later reads nothing again.
4. The download has ended when its stage record is no longer ``running`` or its process
   (pid and start time) is gone; the layers whose shards never arrived then fail with the
   download's state, a layer whose shards changed meanwhile is done again, and only then
   does convert return (its fingerprint includes the download's outputs).

The scheduler that starts both processes starts this one after the download's ``running``
record is written (pipeline.run_stage writes it first thing), or a download not begun yet
looks like one that has ended.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core import events
from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.weights import downloads, layerverify
from dsv4_offload.weights.conversion import (
    DISK_FIX,
    Bars,
    claim_layer_files,
    convert_layer,
    default_jobs,
    disk_shortfall,
    file_size,
    init_worker,
    layer_source,
    make_out_dir,
    parse_layers,
    read_layer_sources,
    record_layer_source,
    source_change,
    worker_progress,
)
from dsv4_offload.weights.gguf_io import OWN_MANIFEST

if TYPE_CHECKING:
    from dsv4_offload.workspace.context import StageContext

POLL_S = 0.2  # how often the download's record is read again; never sleep longer than this
REFETCH_FIX = "rerun `dsv4-offload run` to fetch it again"


@dataclass
class Followed:
    """What a following conversion did, layer by layer."""

    layers: list[int]
    dims: Any
    layouts: dict[int, Any]
    jobs: int = 1
    converted: list[int] = field(default_factory=list)
    checked: list[int] = field(default_factory=list)  # present from before: checked only
    skipped: list[int] = field(default_factory=list)  # converted and checked before
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)  # layer -> error, fix
    bytes: int = 0
    seconds: float = 0.0


# --- one layer's job (in this process or a worker) -----------------------------------------


def _layer_job(source: str, layout: Any, final: str, convert: bool, expected: str | None,
               origin: str, progress: Callable[[int], None] | None = None
               ) -> layerverify.LayerCheck:
    """Write the layer (unless it is there already, made from this source) and check it."""
    if convert:
        report = progress if progress is not None else worker_progress(layout.layer)
        convert_layer(Path(source), layout, Path(final), report)
        events.emit("layer.converted", stage="convert", layer=layout.layer)
    return layerverify.check_layer(Path(source), layout, Path(final), expected, origin)


class _Workers:
    """Layers in flight: run at once in this process (one job), or in ``jobs`` spawned
    worker processes that report their bytes through a queue."""

    def __init__(self, jobs: int, bars: Bars) -> None:
        self.jobs, self.bars = jobs, bars
        self.running: dict[Any, int] = {}  # future -> layer
        self._done_inline: list[tuple[int, Any]] = []
        self._pool: cf.ProcessPoolExecutor | None = None
        if jobs > 1:
            import multiprocessing

            mp = multiprocessing.get_context("spawn")  # fork is unsafe beside threads
            self._queue, self._stop = mp.Queue(), mp.Event()
            self._pool = cf.ProcessPoolExecutor(jobs, mp_context=mp, initializer=init_worker,
                                                initargs=(self._queue, self._stop, os.getpid()))

    @property
    def busy(self) -> int:
        return len(self.running)

    def submit(self, layout: Any, source: Path, final: Path, convert: bool,
               expected: str | None, origin: str) -> None:
        layer = layout.layer
        self.bars.open(layer, layout.file_bytes)
        args = (str(source), layout, str(final), convert, expected, origin)
        if self._pool is None:
            try:
                outcome: Any = _layer_job(*args, progress=lambda n: self.bars.advance(layer, n))
            except Dsv4Error as exc:
                outcome = exc
            self._done_inline.append((layer, outcome))
            return
        self.running[self._pool.submit(_layer_job, *args)] = layer

    def finished(self, timeout: float) -> list[tuple[int, Any]]:
        """Layers done since the last call: (layer, LayerCheck or the Dsv4Error it raised);
        waits up to ``timeout`` for progress when layers are in flight."""
        out, self._done_inline = self._done_inline, []
        if self._pool is not None and self.running:
            try:
                layer, nbytes = self._queue.get(timeout=timeout)
                self.bars.advance(layer, nbytes)
                while True:
                    layer, nbytes = self._queue.get_nowait()
                    self.bars.advance(layer, nbytes)
            except queue.Empty:
                pass
            for future in [f for f in self.running if f.done()]:
                layer = self.running.pop(future)
                try:
                    out.append((layer, future.result()))
                except Dsv4Error as exc:
                    out.append((layer, exc))
        for layer, _outcome in out:
            self.bars.finish(layer)
        return out

    def close(self, interrupted: bool) -> None:
        if self._pool is not None:
            if interrupted:
                self._stop.set()  # running layers stop at their next expert and clean up
            self._pool.shutdown(wait=True, cancel_futures=True)


# --- the loop ------------------------------------------------------------------------------


def _wait_for_head(ctx: StageContext) -> None:
    """Until the download has verified config.json and the index (or has ended without)."""
    while True:
        view = downloads.look(ctx.workspace, ctx.recipe)
        if all(name in view.verified for name in downloads.HEAD_FILES):
            return
        bad = [f"{name} ({view.failed[name]})" for name in downloads.HEAD_FILES
               if name in view.failed]
        if bad or view.ended:
            what = ", ".join(bad) if bad else (f"the download ended ({view.state}) before "
                                               f"{' and '.join(downloads.HEAD_FILES)} were "
                                               "verified")
            raise Dsv4Error(f"convert --follow: nothing to convert: {what}", hint=REFETCH_FIX)
        time.sleep(POLL_S)


def follow(ctx: StageContext, source: Path, out_dir: Path, *, layers_spec: str | None = None,
           jobs: int | None = None, force: bool = False) -> Followed:
    """Convert and check the selected layers (``layers_spec``: --layers) as their shards
    arrive (module docstring), ``jobs`` at once; ``force`` redoes layers already there."""
    from dsv4_offload.weights.checkpoint import Checkpoint
    from dsv4_offload.weights.gguf_io import LayerLayout, forget_manifest_entries, recipe_dims

    conv = ctx.recipe.conversion
    _wait_for_head(ctx)
    t0 = time.monotonic()
    with Checkpoint.open(source) as ckpt:
        dims = ckpt.dims
        layers = parse_layers(layers_spec, dims.layers)
        shards = downloads.layer_shards(ckpt.weight_map)
        layouts = {layer: LayerLayout.for_layer(layer, dims, conv) for layer in layers}
        names = {layer: conv.file_name(layer) for layer in layers}
        expected, origin = layerverify.expected_digests(ctx, names, dims == recipe_dims(conv),
                                                       out_dir)
        jobs = int(jobs or default_jobs(len(layers)))
        if jobs < 1:
            raise InputError(f"--jobs {jobs}: must be at least 1")
        jobs = min(jobs, len(layers))
        result = Followed(layers, dims, layouts, jobs=jobs)
        make_out_dir(out_dir)
        # the layer files not complete yet: the room they need, the bytes the bar counts
        todo = [(layouts[x], out_dir / names[x]) for x in layers
                if file_size(out_dir / names[x]) != layouts[x].file_bytes]
        short = disk_shortfall(out_dir, todo)
        if short is not None:
            raise Dsv4Error(short, hint=DISK_FIX)
        loop = _Loop(ctx, ckpt, source, out_dir, result, shards, names, force,
                     expected or {}, origin if expected is not None else "")
        bars = Bars(ctx, sum(layout.file_bytes for layout, _final in todo), t0)
        workers = _Workers(jobs, bars)
        interrupted = True
        try:
            loop.run(workers, forget_manifest_entries)
            interrupted = False
        except BrokenProcessPool:
            raise Dsv4Error(f"a conversion worker died mid-layer (killed by the OS: out of "
                            f"memory with {jobs} jobs?); finished layers are kept",
                            hint="rerun `dsv4-offload convert` with fewer --jobs (or --jobs 1)",
                            ) from None
        finally:
            workers.close(interrupted)
            bars.close()
    result.seconds = time.monotonic() - t0
    return result


@dataclass
class _Loop:
    ctx: StageContext
    ckpt: Any
    source: Path
    out_dir: Path
    result: Followed
    shards: dict[int, list[str]]
    names: dict[int, str]
    force: bool
    expected: dict[str, str]
    origin: str
    sources: dict[int, Any] = field(default_factory=dict)  # layer -> the source it was made of
    digests: dict[Path, str] = field(default_factory=dict)
    converting: set[int] = field(default_factory=set)  # written here, not only checked

    def fail(self, layer: int, error: str, fix: str) -> None:
        self.result.failed[layer] = (error, fix)
        self.ctx.event("layer.failed", layer=layer, error=error, fix=fix)

    def run(self, workers: _Workers, forget_manifest_entries: Callable[..., None]) -> None:
        pending = list(self.result.layers)
        for layer in pending:
            if layer not in self.shards:
                self.fail(layer, f"layer {layer}: {self.ckpt.root / downloads.INDEX_FILE} "
                          "names no expert tensor of it", REFETCH_FIX)
        pending = [layer for layer in pending if layer in self.shards]
        while True:
            view = downloads.look(self.ctx.workspace, self.ctx.recipe)
            for layer in list(pending):
                bad = [s for s in self.shards[layer] if s in view.failed]
                if bad:
                    pending.remove(layer)
                    self.fail(layer, f"layer {layer}: its shard {bad[0]} failed to download: "
                              f"{view.failed[bad[0]]}", REFETCH_FIX)
            for layer in [x for x in pending if set(self.shards[x]) <= view.verified]:
                if workers.busy >= workers.jobs:
                    break
                pending.remove(layer)
                self.start(layer, workers, forget_manifest_entries)
            for layer, outcome in workers.finished(POLL_S if workers.busy else 0):
                self.done(layer, outcome)
            if view.ended and not workers.busy:
                if any(set(self.shards[x]) <= view.verified for x in pending):
                    continue  # ready, not started while the workers were busy: start them
                if pending:
                    self.never_arrived(pending, view)
                    pending = []
                stale = self.changed_sources()
                if not stale:
                    return
                pending = stale  # their shards changed under them: once more
                continue
            if not workers.busy:
                time.sleep(POLL_S)

    def start(self, layer: int, workers: _Workers,
              forget_manifest_entries: Callable[..., None]) -> None:
        layout, name = self.result.layouts[layer], self.names[layer]
        final = self.out_dir / name
        try:
            self.sources[layer] = layer_source(self.ckpt, layer, self.digests)
        except InputError as exc:
            self.fail(layer, f"layer {layer}: {exc}", REFETCH_FIX)
            return
        made_of = source_change(read_layer_sources(self.out_dir).get(name), self.sources[layer])
        present = file_size(final) == layout.file_bytes and made_of is None and not self.force
        if present and layerverify.still_checked(
                layerverify.read_layer_checks(self.out_dir).get(name), final):
            self.result.skipped.append(layer)
            self.ctx.event("layer.verified", layer=layer, already=True)
            return
        if not present:
            # until it is rewritten and checked, the file vouches for no check; its source
            # is on record before the new file takes its name (a kill just after the
            # rename leaves a complete file the rerun checks, never converts again)
            layerverify.record_layer_check(self.out_dir, name, None)
            forget_manifest_entries(self.out_dir, [name])
            claim_layer_files(self.out_dir, {name: self.sources[layer]})
            self.converting.add(layer)
            self.result.bytes += layout.file_bytes
        # our own manifest vouched for the file being replaced, not for the new one
        mine = self.origin == str(self.out_dir / OWN_MANIFEST)
        expected = None if mine and not present else self.expected.get(name)
        self.ctx.event("layer.started", layer=layer, convert=not present)
        workers.submit(layout, self.source, final, not present, expected,
                       self.origin or "no known digest")

    def done(self, layer: int, outcome: Any) -> None:
        name = self.names[layer]
        converted = layer in self.converting
        self.converting.discard(layer)
        if isinstance(outcome, Dsv4Error):
            self.fail(layer, f"layer {layer}: {outcome.one_line()}",
                      outcome.hint or layerverify.redo(layer))
            return
        if not outcome.ok:
            record_layer_source(self.out_dir, name, None)  # the rerun converts it again
            message, fix, _check = outcome.problems[0]
            self.fail(layer, message, fix)
            return
        record_layer_source(self.out_dir, name, self.sources[layer])
        layerverify.record_layer_check(self.out_dir, name, outcome,
                                      self.origin or "recorded")
        (self.result.converted if converted else self.result.checked).append(layer)
        self.ctx.event("layer.verified", layer=layer, sha256=outcome.sha256)

    def never_arrived(self, pending: list[int], view: downloads.DownloadView) -> None:
        for layer in pending:
            missing = [s for s in self.shards[layer] if s not in view.verified]
            self.fail(layer, f"layer {layer}: the download ended ({view.state}) without "
                      f"{', '.join(missing)}", REFETCH_FIX)

    def changed_sources(self) -> list[int]:
        """Layers converted here whose shards changed since (the download replaced one)."""
        stale = []
        for layer in self.result.converted + self.result.checked + self.result.skipped:
            digests: dict[Path, str] = {}
            try:
                now = layer_source(self.ckpt, layer, digests)
            except InputError:
                now = None
            if now != self.sources.get(layer):
                stale.append(layer)
        for layer in stale:
            for done in (self.result.converted, self.result.checked, self.result.skipped):
                if layer in done:
                    done.remove(layer)
        return stale

