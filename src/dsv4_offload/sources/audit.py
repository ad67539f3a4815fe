"""patch audit: can the patched trees print every log text the tool waits for or fears?

1. The texts: each build step's ``expect_markers`` / ``forbid_markers``, the acceptance
   ``log_markers_required`` / ``log_markers_forbidden`` and the supervisor's fatal patterns.
2. The tree each belongs to: a build step's ``log_sources`` (default: the source holding
   its workdir and the sources nested in it; ``[]``: the command itself, e.g. pip, prints
   them, so they stay unchecked); acceptance and serve texts: every source but
   the delivery, plus the delivery's own scripts (the directory of its series patches,
   without the ``*.patch`` files).
3. What is searched: a marker is a regular expression; its literal runs (text between
   metacharacters and group boundaries, escapes resolved) of 4 or more characters. Write
   the parts the printing code fills in at run time (a format field) as a group:
   ``-- Forward (CPUINFER_ARM_SVE) -> -D(LLAMA_ARM_SVE)=(OFF)`` matches the same lines
   and tells the audit which pieces the code holds verbatim.
   Top-level alternatives are searched one by one; optional and repeated parts are not.
   A run may lack a leading ``-- `` in the source (CMake's ``message(STATUS)`` adds it).
4. Verdicts: ``found`` (one file of the tree holds every run), ``missing`` (no file
   does; an error for a required marker, a warning for a forbidden or fatal one),
   ``unchecked`` (not found and part of the tree is absent: never a pass), ``no-literal``.
5. One ``git grep -F -I`` per source over its tracked files (documentation excluded; ``-i``
   only for the patterns compiled with ``re.IGNORECASE``).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from dsv4_offload.core.runner import capture
from dsv4_offload.recipe import BuildStep, Recipe, Series
from dsv4_offload.workspace.store import Workspace

CMAKE_STATUS = "-- "  # CMake's message(STATUS ...) prefix: printed, not in the source
MIN_RUN = 4  # shorter literal runs ('-- ', 'ON', '=') are everywhere: they prove nothing
DOC_EXCLUDES = (":(exclude)*.md", ":(exclude)*.rst")  # prose is not code that prints
FOUND, MISSING, UNCHECKED, NO_LITERAL = "found", "missing", "unchecked", "no-literal"
# kind -> is the text required (an unprintable one is an error) or feared (a warning)
KINDS = {"expect": True, "forbid": False, "required": True, "forbidden": False, "fatal": False}
_GIT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Scope:
    """Files of one source searched for a tree: optionally one directory, minus excludes."""

    source: str
    subdir: str = ""
    excludes: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.source}:{self.subdir}" if self.subdir else self.source


@dataclass
class MarkerAudit:
    """One marker (or one top-level alternative of it) and what the search found."""

    kind: str  # expect | forbid | required | forbidden | fatal
    owner: str  # where the marker is written
    marker: str
    variant: str  # the top-level alternative searched (the marker itself when none)
    runs: list[str]
    tree: list[str]  # scope labels
    verdict: str = UNCHECKED
    where: str = ""  # <source>/<path>:<line> of the first run, when found
    detail: str = ""

    @property
    def severity(self) -> str:
        if self.verdict == MISSING:
            return "error" if KINDS[self.kind] else "warning"
        if self.verdict in (UNCHECKED, NO_LITERAL):
            return "warning" if KINDS[self.kind] else "info"
        return "ok"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "owner": self.owner, "marker": self.marker,
                "variant": self.variant, "runs": self.runs, "tree": self.tree,
                "verdict": self.verdict, "severity": self.severity, "where": self.where,
                "detail": self.detail}


@dataclass
class AuditReport:
    """Every marker's verdict, the sources searched (or why not) and the time it took."""

    items: list[MarkerAudit]
    sources: dict[str, str]  # source -> its directory, or "absent: <why>"
    seconds: float = 0.0
    searches: int = 0

    def count(self, severity: str) -> int:
        return sum(1 for i in self.items if i.severity == severity)

    @property
    def ok(self) -> bool:
        return self.count("error") == 0

    @property
    def status(self) -> str:
        if not self.ok:
            return "failed"
        return "warn" if self.count("warning") else "ok"

    def summary(self) -> str:
        verdicts: dict[str, int] = {}
        for i in self.items:
            verdicts[i.verdict] = verdicts.get(i.verdict, 0) + 1
        parts = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items()))
        return (f"{len(self.items)} marker(s): {parts or 'none'}; {self.count('error')} "
                f"error(s), {self.count('warning')} warning(s); {self.seconds:.2f}s")

    def errors(self) -> list[MarkerAudit]:
        return [i for i in self.items if i.severity == "error"]

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary(), "seconds": round(self.seconds, 3),
                "searches": self.searches, "sources": self.sources,
                "markers": [i.as_dict() for i in self.items]}


