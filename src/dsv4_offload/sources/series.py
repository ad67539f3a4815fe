"""The patch series against real trees: load and verify, classify, apply, status, reset
and refresh (the CI check is ``sources.check``).

"What is applied" is git history: each patch is one commit on top of the pinned commit,
with trailers naming the patch, its sha256 and where it came from. Commits carry a fixed
committer (and, for plain diffs, author) and the pinned commit's date, so the same series
on the same pinned commit gives the same commit ids on every machine.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.runner import CommandFailed, run_command
from dsv4_offload.sources import git as gitsrc
from dsv4_offload.workspace.store import atomic_write_bytes

if TYPE_CHECKING:
    from dsv4_offload.recipe import PatchEntry, Recipe, Series, Source
    from dsv4_offload.workspace.store import Workspace

TRAILER_NAME = gitsrc.PATCH_TRAILER
TRAILER_SHA = "Dsv4-Patch-Sha256"
TRAILER_SOURCE = "Dsv4-Patch-Source"
COMMITTER = ("dsv4-offload", "dsv4-offload@localhost")
PRE_SERIES_REF = "refs/dsv4/pre-series"  # set while an apply is under way: a crash marker
PATCHED_REF_PREFIX = "refs/dsv4/patched-"
DIRTY_REF_PREFIX = "refs/dsv4/dirty-"
CHECK_FUZZ = 2  # GNU patch's default: what "needs fuzz" means in a check
# kt-kernel's CMake installs commit hooks; a user's signing or whitespace settings must not
# change or break our commits
NO_HOOKS = ["-c", "core.hooksPath=/dev/null", "-c", "commit.gpgSign=false",
            "-c", "apply.whitespace=nowarn"]

# classification of one patch against a tree
CLEAN, OFFSET, FUZZ, FAILS, UPSTREAM = "clean", "offset", "fuzz", "fails", "already-upstream"
# status of one patch in a workspace
APPLIED, NOT_APPLIED, CHANGED, MISSING = "applied", "not-applied", "changed", "missing"


# --- methods -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """How a series ``method`` is applied, checked (index-only) and carried: the one place to
    add a method."""

    apply_args: tuple[str, ...] = ()  # extra `git apply` options (check and index apply)
    mail: bool = False  # a mail from `git format-patch`: `git am` semantics (the diff part)
    # a patch that applies forward anywhere (no context) is told applied only by its reverse
    reverse_first: bool = False
    fuzz: bool = True  # GNU patch's fuzz is a meaningful fallback (not without context)


# `git am` applies a mail's diff with `git apply`, so an index check of an mbox is the
# same `git apply --cached`; only committing it differs (`git am`: the mail's author and
# message)
METHODS: dict[str, Method] = {
    "plain": Method(),
    "mbox": Method(mail=True),
    # this project's own zero-context diffs of pure additions (`git apply --unidiff-zero`)
    "unidiff-zero": Method(apply_args=("--unidiff-zero",), reverse_first=True, fuzz=False),
}


def method_of(entry: PatchEntry) -> Method:
    method = METHODS.get(entry.method)
    if method is None:
        raise InputError(f"patch '{entry.name}': method '{entry.method}' is not known here; "
                         f"use one of {sorted(METHODS)}")
    return method


_HUNK_FAILED = re.compile(r"^error: patch failed: (.+):(\d+)$")
_GIT_APPLY_ERROR = re.compile(r"^error: (.+?): (does not exist in index|already exists in "
                              r"(?:index|working directory)|No such file or directory|"
                              r"does not match index|patch does not apply)$")
_OFFSET = re.compile(r"Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)")
_GNU_FUZZ = re.compile(r"Hunk #(\d+) succeeded at (\d+)(?: \(offset (-?\d+) lines?\))? with "
                       r"fuzz (\d+)")
_GNU_FAILED = re.compile(r"Hunk #(\d+) FAILED at (\d+)")
_GNU_FILE = re.compile(r"^(?:checking|patching) file '?(.+?)'?$")


# --- loading and digests -------------------------------------------------------------------


@dataclass
class LoadedPatch:
    entry: PatchEntry
    data: bytes
    source_label: str  # "<source>@<commit>:<path>" or "<series dir>/<file>"

    def write_to(self, directory: Path) -> Path:
        path = directory / f"{self.entry.name}.patch"
        path.write_bytes(self.data)
        return path


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def patch_places(recipe: Recipe, ws: Workspace | None, source: Source) -> list[Path]:
    places = [gitsrc.cache_repo_path(source.name)]
    if ws is not None:
        places.append(ws.source_dir(recipe, source.name))
    return places


def load_patch(entry: PatchEntry, recipe: Recipe, series: Series,
               ws: Workspace | None) -> LoadedPatch:
    """The patch's bytes from its origin, refused unless their sha256 is the series'."""
    origin = entry.origin
    if origin.file is not None:
        base = series.file
        path = (base.parent if base else Path.cwd()) / origin.file
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise InputError(f"{path}: patch '{entry.name}' cannot be read ({exc.strerror}); "
                             "restore the file or fix origin.file in the series") from None
        label, where = f"{base.parent.name if base else '.'}/{origin.file}", str(path)
    else:
        assert origin.source is not None and origin.path is not None  # the model ensures it
        source = recipe.source(origin.source)
        blob = gitsrc.read_blob(source, origin.path, patch_places(recipe, ws, source))
        label = f"{source.name}@{source.pinned}:{origin.path}"
        where = f"{source.name}@{source.pinned[:12]}:{origin.path}"
        if blob is None:
            raise InputError(f"patch '{entry.name}': {where} is not available; run "
                             "`dsv4-offload fetch` (or check origin.path in the series)")
        data = blob
    actual = _sha256(data)
    if actual != entry.sha256:
        raise InputError(f"patch '{entry.name}' ({where}): sha256 is {actual}, the series "
                         f"expects {entry.sha256}; nothing was changed. Restore the file, or if "
                         "the change is intended run `dsv4-offload patch refresh` / update "
                         "its sha256")
    if entry.method == "unidiff-zero":
        problem = zero_context_problem(data)
        if problem:
            raise InputError(f"patch '{entry.name}' ({where}): method unidiff-zero needs a diff "
                             f"of pure additions without context: {problem}; regenerate it "
                             "with `git diff -U0` of additions only")
    return LoadedPatch(entry, data, label)


def load_patches(entries: Sequence[PatchEntry], recipe: Recipe, series: Series,
                 ws: Workspace | None) -> list[LoadedPatch]:
    """Every patch loaded and verified before any repository is touched."""
    return [load_patch(e, recipe, series, ws) for e in entries]


def series_targets(series: Series, only: Sequence[str] | None = None) -> list[str]:
    targets = list(dict.fromkeys(p.target for p in series.patches))
    if only:
        unknown = [t for t in only if t not in targets]
        if unknown:
            raise InputError(f"--only {unknown[0]}: not a target of series '{series.name}'; "
                             f"use one of {targets}")
        targets = [t for t in targets if t in only]
    return targets


# --- zero-context patches (ours) -----------------------------------------------------------

_ZERO_HUNK = re.compile(r"^@@ -\d+,0 \+\d+(?:,(\d+))? @@(.*)$")


def zero_context_problem(data: bytes) -> str | None:
    """Why a patch is not a diff of pure additions without context (None when it is one)."""
    hunks = 0
    left = 0  # '+' lines still due in the current hunk
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if left:
            if not line.startswith("+"):
                kind = "a removal" if line.startswith("-") else "a context line"
                return f"line {number}: {kind} ('{line[:40]}'); only '+' lines are allowed"
            left -= 1
            continue
        if line.startswith("@@"):
            m = _ZERO_HUNK.match(line)
            if m is None:
                return (f"line {number}: hunk '{line[:40]}' has context or removes lines "
                        "(need '@@ -N,0 +M,K @@')")
            if m.group(2).strip():
                return f"line {number}: the hunk header carries upstream text after '@@'"
            left = int(m.group(1) or 1)
            hunks += 1
        elif line.startswith((" ", "-")) and not line.startswith("--- "):
            kind = "a removal" if line.startswith("-") else "a context line"
            return f"line {number}: {kind} outside a hunk ('{line[:40]}')"
    if left:
        return f"the last hunk ends {left} line(s) early"
    return None if hunks else "no hunks found"


# --- git operations on one tree ------------------------------------------------------------


def commit_env(repo_dir: Path, base: str) -> dict[str, str]:
    """Fixed identity and the base commit's date: reproducible commit ids."""
    date = gitsrc.git_text(repo_dir, "show", "-s", "--format=%cI", base)
    name, email = COMMITTER
    return gitsrc.git_env({
        "GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": email, "GIT_COMMITTER_DATE": date,
    })


