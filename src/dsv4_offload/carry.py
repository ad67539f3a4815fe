"""Carrying the series forward: ``patch check --bisect`` (where along upstream's history each
patch stops applying, or is taken upstream) and ``patch rebase`` (the patches carried onto a
newer upstream commit, written as a new series with a recipe overlay).

Both work in a blob-less history cache (:func:`gitsrc.fetch_history`); bisect never checks
anything out (index-only checks, :mod:`indexcheck`).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload import gitsrc
from dsv4_offload.errors import InputError
from dsv4_offload.series import (
    CLEAN,
    FAILS,
    FUZZ,
    OFFSET,
    UPSTREAM,
    load_patches,
    series_targets,
)

if TYPE_CHECKING:
    from dsv4_offload.recipe import Recipe, Series


def parse_target_ref(item: str, option: str) -> tuple[str, str]:
    name, sep, ref = item.partition("=")
    if not sep or not name.strip() or not ref.strip():
        raise InputError(f"{option} {item!r}: expected TARGET=REF, e.g. "
                         f"{option} ktransformers=v0.7.0")
    return name.strip(), ref.strip()


def _check_target(series: Series, target: str, option: str) -> None:
    targets = series_targets(series)
    if target not in targets:
        raise InputError(f"{option} {target}=...: not a target of series '{series.name}'; "
                         f"use one of {targets}")


# --- bisect --------------------------------------------------------------------------------


@dataclass
class CommitPoint:
    """A commit of the walk where a patch's state is noted."""

    commit: str
    status: str
    subject: str = ""
    date: str = ""
    files: list[str] = field(default_factory=list)  # changed by the commit, touched by the patch
    detail: str = ""


@dataclass
class PatchHistory:
    name: str
    target: str
    at_ref: str  # the status at REF
    last_clean: CommitPoint | None = None
    first_offset: CommitPoint | None = None
    first_fuzz: CommitPoint | None = None
    first_fails: CommitPoint | None = None
    first_upstream: CommitPoint | None = None
    transitions: list[CommitPoint] = field(default_factory=list)  # every change of state


@dataclass
class BisectReport:
    target: str
    pinned: str
    ref: str
    ref_commit: str
    commits_walked: int
    commits_checked: int  # the others changed no file of the target's patches: same result
    seconds: float
    patches: list[PatchHistory]
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(p.at_ref == CLEAN for p in self.patches)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


def first_parent_walk(repo: Path, pinned: str, ref_commit: str) -> list[str]:
    """The pinned commit, then REF's first-parent commits not reachable from it, oldest first."""
    out = gitsrc.git_text(repo, "rev-list", "--first-parent", "--reverse", ref_commit,
                          f"^{pinned}")
    return [pinned, *out.split()]


def _changed(repo: Path, old: str, new: str) -> set[str]:
    # trees only (no rename detection), so a blob-less history answers it
    out = gitsrc.git_text(repo, "diff-tree", "-r", "--name-only", "--no-renames", old, new)
    return set(out.splitlines())


def _point(repo: Path, commit: str, status: str, detail: str, paths: set[str]) -> CommitPoint:
    subject, date = gitsrc.git_text(repo, "show", "-s", "--format=%s%x00%cI", commit).split("\0")
    parents = gitsrc.git_text(repo, "rev-list", "--parents", "-n1", commit).split()[1:]
    changed = _changed(repo, parents[0], commit) if parents else set()
    return CommitPoint(commit, status, subject, date, sorted(changed & paths), detail)