# --- literal runs of a regular expression --------------------------------------------------


def _sre_parse(pattern: str, flags: int) -> Any:
    try:
        from re import _parser as parser  # type: ignore[attr-defined]  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as parser
    return parser.parse(pattern, flags)


def _constants() -> Any:
    try:
        from re import _constants as consts  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_constants as consts
    return consts


def variants(pattern: str, flags: int = 0) -> list[tuple[str, list[str]]]:
    """Each top-level alternative of ``pattern`` with its literal runs (all lengths)."""
    # split the text before parsing: the parser factors out a prefix the alternatives share
    # ('NPU out of memory|NPU out of HBM'), which would hide an alternative nothing prints
    c = _constants()
    return [(part, _runs(list(_sre_parse(part, flags)), c))
            for part in _split_top_level(pattern)]


def _split_top_level(pattern: str) -> list[str]:
    parts, depth, start, i, klass = [], 0, 0, 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if klass:
            klass = ch != "]"
        elif ch == "[":
            klass = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    parts.append(pattern[start:])
    return parts


def _runs(items: list[Any], c: Any) -> list[str]:
    runs: list[str] = []
    current: list[str] = []

    def flush() -> None:
        if current:
            runs.append("".join(current))
            current.clear()

    for op, av in items:
        if op is c.LITERAL:
            current.append(chr(av))
        elif op is c.SUBPATTERN:  # a group: a boundary (a filled-in part), its text counts
            flush()
            runs.extend(_runs(list(av[-1]), c))
        else:  # any class, repeat, anchor or nested alternation ends a run
            flush()
    flush()
    return runs


def searchable(runs: Sequence[str]) -> list[str]:
    return [r for r in runs if len(r) >= MIN_RUN]


def source_forms(run: str) -> list[str]:
    """How a run may stand in the source: as is, or without CMake's status prefix."""
    # message(STATUS "x") prints "-- x": the source holds the text after the prefix
    rest = run[len(CMAKE_STATUS):] if run.startswith(CMAKE_STATUS) else ""
    return [run, rest] if len(rest) >= MIN_RUN else [run]


# --- which tree a marker belongs to --------------------------------------------------------


def _source_of_path(recipe: Recipe, rel: str) -> str | None:
    """The source whose checkout holds workspace path ``rel`` (the deepest one)."""
    best: tuple[int, str] | None = None
    target = PurePosixPath(rel)
    for s in recipe.sources:
        base = PurePosixPath(s.path)
        if target == base or base in target.parents:
            depth = len(base.parts)
            if best is None or depth > best[0]:
                best = (depth, s.name)
    return best[1] if best else None


def _nested_in(recipe: Recipe, name: str) -> list[str]:
    base = PurePosixPath(recipe.source(name).path)
    return [s.name for s in recipe.sources
            if s.name != name and base in PurePosixPath(s.path).parents]


def build_step_tree(recipe: Recipe, step: BuildStep) -> list[Scope]:
    """``log_sources`` of the step, else the source holding its workdir plus those nested in it."""
    if step.log_sources is not None:
        names = list(step.log_sources)
    else:
        holder = _source_of_path(recipe, step.workdir) if step.workdir else None
        names = [holder, *_nested_in(recipe, holder)] if holder else []
    return [Scope(n, excludes=DOC_EXCLUDES) for n in names]


def delivery_scripts_dir(recipe: Recipe, series: Series) -> str:
    """The delivery directory that holds the series' patches (its scripts live there too)."""
    parents = {str(PurePosixPath(p.origin.path).parent) for p in series.patches
               if p.origin.source == recipe.delivery and p.origin.path}
    if not parents:
        return ""
    common = os.path.commonpath(sorted(parents))
    # main_repo/, sglang/, llama_cpp/ sit side by side under the integration dir: when the
    # series takes patches from one of them only, the scripts are still one level up
    return str(PurePosixPath(common).parent) if parents == {common} else common


def serve_tree(recipe: Recipe, series: Series) -> list[Scope]:
    """Every source but the delivery, plus the delivery's scripts (not its patch files)."""
    scopes = [Scope(s.name, excludes=DOC_EXCLUDES) for s in recipe.sources
              if s.name != recipe.delivery]
    scopes.append(Scope(recipe.delivery, delivery_scripts_dir(recipe, series),
                        (*DOC_EXCLUDES, ":(exclude)*.patch")))
    return scopes


