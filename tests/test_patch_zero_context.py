"""Our own patches: zero-context diffs of pure additions, `git apply --unidiff-zero`."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from dsv4_offload.core.errors import InputError
from dsv4_offload.recipe import BUNDLED_SERIES, PatchEntry, Source, load_series
from dsv4_offload.sources import series as series_mod

BASE = "".join(f"line {i}\n" for i in range(1, 11))
ADDITION = """diff --git a/f.c b/f.c
--- a/f.c
+++ b/f.c
@@ -4,0 +5,2 @@
+ours A
+ours B
@@ -8,0 +11 @@
+ours C
"""
WITH_CONTEXT = """diff --git a/f.c b/f.c
--- a/f.c
+++ b/f.c
@@ -4,1 +4,2 @@
 line 4
+ours A
"""
WITH_REMOVAL = """diff --git a/f.c b/f.c
--- a/f.c
+++ b/f.c
@@ -4,1 +4,0 @@
-line 4
"""


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "repo"
    path.mkdir()
    git(path, "init", "-q")
    (path / "f.c").write_text(BASE)
    git(path, "add", ".")
    git(path, "commit", "-qm", "base")
    return path, git(path, "rev-parse", "HEAD")


def _entry(text: str, name: str = "ours") -> PatchEntry:
    return PatchEntry(name=name, target="t", origin={"file": f"{name}.patch"},
                      sha256=hashlib.sha256(text.encode()).hexdigest(), method="unidiff-zero",
                      upstream="local", description="a test addition")


def test_zero_context_patch_applies_as_one_commit(repo: tuple[Path, str], tmp_path: Path) -> None:
    path, base = repo
    patch = series_mod.LoadedPatch(_entry(ADDITION), ADDITION.encode(), "tests/ours.patch")
    source = Source(name="t", url="file:///nowhere", commit=base, path="repo")
    outcome = series_mod.apply_target(path, source, [patch], tmp_path / "log")
    assert outcome.status == "applied", outcome
    lines = (path / "f.c").read_text().splitlines()
    assert lines[3:7] == ["line 4", "ours A", "ours B", "line 5"]
    assert lines[9:12] == ["line 8", "ours C", "line 9"]
    assert "Dsv4-Patch: ours" in git(path, "log", "-1", "--format=%B")
    # refresh regenerates exactly the same zero-context diff from the commit
    assert series_mod.regenerate(path, "HEAD", patch.entry) == ADDITION.encode()
    # a second classification sees it as already applied
    patch_file = patch.write_to(tmp_path)
    c = series_mod.classify(path, patch_file, 1, tmp_path / "log", zero_context=True)
    assert c.status == series_mod.UPSTREAM


@pytest.mark.parametrize(("text", "why"), [
    (WITH_CONTEXT, "has context or removes lines"),
    (WITH_REMOVAL, "has context or removes lines"),
    (ADDITION.replace("@@ -8,0 +11 @@", "@@ -8,0 +11 @@ int main(void)"), "upstream text"),
    (ADDITION.replace("+ours B\n", " line 5\n"), "a context line"),
])
def test_a_patch_with_context_or_removals_is_refused(tmp_path: Path, text: str, why: str) -> None:
    (tmp_path / "ours.patch").write_text(text)
    (tmp_path / "s.yaml").write_text(
        "schema: 1\nname: s\npatches:\n  - name: ours\n    target: t\n"
        "    origin: {file: ours.patch}\n"
        f"    sha256: {hashlib.sha256(text.encode()).hexdigest()}\n"
        "    method: unidiff-zero\n    upstream: local\n    description: d\n")
    s = load_series(tmp_path / "s.yaml")
    with pytest.raises(InputError, match=f"method unidiff-zero needs a diff of pure additions.*"
                                         f"{why}"):
        series_mod.load_patch(s.patches[0], None, s, None)  # type: ignore[arg-type]


def test_bundled_x86_patch_is_pure_additions_and_matches_its_digest() -> None:
    s = load_series(BUNDLED_SERIES / "dsv4-flash-x86.yaml")
    (ours,) = [p for p in s.patches if p.origin.file]
    data = (BUNDLED_SERIES / ours.origin.file).read_bytes()  # type: ignore[operator]
    assert ours.method == "unidiff-zero" and hashlib.sha256(data).hexdigest() == ours.sha256
    assert series_mod.zero_context_problem(data) is None
    names = [p.name for p in s.patches]
    # after the delivery's 0002, whose moe.hpp it extends
    assert names.index(ours.name) == names.index("kt-kernel-cpu-moe-mxfp4-kernel") + 1