def commit_message(patch: LoadedPatch) -> str:
    e = patch.entry
    return (f"{e.name}: {e.description}\n\nApplied by dsv4-offload (upstream status: "
            f"{e.upstream}).\n\n" + "\n".join(trailers(patch)) + "\n")


def trailers(patch: LoadedPatch) -> list[str]:
    return [f"{TRAILER_NAME}: {patch.entry.name}", f"{TRAILER_SHA}: {patch.entry.sha256}",
            f"{TRAILER_SOURCE}: {patch.source_label}"]


def _git(repo_dir: Path, args: list[str], log: Path, env: dict[str, str] | None = None,
         check: bool = True) -> Any:
    return run_command(["git", *args], log=log, cwd=repo_dir, env=env or gitsrc.git_env(),
                       check=check)


def apply_one(repo_dir: Path, patch: LoadedPatch, patch_file: Path, log: Path,
              env: dict[str, str]) -> None:
    """One patch as one commit: ``git am --3way`` for mail format, else ``git apply --index``."""
    strip = f"-p{patch.entry.strip}"
    method = method_of(patch.entry)
    if method.mail:
        _git(repo_dir, [*NO_HOOKS, "am", "-q", "--3way", strip, str(patch_file)], log, env)
        amend = ["commit", "-q", "--amend", "--no-edit", "--no-verify"]
        for t in trailers(patch):
            amend += ["--trailer", t]
        _git(repo_dir, [*NO_HOOKS, *amend], log, env)
    else:
        _git(repo_dir, [*NO_HOOKS, "apply", "--index", *method.apply_args, strip,
                        str(patch_file)], log, env)
        message = patch_file.with_suffix(".msg")  # beside the patch, in the caller's temp dir
        message.write_text(commit_message(patch), encoding="utf-8")
        _git(repo_dir, [*NO_HOOKS, "commit", "-q", "--no-verify", "-F", str(message)], log, env)


