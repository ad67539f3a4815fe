"""Carrying the series forward: ``patch check --bisect`` (where along upstream's history each
patch stops applying, or is taken upstream) and ``patch rebase`` (the patches carried onto a
newer upstream commit, written as a new series with a recipe overlay).

Both work in a blob-less history cache (:func:`gitsrc.fetch_history`); bisect never checks
anything out (index-only checks, :mod:`indexcheck`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.errors import InputError
from dsv4_offload.sources import git as gitsrc
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
    from dsv4_offload.sources.series import LoadedPatch
    from dsv4_offload.workspace.store import Workspace


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


def _patches_and_history(recipe: Recipe, series: Series, target: str, ref: str, log: Path,
                         mirrors: dict[str, list[str]] | None
                         ) -> tuple[list[LoadedPatch], gitsrc.HistoryFetch]:
    """The target's patches, fetched and verified, and REF's blob-less history."""
    entries = series.for_target(target)
    for name in dict.fromkeys(e.origin.source for e in entries if e.origin.source):
        assert name is not None
        gitsrc.fetch_commit(recipe.source(name), log=log, mirrors=mirrors)
    loaded = load_patches(entries, recipe, series, None)
    return loaded, gitsrc.fetch_history(recipe.source(target), ref, log=log, mirrors=mirrors)


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
    last_clean: CommitPoint | None = None  # the last commit of the walk where it is clean
    first_offset: CommitPoint | None = None
    first_fuzz: CommitPoint | None = None
    first_fails: CommitPoint | None = None
    first_upstream: CommitPoint | None = None  # (each first_*: the first commit of the walk)
    transitions: list[CommitPoint] = field(default_factory=list)  # every change of state


@dataclass
class BisectReport:
    target: str
    pinned: str
    ref: str
    ref_commit: str
    commits_walked: int
    commits_checked: int  # the others changed no file of the target's patches: same result
    seconds: float  # all of it
    fetch_seconds: float  # of which fetching the history and the patch origins
    patches: list[PatchHistory]
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(p.at_ref == CLEAN for p in self.patches)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}


@dataclass
class Walk:
    """The pinned commit, then REF's first-parent commits not reachable from it, oldest
    first, with what each changed since the one before it in the walk."""

    commits: list[str]
    changed: dict[str, set[str]]
    subjects: dict[str, tuple[str, str]]  # commit: (subject, committer date)


def first_parent_walk(repo: Path, pinned: str, ref_commit: str) -> Walk:
    """One `git log` for the whole walk; file lists from trees alone (no renames, no blobs)."""
    out = gitsrc.git_text(repo, "log", "--first-parent", "--diff-merges=first-parent",
                          "--no-renames", "--name-only", "--reverse",
                          "--format=%x00%H%x00%P%x00%cI%x00%s", ref_commit, f"^{pinned}")
    commits = [pinned]
    changed: dict[str, set[str]] = {pinned: set()}
    subjects: dict[str, tuple[str, str]] = {}
    fields = out.split("\0")
    # records: "", H, P, date, "subject\n\nfile\nfile\n", H, ...
    for i in range(1, len(fields) - 3, 4):
        commit, parents, date = fields[i].strip(), fields[i + 1].split(), fields[i + 2]
        subject, _, files = fields[i + 3].partition("\n")
        prev = commits[-1]
        commits.append(commit)
        subjects[commit] = (subject, date)
        if parents and parents[0] == prev:
            changed[commit] = {f for f in files.splitlines() if f}
        else:  # the pinned commit is not this one's first parent: compare the two trees
            changed[commit] = _changed(repo, prev, commit)
    return Walk(commits, changed, subjects)


def _changed(repo: Path, old: str, new: str) -> set[str]:
    out = gitsrc.git_text(repo, "diff-tree", "-r", "--name-only", "--no-renames", old, new)
    return set(out.splitlines())


def _point(repo: Path, walk: Walk, commit: str, status: str, detail: str,
           paths: set[str]) -> CommitPoint:
    if commit not in walk.subjects:  # the pinned commit
        subject, _, date = gitsrc.git_text(repo, "show", "-s", "--format=%s%x00%cI",
                                           commit).partition("\0")
        walk.subjects[commit] = (subject, date)
    subject, date = walk.subjects[commit]
    return CommitPoint(commit, status, subject, date, sorted(walk.changed[commit] & paths),
                       detail)


def bisect_target(recipe: Recipe, series: Series, target: str, ref: str, log: Path, *,
                  mirrors: dict[str, list[str]] | None = None) -> BisectReport:
    """Each patch of ``target`` along the first-parent history from the pinned commit to REF.

    Every commit of the walk is decided, none guessed: the states are not monotone (a patch
    can fail, then apply again after a revert), so there is no binary search. A commit that
    changes none of the files the target's patches touch keeps the previous commit's result;
    the others get the whole stack checked in a temporary index (milliseconds each).
    """
    from dsv4_offload.sources.indexcheck import IndexTree, check_and_carry, touched_paths

    _check_target(series, target, "--bisect")
    start = time.monotonic()
    source = recipe.source(target)
    loaded, hist = _patches_and_history(recipe, series, target, ref, log, mirrors)
    fetched = time.monotonic() - start
    repo = hist.repo
    if hist.commit != source.pinned and gitsrc.git_ok(repo, "merge-base", "--is-ancestor",
                                                      hist.commit, source.pinned):
        raise InputError(f"--bisect {target}={ref}: {hist.commit[:12]} is an ancestor of the "
                         f"pinned commit {source.pinned[:12]}; the walk goes forward, give a "
                         "later REF")
    walk = first_parent_walk(repo, source.pinned, hist.commit)
    commits = walk.commits
    states: list[list[tuple[str, str]]] = []  # per commit: (status, detail) per patch
    checked = 0
    with tempfile.TemporaryDirectory(prefix="dsv4-bisect-") as tmp:
        files = [p.write_to(Path(tmp)) for p in loaded]
        paths = [set(touched_paths(repo, f, p.entry.strip, log))
                 for p, f in zip(loaded, files, strict=True)]
        union = set().union(*paths)
        tree: IndexTree | None = None
        for i, commit in enumerate(commits):
            if i and not (walk.changed[commit] & union):
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
        for i, commit in enumerate(commits):
            status, detail = states[i][k]
            if status != prev:
                point = _point(repo, walk, commit, status, detail, paths[k])
                h.transitions.append(point)
                slot = {OFFSET: "first_offset", FUZZ: "first_fuzz", FAILS: "first_fails",
                        UPSTREAM: "first_upstream"}.get(status)
                if slot and getattr(h, slot) is None:
                    setattr(h, slot, point)
            prev = status
        clean = [i for i, row in enumerate(states) if row[k][0] == CLEAN]
        if clean:  # the last clean commit of the walk, wherever the states went before it
            h.last_clean = _point(repo, walk, commits[clean[-1]], CLEAN, "", paths[k])
        histories.append(h)
    return BisectReport(target, source.pinned, ref, hist.commit, len(commits), checked,
                        round(time.monotonic() - start, 3), round(fetched, 3), histories,
                        hist.note)


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
            since = h.transitions[-1]  # the commit that brought the state it has at REF
            msg = f"{h.at_ref} at {r.ref}, since {since.commit[:12]} {since.subject}"
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
                  f"{r.seconds:.2f} s ({r.fetch_seconds:.2f} s fetching)"
                  + (f"; {r.note}" if r.note else ""), "",
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


# --- rebase --------------------------------------------------------------------------------

REBASE_BRANCH_PREFIX = "dsv4-rebase/"
DONE, DROPPED, PENDING, CONFLICT = "done", "dropped", "pending", "conflict"


@dataclass
class Pick:
    name: str
    commit: str  # the patch's commit on the pinned commit
    state: str = PENDING  # pending | conflict | done | dropped
    new_commit: str = ""
    base: str = ""  # HEAD before its cherry-pick: a run killed mid-pick restarts from here
    files: list[str] = field(default_factory=list)  # conflicted, then resolved by hand
    note: str = ""


@dataclass
class RebaseState:
    """Persisted in the workspace between `patch rebase` and `--continue`/`--abort`."""

    target: str
    ref: str
    ref_commit: str
    pinned: str
    series: str
    history: str  # the history cache repository
    worktree: str
    branch: str
    out: str  # the directory written at the end
    picks: list[Pick]

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RebaseState:
        return cls(**{**doc, "picks": [Pick(**p) for p in doc["picks"]]})


@dataclass
class RebaseOutcome:
    status: str  # stopped | done | aborted
    state: RebaseState
    conflicts: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    series_file: str = ""
    recipe_file: str = ""
    message: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "target": self.state.target, "ref": self.state.ref,
                "ref_commit": self.state.ref_commit, "pinned": self.state.pinned,
                "worktree": self.state.worktree, "branch": self.state.branch,
                "out": self.state.out, "patches": [asdict(p) for p in self.state.picks],
                "conflicts": self.conflicts, "written": self.written,
                "series_file": self.series_file, "recipe_file": self.recipe_file,
                "message": self.message}


def _state_file(ws: Workspace) -> Path:
    return ws.rebase_dir / "state.json"


def read_rebase_state(ws: Workspace) -> RebaseState | None:
    from dsv4_offload.workspace.store import read_json

    doc = read_json(_state_file(ws), None)
    if doc is None:
        return None
    try:
        return RebaseState.from_dict(doc)
    except (TypeError, KeyError) as exc:
        raise InputError(f"{_state_file(ws)}: not a rebase state ({exc}); run `dsv4-offload "
                         "patch rebase --abort`") from None


def _save(ws: Workspace, state: RebaseState) -> None:
    from dsv4_offload.workspace.store import atomic_write_json

    atomic_write_json(_state_file(ws), asdict(state))


def _slug(ref: str, commit: str) -> str:
    return commit[:12] if ref == commit else gitsrc._ref_slug(ref)


def _ref_label(state: RebaseState) -> str:
    """'v0.7.0 (e80614fc2d2c)', or the short SHA alone when REF was a SHA."""
    short = state.ref_commit[:12]
    return short if state.ref == state.ref_commit else f"{state.ref} ({short})"


def _committer_env(repo: Path, date_of: str) -> dict[str, str]:
    # only the committer: a cherry-pick keeps each patch's author (a mail's author included)
    from dsv4_offload.sources.series import COMMITTER

    date = gitsrc.git_text(repo, "show", "-s", "--format=%cI", date_of)
    return gitsrc.git_env({"GIT_COMMITTER_NAME": COMMITTER[0],
                           "GIT_COMMITTER_EMAIL": COMMITTER[1], "GIT_COMMITTER_DATE": date})


def rebase_start(recipe: Recipe, series: Series, ws: Workspace, target: str, ref: str,
                 log: Path, *, out: Path | None = None,
                 mirrors: dict[str, list[str]] | None = None) -> RebaseOutcome:
    """The target's patches as commits on the pinned commit, then cherry-picked one by one
    onto REF in a work branch; stops at the first conflict."""
    from dsv4_offload.core.runner import CommandFailed
    from dsv4_offload.sources.indexcheck import touched_paths
    from dsv4_offload.sources.series import NO_HOOKS, _git, apply_one, commit_env

    _check_target(series, target, "patch rebase")
    if read_rebase_state(ws) is not None:
        raise InputError(f"a rebase is under way in {ws.rebase_dir}; finish it with `patch "
                         "rebase --continue` or drop it with `patch rebase --abort`")
    source = recipe.source(target)
    loaded, hist = _patches_and_history(recipe, series, target, ref, log, mirrors)
    slug = _slug(ref, hist.commit)
    out_dir = (out or ws.rebased_dir).absolute() / f"{series.name}@{slug}"
    if out_dir.exists():
        raise InputError(f"{out_dir} exists; move it away or give another --out DIR")
    worktree = ws.rebase_dir / target
    branch = f"{REBASE_BRANCH_PREFIX}{target}-{slug}"
    repo = hist.repo
    if worktree.exists():  # a start killed before it saved its state: ours, left over
        _remove_worktree(repo, worktree, None, log)
    _git(repo, ["worktree", "prune"], log, check=False)
    worktree.parent.mkdir(parents=True, exist_ok=True)
    _git(repo, ["worktree", "add", "-q", "--no-checkout", "--detach", str(worktree),
                source.pinned], log)
    state = RebaseState(target, ref, hist.commit, source.pinned, series.name, str(repo),
                        str(worktree), branch, str(out_dir), [])
    try:
        env = commit_env(worktree, source.pinned)
        with tempfile.TemporaryDirectory(prefix="dsv4-rebase-") as tmp:
            files = [p.write_to(Path(tmp)) for p in loaded]
            # a sparse work tree of the touched files only: the history stays blob-less
            paths = dict.fromkeys(path for p, f in zip(loaded, files, strict=True)
                                  for path in touched_paths(repo, f, p.entry.strip, log))
            _git(worktree, ["sparse-checkout", "set", "--no-cone",
                            *(sparse_pattern(x) for x in paths)], log)
            _git(worktree, ["read-tree", "-mu", "HEAD"], log)
            for patch in loaded:
                try:
                    apply_one(worktree, patch, patch.write_to(Path(tmp)), log, env)
                except CommandFailed as exc:
                    raise InputError(f"patch '{patch.entry.name}' does not apply to its pinned "
                                     f"commit {source.pinned[:12]}; run `patch check` first "
                                     f"(see the log: {log})") from exc
                state.picks.append(Pick(patch.entry.name, gitsrc.git_text(
                    worktree, "rev-parse", "HEAD")))
        _git(worktree, [*NO_HOOKS, "checkout", "-q", "-B", branch, hist.commit], log)
    except BaseException:
        _remove_worktree(repo, worktree, branch, log)
        raise
    _save(ws, state)
    return _pick_rest(recipe, series, ws, state, log)


def sparse_pattern(path: str) -> str:
    """A sparse-checkout (gitignore syntax) pattern matching exactly this one path."""
    escaped = "".join("\\" + ch if ch in "\\*?[" else ch for ch in path)
    return "/" + escaped


def _remove_worktree(repo: Path, worktree: Path, branch: str | None, log: Path) -> None:
    from dsv4_offload.sources.series import _git

    _git(repo, ["worktree", "remove", "--force", "--force", str(worktree)], log, check=False)
    shutil.rmtree(worktree, ignore_errors=True)  # what `worktree remove` left (not a worktree)
    _git(repo, ["worktree", "prune"], log, check=False)
    if branch:
        _git(repo, ["branch", "-D", branch], log, check=False)


def _unmerged(worktree: Path) -> list[str]:
    return gitsrc.git_text(worktree, "diff", "--name-only", "--diff-filter=U").splitlines()


def _is_empty(worktree: Path, rev: str = "HEAD") -> bool:
    return not gitsrc.git_text(worktree, "diff", "--name-only", f"{rev}~1", rev).strip()


def _pick_rest(recipe: Recipe, series: Series, ws: Workspace, state: RebaseState,
               log: Path) -> RebaseOutcome:
    from dsv4_offload.sources.series import NO_HOOKS, _git

    worktree = Path(state.worktree)
    env = _committer_env(worktree, state.ref_commit)
    for pick in state.picks:
        if pick.state != PENDING:
            continue
        if pick.base:  # killed during this pick last time: start it again from its base
            _git(worktree, ["reset", "-q", "--hard", pick.base], log)
        pick.base = gitsrc.git_text(worktree, "rev-parse", "HEAD")
        _save(ws, state)
        res = _git(worktree, [*NO_HOOKS, "cherry-pick", "--keep-redundant-commits",
                              pick.commit], log, env, check=False)
        if res.returncode != 0:
            conflicts = _unmerged(worktree)
            if not conflicts:
                raise InputError(f"cherry-pick of '{pick.name}' failed without a conflict; "
                                 f"see the log: {log}")
            pick.state, pick.files = CONFLICT, conflicts
            _save(ws, state)
            return RebaseOutcome("stopped", state, conflicts, message=(
                f"'{pick.name}' conflicts with {state.ref} in {', '.join(conflicts)}"))
        if _is_empty(worktree):
            _git(worktree, ["reset", "-q", "--hard", "HEAD~1"], log)
            pick.state, pick.note = DROPPED, f"already upstream at {state.ref}: dropped"
        else:
            pick.state, pick.note = DONE, "carried by a clean 3-way cherry-pick"
            pick.new_commit = gitsrc.git_text(worktree, "rev-parse", "HEAD")
        _save(ws, state)
    return _finish(recipe, series, ws, state, log)


def rebase_continue(recipe: Recipe, series: Series, ws: Workspace, log: Path) -> RebaseOutcome:
    """After the conflicted files are fixed and `git add`-ed: commit and carry on."""
    from dsv4_offload.sources.series import NO_HOOKS, _git

    state = read_rebase_state(ws)
    if state is None:
        raise InputError("no rebase is under way in this workspace; start one with "
                         "`patch rebase TARGET=REF`")
    if state.series != series.name:
        raise InputError(f"the rebase under way carries series '{state.series}', this recipe "
                         f"uses '{series.name}'; run with the recipe the rebase started with")
    worktree = Path(state.worktree)
    pick = next((p for p in state.picks if p.state == CONFLICT), None)
    if pick is not None:
        left = _unmerged(worktree)
        if left:
            raise InputError(f"still conflicted in {worktree}: {', '.join(left)}; fix them, "
                             f"`git -C {worktree} add` them, then `patch rebase --continue`")
        env = _committer_env(worktree, state.ref_commit)
        staged = gitsrc.git_text(worktree, "diff", "--cached", "--name-only", "HEAD").strip()
        head = gitsrc.git_text(worktree, "rev-parse", "HEAD")
        if head != pick.base:  # the user committed the resolution (`git cherry-pick --continue`)
            pick.state, pick.new_commit = DONE, head
            pick.note = f"conflict in {', '.join(pick.files)} resolved by hand"
        elif not staged:
            # the fix kept upstream's version: the patch has nothing left to carry
            _git(worktree, ["reset", "-q", "--hard", "HEAD"], log)
            pick.state = DROPPED
            pick.note = (f"conflict in {', '.join(pick.files)} resolved to {state.ref}'s "
                         "version: dropped")
        else:
            _git(worktree, [*NO_HOOKS, "commit", "-q", "--no-edit", "--no-verify"], log, env)
            pick.state, pick.new_commit = DONE, gitsrc.git_text(worktree, "rev-parse", "HEAD")
            pick.note = f"conflict in {', '.join(pick.files)} resolved by hand"
        _save(ws, state)
    return _pick_rest(recipe, series, ws, state, log)


def rebase_abort(ws: Workspace, log: Path) -> RebaseOutcome:
    """Drop the work branch and tree; the workspace's checkouts were never touched."""
    from dsv4_offload.sources.series import _git

    state = read_rebase_state(ws)
    if state is None:
        raise InputError("no rebase is under way in this workspace")
    worktree = Path(state.worktree)
    if worktree.exists():
        _git(worktree, ["cherry-pick", "--abort"], log, check=False)
    _remove_worktree(Path(state.history), worktree, state.branch, log)
    _state_file(ws).unlink()
    return RebaseOutcome("aborted", state, message="rebase dropped; nothing else was changed")


