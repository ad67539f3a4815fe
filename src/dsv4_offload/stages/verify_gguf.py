"""Stage verify-gguf: prove the per-layer GGUF files, in three levels.

1. Every expected file is present with the exact size, and its header reads back with the
   `gguf` reader as the expected structure (magic, version, KV, tensor names, types,
   dims, offsets) — byte for byte the header the converter writes.
2. The sha256 of every file (each read once, files in parallel threads: hashlib releases
   the GIL) against `--manifest FILE`, else the recipe's published digests (real dims),
   else this tool's own manifest from an earlier verified run.
3. `--deep N`: N evenly spaced layers compared with the native source, expert by expert:
   codes and scales after the repack, bit for bit (stricter than comparing dequantized
   values, which would let -0 pass for +0).
4. A layer through kt-kernel (guide appendix D): one verified layer file run by the built
   kt-kernel against the numpy reference from the source, cosine >= 0.9999
   (`build/layercheck`; `--no-kernel` or `selftest.real_layer.enabled: false` skip it).
On success the digests are merged into `gguf-sha256.txt` beside the files.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.inputs import read_user_text
from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.weights.convert import default_jobs, gguf_dir, parse_layers, source_dir
from dsv4_offload.workspace.context import StageContext

HASH_CHUNK = 16 * 2**20
MAX_DIFFS_PER_LAYER = 8


@dataclass
class Report:
    """What the levels found, collected for the result."""

    problems: list[Problem] = field(default_factory=list)
    levels: dict[str, str] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)

    def error(self, message: str, fix: str, check: str) -> None:
        self.problems.append(Problem("error", message, fix, check))

    def warn(self, message: str, fix: str, check: str) -> None:
        self.problems.append(Problem("warning", message, fix, check))

    @property
    def failed(self) -> bool:
        return any(p.severity == "error" for p in self.problems)


def _redo(layer: int) -> str:
    return f"rerun `dsv4-offload convert --layers {layer} --force`"


# --- level 1 -------------------------------------------------------------------------------


def check_files(layouts: dict[int, Any], paths: dict[int, Path], report: Report) -> None:
    """Presence, exact size and header structure of every file."""
    from dsv4_offload.weights.gguf_io import structural_problems

    for layer, layout in layouts.items():
        path = paths[layer]
        try:
            size = path.stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            report.error(f"layer {layer}: {path} is missing",
                         f"run `dsv4-offload convert --layers {layer}`", "level1")
            continue
        if size != layout.file_bytes:
            report.error(f"layer {layer}: {path} is {size} B, expected {layout.file_bytes} B "
                         f"({'truncated' if size < layout.file_bytes else 'too long'})",
                         _redo(layer), "level1")
            continue
        found = structural_problems(path, layout)
        if not found:
            with open(path, "rb") as fh:
                head = fh.read(layout.data_offset)
            if head != layout.header:
                at = next(i for i, (a, b) in enumerate(zip(head, layout.header, strict=True))
                          if a != b)
                found = [f"header byte {at} differs from the converter's header"]
        for text in found:
            report.error(f"layer {layer}: {path.name}: {text}", _redo(layer), "structure")


def check_sources(source: Path, out_dir: Path, paths: dict[int, Path], report: Report) -> None:
    """Each file against the source it was converted from (recorded by convert): a file of
    the right shape made from other weights passes every other level, so it is named here."""
    from dsv4_offload.weights.checkpoint import Checkpoint
    from dsv4_offload.weights.convert import layer_source, read_layer_sources, source_change

    recorded = read_layer_sources(out_dir)
    digests: dict[Path, str] = {}
    unrecorded = []
    with Checkpoint.open(source) as ckpt:
        for layer, path in paths.items():
            change = source_change(recorded.get(path.name), layer_source(ckpt, layer, digests))
            if change is not None and path.name not in recorded:
                unrecorded.append(layer)
            elif change is not None:
                report.error(f"layer {layer}: {path.name} was converted from other weights: "
                             f"{change} ({source})", _redo(layer), "source")
    if unrecorded:
        report.warn(f"{len(unrecorded)} layer file(s) have no record of their source in "
                    f"{out_dir} (converted by hand or by an older version): layers "
                    f"{unrecorded[:8]}", "rerun `dsv4-offload convert --force` to record it",
                    "source")


# --- level 2 -------------------------------------------------------------------------------


def sha256_file(path: Path, advance: Any = None) -> str:
    """sha256 of a file, read once in large chunks (hashlib releases the GIL on them)."""
    digest = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])
            if advance is not None:
                advance(n)
    return digest.hexdigest()


def _thread_safe(advance: Any) -> Any:
    """``advance`` callable from several threads (a Task's advance is a read-modify-write)."""
    if advance is None:
        return None
    lock = threading.Lock()

    def locked_advance(n: int) -> None:
        with lock:
            advance(n)

    return locked_advance


def hash_files(paths: list[Path], jobs: int, advance: Any = None) -> dict[Path, str]:
    locked_advance = _thread_safe(advance)
    with cf.ThreadPoolExecutor(max(1, jobs), thread_name_prefix="sha256") as pool:
        digests = pool.map(lambda p: sha256_file(p, locked_advance), paths)
        return dict(zip(paths, digests, strict=True))


def expected_digests(ctx: StageContext, names: dict[int, str], real_dims: bool,
                     out_dir: Path) -> tuple[dict[str, str] | None, str]:
    """(file name -> digest, where they come from), or (None, why not) if there are none."""
    from dsv4_offload.weights.gguf_io import OWN_MANIFEST, parse_manifest, read_own_manifest

    manifest = ctx.option("manifest")
    if manifest:
        path = Path(manifest)
        text = read_user_text(path, "manifest", 1 << 20, "give a sha256sum file",
                              label=f"--manifest {path}")
        return parse_manifest(text, str(path)), str(path)
    conv = ctx.recipe.conversion
    if real_dims and conv.digests:
        check_delivery_manifest(ctx)
        return {names[k]: v for k, v in conv.digests.items() if k in names}, \
            "the recipe's published digests (conversion.digests)"
    own = read_own_manifest(out_dir)
    if own is not None:
        return own, str(out_dir / OWN_MANIFEST)
    return None, "no published digests for these dims and no manifest"


def check_delivery_manifest(ctx: StageContext) -> Path | None:
    """If the delivery's manifest has been fetched, it must agree with the inline digests.

    The recipe carries the 43 digests itself (usable before `fetch`); when the pinned
    manifest file is in the workspace too, a disagreement means the recipe was edited
    wrongly, and which one to trust is the user's call.
    """
    from dsv4_offload.weights.gguf_io import parse_manifest

    conv = ctx.recipe.conversion
    pinned = conv.digests_manifest
    if pinned is None:
        return None
    path = ctx.workspace.source_dir(ctx.recipe, pinned.source) / pinned.path
    try:
        raw = path.read_bytes()
    except OSError:
        return None  # not fetched: the inline digests stand alone
    if hashlib.sha256(raw).hexdigest() != pinned.sha256:
        raise InputError(
            f"{path}: sha256 differs from conversion.digests_manifest.sha256 in the recipe; "
            "the delivery checkout is modified: rerun `dsv4-offload fetch --force`"
        )
    published = parse_manifest(raw.decode("utf-8", "replace"), str(path))
    for layer, digest in sorted(conv.digests.items()):
        name = conv.file_name(layer)
        if published.get(name) != digest:
            raise InputError(
                f"recipe conversion.digests[{layer}] is {digest[:16]}… but the delivery's "
                f"{path.name} says {str(published.get(name))[:16]}… for {name}; fix the recipe"
            )
    return path


# --- level 3 -------------------------------------------------------------------------------


def _pread_into(fd: int, out: Any, offset: int, path: Path) -> None:
    view = memoryview(out)
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise InputError(f"{path}: unexpected end of file at byte {offset + done}; it "
                             "changed during the check: rerun `dsv4-offload verify-gguf`")
        done += n


def _equal(a: Any, b: Any) -> bool:
    import numpy as np

    if a.size % 8 == 0:  # compare 8 bytes at a time
        return bool(np.array_equal(a.view(np.uint64), b.view(np.uint64)))
    return bool(np.array_equal(a, b))


def _describe_diff(layer: int, tensor: Any, expert: int, got: Any, want: Any) -> str:
    import numpy as np

    from dsv4_offload.weights import mxfp4

    rows_got = got.reshape(tensor.rows, tensor.row_bytes)
    rows_want = want.reshape(tensor.rows, tensor.row_bytes)
    bad_rows = np.nonzero((rows_got != rows_want).any(axis=1))[0]
    row = int(bad_rows[0])
    blocks_got = rows_got[row].reshape(-1, mxfp4.BLOCK_BYTES)
    blocks_want = rows_want[row].reshape(-1, mxfp4.BLOCK_BYTES)
    block = int(np.nonzero((blocks_got != blocks_want).any(axis=1))[0][0])
    if blocks_got[block, 0] != blocks_want[block, 0]:
        what = (f"scale (E8M0) 0x{int(blocks_got[block, 0]):02x} in the file, "
                f"0x{int(blocks_want[block, 0]):02x} from the source")
    else:
        what = "E2M1 codes differ from the source"
    return (f"layer {layer}: tensor {tensor.name} ({tensor.projection}), expert {expert}, "
            f"row {row}, block {block}: {what} ({len(bad_rows)} of {tensor.rows} rows differ)")


def compare_with_source(path: Path, layout: Any, ckpt: Any, threads: int,
                        advance: Any = None) -> list[str]:
    """Bit-exact comparison of one layer file with the repacked source; returns differences."""
    import numpy as np

    from dsv4_offload.weights import mxfp4

    entries = ckpt.layer_tensors(layout.layer)
    experts = layout.dims.experts
    threads = max(1, min(threads, experts))
    advance = _thread_safe(advance)
    fd = os.open(path, os.O_RDONLY)

    def compare_range(lo: int, hi: int) -> list[tuple[int, int, Any, Any]]:
        max_out = max(t.expert_bytes for t in layout.tensors)
        got_buf, want_buf = np.empty(max_out, np.uint8), np.empty(max_out, np.uint8)
        repacker = mxfp4.Repacker()  # one per thread: it owns scratch buffers
        diffs: list[tuple[int, int, Any, Any]] = []
        for t_index, (tensor, (_proj, pairs)) in enumerate(
                zip(layout.tensors, entries, strict=True)):
            for expert in range(lo, hi):
                w_entry, s_entry = pairs[expert]
                got = got_buf[: tensor.expert_bytes]
                want = want_buf[: tensor.expert_bytes]
                _pread_into(fd, got, tensor.expert_offset(expert), path)
                with ckpt.mapped(w_entry) as weight, ckpt.mapped(s_entry) as scale:
                    repacker.repack_into(weight, scale, want)
                    del weight, scale  # let the maps close
                if not _equal(got, want) and len(diffs) < MAX_DIFFS_PER_LAYER:
                    diffs.append((t_index, expert, got.copy(), want.copy()))
                if advance is not None:
                    advance(tensor.expert_bytes)
        return diffs

    try:
        bounds = [(i * experts // threads, (i + 1) * experts // threads) for i in range(threads)]
        with cf.ThreadPoolExecutor(threads, thread_name_prefix="deep") as pool:
            found = [d for part in pool.map(lambda b: compare_range(*b), bounds) for d in part]
    finally:
        os.close(fd)
    messages = []
    found.sort(key=lambda d: (d[0], d[1]))
    for t_index, expert, got, want in found[:MAX_DIFFS_PER_LAYER]:
        tensor = layout.tensors[t_index]
        text = _describe_diff(layout.layer, tensor, expert, got, want)
        twin = next((e for t, e, _g, w in found if t == t_index and e != expert
                     and _equal(got, w)), None)
        if twin is not None:
            text += f"; it holds expert {twin}'s data (experts out of order)"
        messages.append(text)
    return messages


def deep_layers(layers: list[int], count: int) -> list[int]:
    """`count` evenly spaced layers of `layers` (first and last included)."""
    if count <= 0 or not layers:
        return []
    if count >= len(layers):
        return list(layers)
    if count == 1:
        return [layers[len(layers) // 2]]
    step = (len(layers) - 1) / (count - 1)
    return sorted({layers[round(i * step)] for i in range(count)})


# --- the stage -----------------------------------------------------------------------------


def fingerprint_inputs(ctx: StageContext) -> dict[str, str]:
    """Size and mtime of each layer file, so a touched file makes this stage stale."""
    out_dir = gguf_dir(ctx)
    stats = []
    try:
        for entry in sorted(os.scandir(out_dir), key=lambda e: e.name):
            if entry.name.endswith(".gguf"):
                st = entry.stat()
                stats.append(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}")
    except FileNotFoundError:
        pass
    digest = hashlib.sha256("\n".join(stats).encode()).hexdigest()[:16]
    from dsv4_offload.build.moerun import module_fingerprint

    # level 4 runs the built kt-kernel: a rebuild makes this stage stale
    out = {"gguf.files": f"{len(stats)}:{digest}", **module_fingerprint(ctx)}
    if ctx.option("manifest"):
        out["manifest"] = str(ctx.option("manifest"))
    return out


def run(ctx: StageContext) -> StageResult:
    from dsv4_offload.weights.checkpoint import CONFIG_FILE, parse_config
    from dsv4_offload.weights.gguf_io import LayerLayout, recipe_dims, write_own_manifest

    conv = ctx.recipe.conversion
    out_dir, source = gguf_dir(ctx), source_dir(ctx)
    has_source = (source / CONFIG_FILE).is_file()
    dims = parse_config(source / CONFIG_FILE) if has_source else recipe_dims(conv)
    real_dims = dims == recipe_dims(conv)
    layers = parse_layers(ctx.option("layers"), dims.layers)
    layouts = {layer: LayerLayout.for_layer(layer, dims, conv) for layer in layers}
    if real_dims and layouts[layers[0]].file_bytes != conv.expected_file_bytes:
        raise InputError(
            f"recipe conversion.expected_file_bytes is {conv.expected_file_bytes} but the layout "
            f"gives {layouts[layers[0]].file_bytes}; fix the recipe"
        )
    names = {layer: conv.file_name(layer) for layer in layers}
    paths = {layer: out_dir / names[layer] for layer in layers}
    jobs = int(ctx.option("jobs") or default_jobs(len(layers)))
    report = Report()
    report.data.update(gguf_dir=str(out_dir), layers=layers, dims=dims.as_dict(),
                       dims_from=str(source / CONFIG_FILE) if has_source else "recipe")

    check_files(layouts, paths, report)
    if has_source and not report.failed:
        check_sources(source, out_dir, paths, report)
    report.levels["1"] = "failed" if report.failed else "ok"
    if report.failed:
        return _result(report, f"level 1 failed for {len(layers)} layer file(s) in {out_dir}")
    expected, origin = expected_digests(ctx, names, real_dims, out_dir)
    digests = _level2(ctx, layouts, paths, names, expected, origin, jobs, report)
    _level3(ctx, layouts, paths, source if has_source else None, jobs, report)
    if not report.failed:
        from dsv4_offload.build.layercheck import level4

        report.levels["4"], found, kernel = level4(ctx, paths, source if has_source else None)
        report.problems += found
        report.data.update(kernel)
    if report.failed:
        return _result(report, f"verification failed ({_levels_text(report)})")
    manifest = write_own_manifest(out_dir, digests)
    report.data["manifest"] = str(manifest)
    return _result(report, f"{len(layers)} layer file(s) verified ({_levels_text(report)}); "
                   f"digests in {manifest}")


def _level2(ctx: StageContext, layouts: dict[int, Any], paths: dict[int, Path],
            names: dict[int, str], expected: dict[str, str] | None, origin: str, jobs: int,
            report: Report) -> dict[str, str]:
    """Hash every file once (in parallel) and compare; returns file name -> digest."""
    total = sum(layout.file_bytes for layout in layouts.values())
    t0 = time.monotonic()
    with ctx.task("verify: sha256", total, "B") as task:
        digests = hash_files([paths[layer] for layer in layouts], jobs, task.advance)
    seconds = time.monotonic() - t0
    by_name = {names[layer]: digests[paths[layer]] for layer in layouts}
    report.data.update(digests=by_name, digest_source=origin,
                       sha256_gb_per_s=round(total / max(seconds, 1e-9) / 1e9, 3))
    if expected is None:
        report.levels["2"] = "recorded"
        report.warn(f"level 2: {origin}; the digests were computed and recorded only",
                    "pass --manifest FILE to check against known digests", "level2")
        return by_name
    for layer in layouts:
        want, got = expected.get(names[layer]), by_name[names[layer]]
        if want is None:
            report.error(f"layer {layer}: {origin} has no digest for {names[layer]}",
                         "give a manifest that lists every layer file", "level2")
        elif want != got:
            report.error(f"layer {layer}: {names[layer]} sha256 {got[:16]}… differs from "
                         f"{want[:16]}… ({origin}): the file is corrupt or was built from "
                         "another source", f"{_redo(layer)}; `verify-gguf --deep` with "
                         f"`--layers {layer}` shows where it differs", "level2")
    report.levels["2"] = "failed" if report.failed else "ok"
    return by_name


def _level3(ctx: StageContext, layouts: dict[int, Any], paths: dict[int, Path],
            source: Path | None, jobs: int, report: Report) -> None:
    """Compare --deep N evenly spaced layers bit for bit with the repacked source."""
    from dsv4_offload.weights.checkpoint import Checkpoint

    deep_option = ctx.option("deep")
    chosen = deep_layers(list(layouts), 1 if deep_option is None else int(deep_option))
    report.levels["3"] = "skipped"
    if not chosen:
        return
    if source is None:
        # without --deep, a missing source only weakens the check; asked for, it fails it
        (report.error if deep_option is not None else report.warn)(
            f"level 3: no source checkpoint at {source_dir(ctx)} to compare with",
            "pass --source DIR (the native MXFP4 checkpoint) or --deep 0", "level3")
        return
    deep_bytes = sum(layouts[layer].file_bytes - layouts[layer].data_offset for layer in chosen)
    t0 = time.monotonic()
    differing = 0
    with Checkpoint.open(source) as ckpt, ctx.task("verify: bit-exact", deep_bytes,
                                                    "B") as task:
        for layer in chosen:
            for text in compare_with_source(paths[layer], layouts[layer], ckpt, jobs,
                                            task.advance):
                report.error(text, _redo(layer), "level3")
                differing += 1
    seconds = time.monotonic() - t0
    report.levels["3"] = "failed" if differing else "ok"
    report.data.update(deep_layers=chosen,
                       deep_gb_per_s=round(deep_bytes / max(seconds, 1e-9) / 1e9, 3))


def _levels_text(report: Report) -> str:
    return ", ".join(f"L{k} {v}" for k, v in sorted(report.levels.items()))


def _result(report: Report, summary: str) -> StageResult:
    if report.failed:
        status = Status.FAILED
    elif report.problems:
        status = Status.WARN
    else:
        status = Status.OK
    data = {**report.data, "levels": report.levels}
    outputs = {} if report.failed else {
        "gguf_dir": data["gguf_dir"], "levels": report.levels,
        "digests": data.get("digests", {}), "manifest": data.get("manifest")}
    return StageResult(status, summary, data=data, problems=report.problems, outputs=outputs)