def am_in_progress(repo_dir: Path) -> bool:
    git_dir = Path(gitsrc.git_text(repo_dir, "rev-parse", "--absolute-git-dir"))
    return (git_dir / "rebase-apply").exists()


def rollback(repo_dir: Path, to: str, log: Path) -> None:
    """Back to ``to``: abort a half-done ``git am`` first (``reset --hard`` is not enough)."""
    git_dir = Path(gitsrc.git_text(repo_dir, "rev-parse", "--absolute-git-dir"))
    if (git_dir / "rebase-apply").exists():
        _git(repo_dir, ["am", "--abort"], log, check=False)
        if (git_dir / "rebase-apply").exists():  # --abort refuses some states; it is ours
            shutil.rmtree(git_dir / "rebase-apply")
    # a killed git leaves its lock behind; we hold the workspace lock, so nobody else is here
    with contextlib.suppress(FileNotFoundError):
        (git_dir / "index.lock").unlink()
    _git(repo_dir, ["reset", "-q", "--hard", to], log)


def rejected_hunks(repo_dir: Path, patch_file: Path, strip: int, log: Path,
                   zero_context: bool = False) -> list[str]:
    """``file:line`` of each hunk (or file) ``git apply`` rejects."""
    zero = ["--unidiff-zero"] if zero_context else []
    result = _git(repo_dir, ["apply", "--check", "-v", f"-p{strip}", *zero, str(patch_file)],
                  log, check=False)
    return parse_rejected(result.tail)


def parse_rejected(tail: list[str]) -> list[str]:
    """``file:line`` of each hunk (or file) in the output of ``git apply --check -v``."""
    out: list[str] = []
    for line in tail:
        m = _HUNK_FAILED.match(line.strip())
        if m:
            out.append(f"{m.group(1)}:{m.group(2)}")
            continue
        m = _GIT_APPLY_ERROR.match(line.strip())
        if m and m.group(2) != "patch does not apply":
            out.append(f"{m.group(1)} ({m.group(2)})")
    return list(dict.fromkeys(out))


@dataclass
class Classification:
    status: str
    detail: str = ""
    hunks: list[str] = field(default_factory=list)  # rejected (fails) or moved (offset/fuzz)