def fatal_patterns() -> list[tuple[str, str, int]]:
    """(key, pattern, flags) of the supervisor's fatal lines."""
    from dsv4_offload.serving.supervisor import FATAL_PATTERNS

    return [(f.key, f.pattern.pattern, f.pattern.flags & re.IGNORECASE)
            for f in FATAL_PATTERNS]


@dataclass
class _Wanted:
    kind: str
    owner: str
    marker: str
    flags: int
    tree: list[Scope]
    near: str = ""  # "<source>/<dir>/": files there are named first (a step's own workdir)


def wanted_markers(recipe: Recipe, series: Series, *, steps: Sequence[str] | None = None,
                   build_only: bool = False) -> list[_Wanted]:
    """Every text the tool matches in upstream output, with the tree that must print it."""
    out: list[_Wanted] = []
    for step in recipe.build.steps:
        if steps is not None and step.name not in steps:
            continue
        tree = build_step_tree(recipe, step)
        near = _workdir_in_source(recipe, step.workdir) if step.workdir else ""
        out += [_Wanted("expect", f"build.steps[{step.name}].expect_markers", m, 0, tree, near)
                for m in step.expect_markers]
        out += [_Wanted("forbid", f"build.steps[{step.name}].forbid_markers", m, 0, tree, near)
                for m in step.forbid_markers]
    # a recipe that never serves (x86 rehearsal) expects no server log lines
    skipped = set(recipe.not_applicable)
    if build_only:
        return out
    tree = serve_tree(recipe, series)
    acc = recipe.acceptance
    if "accept" not in skipped:
        # a line only a patch of our own prints is searched only where the series applies it
        out += [_Wanted("required", "acceptance.log_markers_required", m.pattern, 0, tree)
                for m in acc.log_markers_required
                if m.when_patch is None or series.holds(m.when_patch)]
        out += [_Wanted("forbidden", "acceptance.log_markers_forbidden", m.pattern, 0,
                         tree)
                for m in acc.log_markers_forbidden
                if m.when_patch is None or series.holds(m.when_patch)]
    if "serve" not in skipped:
        out += [_Wanted("fatal", f"supervisor.FATAL_PATTERNS[{key}]", p, flags, tree)
                for key, p, flags in fatal_patterns()]
    return out


def _workdir_in_source(recipe: Recipe, workdir: str) -> str:
    holder = _source_of_path(recipe, workdir)
    if holder is None:
        return ""
    rel = PurePosixPath(workdir).relative_to(recipe.source(holder).path)
    return f"{holder}/{rel}/" if rel.parts else f"{holder}/"


# --- searching -----------------------------------------------------------------------------


def workspace_dirs(recipe: Recipe, workspace: Workspace) -> dict[str, Path]:
    return {s.name: workspace.source_dir(recipe, s.name) for s in recipe.sources}


def _is_checkout(path: Path) -> bool:
    if not path.is_dir():
        return False
    proc = capture(["git", "-C", str(path), "rev-parse", "--show-toplevel"],
                   timeout=_GIT_TIMEOUT_S)
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == path.resolve()


Key = tuple[str, bool]  # a needle and whether it is searched ignoring case


def grep_scope(root: Path, scope: Scope, needles: Sequence[str], *,
               ignore_case: bool = False) -> dict[str, dict[Key, int]]:
    """path -> {(needle, ignore_case): first line} for the needles each tracked file holds."""
    # -i costs ~5x on llama.cpp: only the fatal patterns compiled with re.I need it
    args = ["git", "-C", str(root), "grep", "-n", "-z", "-I", "-F", "--no-color"]
    if ignore_case:
        args.append("-i")
    for n in needles:
        args += ["-e", n]
    args += ["--", scope.subdir or ".", *scope.excludes]
    proc = capture(args, timeout=_GIT_TIMEOUT_S)
    if proc.returncode not in (0, 1):  # 1: nothing matched
        raise RuntimeError(proc.stderr.strip() or "git grep failed")
    wanted = [(n, n.casefold() if ignore_case else n) for n in needles]
    hits: dict[str, dict[Key, int]] = {}
    for record in proc.stdout.split("\n"):
        parts = record.split("\0", 2)
        if len(parts) != 3:
            continue
        path, line, text = parts[0], int(parts[1]), parts[2]
        if ignore_case:
            text = text.casefold()
        seen = hits.setdefault(path, {})
        for needle, form in wanted:
            if form in text:
                seen.setdefault((needle, ignore_case), line)
    return hits


