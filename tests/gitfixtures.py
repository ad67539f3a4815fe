"""Upstream repositories built once per session and served over file://, plus a recipe and
series pointing at them.

Layout mirrors the real recipe in miniature: ``main`` is the tree root (it records
gitlinks at third_party/sub and third_party/lib, and its .gitmodules points sub elsewhere,
as ktransformers does for sglang), ``sub`` is patched and nested at its own commit, ``lib`` is
an unpatched submodule, ``delivery`` carries the patch files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED_RECIPE = REPO_ROOT / "src" / "dsv4_offload" / "data" / "recipes" / "dsv4-flash-910b.yaml"
AUTHOR = ("Alice Maintainer", "alice@example.org")
DELIVERY_DIR = "integration/series"


def git(cwd: Path, *args: str, env: dict[str, str] | None = None) -> str:
    full = {**os.environ, "GIT_AUTHOR_NAME": "Up Stream", "GIT_AUTHOR_EMAIL": "up@example.org",
            "GIT_COMMITTER_NAME": "Up Stream", "GIT_COMMITTER_EMAIL": "up@example.org",
            "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z",
            "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z", **(env or {})}
    out = subprocess.run(["git", *args], cwd=cwd, env=full, check=True, capture_output=True)
    return out.stdout.decode().strip()


def lines(prefix: str, n: int) -> str:
    return "".join(f"{prefix} line {i}\n" for i in range(1, n + 1))


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def make_upstream(path: Path, files: dict[str, str], gitlinks: dict[str, str] | None = None,
                  extra_commit: dict[str, str] | None = None) -> tuple[str, str]:
    """A repository with one commit (the pinned one) and maybe a later tip on main."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    _write(path, files)
    git(path, "add", "-A")
    for rel, sha in (gitlinks or {}).items():
        git(path, "update-index", "--add", "--cacheinfo", f"160000,{sha},{rel}")
    git(path, "commit", "-q", "-m", "pinned upstream state")
    pinned = git(path, "rev-parse", "HEAD")
    tip = pinned
    if extra_commit:
        _write(path, extra_commit)
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", "a later upstream commit",
            env={"GIT_COMMITTER_DATE": "2025-02-01T00:00:00Z"})
        tip = git(path, "rev-parse", "HEAD")
    return pinned, tip


def make_patch(upstream: Path, pinned: str, work: Path, edit: Callable[[Path], None],
               base_edit: Callable[[Path], None] | None = None, mbox: bool = False,
               subject: str = "a change") -> bytes:
    """A patch made in a clone at ``pinned``; ``base_edit`` first moves its base elsewhere
    (to make patches that need an offset, need fuzz, fail or are already in upstream)."""
    if work.exists():
        shutil.rmtree(work)
    git(upstream.parent, "clone", "-q", str(upstream), str(work))
    git(work, "checkout", "-q", pinned)
    if base_edit:
        base_edit(work)
        git(work, "add", "-A")
        git(work, "commit", "-q", "-m", "moved base")
    edit(work)
    git(work, "add", "-A")
    env = {"GIT_AUTHOR_NAME": AUTHOR[0], "GIT_AUTHOR_EMAIL": AUTHOR[1]} if mbox else None
    git(work, "commit", "-q", "-m", f"{subject}\n\nWhy it is needed.", env=env)
    if mbox:
        args = ["format-patch", "-1", "--stdout", "--no-signature"]
    else:
        args = ["diff", "--src-prefix=a/", "--dst-prefix=b/", "HEAD~1", "HEAD"]
    data = subprocess.run(["git", *args], cwd=work, check=True, capture_output=True).stdout
    shutil.rmtree(work)
    return data