def applied_cleanly_or_moved(tail: list[str]) -> Classification:
    """clean, or offset with the moved hunks, from a successful ``git apply --check -v``."""
    moved = [f"hunk {m.group(1)} at {m.group(2)} ({int(m.group(3)):+d})"
             for m in map(_OFFSET.search, tail) if m]
    if moved:
        return Classification(OFFSET, f"applies with offset: {', '.join(moved)}", moved)
    return Classification(CLEAN)


def classify(repo_dir: Path, patch_file: Path, strip: int, log: Path,
             zero_context: bool = False) -> Classification:
    """clean / offset / fuzz / fails / already-upstream, without changing the tree."""
    zero = ["--unidiff-zero"] if zero_context else []
    if zero_context:
        # pure additions without context apply forward anywhere, even twice: only the
        # reverse (removing exactly those lines there) tells an applied patch
        rev = _git(repo_dir, ["apply", "--check", "--reverse", f"-p{strip}", *zero,
                              str(patch_file)], log, check=False)
        if rev.returncode == 0:
            return Classification(UPSTREAM, "already in the tree (applies in reverse)")
    fwd = _git(repo_dir, ["apply", "--check", "-v", f"-p{strip}", *zero, str(patch_file)], log,
               check=False)
    if fwd.returncode == 0:
        return applied_cleanly_or_moved(fwd.tail)
    rev = _git(repo_dir, ["apply", "--check", "--reverse", f"-p{strip}", *zero, str(patch_file)],
               log, check=False)
    if rev.returncode == 0:
        return Classification(UPSTREAM, "already in the tree (applies in reverse)")
    hunks = rejected_hunks(repo_dir, patch_file, strip, log, zero_context)
    # without context lines there is nothing to fuzz: GNU patch would only guess a place
    gnu = None if zero_context else _gnu_patch(repo_dir, patch_file, strip, log, dry_run=True)
    if gnu is not None and gnu.returncode == 0:
        fuzzed = [f"hunk {m.group(1)} at {m.group(2)} (fuzz {m.group(4)})"
                  for m in map(_GNU_FUZZ.search, gnu.tail) if m]
        return Classification(FUZZ, "needs fuzz: " + (", ".join(fuzzed) or "GNU patch only"),
                              fuzzed)
    return Classification(FAILS, "rejected: " + (", ".join(hunks) or "see the log"), hunks)


def _gnu_patch(repo_dir: Path, patch_file: Path, strip: int, log: Path,
               dry_run: bool) -> Any | None:
    """GNU patch with fuzz, to tell "needs fuzz" from "fails"; None when not installed."""
    exe = shutil.which("patch")
    if exe is None:
        return None
    args = [exe, "--batch", "--force", f"-p{strip}", f"-F{CHECK_FUZZ}", "--no-backup-if-mismatch",
            "-r", "-", "-i", str(patch_file)]
    if dry_run:
        args.insert(1, "--dry-run")
    return run_command(args, log=log, cwd=repo_dir, env=gitsrc.git_env(), check=False)


@dataclass
class AppliedRecord:
    commit: str
    name: str
    sha256: str
    source: str


def applied_records(repo_dir: Path, base: str) -> list[AppliedRecord]:
    """Commits in ``base..HEAD``, oldest first, with their series trailers ('' if none)."""
    keys = (TRAILER_NAME, TRAILER_SHA, TRAILER_SOURCE)
    return [AppliedRecord(*row) for row in gitsrc.patch_commits(repo_dir, base, keys)]


# --- apply ---------------------------------------------------------------------------------


@dataclass
class TargetOutcome:
    target: str
    path: str
    status: str  # applied | unchanged | failed | blocked
    applied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed_patch: str | None = None
    rejected: list[str] = field(default_factory=list)
    message: str = ""
    recovered: bool = False
    head: str | None = None


def recover_interrupted(repo_dir: Path, log: Path) -> bool:
    """An apply killed half-way left ``refs/dsv4/pre-series``: return to it."""
    if not gitsrc.git_ok(repo_dir, "rev-parse", "--verify", "-q", PRE_SERIES_REF):
        return False
    pre = gitsrc.git_text(repo_dir, "rev-parse", PRE_SERIES_REF)
    rollback(repo_dir, pre, log)
    gitsrc.git_text(repo_dir, "update-ref", "-d", PRE_SERIES_REF)
    return True


