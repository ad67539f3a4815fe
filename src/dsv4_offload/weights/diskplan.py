"""The disk a bring-up needs at its peak: both weight sets and the GGUF set, together.

The one source of the disk figure: `run` refuses on it and doctor's `disk` row shows it.
The MXFP4 checkpoint stays after its conversion (the launcher reads it for streaming
prefill, KT_MXFP4_CKPT), so the peak of this tool's run (the download and the conversion
overlapping) is W8A8 + MXFP4 + GGUF. The delivery's serial way (G258: MXFP4, convert,
delete the MXFP4 source, then W8A8) peaks lower; each figure is stated. What a run still
needs is each set's expected size (``weights.*.expected_bytes``, ``conversion.layers x
conversion.expected_file_bytes``) minus what is already on disk there, counted per filesystem
(``st_dev``): three directories on one disk share its free space. Which sets a run writes
and where they go is the registry's (a row's ``disk_sets``).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.host import nearest_existing
from dsv4_offload.core.registry import STAGES, DiskSet, recipe_value
from dsv4_offload.core.results import FAIL, OK, WARN, Check
from dsv4_offload.weights.conversion import GIB

if TYPE_CHECKING:
    from dsv4_offload.recipe import Recipe
    from dsv4_offload.workspace.store import Workspace

# the delivery's serial way (G258): the set deleted once converted, and the set fetched after
DELETED_SOURCE = "mxfp4"
LAST_SET = "w8a8"


@dataclass
class SetNeed:
    """One set: where it goes, how big it gets, how much of it is there already."""

    name: str
    directory: Path
    expected: int
    present: int

    @property
    def need(self) -> int:
        return max(0, self.expected - self.present)


@dataclass
class FsNeed:
    """One filesystem: the sets on it, what they still need together, what it has free."""

    device: int
    probe: Path  # the nearest existing directory, where the free space was read
    sets: list[SetNeed] = field(default_factory=list)
    free: int = 0

    @property
    def need(self) -> int:
        return sum(s.need for s in self.sets)

    @property
    def short(self) -> bool:
        return self.need > self.free

    @property
    def serial_need(self) -> int:
        """The peak of the delivery's serial way on this filesystem: the MXFP4 source and
        the GGUF set first, then the source deleted (G258) before the W8A8 set arrives."""
        source = [s for s in self.sets if s.name == DELETED_SOURCE]
        if not source:
            return self.need
        first = sum(s.need for s in self.sets if s.name != LAST_SET)
        freed = sum(s.expected for s in source)
        return max(first, first - freed + sum(s.need for s in self.sets if s.name == LAST_SET))

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "probe": str(self.probe), "need_bytes": self.need,
                "free_bytes": self.free, "short": self.short,
                "serial_need_bytes": self.serial_need,
                "sets": [{"set": s.name, "dir": str(s.directory), "expected_bytes": s.expected,
                          "present_bytes": s.present, "need_bytes": s.need} for s in self.sets]}


def bytes_under(directory: Path) -> int:
    """The size of the regular files under ``directory`` (0 when it does not exist)."""
    total = 0
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(dirpath, name)):
                total += st.st_size
    return total


def set_needs(recipe: Recipe, ws: Workspace, sets: tuple[DiskSet, ...]) -> list[SetNeed]:
    """Each set: its directory (under the workspace when relative) and expected bytes, from
    the recipe paths its row names, with what is there already."""
    out = []
    for s in sets:
        directory = ws.root / recipe_value(recipe, s.directory)
        expected = math.prod(int(recipe_value(recipe, f)) for f in s.size)
        out.append(SetNeed(s.name, directory, expected, bytes_under(directory)))
    return out


def by_filesystem(needs: list[SetNeed]) -> list[FsNeed]:
    """The sets grouped by the filesystem their directory is (or will be) on."""
    found: dict[int, FsNeed] = {}
    for need in needs:
        probe = nearest_existing(need.directory)
        device = probe.stat().st_dev
        fs = found.get(device)
        if fs is None:
            fs = found[device] = FsNeed(device, probe, free=shutil.disk_usage(probe).free)
        fs.sets.append(need)
    return list(found.values())


def total_need(filesystems: list[FsNeed]) -> int:
    """What the run still writes, on every filesystem together."""
    return sum(fs.need for fs in filesystems)


def need_words(fs: FsNeed) -> str:
    """The figure of one filesystem, both ways, in words: what it still takes, what is free."""
    text = (f"this run still writes {fs.need / GIB:.1f} GiB to the filesystem of {fs.probe} "
            f"({fs.free / GIB:.1f} GiB free)")
    if fs.serial_need < fs.need:
        text += (f"; the delivery's serial way (convert, delete the MXFP4 source, G258, then "
                 f"the W8A8 download) would peak at {fs.serial_need / GIB:.1f} GiB")
    return text


def shortfall(filesystems: list[FsNeed]) -> str | None:
    """One line for the first filesystem that cannot hold what the run still writes there:
    the directories, the need both ways, how much more it needs and the fix; None when all fit."""
    for fs in filesystems:
        if not fs.short:
            continue
        dirs = ", ".join(f"{s.directory} ({s.name}: {s.need / GIB:.1f} GiB to come)"
                         for s in fs.sets if s.need)
        text = (f"disk: the run needs {(fs.need - fs.free) / GIB:.1f} GiB more free space: "
                f"it still writes {fs.need / GIB:.1f} GiB to the filesystem of {fs.probe} "
                f"({dirs}) and only {fs.free / GIB:.1f} GiB are free there; ")
        if fs.serial_need <= fs.free:
            text += (f"only the delivery's serial way fits ({fs.serial_need / GIB:.1f} GiB at "
                     "its peak), stage by stage by hand: `download mxfp4`, `convert`, "
                     "`verify-gguf`, delete the MXFP4 source (G258; streaming prefill, "
                     "KT_MXFP4_CKPT, then has no source), `download w8a8`, `serve` (`run` "
                     "keeps the source and would fetch it again); or ")
        return text + ("free that much, or point the workspace (--workspace DIR), "
                       "weights.*.dir or conversion.gguf_dir at a bigger disk")
    return None


def run_disk(recipe: Recipe, ws: Workspace, workspace_free: int | None) -> list[FsNeed]:
    """What a whole run writes (the disk sets of the registry rows the recipe applies), with
    the workspace's free space as doctor measured it (a captured host's df is the host's)."""
    sets = tuple(d for spec in STAGES if spec.name not in recipe.not_applicable
                 for d in spec.disk_sets)
    if not sets:
        return []
    filesystems = by_filesystem(set_needs(recipe, ws, sets))
    if workspace_free is not None:
        home = nearest_existing(ws.root.absolute()).stat().st_dev
        for fs in filesystems:
            if fs.device == home:
                fs.free = workspace_free
    return filesystems


