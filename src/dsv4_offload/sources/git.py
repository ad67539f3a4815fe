"""Pinned git sources: a shared cache of bare repositories, fetch by SHA, workspace checkouts.

Every source is fetched once into ``<cache>/git/<name>.git`` (depth 1, by full SHA, with a
fallback for hosts that refuse unadvertised SHAs) and pinned there under
``refs/dsv4/pins/<sha>`` so a second workspace copies it without touching the network.
Checkouts are independent repositories copied from the cache at the pinned commit.

Quick read-only queries go through GitPython (``repo.git.*``); commands whose output the user
may need to read (fetch, checkout) go through :func:`runner.run_command`, which logs them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.runner import capture, redact
from dsv4_offload.recipe.fields import GIT_URL_SCHEMES, git_url_problem
from dsv4_offload.recipe.sourcelock import read_source_locks
from dsv4_offload.workspace.store import CACHE_ENV, cache_root

if TYPE_CHECKING:

    from dsv4_offload.core.results import Task
    from dsv4_offload.recipe import Recipe, Source

MIRRORS_ENV = "DSV4_MIRRORS"
PIN_REF_PREFIX = "refs/dsv4/pins/"
PINNED_REF = "refs/dsv4/pinned"  # in a checkout: the commit the recipe pins
CHECKOUT_BRANCH = "dsv4-offload"
PATCH_TRAILER = "Dsv4-Patch"

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
# "Receiving objects:  45% (123/456), 1.20 MiB | 2.00 MiB/s" (git --progress, on stderr)
_RECEIVING = re.compile(
    r"Receiving objects:\s+\d+% \((\d+)/(\d+)\)(?:,\s+([\d.]+)\s+(bytes|KiB|MiB|GiB))?"
)
_UNITS = {"bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


# --- where things live ---------------------------------------------------------------------


def cache_repo_path(name: str) -> Path:
    return cache_root() / "git" / f"{name}.git"


def git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for git: never prompt for credentials (a dead mirror must fail fast),
    never hang on a stalled transfer, messages in English so they can be parsed."""
    env = dict(os.environ)
    env.update({"GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", "LANGUAGE": "C",
                # the only transports git may use, whatever a URL or a config asks for
                "GIT_ALLOW_PROTOCOL": ":".join(GIT_URL_SCHEMES)})
    # a stalled HTTP transfer (under 1 KB/s for a minute) fails, so the next mirror is tried
    env.setdefault("GIT_HTTP_LOW_SPEED_LIMIT", "1000")
    env.setdefault("GIT_HTTP_LOW_SPEED_TIME", "60")
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    if extra:
        env.update(extra)
    return env


def require_git() -> None:
    if shutil.which("git") is None:
        raise Dsv4Error("git is not installed or not on PATH; install it (apt-get install git)")


def git_bytes(repo_dir: Path, *args: str) -> bytes:
    """The raw stdout of a git command (exact bytes, e.g. a blob to hash)."""
    import git

    out = git.Git(repo_dir).execute(
        ["git", *args], stdout_as_string=False, strip_newline_in_stdout=False, env=git_env()
    )
    return out if isinstance(out, bytes) else bytes(out)


def git_text(repo_dir: Path, *args: str) -> str:
    import git

    return str(git.Git(repo_dir).execute(["git", *args], env=git_env()))


def git_ok(repo_dir: Path, *args: str) -> bool:
    import git

    try:
        git.Git(repo_dir).execute(["git", *args], env=git_env())
    except git.GitCommandError:
        return False
    return True


def has_commit(repo_dir: Path, commit: str) -> bool:
    return git_ok(repo_dir, "cat-file", "-e", f"{commit}^{{commit}}")