def keep_and_reset(repo_dir: Path, pinned: str, log: Path, keep_dirty: bool) -> list[str]:
    """Back to the pinned commit; the patched state (and local edits) stay under refs."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = []
    if keep_dirty and gitsrc.dirty_files(repo_dir):
        stash = gitsrc.git_text(repo_dir, "stash", "create", "dsv4-offload: local changes")
        if stash:
            gitsrc.git_text(repo_dir, "update-ref", DIRTY_REF_PREFIX + stamp, stash)
            kept.append(DIRTY_REF_PREFIX + stamp)
    head = gitsrc.head_commit(repo_dir)
    if head and head != pinned:
        gitsrc.git_text(repo_dir, "update-ref", PATCHED_REF_PREFIX + stamp, head)
        kept.append(PATCHED_REF_PREFIX + stamp)
    _git(repo_dir, ["reset", "-q", "--hard", pinned], log)
    return kept


def apply_target(repo_dir: Path, source: Source, patches: list[LoadedPatch], log: Path,
                 force: bool = False) -> TargetOutcome:
    """The target's patches as commits on its pinned commit; all or nothing."""
    outcome = TargetOutcome(source.name, str(repo_dir), "unchanged")
    if not (repo_dir / ".git").exists():
        outcome.status, outcome.message = "blocked", f"{repo_dir} is not a checkout; run fetch"
        return outcome
    outcome.recovered = recover_interrupted(repo_dir, log)
    pinned = source.pinned
    dirty = gitsrc.dirty_files(repo_dir)
    if dirty:
        outcome.status = "blocked"
        outcome.message = (f"{repo_dir} has local changes ({dirty[0]}); commit or move them, "
                           "or `dsv4-offload patch reset --force` (keeps them under a ref)")
        return outcome
    if not gitsrc.has_commit(repo_dir, pinned) or not gitsrc.git_ok(
            repo_dir, "merge-base", "--is-ancestor", pinned, "HEAD"):
        outcome.status = "blocked"
        outcome.message = f"{repo_dir} is not on the pinned commit {pinned[:12]}; run fetch"
        return outcome
    records = applied_records(repo_dir, pinned)
    mismatch = _first_mismatch(records, patches)
    if mismatch:
        if not force:
            outcome.status = "blocked"
            outcome.message = (f"{mismatch}; run `dsv4-offload patch reset --only "
                               f"{source.name}` then apply (or apply --force, which keeps "
                               "the old state under a ref)")
            return outcome
        keep_and_reset(repo_dir, pinned, log, keep_dirty=False)
        records = []
    outcome.skipped = [r.name for r in records]
    todo = patches[len(records):]
    if not todo:
        outcome.head = gitsrc.head_commit(repo_dir)
        return outcome
    env = commit_env(repo_dir, pinned)
    before = gitsrc.head_commit(repo_dir)
    assert before is not None
    gitsrc.git_text(repo_dir, "update-ref", PRE_SERIES_REF, before)
    with tempfile.TemporaryDirectory(prefix="dsv4-series-") as tmp:
        current: LoadedPatch | None = None
        try:
            for current in todo:
                patch_file = current.write_to(Path(tmp))
                try:
                    apply_one(repo_dir, current, patch_file, log, env)
                except CommandFailed:
                    # name the rejected hunks against the tree this patch met (after the
                    # earlier ones), then roll back
                    if am_in_progress(repo_dir):
                        _git(repo_dir, ["am", "--abort"], log, check=False)
                    outcome.rejected = rejected_hunks(
                        repo_dir, patch_file, current.entry.strip, log,
                        current.entry.method == "unidiff-zero")
                    rollback(repo_dir, before, log)
                    outcome.status, outcome.failed_patch = "failed", current.entry.name
                    outcome.message = (f"patch '{current.entry.name}' does not apply to "
                                       f"{source.name}; rolled back to {before[:12]}")
                    outcome.applied = []
                    break
                outcome.applied.append(current.entry.name)
            else:
                outcome.status = "applied"
        except BaseException:
            # Ctrl-C or an unexpected error: leave the target as it was before this run
            rollback(repo_dir, before, log)
            gitsrc.git_text(repo_dir, "update-ref", "-d", PRE_SERIES_REF)
            raise
    gitsrc.git_text(repo_dir, "update-ref", "-d", PRE_SERIES_REF)
    outcome.head = gitsrc.head_commit(repo_dir)
    return outcome