def _replace(rel: str, old: str, new: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        p = root / rel
        p.write_text(p.read_text().replace(old, new))
    return edit


def _chain(*edits: Callable[[Path], None]) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        for e in edits:
            e(root)
    return edit


def _new_file(rel: str, text: str) -> Callable[[Path], None]:
    return lambda root: _write(root, {rel: text})


def _delete(rel: str) -> Callable[[Path], None]:
    return lambda root: (root / rel).unlink()


def _chmod_x(rel: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        p = root / rel
        p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return edit


@dataclass
class PatchSpec:
    name: str
    target: str
    data: bytes
    method: str = "plain"
    own_file: bool = False  # in the project's patches/ dir rather than in the delivery
    expect: str = "clean"  # what `patch check` must say

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def file_name(self) -> str:
        return f"{self.name}.patch"


@dataclass
class Upstreams:
    root: Path
    commits: dict[str, str]
    tips: dict[str, str]
    patches: dict[str, PatchSpec]
    delivery_commit: str = ""
    kitchen_sink: list[str] = field(default_factory=list)
    good: list[str] = field(default_factory=list)
    third_fails: list[str] = field(default_factory=list)

    def url(self, name: str) -> str:
        return (self.root / name).as_uri()


MAIN_FILES = {
    "README.md": "the tree root\n",
    "src/core.c": lines("core", 30),
    "src/old.c": lines("old", 5),
    "src/shift.c": lines("shift", 40),
    "src/fuzz.c": lines("fuzz", 30),
    "src/done.c": lines("done", 10) + "already fixed upstream\n" + lines("tail", 5),
    "src/bad.c": lines("bad", 20),
    "tools/run.sh": "#!/bin/sh\necho run\n",
    ".gitmodules": '[submodule "third_party/sub"]\n\tpath = third_party/sub\n'
                   "\turl = https://example.invalid/someone-else/sub\n"
                   '[submodule "third_party/lib"]\n\tpath = third_party/lib\n'
                   "\turl = https://example.invalid/lib\n",
}
SUB_FILES = {"pkg/mod.py": lines("mod", 20), "pkg/other.py": lines("other", 12)}
LIB_FILES = {"include/lib.h": "#pragma once\n"}


def build_upstreams(root: Path) -> Upstreams:
    root.mkdir(parents=True, exist_ok=True)
    work = root / "_work"
    lib_pin, _ = make_upstream(root / "lib", LIB_FILES)
    sub_pin, sub_tip = make_upstream(root / "sub", SUB_FILES,
                                     extra_commit={"pkg/later.py": "later = 1\n"})
    stale_sub = "1" * 40  # main records another sub commit, as ktransformers does for sglang
    main_pin, main_tip = make_upstream(
        root / "main", MAIN_FILES,
        gitlinks={"third_party/sub": stale_sub, "third_party/lib": lib_pin},
        extra_commit={"NEWS": "later\n"})
    up = root / "main"
    specs = [
        PatchSpec("main-core", "main", make_patch(
            up, main_pin, work,
            _chain(_replace("src/core.c", "core line 15\n", "core line 15 patched\n"),
                   _new_file("src/new.c", "int added;\n")))),
        PatchSpec("main-delete-and-mode", "main", make_patch(
            up, main_pin, work, _chain(_delete("src/old.c"), _chmod_x("tools/run.sh")))),
        PatchSpec("main-offset", "main", make_patch(
            up, main_pin, work,
            _replace("src/shift.c", "shift line 20\n", "shift line 20 patched\n"),
            base_edit=_replace("src/shift.c", lines("shift", 3), "")), expect="offset"),
        PatchSpec("main-fuzz", "main", make_patch(
            up, main_pin, work, _replace("src/fuzz.c", "fuzz line 15\n", "fuzz line 15 patched\n"),
            base_edit=_replace("src/fuzz.c", "fuzz line 12\n", "fuzz line 12 elsewhere\n")),
            expect="fuzz"),
        PatchSpec("main-already-upstream", "main", make_patch(
            up, main_pin, work, _replace("src/done.c", "done line 10\n",
                                         "done line 10\nalready fixed upstream\n"),
            base_edit=_replace("src/done.c", "already fixed upstream\n", "")),
            expect="already-upstream"),
        PatchSpec("main-bad", "main", make_patch(
            up, main_pin, work, _replace("src/bad.c", "bad line 10\n", "bad line 10 patched\n"),
            base_edit=lambda r: _write(r, {"src/bad.c": lines("different", 20).replace(
                "different line 10", "bad line 10")})), expect="fails"),
        PatchSpec("sub-mbox", "sub", make_patch(
            root / "sub", sub_pin, work,
            _replace("pkg/mod.py", "mod line 5\n", "mod line 5 mailed\n"),
            mbox=True, subject="sub: a mailed fix"), method="mbox"),
        PatchSpec("sub-own", "sub", make_patch(
            root / "sub", sub_pin, work, _new_file("pkg/ours.py", "ours = True\n")), own_file=True),
        PatchSpec("sub-fails", "sub", make_patch(
            root / "sub", sub_pin, work,
            _replace("pkg/other.py", "other line 6\n", "other line 6 x\n"),
            base_edit=lambda r: _write(r, {"pkg/other.py": lines("nope", 12).replace(
                "nope line 6", "other line 6")})), expect="fails"),
        PatchSpec("sub-mbox-fails", "sub", make_patch(
            root / "sub", sub_pin, work,
            _replace("pkg/other.py", "other line 9\n", "other line 9 mailed\n"),
            base_edit=lambda r: _write(r, {"pkg/other.py": lines("nah", 12).replace(
                "nah line 9", "other line 9")}), mbox=True, subject="sub: a stale mail"),
            method="mbox", expect="fails"),
    ]
    patches = {s.name: s for s in specs}
    delivery_files = {f"{DELIVERY_DIR}/{s.file_name}": s.data.decode() for s in specs
                      if not s.own_file}
    delivery_pin, _ = make_upstream(root / "delivery", delivery_files)
    return Upstreams(
        root, {"main": main_pin, "sub": sub_pin, "lib": lib_pin, "delivery": delivery_pin},
        {"main": main_tip, "sub": sub_tip}, patches, delivery_pin,
        kitchen_sink=["main-core", "main-delete-and-mode", "main-offset", "main-fuzz",
                      "main-already-upstream", "main-bad", "sub-mbox", "sub-own", "sub-fails"],
        good=["main-core", "main-delete-and-mode", "main-offset", "sub-mbox", "sub-own"],
        third_fails=["main-core", "main-delete-and-mode", "main-bad", "sub-mbox"],
    )


@dataclass
class Project:
    """A recipe + series (+ own patch files) in a temp dir, pointing at the upstreams."""

    dir: Path
    recipe: Path
    series: Path
    upstreams: Upstreams

    def cli(self, workspace: Path) -> list[str]:
        return ["--workspace", str(workspace), "--recipe", str(self.recipe)]


def write_project(dir: Path, up: Upstreams, names: list[str],
                  urls: dict[str, str] | None = None, mirrors: dict[str, list[str]] | None = None,
                  refs: dict[str, str] | None = None) -> Project:
    dir.mkdir(parents=True, exist_ok=True)
    patches_dir = dir / "patches"
    patches_dir.mkdir(exist_ok=True)
    entries = []
    for name in names:
        spec = up.patches[name]
        if spec.own_file:
            (patches_dir / spec.file_name).write_bytes(spec.data)
            origin = {"file": spec.file_name}
        else:
            origin = {"source": "delivery", "path": f"{DELIVERY_DIR}/{spec.file_name}"}
        entries.append({"name": name, "target": spec.target, "origin": origin,
                        "sha256": spec.sha256, "strip": 1, "method": spec.method,
                        "upstream": "local", "description": f"test patch {name}"})
    series = patches_dir / "test-series.yaml"
    series.write_text("# test series\n" + yaml.safe_dump(
        {"schema": 1, "name": "test-series", "patches": entries}, sort_keys=False))
    urls = urls or {}
    refs = refs or {"main": "main"}

    def source(name: str, path: str, **extra: object) -> dict[str, object]:
        out: dict[str, object] = {"name": name, "url": urls.get(name, up.url(name)),
                                  "commit": up.commits[name], "path": path}
        if mirrors and name in mirrors:
            out["mirrors"] = mirrors[name]
        if name in refs:
            out["ref"] = refs[name]
        out.update(extra)
        return out

    doc = yaml.safe_load(BUNDLED_RECIPE.read_text())
    doc.update(name="test-recipe", series="patches/test-series.yaml", delivery="delivery",
               tree_root="main", sources=[
                   source("main", "src/main"),
                   source("sub", "src/main/third_party/sub"),
                   source("lib", "src/main/third_party/lib", submodule_of="main", patched=False),
                   source("delivery", "src/delivery", patched=False),
               ])
    _detach_from_bundled_sources(doc)
    recipe = dir / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return Project(dir, recipe, series, up)


@pytest.fixture(scope="session")
def upstreams(tmp_path_factory: pytest.TempPathFactory) -> Upstreams:
    return build_upstreams(tmp_path_factory.mktemp("upstreams"))


@pytest.fixture
def git_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private git config and cache: the developer's settings never leak in."""
    config = tmp_path / "gitconfig"
    config.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DSV4_MIRRORS", raising=False)
    yield config


def refusing_env() -> dict[str, str]:
    """Protocol v0 without allowReachableSHA1InWant: the host refuses unadvertised SHAs."""
    return {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "protocol.version",
            "GIT_CONFIG_VALUE_0": "0"}


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    """The real entry point with --json; returns the exit code and the JSON document."""
    import json

    from dsv4_offload.cli import main

    capsys.readouterr()
    try:
        main(["--json", *args])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip() else {})


def cli_subprocess(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "dsv4_offload", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def repo_state(path: Path) -> dict[str, str]:
    """What a user would compare: HEAD, its tree, and the work-tree status."""
    return {"head": git(path, "rev-parse", "HEAD"), "tree": git(path, "rev-parse", "HEAD^{tree}"),
            "status": git(path, "status", "--porcelain", "--ignore-submodules=all")}


def write_git_shim(dir: Path, block_on: str, nth: int, reached: Path, fail: bool = False) -> Path:
    """A ``git`` on PATH that runs the real one but blocks at the nth ``block_on`` command
    (writing its pid to ``reached``), so a test can SIGKILL the tool and that git at a known
    point in the middle of an apply; with ``fail``, that command fails at once instead."""
    real = shutil.which("git")
    dir.mkdir(parents=True, exist_ok=True)
    counter = dir / "count"
    shim = dir / "git"
    then = (f'echo "fatal: {block_on} refused by the test" >&2; exit 1' if fail
            else "exec sleep 120")
    shim.write_text(f"""#!/bin/sh
case " $* " in
  *" {block_on} "*)
    n=$(cat "{counter}" 2>/dev/null || echo 0); n=$((n+1)); echo "$n" > "{counter}"
    if [ "$n" -eq {nth} ]; then
      echo $$ > "{reached}.tmp"; mv "{reached}.tmp" "{reached}"
      {then}
    fi ;;
esac
exec "{real}" "$@"
""")
    shim.chmod(0o755)
    return dir


# --- a 40-commit upstream history (patch check --bisect, patch rebase) ----------------------

HIST_FILES = {"README": "a history\n", "src/a.c": lines("a", 40), "src/b.c": lines("b", 20)}
FUZZ_AT, FAILS_AT, MERGE_AT, UPSTREAM_AT, CONFLICT_AT, HIST_LENGTH = 10, 20, 25, 30, 35, 40


@dataclass
class History:
    """``hist``: a pinned commit and 40 first-parent commits after it on main, in which the
    patch ``hist-moving`` (src/a.c) needs fuzz at FUZZ_AT, fails at FAILS_AT and is taken
    upstream at UPSTREAM_AT, and the mail ``hist-mail`` (src/b.c) conflicts from CONFLICT_AT.
    A side branch is merged at MERGE_AT (its own commit is not on the first-parent walk)."""

    path: Path
    pinned: str
    walk: list[str]  # the 40 commits after the pinned one, oldest first; walk[i-1] is number i
    patches: dict[str, PatchSpec]

    @property
    def url(self) -> str:
        return self.path.as_uri()

    def at(self, number: int) -> str:
        return self.walk[number - 1]


def build_history(root: Path) -> History:
    path = root / "hist"
    pinned, _ = make_upstream(path, HIST_FILES)
    git(path, "config", "uploadpack.allowFilter", "true")  # a host that serves blob-less
    work = root / "_hist_work"
    specs = [
        PatchSpec("hist-moving", "hist", make_patch(
            path, pinned, work, _replace("src/a.c", "a line 20\n", "a line 20 patched\n")),
            own_file=True),
        PatchSpec("hist-mail", "hist", make_patch(
            path, pinned, work, _replace("src/b.c", "b line 10\n", "b line 10 ours\n"),
            mbox=True, subject="b: our change"), method="mbox", own_file=True),
    ]
    walk = []
    for i in range(1, HIST_LENGTH + 1):
        when = f"2025-03-{1 + i // 24:02d}T{i % 24:02d}:00:00Z"
        env = {"GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when}
        subject = f"upstream {i}: notes"
        if i == FUZZ_AT:  # the first context line of the patch's hunk: GNU patch -F1 copes
            _replace("src/a.c", "a line 17\n", "a line 17 moved\n")(path)
            subject = f"upstream {i}: reword line 17"
        elif i == FAILS_AT:  # inner context on both sides: beyond fuzz 2
            _chain(_replace("src/a.c", "a line 19\n", "a line 19 gone\n"),
                   _replace("src/a.c", "a line 21\n", "a line 21 gone\n"))(path)
            subject = f"upstream {i}: rewrite around line 20"
        elif i == UPSTREAM_AT:  # upstream takes the change itself
            _write(path, {"src/a.c": lines("a", 40).replace("a line 20\n",
                                                           "a line 20 patched\n")})
            subject = f"upstream {i}: take the line 20 fix"
        elif i == CONFLICT_AT:
            _replace("src/b.c", "b line 10\n", "b line 10 theirs\n")(path)
            subject = f"upstream {i}: their line 10"
        elif i == MERGE_AT:
            git(path, "checkout", "-q", "-b", "side")
            _write(path, {"notes/side.txt": "side\n"})
            git(path, "add", "-A")
            git(path, "commit", "-q", "-m", "side work", env=env)
            git(path, "checkout", "-q", "main")
            git(path, "merge", "-q", "--no-ff", "side", "-m", f"upstream {i}: merge side",
                env=env)
            walk.append(git(path, "rev-parse", "HEAD"))
            continue
        else:
            _write(path, {f"notes/n{i}.txt": f"note {i}\n"})
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", subject, env=env)
        walk.append(git(path, "rev-parse", "HEAD"))
    git(path, "tag", "v2.0", walk[-1])
    return History(path, pinned, walk, {s.name: s for s in specs})


def write_history_project(dir: Path, up: Upstreams, hist: History, url: str | None = None,
                          pinned: str | None = None, names: list[str] | None = None
                          ) -> Project:
    """A recipe whose tree root is ``hist`` (plus the delivery), and a series of its patches."""
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "patches").mkdir(exist_ok=True)
    entries = []
    for spec in hist.patches.values():
        if names is not None and spec.name not in names:
            continue
        (dir / "patches" / spec.file_name).write_bytes(spec.data)
        entries.append({"name": spec.name, "target": "hist", "origin": {"file": spec.file_name},
                        "sha256": spec.sha256, "strip": 1, "method": spec.method,
                        "upstream": "submitted", "description": f"test patch {spec.name}"})
    series = dir / "patches" / "hist-series.yaml"
    series.write_text(yaml.safe_dump({"schema": 1, "name": "hist-series", "patches": entries},
                                     sort_keys=False))
    doc = yaml.safe_load(BUNDLED_RECIPE.read_text())
    doc.update(name="hist-recipe", series="patches/hist-series.yaml", delivery="delivery",
               tree_root="hist", sources=[
                   {"name": "hist", "url": url or hist.url, "commit": pinned or hist.pinned,
                    "path": "src/hist", "ref": "main"},
                   {"name": "delivery", "url": up.url("delivery"),
                    "commit": up.commits["delivery"], "path": "src/delivery", "patched": False},
               ])
    _detach_from_bundled_sources(doc)
    recipe = dir / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return Project(dir, recipe, series, up)


def _detach_from_bundled_sources(doc: dict[str, Any]) -> None:
    """What of the bundled recipe names its sources, fitted to test sources replacing them."""
    for step in doc["build"]["steps"]:
        step.pop("log_sources", None)  # names the bundled recipe's sources, replaced here
    # sglang's log lines: these test upstreams print none of them (`patch audit` would say so)
    doc["acceptance"].update(log_markers_required=[], log_markers_forbidden=[])
    if doc.get("conversion", {}).get("digests_manifest"):
        doc["conversion"]["digests_manifest"]["source"] = "delivery"


@pytest.fixture(scope="session")
def history(tmp_path_factory: pytest.TempPathFactory) -> History:
    return build_history(tmp_path_factory.mktemp("history"))
