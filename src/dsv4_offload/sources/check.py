"""The CI check of a series: each patch tried against its target's commit in a temporary
index (``indexcheck``), reported as JUnit XML and a markdown table."""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.errors import InputError
from dsv4_offload.sources import git as gitsrc
from dsv4_offload.sources.indexcheck import IndexTree, check_and_carry
from dsv4_offload.sources.series import (
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

@dataclass
class CheckRow:
    name: str
    target: str
    base: str
    status: str
    detail: str = ""
    hunks: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class CheckReport:
    rows: list[CheckRow]
    bases: dict[str, str]

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.status == CLEAN for r in self.rows)

    def counts(self) -> dict[str, int]:
        return dict(Counter(r.status for r in self.rows))

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "counts": self.counts(), "bases": self.bases,
                "patches": [asdict(r) for r in self.rows]}


def check_series(recipe: Recipe, series: Series, log: Path, *,
                 mirrors: dict[str, list[str]] | None = None,
                 revs: dict[str, str] | None = None,
                 only: Sequence[str] | None = None) -> CheckReport:
    """Try the series against each target's commit in a temporary index of the cache (no
    checkout, only the touched files' blobs read); never touches a workspace."""
    revs = dict(revs or {})
    targets = series_targets(series, only)
    for t in revs:
        if t not in series_targets(series):
            raise InputError(f"--rev {t}=...: not a target of series '{series.name}'")
    entries = [p for p in series.patches if p.target in targets]
    origins = dict.fromkeys(e.origin.source for e in entries if e.origin.source)
    for name in origins:
        assert name is not None
        gitsrc.fetch_commit(recipe.source(name), log=log, mirrors=mirrors)
    loaded = load_patches(entries, recipe, series, None)
    rows: list[CheckRow] = []
    bases: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="dsv4-check-") as tmp:
        for target in targets:
            source = recipe.source(target)
            if target in revs:
                base = gitsrc.resolve_remote_ref(source, revs[target], log=log, mirrors=mirrors)
            else:
                base = gitsrc.fetch_commit(source, log=log, mirrors=mirrors).commit
            bases[target] = base
            tree = IndexTree(gitsrc.cache_repo_path(target), base, Path(tmp) / target, log)
            for patch in (p for p in loaded if p.entry.target == target):
                c, seconds = check_and_carry(tree, patch.entry, patch.write_to(Path(tmp)))
                rows.append(CheckRow(patch.entry.name, target, base, c.status, c.detail,
                                     c.hunks, seconds))
    return CheckReport(rows, bases)


def junit_xml(report: CheckReport) -> bytes:
    """One testcase per patch; anything but clean is a failure (the CI exit code agrees)."""
    import xml.etree.ElementTree as ET

    counts = report.counts()
    failures = sum(n for s, n in counts.items() if s != CLEAN)
    suite = ET.Element("testsuite", name="dsv4-offload patch check", tests=str(len(report.rows)),
                       failures=str(failures), errors="0",
                       time=f"{sum(r.seconds for r in report.rows):.3f}")
    for r in report.rows:
        case = ET.SubElement(suite, "testcase", classname=f"patch.{r.target}", name=r.name,
                             time=f"{r.seconds:.3f}")
        if r.status != CLEAN:
            fail = ET.SubElement(case, "failure", type=r.status,
                                 message=f"{r.status}: {r.detail}"[:500])
            fail.text = "\n".join([f"base {r.base}", r.detail, *r.hunks])
    suites = ET.Element("testsuites")
    suites.append(suite)
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True) + b"\n"


_MARK = {CLEAN: "✅ clean", OFFSET: "⚠️ offset", FUZZ: "⚠️ fuzz", FAILS: "❌ fails",
         UPSTREAM: "ℹ️ already upstream"}


def markdown_summary(report: CheckReport) -> str:
    """A table for a CI step summary."""
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items())
    head = "passed" if report.ok else "FAILED"
    lines = [f"## Patch series check: {head}", "", f"{len(report.rows)} patches: {counts}", "",
             "| patch | target | base | result | detail |", "|---|---|---|---|---|"]
    for r in report.rows:
        detail = (r.detail or "").replace("|", "\\|")
        lines.append(f"| `{r.name}` | {r.target} | `{r.base[:12]}` | "
                     f"{_MARK.get(r.status, r.status)} | {detail} |")
    return "\n".join(lines) + "\n"