def _first_mismatch(records: list[AppliedRecord], patches: list[LoadedPatch]) -> str | None:
    """Applied commits must be a prefix of the series (same names, same digests)."""
    for i, rec in enumerate(records):
        if not rec.name:
            return f"commit {rec.commit[:12]} on top of the pinned commit is not a series patch"
        if i >= len(patches) or patches[i].entry.name != rec.name:
            return f"applied patch '{rec.name}' is not next in the series"
        if rec.sha256 != patches[i].entry.sha256:
            return (f"applied patch '{rec.name}' has sha256 {rec.sha256[:12]}…, the series now "
                    f"has {patches[i].entry.sha256[:12]}…")
    return None


def apply_series(recipe: Recipe, series: Series, ws: Workspace, log: Path, *,
                 only: Sequence[str] | None = None, force: bool = False
                 ) -> list[TargetOutcome]:
    """Verify every digest first, then apply target by target in series order."""
    targets = series_targets(series, only)
    entries = [p for p in series.patches if p.target in targets]
    loaded = load_patches(entries, recipe, series, ws)
    outcomes = []
    for target in targets:
        source = recipe.source(target)
        patches = [p for p in loaded if p.entry.target == target]
        outcomes.append(apply_target(ws.source_dir(recipe, target), source, patches, log, force))
    return outcomes


# --- status, reset, refresh ----------------------------------------------------------------


@dataclass
class PatchState:
    name: str
    target: str
    state: str  # applied | not-applied | changed | missing
    commit: str | None = None
    detail: str = ""


def series_status(recipe: Recipe, series: Series, ws: Workspace) -> list[PatchState]:
    rows: list[PatchState] = []
    for target in series_targets(series):
        source = recipe.source(target)
        repo_dir = ws.source_dir(recipe, target)
        entries = series.for_target(target)
        if not (repo_dir / ".git").exists() or not gitsrc.has_commit(repo_dir, source.pinned):
            rows += [PatchState(e.name, target, MISSING, detail=f"{target} is not fetched")
                     for e in entries]
            continue
        interrupted = gitsrc.git_ok(repo_dir, "rev-parse", "--verify", "-q", PRE_SERIES_REF)
        records = {r.name: r for r in applied_records(repo_dir, source.pinned) if r.name}
        dirty = set(gitsrc.dirty_files(repo_dir))
        for e in entries:
            rec = records.get(e.name)
            if rec is None:
                try:
                    load_patch(e, recipe, series, ws)
                except InputError as exc:
                    rows.append(PatchState(e.name, target, MISSING, detail=exc.message))
                    continue
                detail = "an interrupted apply is pending: run patch apply" if interrupted else ""
                rows.append(PatchState(e.name, target, NOT_APPLIED, detail=detail))
            elif rec.sha256 != e.sha256:
                rows.append(PatchState(e.name, target, CHANGED, rec.commit,
                                       f"applied with sha256 {rec.sha256[:12]}…, the series "
                                       f"has {e.sha256[:12]}…"))
            else:
                touched = set(gitsrc.git_text(repo_dir, "diff-tree", "--no-commit-id",
                                              "--name-only", "-r", rec.commit).splitlines())
                edited = sorted(touched & dirty)
                if edited:
                    rows.append(PatchState(e.name, target, CHANGED, rec.commit,
                                           f"local edits in {', '.join(edited[:3])}"))
                else:
                    rows.append(PatchState(e.name, target, APPLIED, rec.commit))
    return rows


def reset_targets(recipe: Recipe, series: Series, ws: Workspace, log: Path,
                  targets: Sequence[str] | None, force: bool) -> list[dict[str, Any]]:
    """Each target back to its pinned commit, the patched state kept under a ref."""
    rows = []
    for target in series_targets(series, targets):
        source = recipe.source(target)
        repo_dir = ws.source_dir(recipe, target)
        row: dict[str, Any] = {"target": target, "path": str(repo_dir), "kept": []}
        rows.append(row)
        if not (repo_dir / ".git").exists():
            row["result"] = "absent"
            continue
        recover_interrupted(repo_dir, log)
        dirty = gitsrc.dirty_files(repo_dir)
        if dirty and not force:
            row["result"] = "blocked"
            row["message"] = (f"local changes in {dirty[0]}; commit them, or rerun with --force "
                              "(they are kept under a ref)")
            continue
        if gitsrc.head_commit(repo_dir) == source.pinned and not dirty:
            row["result"] = "pinned"
            continue
        row["kept"] = keep_and_reset(repo_dir, source.pinned, log, keep_dirty=True)
        row["result"] = "reset"
    return rows


