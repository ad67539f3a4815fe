"""Index-only patch checks: a patch tried against a commit without a checkout.

The commit's tree is read into a temporary index (``GIT_INDEX_FILE=tmp git read-tree``) and
``git apply --cached --check`` runs against it, so a check reads only the blobs of the files
the patch touches (in a blob-less cache they are fetched on demand) and costs milliseconds.
GNU ``patch`` (the fuzz fallback) needs files: only the touched ones are written out, from the
index. A patch that applies is then applied to the same index, so the next patch of the
series meets the tree it expects. The classification is :func:`series.classify`'s.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.runner import run_command
from dsv4_offload.sources import git as gitsrc
from dsv4_offload.sources.series import (
    _GNU_FUZZ,
    CHECK_FUZZ,
    CLEAN,
    FAILS,
    FUZZ,
    OFFSET,
    UPSTREAM,
    Classification,
    Method,
    applied_cleanly_or_moved,
    method_of,
    parse_rejected,
)

if TYPE_CHECKING:
    from dsv4_offload.recipe import PatchEntry


def touched_paths(repo: Path, patch_file: Path, strip: int, log: Path) -> list[str]:
    """Every path the patch reads or writes (both names of a rename), from ``--numstat``."""
    res = _every_line(["git", "apply", "--numstat", "-z", f"-p{strip}", str(patch_file)],
                      log, repo, gitsrc.git_env())
    if res.returncode != 0:
        return []
    # the runner splits on newlines (a path may hold one); -z fields are NUL-separated:
    # "A\tD\tpath\0" or, for a rename, "A\tD\t\0old\0new\0"
    fields = "\n".join(res.tail).split("\0")
    out: list[str] = []
    i = 0
    while i < len(fields):
        head = fields[i]
        parts = head.split("\t")
        if len(parts) == 3 and parts[2]:
            out.append(parts[2])
            i += 1
        elif len(parts) == 3 and i + 2 < len(fields):
            out += [fields[i + 1], fields[i + 2]]
            i += 3
        else:
            i += 1
    return list(dict.fromkeys(p.strip("\n") for p in out if p.strip("\n")))


class IndexTree:
    """A commit's tree in a temporary index of ``repo`` (bare or not); nothing checked out."""

    def __init__(self, repo: Path, commit: str, tmp: Path, log: Path) -> None:
        self.repo, self.tmp, self.log = repo, tmp, log
        tmp.mkdir(parents=True, exist_ok=True)
        self.env = gitsrc.git_env({"GIT_INDEX_FILE": str(tmp / "index")})
        self.commit = commit
        self._paths: dict[tuple[Path, int], list[str]] = {}
        self.reset(commit)

    def git(self, *args: str, work_tree: Path | None = None, check: bool = False) -> Any:
        """git on the temporary index; the result's ``tail`` holds every line of output."""
        pre = [f"--work-tree={work_tree}"] if work_tree is not None else []
        return _every_line(["git", *pre, *args], self.log, self.repo, self.env, check)

    def reset(self, commit: str) -> None:
        """The index back to ``commit``'s tree (the patches carried so far dropped)."""
        self.git("read-tree", commit, check=True)
        self.commit = commit

    def _apply(self, patch_file: Path, strip: int, method: Method, *extra: str) -> Any:
        return self.git("apply", "--cached", *method.apply_args, f"-p{strip}", *extra,
                        str(patch_file))

    def classify(self, patch_file: Path, strip: int, method: Method) -> Classification:
        """clean / offset / fuzz / fails / already-upstream against the index."""
        upstream = Classification(UPSTREAM, "already in the tree (applies in reverse)")
        if method.reverse_first and self._reverse_applies(patch_file, strip, method):
            return upstream
        fwd = self._apply(patch_file, strip, method, "--check", "-v")
        if fwd.returncode == 0:
            return applied_cleanly_or_moved(fwd.tail)
        if not method.reverse_first and self._reverse_applies(patch_file, strip, method):
            return upstream
        hunks = parse_rejected(fwd.tail)
        merge = self.three_way(patch_file, strip, method)
        gnu = self._gnu_patch(patch_file, strip, dry_run=True) if method.fuzz else None
        if gnu is not None and gnu.returncode == 0:
            fuzzed = [f"hunk {m.group(1)} at {m.group(2)} (fuzz {m.group(4)})"
                      for m in map(_GNU_FUZZ.search, gnu.tail) if m]
            return Classification(FUZZ, "needs fuzz: " + (", ".join(fuzzed) or "GNU patch only")
                                  + merge, fuzzed)
        return Classification(FAILS, "rejected: " + (", ".join(hunks) or "see the log") + merge,
                              hunks)

    def _reverse_applies(self, patch_file: Path, strip: int, method: Method) -> bool:
        return bool(self._apply(patch_file, strip, method, "--check", "--reverse").returncode
                    == 0)

    def three_way(self, patch_file: Path, strip: int, method: Method) -> str:
        """What a 3-way merge (`git am -3`, `patch rebase`) would make of a patch that does
        not apply as it is, tried on a copy of the index; '' when the patch's preimage blobs
        are unknown here (a 3-way merge needs them)."""
        scratch = self.tmp / "index.3way"
        shutil.copyfile(self.tmp / "index", scratch)
        env = {**self.env, "GIT_INDEX_FILE": str(scratch)}
        res = _every_line(["git", "apply", "--cached", "--3way", *method.apply_args,
                           f"-p{strip}", str(patch_file)], self.log, self.repo, env)
        if res.returncode == 0:
            return "; a 3-way merge applies it"
        unmerged = _every_line(["git", "ls-files", "-u", "-z"], self.log, self.repo, env)
        files = sorted({f.split("\t", 1)[1] for f in "\n".join(unmerged.tail).split("\0")
                        if "\t" in f})
        return f"; a 3-way merge conflicts in {', '.join(files)}" if files else ""

    def carry(self, patch_file: Path, strip: int, method: Method,
              c: Classification) -> Classification:
        """Apply a patch that applies (clean, offset: git; fuzz: GNU patch) to the index."""
        if c.status in (CLEAN, OFFSET):
            res = self._apply(patch_file, strip, method)
            if res.returncode != 0:
                why = next((ln for ln in reversed(res.tail) if ln.startswith("error:")), "")
                return Classification(FAILS, f"git apply failed: {why or 'see the log'}")
        elif c.status == FUZZ:
            work = self._gnu_patch(patch_file, strip, dry_run=False)
            if work is None or work.returncode != 0:
                return Classification(FAILS, "GNU patch failed to apply it; see the log")
            self.git("update-index", "--add", "--remove", "--", *self.paths(patch_file, strip),
                     work_tree=self._files, check=True)
        return c

    def paths(self, patch_file: Path, strip: int) -> list[str]:
        """:func:`touched_paths`, once per patch file."""
        key = (patch_file, strip)
        if key not in self._paths:
            self._paths[key] = touched_paths(self.repo, patch_file, strip, self.log)
        return self._paths[key]

    @property
    def _files(self) -> Path:
        return self.tmp / "files"

    def materialize(self, paths: list[str]) -> Path:
        """The touched files, and only they, written out from the index for GNU patch."""
        files = self._files
        if files.exists():
            shutil.rmtree(files)
        files.mkdir(parents=True)
        if paths:
            # -q: a path the patch creates is not in the index, and that is fine
            self.git("checkout-index", "-q", "-f", "--", *paths, work_tree=files)
        return files

    def _gnu_patch(self, patch_file: Path, strip: int, dry_run: bool) -> Any | None:
        exe = shutil.which("patch")
        if exe is None:
            return None
        files = self.materialize(self.paths(patch_file, strip))
        args = [exe, "--batch", "--force", f"-p{strip}", f"-F{CHECK_FUZZ}",
                "--no-backup-if-mismatch", "-r", "-", "-i", str(patch_file)]
        if dry_run:
            args.insert(1, "--dry-run")
        return _every_line(args, self.log, files, gitsrc.git_env())


def _every_line(args: list[str], log: Path, cwd: Path, env: dict[str, str],
                check: bool = False) -> Any:
    """run_command keeps the last lines only; a patch of hundreds of hunks reports an offset
    (or fuzz) on each, and every one of them counts."""
    lines: list[str] = []
    res = run_command(args, log=log, cwd=cwd, env=env, check=check, on_line=lines.append)
    res.tail = lines
    return res


def check_and_carry(tree: IndexTree, entry: PatchEntry, patch_file: Path
                    ) -> tuple[Classification, float]:
    """One patch classified against the index, then carried if it applies; and the time."""
    start = time.monotonic()
    method = method_of(entry)
    c = tree.classify(patch_file, entry.strip, method)
    c = tree.carry(patch_file, entry.strip, method, c)
    return c, round(time.monotonic() - start, 3)
