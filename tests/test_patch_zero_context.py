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


# --- our fix of sglang/0003's resident-expert write ------------------------------------------

STREAM_FILE = "python/sglang/srt/layers/moe/kt_stream_prefill.py"
RESIDENT_FIX = "sglang-resident-write-through"


def resident_fix() -> tuple[PatchEntry, bytes]:
    s = load_series(BUNDLED_SERIES / "dsv4-flash.yaml")
    (entry,) = [p for p in s.patches if p.name == RESIDENT_FIX]
    return entry, (BUNDLED_SERIES / entry.origin.file).read_bytes()  # type: ignore[operator]


def stand_in_stream_file() -> str:
    """kt_stream_prefill.py as sglang/0003 creates it, by line count only: lines of ours up to
    line 982 (the last of 0003's four index_select writes, where our hunk goes), inside the
    function our lines extend, and no line of the delivery's."""
    head = ["def _apply_resident_layer_depool(L, layer, w13, s13b, w2, s2b, top, torch):"]
    body = [f"    pass  # stand-in for line {i} of the file after sglang/0003"
            for i in range(2, 983)]
    return "\n".join(head + body) + "\n"


def test_bundled_resident_write_fix_is_ours_and_follows_0003() -> None:
    entry, data = resident_fix()
    assert entry.method == "unidiff-zero" and entry.upstream == "local" and entry.risk
    assert hashlib.sha256(data).hexdigest() == entry.sha256
    assert series_mod.zero_context_problem(data) is None
    s = load_series(BUNDLED_SERIES / "dsv4-flash.yaml")
    names = [p.name for p in s.patches]
    assert names.index(RESIDENT_FIX) == names.index("sglang-streaming-prefill-depool") + 1
    # the hunk goes right after kt_stream_prefill.py:982, the last of the four writes
    assert b"@@ -982,0 +983,19 @@" in data and STREAM_FILE.encode() in data


class FakeTensor:
    """Just what our lines call on a torch tensor, over numpy; ``stuck`` is a parameter that
    every write leaves as it was (the FRACTAL_NZ defect, here for copy_ too)."""

    def __init__(self, a: object, stuck: bool = False) -> None:
        import numpy as np

        self.a, self.stuck = np.asarray(a), stuck

    @property
    def data(self) -> FakeTensor:
        return self

    def copy_(self, other: FakeTensor) -> FakeTensor:
        if not self.stuck:
            self.a[...] = other.a
        return self

    def cpu(self) -> FakeTensor:
        return FakeTensor(self.a.copy())

    def __getitem__(self, key: object) -> FakeTensor:
        return FakeTensor(self.a[key])

    def __int__(self) -> int:
        return int(self.a)


def fake_torch() -> object:
    import types

    import numpy as np

    def index_select(src: FakeTensor, dim: int, index: FakeTensor,
                     out: FakeTensor | None = None) -> FakeTensor:
        assert dim == 0 and out is None  # our lines never write through out=
        return FakeTensor(src.a[index.a])

    return types.SimpleNamespace(index_select=index_select,
                                 equal=lambda x, y: bool(np.array_equal(x.a, y.a)))


@pytest.mark.parametrize("stuck", [False, True], ids=["written", "write-lost"])
def test_resident_write_fix_applies_and_reports_what_slot_0_holds(
        tmp_path: Path, stuck: bool, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    repo = tmp_path / "sglang"
    (repo / STREAM_FILE).parent.mkdir(parents=True)
    (repo / STREAM_FILE).write_text(stand_in_stream_file())
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "sglang after 0003 (stand-in)")
    entry, data = resident_fix()
    source = Source(name="sglang", url="file:///nowhere", commit=git(repo, "rev-parse", "HEAD"),
                    path="sglang")
    patch = series_mod.LoadedPatch(entry, data, "sglang-resident-write-through.patch")
    outcome = series_mod.apply_target(repo, source, [patch], tmp_path / "log")
    assert outcome.status == "applied", outcome
    text = (repo / STREAM_FILE).read_text()
    lines = text.splitlines()
    assert lines[981].startswith("    pass  # stand-in for line 982")
    assert lines[982].startswith("    # dsv4-offload:") and len(lines) == 982 + 19
    # run the patched function: 4 slots of 16 experts, the hot ones picked by `top`
    space: dict[str, object] = {}
    exec(compile(text, STREAM_FILE, "exec"), space)
    rng = np.random.default_rng(0)
    w13, w2 = FakeTensor(rng.random((16, 6, 4))), FakeTensor(rng.random((16, 4, 3)))
    s13, s2 = FakeTensor(rng.random((16, 6))), FakeTensor(rng.random((16, 4)))
    layer = type("Layer", (), {})()
    for name, like in (("w13_weight", w13), ("w2_weight", w2),
                       ("w13_weight_scale_bf16", s13), ("w2_weight_scale_bf16", s2)):
        setattr(layer, name, FakeTensor(np.zeros((4, *like.a.shape[1:])), stuck=stuck))
    top = FakeTensor(np.array([9, 3, 14, 0]))
    space["_apply_resident_layer_depool"](0, layer, w13, s13, w2, s2, top, fake_torch())
    out = capsys.readouterr().out
    if stuck:
        assert out == ("[KT_STREAM] resident write FAILED: layer 0 slot 0 does not hold "
                       "expert 9\n")
    else:
        assert out == "[KT_STREAM] resident write verified: layer 0 slot 0 holds expert 9\n"
        assert np.array_equal(layer.w13_weight.a, w13.a[[9, 3, 14, 0]])
        assert np.array_equal(layer.w2_weight_scale_bf16.a, s2.a[[9, 3, 14, 0]])
    # a later layer writes as well but reads nothing back (the check is once per update)
    space["_apply_resident_layer_depool"](1, layer, w13, s13, w2, s2, top, fake_torch())
    assert capsys.readouterr().out == ""