def regenerate(repo_dir: Path, commit: str, entry: PatchEntry) -> bytes:
    """The patch text of one applied commit, in the entry's format, without our trailers."""
    if entry.strip not in (0, 1):
        raise InputError(f"patch '{entry.name}': refresh supports strip 0 or 1, not "
                         f"{entry.strip}; regenerate it by hand")
    prefixes = (["--src-prefix=a/", "--dst-prefix=b/"] if entry.strip == 1 else ["--no-prefix"])
    if entry.method == "mbox":
        text = gitsrc.git_bytes(repo_dir, "format-patch", "-1", "--stdout", "--no-signature",
                                "--zero-commit", "--no-numbered", "--no-color", *prefixes,
                                commit)
        head, sep, rest = text.partition(b"\n---\n")
        head = re.sub(rb"\n(?:Dsv4-Patch[\w-]*: [^\n]*\n?)+", b"\n", head).rstrip(b"\n") + b"\n"
        return head + sep + rest if sep else text
    if entry.method == "unidiff-zero":
        text = gitsrc.git_bytes(repo_dir, "diff", "--no-color", "--no-ext-diff", "-U0",
                                *prefixes, f"{commit}^", commit)
        # keep only lines we wrote: no index line, no upstream function text in hunk headers
        lines = [re.sub(rb"^(@@ [^@]+ @@).*$", rb"\1", line)
                 for line in text.split(b"\n") if not line.startswith(b"index ")]
        return b"\n".join(lines)
    return gitsrc.git_bytes(repo_dir, "diff", "--no-color", "--no-ext-diff", *prefixes,
                            f"{commit}^", commit)


def refresh_series(recipe: Recipe, series: Series, ws: Workspace,
                   only: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Our own patch files regenerated from their commits; the series' sha256 updated."""
    spath = series.file
    if spath is None:
        raise InputError("the series has no file to update; load it from a file")
    rows = []
    targets = series_targets(series, only)
    text = spath.read_text(encoding="utf-8")
    for entry in series.patches:
        if entry.target not in targets:
            continue
        row: dict[str, Any] = {"name": entry.name, "target": entry.target}
        rows.append(row)
        if entry.origin.file is None:
            row["result"] = "not ours"
            row["detail"] = "comes from a pinned source; refresh it there"
            continue
        source = recipe.source(entry.target)
        repo_dir = ws.source_dir(recipe, entry.target)
        rec = next((r for r in applied_records(repo_dir, source.pinned) if r.name == entry.name),
                   None) if (repo_dir / ".git").exists() else None
        if rec is None:
            row["result"] = "not applied"
            row["detail"] = "apply the series, edit, commit (amend), then refresh"
            continue
        data = regenerate(repo_dir, rec.commit, entry)
        if entry.method == "unidiff-zero":
            # our patches open with a note of ours before the diff: keep it
            old = (spath.parent / entry.origin.file).read_bytes()
            data = old[: old.find(b"diff --git")] + data if b"diff --git" in old else data
        new = _sha256(data)
        if new == entry.sha256:
            row["result"] = "unchanged"
            continue
        if text.count(entry.sha256) != 1:
            raise InputError(f"{spath}: sha256 of '{entry.name}' appears "
                             f"{text.count(entry.sha256)} times; edit the series by hand")
        atomic_write_bytes(spath.parent / entry.origin.file, data)
        text = text.replace(entry.sha256, new)
        atomic_write_bytes(spath, text.encode("utf-8"))
        row.update(result="refreshed", old_sha256=entry.sha256, sha256=new,
                   detail=(f"re-apply to record it: patch reset --only {entry.target} "
                           "&& patch apply"))
    return rows


def write_report(path: Path, data: bytes) -> None:
    try:
        atomic_write_bytes(path, data)
    except OSError as exc:
        raise InputError(f"{path}: cannot write the report ({exc.strerror}); give a writable "
                         "path") from None