def bisect_target(recipe: Recipe, series: Series, target: str, ref: str, log: Path, *,
                  mirrors: dict[str, list[str]] | None = None) -> BisectReport:
    """Each patch of ``target`` along the first-parent history from the pinned commit to REF.

    Every commit of the walk is decided, none guessed: the states are not monotone (a patch
    can fail, then apply again after a revert), so there is no binary search. A commit that
    changes none of the files the target's patches touch keeps the previous commit's result;
    the others get the whole stack checked in a temporary index (milliseconds each).
    """
    from dsv4_offload.indexcheck import IndexTree, check_and_carry, touched_paths

    _check_target(series, target, "--bisect")
    start = time.monotonic()
    source = recipe.source(target)
    entries = series.for_target(target)
    for name in dict.fromkeys(e.origin.source for e in entries if e.origin.source):
        assert name is not None
        gitsrc.fetch_commit(recipe.source(name), log=log, mirrors=mirrors)
    loaded = load_patches(entries, recipe, series, None)
    hist = gitsrc.fetch_history(source, ref, log=log, mirrors=mirrors)
    repo = hist.repo
    walk = first_parent_walk(repo, source.commit, hist.commit)
    states: list[list[tuple[str, str]]] = []  # per commit: (status, detail) per patch
    checked = 0
    with tempfile.TemporaryDirectory(prefix="dsv4-bisect-") as tmp:
        files = [p.write_to(Path(tmp)) for p in loaded]
        paths = [set(touched_paths(repo, f, p.entry.strip, log))
                 for p, f in zip(loaded, files, strict=True)]
        union = set().union(*paths)
        tree: IndexTree | None = None
        for i, commit in enumerate(walk):
            if i and not (_changed(repo, walk[i - 1], commit) & union):
                states.append(states[-1])
                continue
            if tree is None:
                tree = IndexTree(repo, commit, Path(tmp) / "index", log)
            else:
                tree.reset(commit)
            row = []
            for p, f in zip(loaded, files, strict=True):
                c, _ = check_and_carry(tree, p.entry, f)
                row.append((c.status, c.detail))
            states.append(row)
            checked += 1
    histories = []
    for k, p in enumerate(loaded):
        h = PatchHistory(p.entry.name, target, states[-1][k][0])
        prev = None
        for i, commit in enumerate(walk):
            status, detail = states[i][k]
            if status != prev:
                point = _point(repo, commit, status, detail, paths[k])
                h.transitions.append(point)
                slot = {OFFSET: "first_offset", FUZZ: "first_fuzz", FAILS: "first_fails",
                        UPSTREAM: "first_upstream"}.get(status)
                if slot and getattr(h, slot) is None:
                    setattr(h, slot, point)
                if prev == CLEAN and h.last_clean is None:
                    h.last_clean = _point(repo, walk[i - 1], CLEAN, "", paths[k])
            prev = status
        if h.last_clean is None and prev == CLEAN:
            h.last_clean = _point(repo, walk[-1], CLEAN, "", paths[k])  # clean all the way
        histories.append(h)
    return BisectReport(target, source.commit, ref, hist.commit, len(walk), checked,
                        round(time.monotonic() - start, 3), histories, hist.note)


_COLUMNS = (("last clean", "last_clean"), ("first offset", "first_offset"),
            ("first fuzz", "first_fuzz"), ("first fails", "first_fails"),
            ("first upstream", "first_upstream"))


def _cell(point: CommitPoint | None) -> str:
    return f"{point.commit[:12]} {point.subject}" if point else "—"


def bisect_rows(reports: list[BisectReport]) -> list[tuple[str, ...]]:
    """One row per patch: name, target, status at REF, then the commits of each column."""
    return [(h.name, h.target, h.at_ref, *(_cell(getattr(h, attr)) for _, attr in _COLUMNS))
            for r in reports for h in r.patches]


def bisect_junit(reports: list[BisectReport]) -> bytes:
    """One testcase per patch; a failure when it is not clean at REF, naming the commit."""
    import xml.etree.ElementTree as ET

    suites = ET.Element("testsuites")
    for r in reports:
        failures = sum(1 for h in r.patches if h.at_ref != CLEAN)
        suite = ET.SubElement(suites, "testsuite", name=f"dsv4-offload patch bisect {r.target}",
                              tests=str(len(r.patches)), failures=str(failures), errors="0",
                              time=f"{r.seconds:.3f}")
        for h in r.patches:
            case = ET.SubElement(suite, "testcase", classname=f"patch.{r.target}", name=h.name)
            if h.at_ref == CLEAN:
                continue
            first = next((t for t in h.transitions if t.status != CLEAN), None)
            msg = f"{h.at_ref} at {r.ref}" + (
                f"; first {first.status} at {first.commit[:12]} {first.subject}" if first else "")
            fail = ET.SubElement(case, "failure", type=h.at_ref, message=msg[:500])
            fail.text = "\n".join(
                f"{t.commit} {t.date} {t.status}: {t.subject} ({', '.join(t.files) or '-'})"
                for t in h.transitions)
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True) + b"\n"


def bisect_markdown(reports: list[BisectReport]) -> str:
    """A table for a CI step summary."""
    lines = []
    for r in reports:
        head = "every patch clean" if r.ok else "patches need work"
        lines += [f"## Patch bisect {r.target}: {r.pinned[:12]} → {r.ref} "
                  f"(`{r.ref_commit[:12]}`): {head}", "",
                  f"{r.commits_walked} commits walked, {r.commits_checked} checked, "
                  f"{r.seconds:.2f} s" + (f"; {r.note}" if r.note else ""), "",
                  "| patch | at REF | " + " | ".join(c for c, _ in _COLUMNS) + " |",
                  "|---|---|" + "---|" * len(_COLUMNS)]
        for h in r.patches:
            cells = []
            for _, attr in _COLUMNS:
                pt: CommitPoint | None = getattr(h, attr)
                subject = pt.subject.replace("|", "\\|") if pt else ""
                cells.append(f"`{pt.commit[:12]}` {subject} ({pt.date[:10]}"
                             + (f"; {', '.join(pt.files)}" if pt.files else "") + ")"
                             if pt else "—")
            row = f"| `{h.name}` | {h.at_ref} | " + " | ".join(cells) + " |"
            lines.append(row.replace("\n", " "))
        lines.append("")
    return "\n".join(lines)