def disk_check(recipe: Recipe, workspace_free: int | None, disk: list[FsNeed] | None) -> Check:
    """Doctor's `disk` row: free disk against what the run still writes, as `run` counts it;
    a recipe that writes no weight set against host.disk_min_gib (build trees, rehearsal)."""
    host = recipe.host
    if disk:
        need = total_need(disk)
        free = sum(fs.free for fs in disk)
        short = shortfall(disk)
        observed = f"{free / GIB:,.1f} GiB free" + (f", {need / GIB:,.1f} GiB to write"
                                                   if short else "")
        return Check("disk", FAIL if short else OK, observed,
                     "; ".join(need_words(fs) for fs in disk),
                     short.removeprefix("disk: ") if short else "")
    required = (f">= {host.disk_min_gib:g} GiB free under the workspace "
                f"({host.disk_recommended_gib:g} recommended)")
    if workspace_free is None:
        return Check("disk", WARN, "unknown", required, "check `df -h` on the workspace")
    gib = workspace_free / GIB
    status = FAIL if gib < host.disk_min_gib else (
        WARN if gib < host.disk_recommended_gib else OK)
    target = host.disk_min_gib if status == FAIL else host.disk_recommended_gib
    return Check("disk", status, f"{gib:,.1f} GiB free", required, "" if status == OK else
                 f"free {target - gib:,.1f} GiB more, or point --workspace at a larger "
                 "filesystem")
