"""The disk a bring-up needs at its peak: both weight sets and the GGUF set, together.

The MXFP4 checkpoint stays after its conversion (the launcher reads it for streaming
prefill, KT_MXFP4_CKPT), so the peak of a pipelined run (the download and the conversion
overlapping) is the same as the end of a serial one: W8A8 + MXFP4 + GGUF. What a run still
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
from dsv4_offload.core.registry import DiskSet, recipe_value
from dsv4_offload.weights.conversion import GIB

if TYPE_CHECKING:
    from dsv4_offload.recipe import Recipe
    from dsv4_offload.workspace.store import Workspace

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

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "probe": str(self.probe), "need_bytes": self.need,
                "free_bytes": self.free, "short": self.short,
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


def shortfall(filesystems: list[FsNeed]) -> str | None:
    """One line for the first filesystem that cannot hold what the run still writes there:
    the directories, the need, the free space and the fix; None when all fit."""
    for fs in filesystems:
        if not fs.short:
            continue
        dirs = ", ".join(f"{s.directory} ({s.name}: {s.need / GIB:.1f} GiB to come)"
                         for s in fs.sets if s.need)
        return (f"disk: the overlapped run still writes {fs.need / GIB:.1f} GiB to the "
                f"filesystem of {fs.probe} ({dirs}) but only {fs.free / GIB:.1f} GiB are free "
                f"there; free {(fs.need - fs.free) / GIB:.1f} GiB, or point the workspace "
                "(--workspace DIR), weights.*.dir or conversion.gguf_dir at a bigger disk")
    return None