def head_commit(repo_dir: Path) -> str | None:
    """HEAD's commit, None without one. A plain git, not GitPython: `status` asks this
    of every patched source (build and patch fingerprints) and must stay fast."""
    try:
        proc = capture(["git", "rev-parse", "--verify", "-q", "HEAD^{commit}"],
                       cwd=repo_dir, env=git_env(), timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


# --- mirrors -------------------------------------------------------------------------------


def checked_git_url(url: str, origin: str) -> str:
    """``url`` when git may be given it; otherwise an InputError naming ``origin``."""
    why = git_url_problem(url)
    if why is not None:
        raise InputError(
            f"{origin}: URL {redact(url)[:160]!r} {why}; give an https://, ssh://, git:// or "
            "file:// URL (or user@host:path)")
    return url


def parse_mirrors(values: Sequence[str], env_value: str | None = None) -> dict[str, list[str]]:
    """``NAME=URL`` items (options first, then ``$DSV4_MIRRORS``, comma/space separated)."""
    items = [(item, "--mirror") for item in values]
    if env_value:
        items += [(x, MIRRORS_ENV) for x in re.split(r"[\s,;]+", env_value) if x]
    out: dict[str, list[str]] = {}
    for item, origin in items:
        name, sep, url = item.partition("=")
        if not sep or not name.strip() or not url.strip():
            raise InputError(
                f"{origin}: mirror {redact(item)!r}: expected NAME=URL (e.g. --mirror "
                f"sglang=file:///srv/sglang.git or {MIRRORS_ENV}='sglang=https://host/sglang.git')"
            )
        url = checked_git_url(url.strip(), f"{origin} {name.strip()}=…")
        out.setdefault(name.strip(), []).append(url)
    return out


def mirrors_from(values: Sequence[str] | None, recipe: Recipe) -> dict[str, list[str]]:
    """Mirrors from the options and the environment, checked against the recipe's sources."""
    mirrors = parse_mirrors(values or [], os.environ.get(MIRRORS_ENV))
    names = [s.name for s in recipe.sources]
    for name in mirrors:
        if name not in names:
            raise InputError(f"mirror for '{name}': not a source of recipe '{recipe.name}'; "
                             f"use one of {names}")
    return mirrors


def candidate_urls(source: Source, extra: dict[str, list[str]] | None = None) -> list[str]:
    """User mirrors first, then the recipe's URL and its mirrors, without repeats."""
    urls = list((extra or {}).get(source.name, [])) + [source.url, *source.mirrors]
    for url in urls:
        checked_git_url(url, f"sources.{source.name} (url, mirrors or --mirror)")
    return list(dict.fromkeys(urls))


# --- the cache -----------------------------------------------------------------------------


@dataclass
class FetchOutcome:
    name: str
    commit: str
    cache: Path
    url: str | None = None  # None: already in the cache, nothing fetched
    method: str = "cached"  # cached | sha | ref | heads
    bytes_received: int = 0
    attempts: list[str] = field(default_factory=list)  # "url: why it failed"


@contextlib.contextmanager
def _cache_lock(repo: Path) -> Iterator[None]:
    """Two workspaces fetching into the same cache repository take turns."""
    repo.parent.mkdir(parents=True, exist_ok=True)
    with open(repo.with_suffix(".lock"), "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def ensure_cache_repo(name: str) -> Path:
    return _ensure_bare(cache_repo_path(name))


def _ensure_bare(repo: Path) -> Path:
    """A bare repository of the shared cache at ``repo``, made on first use."""
    if not (repo / "HEAD").exists():
        import git

        try:
            git.Repo.init(repo, bare=True)
        except OSError as exc:
            # the cache, not the network: its fix is where the cache is ($DSV4_CACHE)
            raise InputError(f"{repo}: cannot create the git cache ({exc.strerror})",
                             hint=f"set {CACHE_ENV} to a writable directory (the cache is "
                             f"{cache_root()})") from None
    return repo


def _progress_reader(task: Task | None, received: list[int]) -> Callable[[str], None]:
    def on_line(line: str) -> None:
        # git redraws progress with '\r'; the runner hands over whole lines, so take the last
        for part in reversed(line.split("\r")):
            m = _RECEIVING.search(part)
            if m:
                if m.group(3):
                    received[0] = int(float(m.group(3)) * _UNITS[m.group(4)])
                if task is not None:
                    task.update(completed=received[0] or int(m.group(1)))
                return

    return on_line


def _fetch(repo: Path, options: list[str], url: str, refspecs: list[str], log: Path,
           task: Task | None) -> tuple[bool, str, int]:
    from dsv4_offload.core.runner import CommandFailed, run_command

    received = [0]
    done = threading.Event()
    watcher = threading.Thread(target=_watch_incoming_pack, args=(repo, task, done), daemon=True)
    watcher.start()
    try:
        # the URL after '--': whatever it holds, git never reads it as an option
        run_command(["git", "fetch", "--progress", "--no-tags", "--no-write-fetch-head", *options,
                     "--", url, *refspecs],
                    log=log, cwd=repo, env=git_env(), on_line=_progress_reader(task, received))
    except CommandFailed as exc:
        return False, exc.excerpt[-1] if exc.excerpt else exc.message, received[0]
    finally:
        done.set()
        watcher.join()
    return True, "", received[0]


def _watch_incoming_pack(repo: Path, task: Task | None, done: threading.Event) -> None:
    """Live byte counts: git only ends its '\r'-redrawn progress line when a phase is over,
    so watch the pack it is receiving grow instead."""
    if task is None:
        return
    pack_dir = repo / "objects" / "pack"
    while not done.wait(0.25):
        size = 0
        for tmp in pack_dir.glob("tmp_pack_*"):
            with contextlib.suppress(OSError):
                size += tmp.stat().st_size
        if size:
            task.update(completed=size)


def fetch_commit(source: Source, *, log: Path, mirrors: dict[str, list[str]] | None = None,
                 commit: str | None = None, task: Task | None = None) -> FetchOutcome:
    """Make ``commit`` (default: the pinned one) present in the cache and pin it there.

    1. already in the cache: nothing fetched;
    2. for each URL (user mirrors, recipe URL, recipe mirrors): ``fetch --depth 1 URL SHA``;
    3. some hosts refuse an unadvertised SHA, so then fetch the recipe's ref (depth 1, then
       its whole history) or, without a ref, all branches, and check the commit is there.
    """
    commit = commit or source.pinned
    repo = ensure_cache_repo(source.name)
    outcome = FetchOutcome(source.name, commit, repo)
    with _cache_lock(repo):
        if not has_commit(repo, commit):
            for url in candidate_urls(source, mirrors):
                if _fetch_from(repo, url, source, commit, log, task, outcome):
                    break
            else:
                tried = "; ".join(outcome.attempts) or "no URL"
                raise Dsv4Error(
                    f"source '{source.name}': commit {commit} could not be fetched ({tried})",
                    hint=f"check the network, or add --mirror {source.name}=URL", log=str(log))
        git_text(repo, "update-ref", PIN_REF_PREFIX + commit, commit)
    return outcome


def _fetch_from(repo: Path, url: str, source: Source, commit: str, log: Path,
                task: Task | None, outcome: FetchOutcome) -> bool:
    shallow = ["--depth", "1"]
    ok, why, got = _fetch(repo, shallow, url, [commit], log, task)
    if ok and has_commit(repo, commit):
        outcome.url, outcome.method, outcome.bytes_received = redact(url), "sha", got
        return True
    if not ok and _unreachable(why):
        outcome.attempts.append(f"{redact(url)}: {why}")
        return False
    # the host refused the SHA (or served something else): go through named refs
    plans: list[tuple[str, bool, list[str]]] = []  # (method, shallow, refspecs)
    if source.ref:
        refspec = f"+{source.ref}:refs/dsv4/fallback/{_ref_slug(source.ref)}"
        plans += [("ref", True, [refspec]), ("ref", False, [refspec])]
    plans.append(("heads", False, ["+refs/heads/*:refs/dsv4/heads/*",
                                   "+refs/tags/*:refs/dsv4/tags/*"]))
    for method, is_shallow, refspecs in plans:
        # a full fetch into a shallow repo stops at its shallow boundary unless unshallowed
        depth = shallow if is_shallow else (
            ["--unshallow"] if (repo / "shallow").exists() else [])
        ok, why2, got2 = _fetch(repo, depth, url, refspecs, log, task)
        got += got2
        if ok and has_commit(repo, commit):
            outcome.url, outcome.method, outcome.bytes_received = redact(url), method, got
            return True
        if not ok:
            why = why2
    missing = f"the commit is not on {source.ref or 'any branch'}"
    outcome.attempts.append(f"{redact(url)}: {why or missing}")
    return False


def resolve_commit_prefix(source: Source, *, log: Path,
                          mirrors: dict[str, list[str]] | None = None,
                          task: Task | None = None) -> str:
    """The one commit on ``source.branch`` whose SHA starts with ``source.commit_prefix``.

    The branch's whole history is fetched (an abbreviated SHA cannot be asked of a server);
    no match or more than one match is an error that says so.
    """
    prefix, branch = source.commit_prefix, source.branch
    if prefix is None or branch is None:
        raise InputError(f"source '{source.name}' has no commit_prefix + branch to resolve")
    repo = ensure_cache_repo(source.name)
    local = f"refs/dsv4/branches/{_ref_slug(branch)}"
    attempts: list[str] = []
    with _cache_lock(repo):
        for url in candidate_urls(source, mirrors):
            depth = ["--unshallow"] if (repo / "shallow").exists() else []
            ok, why, _ = _fetch(repo, depth, url, [f"+refs/heads/{branch}:{local}"], log,
                                   task)
            if ok:
                break
            attempts.append(f"{redact(url)}: {why}")
        else:
            raise Dsv4Error(f"source '{source.name}': branch {branch} could not be fetched to "
                            f"resolve {prefix} ({'; '.join(attempts)}); check the network or "
                            f"pass --mirror {source.name}=URL", log=str(log))
        history = git_text(repo, "rev-list", local).split()
    return pick_prefix_match(source.name, prefix, branch, history)


def pick_prefix_match(name: str, prefix: str, branch: str, history: list[str]) -> str:
    """The single SHA of ``history`` that starts with ``prefix``, else a one-line error."""
    matches = [c for c in history if c.startswith(prefix)]
    if not matches:
        raise InputError(f"source '{name}': no commit on {branch} starts with {prefix} "
                         f"({len(history)} commits searched); check commit_prefix and branch")
    if len(matches) > 1:
        shown = ", ".join(m[:12] for m in matches[:4])
        raise InputError(f"source '{name}': commit_prefix {prefix} is ambiguous on {branch} "
                         f"({len(matches)} commits: {shown}); write the full SHA in 'commit' "
                         "or more digits in 'commit_prefix'")
    return matches[0]


# --- the source lock: prefix pins resolved once -------------------------------------------


def write_source_lock(lock_file: Path, source: Source, commit: str) -> None:
    """Record a resolved prefix (atomically) so later fetches use the same commit."""
    from dsv4_offload.core.clock import now_iso
    from dsv4_offload.workspace.store import atomic_write_json

    locks = read_source_locks(lock_file)
    locks[source.name] = {"commit_prefix": source.commit_prefix or "",
                          "branch": source.branch or "", "url": source.url, "commit": commit,
                          "resolved": now_iso()}
    atomic_write_json(lock_file, {"schema": 1, "sources": locks})


def _unreachable(why: str) -> bool:
    """A dead host or path: no point asking it again for a ref."""
    return bool(re.search(r"does not appear to be a git repository|Could not resolve host|"
                          r"unable to access|Connection refused|not found|No such file", why, re.I))


def _ref_slug(ref: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", ref).strip("-") or "ref"


def resolve_remote_ref(source: Source, ref: str, *, log: Path,
                       mirrors: dict[str, list[str]] | None = None) -> str:
    """The commit a branch/tag/SHA names upstream, fetched into the cache (for --rev)."""
    if _HEX40.match(ref):
        return fetch_commit(source, log=log, mirrors=mirrors, commit=ref).commit
    repo = ensure_cache_repo(source.name)
    local = f"refs/dsv4/rev/{_ref_slug(ref)}"
    why = ""
    with _cache_lock(repo):
        for url in candidate_urls(source, mirrors):
            ok, why, _ = _fetch(repo, ["--depth", "1"], url, [f"+{ref}:{local}"], log, None)
            if ok:
                commit = git_text(repo, "rev-parse", f"{local}^{{commit}}")
                git_text(repo, "update-ref", PIN_REF_PREFIX + commit, commit)
                return commit
    raise Dsv4Error(f"source '{source.name}': ref '{ref}' could not be fetched ({why}); "
                    "give a branch, tag or full SHA that exists upstream", log=str(log))


def read_blob(source: Source, path: str, places: Sequence[Path]) -> bytes | None:
    """A file of ``source`` at its pinned commit, from the first repo that has the commit."""
    for repo in places:
        is_repo = (repo / "HEAD").exists() or (repo / ".git").exists()
        if is_repo and has_commit(repo, source.pinned):
            import git

            try:
                return git_bytes(repo, "cat-file", "blob", f"{source.pinned}:{path}")
            except git.GitCommandError:
                return None
    return None


# --- workspace checkouts -------------------------------------------------------------------


@dataclass
class CheckoutState:
    """What is at a checkout path now."""

    kind: str  # absent | pinned | patched | dirty | other-commit | not-a-repo | symlink
    head: str | None = None
    detail: str = ""

    @property
    def usable(self) -> bool:
        return self.kind in ("pinned", "patched")


def is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def dirty_files(repo_dir: Path) -> list[str]:
    """Modified tracked files; nested checkouts (gitlinks) are expected to differ."""
    out = git_text(repo_dir, "status", "--porcelain", "--untracked-files=no",
                   "--ignore-submodules=all")
    return [line[3:] for line in out.splitlines() if line.strip()]


def patch_commits(repo_dir: Path, base: str,
                  keys: Sequence[str] = (PATCH_TRAILER,)) -> list[list[str]]:
    """``[commit, value of each trailer in keys or '']`` for each commit in ``base..HEAD``,
    oldest first."""
    fields = "%x1f".join(f"%(trailers:key={k},valueonly,separator=%x2c)" for k in keys)
    out = git_text(repo_dir, "log", "--reverse", f"--format=%H%x1f{fields}%x1e", f"{base}..HEAD")
    width = 1 + len(keys)
    rows = []
    for record in out.split("\x1e"):
        if record.strip():
            parts = [p.strip() for p in record.split("\x1f")]
            rows.append((parts + [""] * width)[:width])
    return rows


def inspect_checkout(path: Path, commit: str) -> CheckoutState:
    if path.is_symlink():  # checkouts are made, patched and reset: only inside the workspace
        return CheckoutState("symlink", detail=f"it points to {os.readlink(path)}; the tool "
                             "writes only inside the workspace")
    if not path.exists() or is_empty_dir(path):
        return CheckoutState("absent")
    if not (path / ".git").exists():
        return CheckoutState("not-a-repo", detail=f"{path} exists and is not a git checkout")
    head = head_commit(path)
    if head is None:
        return CheckoutState("other-commit", detail="the repository has no commit checked out")
    if head != commit:
        if not has_commit(path, commit) or not git_ok(path, "merge-base", "--is-ancestor",
                                                      commit, head):
            return CheckoutState("other-commit", head,
                                 f"HEAD is {head[:12]}, not the pinned {commit[:12]}")
        foreign = [c for c, name in patch_commits(path, commit) if not name]
        if foreign:
            return CheckoutState("other-commit", head,
                                 f"HEAD has {len(foreign)} commit(s) on top of the pinned one "
                                 f"that are not series patches (first {foreign[0][:12]})")
    dirty = dirty_files(path)
    if dirty:
        more = f" (+{len(dirty) - 1} more)" if len(dirty) > 1 else ""
        return CheckoutState("dirty", head, f"local changes in {dirty[0]}{more}")
    return CheckoutState("pinned" if head == commit else "patched", head)


def move_aside(path: Path) -> Path:
    """Rename ``path`` to ``<path>.moved-<timestamp>``: --force never deletes anything."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.moved-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.moved-{stamp}-{n}")
    path.rename(target)
    return target


def partial_path(path: Path) -> Path:
    """Where a checkout is built before it is renamed into place."""
    return path.with_name(f".{path.name}.dsv4-partial")


def create_checkout(path: Path, source: Source, log: Path) -> None:
    """A fresh repository at ``path``, copied from the cache, on a branch at the pinned commit.

    Built beside the target and renamed into place, so an interrupted fetch never leaves a
    half-made checkout that the next run would have to call "not ours".
    """
    from dsv4_offload.core.runner import run_command

    env = git_env()
    cache = cache_repo_path(source.name)
    work = partial_path(path)
    if work.exists():  # left by an interrupted run; the name is ours alone
        shutil.rmtree(work)
    work.parent.mkdir(parents=True, exist_ok=True)
    try:
        run_command(["git", "init", "-q", str(work)], log=log, env=env)
        # by ref name, not SHA: a user's protocol.version=0 would refuse a bare SHA even locally
        run_command(["git", "fetch", "-q", "--no-tags", "--depth", "1", str(cache),
                     f"{PIN_REF_PREFIX}{source.pinned}:{PINNED_REF}"], log=log, cwd=work, env=env)
        run_command(["git", "checkout", "-q", "-B", CHECKOUT_BRANCH, source.pinned],
                    log=log, cwd=work, env=env)
        git_ok(work, "remote", "add", "origin", source.url)
        head = head_commit(work)
        if head != source.pinned:
            raise Dsv4Error(f"{path}: HEAD is {head} after checkout, expected {source.pinned}; "
                            "the cache may be corrupt: move it aside and rerun", log=str(log))
        os.rename(work, path)  # replaces an empty directory (a gitlink placeholder) atomically
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # a failed checkout leaves nothing behind
        raise


def checkout_order(recipe: Recipe) -> list[Source]:
    """Outer checkouts before the ones nested inside them (sglang lives in ktransformers)."""
    return sorted(recipe.sources, key=lambda s: (len(Path(s.path).parts), s.path))


def gitlink_commit(tree_repo: Path, commit: str, relpath: str) -> str | None:
    """The commit a tree records for a submodule path, if it records one."""
    import git

    try:
        out = git_text(tree_repo, "ls-tree", commit, "--", relpath)
    except git.GitCommandError:
        return None
    parts = out.split()
    return parts[2] if len(parts) >= 3 and parts[1] == "commit" else None


# --- blob-less history (bisect, rebase) ----------------------------------------------------

HISTORY_REMOTE = "dsv4-history"
# git's fetch-pack.c (both protocol versions): warning("filtering not recognized by server,
# ignoring") when the host does not allow filters; it then serves everything (seen with
# git 2.39.5 and a file:// host whose uploadpack.allowFilter is off)
_FILTER_IGNORED = "filtering not recognized by server"


def history_repo_path(name: str) -> Path:
    """A second cache repository per source: its history without blobs (a partial clone)."""
    return cache_root() / "git" / f"{name}.history.git"


@dataclass
class HistoryFetch:
    repo: Path
    commit: str  # what the ref names
    url: str
    note: str = ""  # set when the host refused filters and the blobs came too


def _configure_partial(repo: Path, url: str) -> None:
    """A promisor remote, so a blob the history lacks is fetched when a check reads it."""
    for key, value in (("core.repositoryformatversion", "1"),
                       (f"remote.{HISTORY_REMOTE}.url", url),
                       (f"remote.{HISTORY_REMOTE}.promisor", "true"),
                       (f"remote.{HISTORY_REMOTE}.partialclonefilter", "blob:none"),
                       ("extensions.partialClone", HISTORY_REMOTE)):
        git_text(repo, "config", key, value)


def _run_fetch(repo: Path, args: list[str], log: Path) -> tuple[bool, list[str]]:
    from dsv4_offload.core.runner import run_command

    lines: list[str] = []
    res = run_command(["git", "fetch", "--no-tags", "--no-write-fetch-head", *args], log=log,
                      cwd=repo, env=git_env(), on_line=lines.append, check=False)
    return res.returncode == 0, lines


def fetch_history(source: Source, ref: str, *, log: Path,
                  mirrors: dict[str, list[str]] | None = None) -> HistoryFetch:
    """The history of ``ref`` and the pinned commit, blob-less, into the history cache.

    1. ``fetch --filter=blob:none`` of the ref (and of the pinned commit by SHA if the ref
       does not contain it); blobs arrive on demand when a check reads a file;
    2. a host that ignores filters serves everything: kept, with a note; a filtered fetch
       that fails (and not for a dead host) is tried again without the filter, with a note.
    """
    repo = _ensure_bare(history_repo_path(source.name))
    local = f"refs/dsv4/rev/{_ref_slug(ref)}"
    want = ref if _HEX40.match(ref) else f"+{ref}:{local}"
    why = ""
    with _cache_lock(repo):
        for url in candidate_urls(source, mirrors):
            _configure_partial(repo, url)
            ok, out = _run_fetch(repo, ["--filter=blob:none", "--", HISTORY_REMOTE, want], log)
            why = next((ln for ln in reversed(out) if ln.startswith("fatal:")), "see the log")
            note = ""
            if any(_FILTER_IGNORED in line for line in out):
                note = (f"{redact(url)} does not allow filters (uploadpack.allowFilter): "
                        "fetched the full history, blobs included")
            elif not ok and not _unreachable(why):
                ok, out = _run_fetch(repo, ["--", HISTORY_REMOTE, want], log)
                note = (f"a blob-less fetch from {redact(url)} failed ({why}): fetched the full "
                        "history")
                why = next((ln for ln in reversed(out) if ln.startswith("fatal:")), why)
            if not ok:
                continue
            named = ref if _HEX40.match(ref) else local
            commit = git_text(repo, "rev-parse", f"{named}^{{commit}}")
            if not has_commit(repo, source.pinned):
                # the pinned commit is not in the ref's history: ask for it by SHA
                ok2, _ = _run_fetch(repo, ["--filter=blob:none", "--", HISTORY_REMOTE,
                                              source.pinned],
                                    log)
                if not ok2 or not has_commit(repo, source.pinned):
                    why = f"the pinned commit {source.pinned[:12]} is not reachable from {ref}"
                    continue
            git_text(repo, "update-ref", PIN_REF_PREFIX + source.pinned, source.pinned)
            git_text(repo, "update-ref", PIN_REF_PREFIX + commit, commit)
            return HistoryFetch(repo, commit, redact(url), note)
    raise Dsv4Error(f"source '{source.name}': the history of '{ref}' could not be fetched "
                    f"({why}); give a branch, tag or full SHA that exists upstream, or pass "
                    f"--mirror {source.name}=URL", log=str(log))