def audit(recipe: Recipe, series: Series, dirs: Mapping[str, Path], *,
          steps: Sequence[str] | None = None, build_only: bool = False) -> AuditReport:
    """Search every wanted marker in the trees under ``dirs`` (source name -> checkout)."""
    t0 = time.monotonic()
    wanted = wanted_markers(recipe, series, steps=steps, build_only=build_only)
    sources: dict[str, str] = {}
    present: dict[str, Path] = {}
    for name in {sc.source for w in wanted for sc in w.tree}:
        path = dirs.get(name)
        if path is None:
            sources[name] = "absent: not laid out"
        elif not _is_checkout(path):
            sources[name] = f"absent: {path} is not a git checkout (run `dsv4-offload fetch`)"
        else:
            sources[name] = str(path)
            present[name] = path
    items: list[MarkerAudit] = []
    needles_by_scope: dict[tuple[Scope, bool], set[str]] = {}
    for w in wanted:
        for variant, runs in variants(w.marker, w.flags):
            item = MarkerAudit(w.kind, w.owner, w.marker, variant, searchable(runs),
                               [sc.label for sc in w.tree])
            items.append(item)
            for sc in w.tree:
                if sc.source in present:
                    key = (sc, bool(w.flags & re.IGNORECASE))
                    needles_by_scope.setdefault(key, set()).update(
                        form for r in item.runs for form in source_forms(r))
    hits: dict[Scope, dict[str, dict[Key, int]]] = {}
    searches = 0
    for (sc, icase), needles in needles_by_scope.items():
        if needles and sc.source in present:
            try:
                found = grep_scope(present[sc.source], sc, sorted(needles), ignore_case=icase)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                # e.g. git's "dubious ownership" in a container: unsearched is not passed
                sources[sc.source] = f"absent: git grep failed: {str(exc).splitlines()[0]}"
                del present[sc.source]
                continue
            merged = hits.setdefault(sc, {})
            for rel, keys in found.items():
                merged.setdefault(rel, {}).update(keys)
            searches += 1
    by_item = iter(items)
    for w in wanted:
        for _ in variants(w.marker, w.flags):
            _judge(next(by_item), w, present, hits)
    return AuditReport(items, dict(sorted(sources.items())), time.monotonic() - t0, searches)


def _judge(item: MarkerAudit, w: _Wanted, present: Mapping[str, Path],
           hits: Mapping[Scope, Mapping[str, Mapping[Key, int]]]) -> None:
    if not item.runs:
        item.verdict = NO_LITERAL
        item.detail = (f"no literal run of {MIN_RUN}+ characters to search: write the text "
                       "the code prints, with only the filled-in parts as groups")
        return
    icase = bool(w.flags & re.IGNORECASE)
    partial: dict[str, str] = {}
    for sc in w.tree:
        if sc.source not in present:
            continue
        # the step's own directory first: an archived copy elsewhere is a poorer citation
        files = sorted(hits.get(sc, {}).items(),
                       key=lambda kv: not f"{sc.source}/{kv[0]}".startswith(w.near or "\0"))
        for path, found in files:
            lines = {r: next((found[(f, icase)] for f in source_forms(r)
                              if (f, icase) in found), None) for r in item.runs}
            have = [r for r in item.runs if lines[r] is not None]
            for r in have:
                partial.setdefault(r, f"{sc.source}/{path}")
            if len(have) == len(item.runs):
                item.verdict = FOUND  # the line of the first run: the head of the message
                item.where = f"{sc.source}/{path}:{lines[item.runs[0]]}"
                return
    if not w.tree:
        item.verdict = UNCHECKED
        item.detail = ("no tree to search: the step's log_sources is [] (the command itself "
                       "prints it) or no source holds its workdir")
        return
    absent = [sc.label for sc in w.tree if sc.source not in present]
    searched = ", ".join(sc.label for sc in w.tree if sc.source in present) or "nothing"
    if absent:
        item.verdict = UNCHECKED
        item.detail = (f"not in {searched}; absent: {', '.join(absent)}, which may print "
                       "it (`dsv4-offload fetch`, `patch apply`)")
        return
    item.verdict = MISSING
    lacking = [r for r in item.runs if r not in partial]
    if lacking:
        item.detail = f"no file of {searched} contains {lacking[0]!r}"
    else:
        item.detail = ("its parts are in different files (" + ", ".join(
            f"{r!r} in {partial[r]}" for r in item.runs) + ") but no one file holds them all")


def refusal_fix(item: MarkerAudit) -> str:
    """What to do about a required marker that nothing prints."""
    return (f"the recipe's marker is wrong (copy the text the code prints, with its file "
            f"and line, into {item.owner}) or the tree is not patched "
            "(`dsv4-offload patch status`, then `dsv4-offload patch apply`)")
