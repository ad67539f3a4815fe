"""One patch check per commit: index-only (`patch check`, `--bisect`) against a scratch
worktree per commit (what `patch check` did before), on a repository made here.

Run: .venv/bin/python bench/bench_index_check.py [--files N] [--commits N]
Builds a repository of --files files (ktransformers at the pinned commit has ~1,400) and
--commits commits that each move the patched file (so none can be skipped), then times, per
commit, the index-only classification and `git worktree add` + `git apply --check` +
`git worktree remove`, and prints both medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.org",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.org"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


def build(root: Path, files: int, commits: int) -> tuple[Path, list[str], Path]:
    repo = root / "up"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for i in range(files):
        p = repo / f"d{i % 40}" / f"f{i}.c"
        p.parent.mkdir(exist_ok=True)
        p.write_text("".join(f"line {j} of {i}\n" for j in range(60)))
    target = repo / "d0" / "f0.c"
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    target.write_text(target.read_text().replace("line 30 of 0\n", "line 30 of 0 patched\n"))
    patch = root / "p.patch"
    patch.write_text(git(repo, "diff") + "\n")
    git(repo, "checkout", "-q", "--", ".")
    shas = []
    for c in range(commits):
        # one line more at the top each time: the hunk moves (offset), never skippable
        target.write_text(f"added {c}\n" + target.read_text())
        git(repo, "commit", "-q", "-am", f"move {c}")
        shas.append(git(repo, "rev-parse", "HEAD"))
    bare = root / "cache.git"
    git(root, "clone", "-q", "--bare", str(repo), str(bare))
    return bare, shas, patch


def main() -> int:
    from dsv4_offload.sources.indexcheck import IndexTree
    from dsv4_offload.sources.series import METHODS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1400)
    parser.add_argument("--commits", type=int, default=30)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
        root = Path(tmp)
        bare, shas, patch = build(root, opts.files, opts.commits)
        log = root / "log"
        index_times, statuses = [], set()
        tree = IndexTree(bare, shas[0], root / "idx", log)
        for sha in shas:
            t0 = time.perf_counter()
            tree.reset(sha)
            statuses.add(tree.classify(patch, 1, METHODS["plain"]).status)
            index_times.append(time.perf_counter() - t0)
        worktree_times = []
        for sha in shas:
            wt = root / "wt"
            t0 = time.perf_counter()
            git(bare, "worktree", "add", "-q", "--detach", str(wt), sha)
            subprocess.run(["git", "apply", "--check", "-v", str(patch)], cwd=wt,
                           capture_output=True, check=True)
            git(bare, "worktree", "remove", "--force", str(wt))
            worktree_times.append(time.perf_counter() - t0)
    index_ms = statistics.median(index_times) * 1000
    worktree_ms = statistics.median(worktree_times) * 1000
    print(f"{opts.files} files, {opts.commits} commits, results {sorted(statuses)}")
    print(f"scratch worktree per commit (reference): median {worktree_ms:8.1f} ms")
    print(f"index-only check per commit:             median {index_ms:8.1f} ms")
    print(f"ratio worktree / index-only: {worktree_ms / index_ms:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