def _finish(recipe: Recipe, series: Series, ws: Workspace, state: RebaseState,
            log: Path) -> RebaseOutcome:
    """The carried patches, their series and a recipe overlay, written all at once."""
    import os

    import yaml

    from dsv4_offload.sources.series import _sha256, regenerate

    worktree = Path(state.worktree)
    out_dir = Path(state.out)
    if out_dir.exists():
        raise InputError(f"{out_dir} exists; move it away and run `patch rebase --continue`")
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    kept = [e for e in series.patches if e.target != state.target] + [
        p for p in state.picks if p.state == DONE]
    if not kept:  # a series needs a patch: say so rather than write one that cannot load
        raise InputError(f"every patch of series '{series.name}' is already upstream at "
                         f"{_ref_label(state)}: nothing to carry; pin that commit in the "
                         "recipe without these patches, then `patch rebase --abort`")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    picks = {p.name: p for p in state.picks}
    new_series_name = f"{state.series}-{_slug(state.ref, state.ref_commit)}"
    series_file = f"{new_series_name}.yaml"
    old_dir = series.file
    written: list[str] = []
    body: list[str] = []
    try:
        for entry in series.patches:
            doc = entry.model_dump(mode="json", by_alias=True, exclude_none=True)
            doc["origin"] = {k: v for k, v in doc["origin"].items() if v is not None}
            note = ""
            pick = picks.get(entry.name) if entry.target == state.target else None
            if pick is not None:
                if pick.state == DROPPED:
                    body.append(f"  # {entry.name}: {pick.note}\n")
                    continue
                data = regenerate(worktree, pick.new_commit, entry)
                (partial / f"{entry.name}.patch").write_bytes(data)
                written.append(f"{entry.name}.patch")
                old = _sha256(_old_bytes(entry, recipe, series))
                doc.update(origin={"file": f"{entry.name}.patch"}, sha256=_sha256(data),
                           strip=1 if entry.strip == 1 else 0)
                note = (f"{pick.note}; carried from {state.pinned[:12]} to "
                        f"{_ref_label(state)}; "
                        + ("patch text unchanged" if old == doc["sha256"] else
                           f"was sha256 {old[:12]}…"))
            elif entry.origin.file is not None and old_dir is not None:
                # our own file for another target: copied, the new series dir is self-contained
                shutil.copyfile(old_dir.parent / entry.origin.file,
                                partial / Path(entry.origin.file).name)
                doc["origin"] = {"file": Path(entry.origin.file).name}
                written.append(Path(entry.origin.file).name)
            text = yaml.safe_dump([doc], sort_keys=False, allow_unicode=True, width=1000)
            if note:
                body.append(f"  # {entry.name}: {note}\n")
            body.append("".join(f"  {line}\n" for line in text.splitlines()))
        header = (f"# {series.name} with the {state.target} patches carried onto "
                  f"{_ref_label(state)} by `dsv4-offload patch rebase`, from "
                  f"{state.pinned[:12]}.\n# Review the patches, then commit this directory.\n")
        doc_head = {"schema": 1, "name": new_series_name,
                    "description": (f"{series.description or series.name} — {state.target} "
                                    f"carried onto {_ref_label(state)}")}
        (partial / series_file).write_text(
            header + yaml.safe_dump(doc_head, sort_keys=False, allow_unicode=True, width=1000)
            + "patches:\n" + "".join(body), encoding="utf-8")
        recipe_file = partial / "recipe.yaml"
        recipe_file.write_text(_overlay(recipe, recipe.file, out_dir, state,
                                        series_file), encoding="utf-8")
        os.replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _remove_worktree(Path(state.history), worktree, None, log)  # the branch stays for review
    _state_file(ws).unlink()
    return RebaseOutcome("done", state, written=written,
                         series_file=str(out_dir / series_file),
                         recipe_file=str(out_dir / "recipe.yaml"),
                         message=f"wrote {out_dir}; branch {state.branch} in {state.history}")


def _old_bytes(entry: Any, recipe: Recipe, series: Series) -> bytes:
    from dsv4_offload.sources.series import load_patch

    return load_patch(entry, recipe, series, None).data


def _overlay(recipe: Recipe, path: Path | None, out_dir: Path, state: RebaseState,
             series_file: str) -> str:
    """A recipe that extends the original and pins the target at REF, with the new series."""
    import os

    import yaml

    from dsv4_offload.recipe import BUNDLED_RECIPES

    if path is None:
        raise InputError("the recipe has no file to extend; load it from a file")
    if path.resolve().parent == BUNDLED_RECIPES.resolve():
        extends = path.stem
    else:
        extends = os.path.relpath(path.resolve(), out_dir.resolve())
    source: dict[str, Any] = {"name": state.target, "commit": state.ref_commit}
    if state.ref != state.ref_commit:
        source["ref"] = state.ref
    doc = {"schema": 1, "extends": extends,
           "name": f"{recipe.name}-{_slug(state.ref, state.ref_commit)}",
           "series": series_file, "sources": [source]}
    return (f"# {recipe.name} with {state.target} at {_ref_label(state)} and the carried series; "
            "written by `dsv4-offload patch rebase`.\n"
            + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=1000))
