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
   (`build/layerforward`; `--no-kernel` or `selftest.real_layer.enabled: false` skip it).
On success the digests are merged into `gguf-sha256.txt` beside the files.

Layers `convert` already checked as it wrote them (a convert that followed the download:
the same checks, weights/layerverify.py, with a bit-exact sample of every layer) and that
are unchanged since (size and mtime) are not read again: their recorded digest stands for
level 2, their sample for the default level 3 (an explicit `--deep N` compares anyway).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.options import PathText, StageOptions
from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.weights.conversion import default_jobs, gguf_dir, parse_layers, source_dir
from dsv4_offload.weights.layerverify import (  # the checks convert runs per layer, too
    check_delivery_manifest,
    compare_with_source,
    deep_layers,
    expected_digests,
    file_problems,
    hash_files,
    read_layer_checks,
    still_checked,
)
from dsv4_offload.weights.layerverify import redo as _redo
from dsv4_offload.workspace.context import StageContext

__all__ = ["check_delivery_manifest", "deep_layers", "expected_digests", "run"]


class VerifyGgufOptions(StageOptions):
    deep: int | None = None  # layers compared bit for bit (default 1, unless convert did)
    manifest: PathText | None = None  # sha256sum-format digests (default: the recipe's)
    source: PathText | None = None  # the MXFP4 checkpoint (default: the workspace's download)
    gguf_dir: PathText | None = None  # the layer files (default: the workspace's)
    layers: str | None = None  # '0-42', '3,5,7' (default: every layer)
    jobs: int | None = None  # files hashed at once (default: from the cores)
    kernel: bool = True  # level 4: a layer through the built kt-kernel
    python: PathText | None = None  # the build python that runs kt-kernel at level 4


Options = VerifyGgufOptions


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


# --- level 1 -------------------------------------------------------------------------------


def check_files(layouts: dict[int, Any], paths: dict[int, Path], report: Report) -> None:
    """Presence, exact size and header structure of every file."""
    for layer, layout in layouts.items():
        for message, fix, check in file_problems(layer, layout, paths[layer]):
            report.error(message, fix, check)


def check_sources(source: Path, out_dir: Path, paths: dict[int, Path], report: Report) -> None:
    """Each file against the source it was converted from (recorded by convert): a file of
    the right shape made from other weights passes every other level, so it is named here."""
    from dsv4_offload.weights.checkpoint import Checkpoint
    from dsv4_offload.weights.conversion import layer_source, read_layer_sources, source_change

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


# --- the stage -----------------------------------------------------------------------------


def fingerprint_inputs(ctx: StageContext) -> dict[str, str]:
    """Size and mtime of each layer file, so a touched file makes this stage stale."""
    options = ctx.options_as(VerifyGgufOptions)
    out_dir = gguf_dir(ctx, options.gguf_dir)
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
    if options.manifest:
        out["manifest"] = str(options.manifest)
    return out


def run(ctx: StageContext) -> StageResult:
    from dsv4_offload.weights.checkpoint import CONFIG_FILE, parse_config
    from dsv4_offload.weights.gguf_io import LayerLayout, recipe_dims, write_own_manifest

    conv = ctx.recipe.conversion
    options = ctx.options_as(VerifyGgufOptions)
    out_dir, source = gguf_dir(ctx, options.gguf_dir), source_dir(ctx, options.source)
    has_source = (source / CONFIG_FILE).is_file()
    dims = parse_config(source / CONFIG_FILE) if has_source else recipe_dims(conv)
    real_dims = dims == recipe_dims(conv)
    layers = parse_layers(options.layers, dims.layers)
    layouts = {layer: LayerLayout.for_layer(layer, dims, conv) for layer in layers}
    if real_dims and layouts[layers[0]].file_bytes != conv.expected_file_bytes:
        raise InputError(
            f"recipe conversion.expected_file_bytes is {conv.expected_file_bytes} but the layout "
            f"gives {layouts[layers[0]].file_bytes}; fix the recipe"
        )
    names = {layer: conv.file_name(layer) for layer in layers}
    paths = {layer: out_dir / names[layer] for layer in layers}
    jobs = int(options.jobs or default_jobs(len(layers)))
    report = Report()
    report.data.update(gguf_dir=str(out_dir), layers=layers, dims=dims.as_dict(),
                       dims_from=str(source / CONFIG_FILE) if has_source else "recipe")

    check_files(layouts, paths, report)
    if has_source and not report.failed:
        check_sources(source, out_dir, paths, report)
    report.levels["1"] = "failed" if report.failed else "ok"
    if report.failed:
        return _result(report, f"level 1 failed for {len(layers)} layer file(s) in {out_dir}")
    checks = read_layer_checks(out_dir)
    prechecked = {layer: checks[names[layer]] for layer in layers
                  if still_checked(checks.get(names[layer]), paths[layer])}
    report.data["prechecked"] = sorted(prechecked)
    expected, origin = expected_digests(ctx, names, real_dims, out_dir, options.manifest)
    digests = _level2(ctx, layouts, paths, names, expected, origin, jobs, report, prechecked)
    _level3(ctx, layouts, paths, source if has_source else None, jobs, report, prechecked)
    if not report.failed:
        from dsv4_offload.build.layerforward import level4

        report.levels["4"], found, kernel = level4(ctx, paths, source if has_source else None,
                                                   kernel=options.kernel, python=options.python)
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
            report: Report, prechecked: dict[int, Any] | None = None) -> dict[str, str]:
    """Hash every file once (in parallel; not those convert hashed, unchanged since) and
    compare; returns file name -> digest."""
    prechecked = prechecked or {}
    todo = [layer for layer in layouts if layer not in prechecked]
    total = sum(layouts[layer].file_bytes for layer in todo)
    t0 = time.monotonic()
    with ctx.task("verify: sha256", total, "B") as task:
        digests = hash_files([paths[layer] for layer in todo], jobs, task.advance)
    seconds = time.monotonic() - t0
    by_name = {names[layer]: digests[paths[layer]] if layer in todo
               else str(prechecked[layer]["sha256"]) for layer in layouts}
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
            source: Path | None, jobs: int, report: Report,
            prechecked: dict[int, Any] | None = None) -> None:
    """Compare --deep N evenly spaced layers bit for bit with the repacked source (by
    default, not a layer convert compared a sample of, unchanged since)."""
    from dsv4_offload.weights.checkpoint import Checkpoint

    options = ctx.options_as(VerifyGgufOptions)
    deep_option = options.deep
    chosen = deep_layers(list(layouts), 1 if deep_option is None else deep_option)
    report.levels["3"] = "skipped"
    sampled = sorted(layer for layer, entry in (prechecked or {}).items()
                     if entry.get("experts_compared"))
    if deep_option is None and chosen and set(chosen) <= set(sampled):
        report.levels["3"] = "ok"  # by convert, as it wrote each layer
        report.data.update(deep_layers=[], sampled_by_convert=sampled)
        return
    if not chosen:
        return
    if source is None:
        # without --deep, a missing source only weakens the check; asked for, it fails it
        (report.error if deep_option is not None else report.warn)(
            f"level 3: no source checkpoint at {source_dir(ctx, options.source)} to compare with",
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
