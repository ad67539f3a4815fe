"""Model hubs: file listings, resumable per-file downloads, and our own verification.

The hub clients (``huggingface_hub``, ``modelscope``) fetch and resume; we never trust
them for integrity (``huggingface_hub`` accepted a corrupted file silently), so every
file is checked here against the hub's listing: size always, sha256 when the hub lists
one (LFS files, ModelScope), the git blob id otherwise (small files on Hugging Face).
Client imports stay inside functions so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsv4_offload.core.digests import file_sha256, hash_file
from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.runner import open_private_log, redact

HUBS = ("huggingface", "modelscope")
DEFAULT_ENDPOINTS = {"huggingface": "https://huggingface.co", "modelscope": "https://modelscope.cn"}
ENDPOINT_ENV = {"huggingface": "HF_ENDPOINT", "modelscope": "MODELSCOPE_ENDPOINT"}
MAX_LISTED_PATH = 1024
# a transfer under this rate for STALL_SECONDS is stalled (git's own low-speed limit, 1 KB/s)
STALL_BYTES_PER_S = 1000
STALL_SECONDS = 120.0


class HubError(Dsv4Error):
    """A hub could not be reached or refused a request."""


@dataclass(frozen=True)
class HubFile:
    """One file of a hub listing: what a correct local copy must match."""

    path: str
    size: int
    sha256: str | None = None
    git_oid: str | None = None  # sha1 of the git blob; Hugging Face lists it for every file

    @classmethod
    def from_dict(cls, value: Any, where: str) -> HubFile:
        if not isinstance(value, dict) or not isinstance(value.get("path"), str) \
                or not isinstance(value.get("size"), int) or value["size"] < 0:
            raise InputError(f"{where}: a file entry lacks 'path' or a non-negative 'size'; "
                             "delete the file and rerun `dsv4-offload download` online")
        sha, oid = value.get("sha256"), value.get("git_oid")
        return cls(listed_path(value["path"], where), value["size"],
                   sha if isinstance(sha, str) else None, oid if isinstance(oid, str) else None)


def listed_path(path: Any, where: str) -> str:
    """``path`` from a listing when it is a plain relative path (no '/', '..', '.', NUL at
    its start or inside); otherwise an InputError naming the entry, before anything is
    written or deleted for it."""
    text = path if isinstance(path, str) else repr(path)
    parts = text.split("/")
    if not isinstance(path, str) or not path or len(path) > MAX_LISTED_PATH \
            or any(part in ("", ".", "..") for part in parts) \
            or any(ord(c) < 32 or c == "\\" for c in path):
        raise InputError(
            f"{where}: listing entry {text[:120]!r} is not a relative path inside the weights "
            "directory (absolute, '..', empty part or control character); refusing the whole "
            "listing — check the hub or --endpoint mirror you use")
    return path


def confined(local_dir: Path, path: str, where: str) -> Path:
    """``local_dir / path`` after checking that ``path`` is a plain relative path and that no
    directory or file on the way below ``local_dir`` is a symlink."""
    probe = local_dir
    for part in listed_path(path, where).split("/"):
        probe = probe / part
        if probe.is_symlink():
            raise InputError(f"{where}: listing entry '{path}' goes through the symlink {probe}; "
                             "remove that link (weights are written only inside "
                             f"{local_dir}) and rerun")
    return probe


@dataclass
class HubListing:
    """The files of one repo at one revision, as the hub lists them."""

    hub: str
    repo_id: str
    revision: str
    resolved: str | None  # the commit sha the revision pointed at (None if the hub has none)
    endpoint: str
    files: list[HubFile] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def digest(self) -> str:
        """A short identity of the listing's content (paths, sizes, hashes)."""
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.path):
            h.update(f"{f.path}\0{f.size}\0{f.sha256 or ''}\0{f.git_oid or ''}\n".encode())
        return h.hexdigest()[:16]

    def as_dict(self) -> dict[str, Any]:
        return {"hub": self.hub, "repo_id": self.repo_id, "revision": self.revision,
                "resolved": self.resolved, "endpoint": redact(self.endpoint),
                "files": [asdict(f) for f in self.files]}

    @classmethod
    def from_dict(cls, value: Any, where: str) -> HubListing:
        if not isinstance(value, dict) or value.get("hub") not in HUBS \
                or not isinstance(value.get("files"), list):
            raise InputError(f"{where}: not a hub listing (needs 'hub' and 'files'); delete it "
                             "and rerun `dsv4-offload download` online")
        return cls(value["hub"], str(value.get("repo_id")), str(value.get("revision")),
                   value.get("resolved"), str(value.get("endpoint")),
                   [HubFile.from_dict(f, where) for f in value["files"]])


def resolve_endpoint(hub: str, override: str | None = None) -> str:
    """--endpoint wins, then the hub's own variable (HF_ENDPOINT, MODELSCOPE_ENDPOINT)."""
    value = override or os.environ.get(ENDPOINT_ENV[hub]) or DEFAULT_ENDPOINTS[hub]
    if not value.startswith(("http://", "https://")):
        raise InputError(f"endpoint '{redact(value)}' for {hub} must start with http:// or "
                         f"https:// (from --endpoint or {ENDPOINT_ENV[hub]})")
    return value.rstrip("/")


# the clients' own "no network" switches (modelscope has none), honoured as --local-dir-only
OFFLINE_ENV = {"huggingface": "HF_HUB_OFFLINE"}


def offline_by_env(hub: str) -> bool:
    name = OFFLINE_ENV.get(hub)
    if name is None:
        return False
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def unreachable(hub: str, repo_id: str, endpoint: str, exc: BaseException) -> HubError:
    reason = redact(str(exc).splitlines()[0]) if str(exc) else type(exc).__name__
    return HubError(
        f"cannot list {repo_id} on {hub} at {redact(endpoint)} "
        f"({type(exc).__name__}: {reason[:160]})",
        hint=f"check the network or a mirror (--endpoint URL or {ENDPOINT_ENV[hub]}); if the "
        "files are already on disk, rerun with --local-dir-only",
    )


def not_a_listing(hub: str, repo_id: str, endpoint: str, exc: BaseException) -> HubError:
    reason = redact(str(exc).splitlines()[0]) if str(exc) else type(exc).__name__
    return HubError(
        f"{hub} at {redact(endpoint)} answered the listing of {repo_id} with something that "
        f"is not a file listing ({type(exc).__name__}: {reason[:120]})",
        hint=f"check --endpoint / {ENDPOINT_ENV[hub]}: a proxy's HTML page or a wrong URL "
        "answers like this")


def _listed_file(path: Any, size: Any, sha256: Any, git_oid: Any) -> HubFile:
    """One listing entry, typed: a size that is not a non-negative integer is refused."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"entry {str(path)[:120]!r} has size {str(size)[:40]!r}")
    for value in (sha256, git_oid):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"entry {str(path)[:120]!r} has a hash that is not text")
    if not isinstance(path, str):
        raise ValueError(f"entry path {str(path)[:120]!r} is not text")
    return HubFile(path, size, sha256, git_oid)


def filter_paths(paths: list[str], allow_patterns: list[str]) -> list[str]:
    """The hub clients' own pattern semantics (fnmatch; a trailing '/' means a folder)."""
    from huggingface_hub.utils import filter_repo_objects

    return list(filter_repo_objects(paths, allow_patterns=allow_patterns or None))


def list_files(hub: str, repo_id: str, revision: str, allow_patterns: list[str],
               endpoint: str, commit: str | None = None) -> HubListing:
    """Ask the hub which files ``revision`` holds (after the allow patterns); at ``commit``
    when given (weights/history.py resolved it), the listing keeping ``revision``'s name."""
    if hub == "huggingface":
        listing = _list_huggingface(repo_id, commit or revision, endpoint)
    elif hub == "modelscope":
        listing = _list_modelscope(repo_id, commit or revision, endpoint)
    else:  # the recipe model only admits HUBS
        raise InputError(f"unknown hub '{hub}'; use one of {list(HUBS)}")
    if commit is not None:
        if listing.resolved not in (None, commit):
            raise HubError(f"{redact(endpoint)}: {repo_id} listed at commit {commit} answers "
                           f"for commit {listing.resolved}",
                           hint="the hub or a mirror in between serves another commit than "
                           "asked; try another --endpoint")
        listing.revision, listing.resolved = revision, commit
    where = f"{hub} listing of {repo_id}@{revision} at {redact(endpoint)}"
    for f in listing.files:
        listed_path(f.path, where)
    keep = set(filter_paths([f.path for f in listing.files], allow_patterns))
    listing.files = [f for f in listing.files if f.path in keep]
    if not listing.files:
        raise InputError(
            f"{hub} {repo_id}@{revision} lists no file matching allow_patterns {allow_patterns}; "
            "fix weights.*.allow_patterns in the recipe"
        )
    return listing


@contextlib.contextmanager
def huggingface_errors(repo_id: str, revision: str, endpoint: str) -> Iterator[None]:
    """huggingface_hub's errors as this tool's one-line ones: a revision or repository the
    hub does not have is the recipe's to fix; a hub not reached is unreachable; an answer of
    another shape is not a listing."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except RevisionNotFoundError:
        raise InputError(f"{repo_id} on huggingface has no revision '{revision}'; fix "
                         "weights.*.revision in the recipe") from None
    except RepositoryNotFoundError:
        raise InputError(f"{repo_id} not found on huggingface at {redact(endpoint)} (or it is "
                         "gated: log in with `hf auth login`); fix weights.*.repo_id") from None
    except (HfHubHTTPError, OSError) as exc:
        raise unreachable("huggingface", repo_id, endpoint, exc) from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise not_a_listing("huggingface", repo_id, endpoint, exc) from None
    except Exception as exc:
        # transport errors (connect, timeout) come from the client's httpx-family package,
        # whose name changes between huggingface_hub releases; match it by module
        if type(exc).__module__.split(".")[0].startswith(("httpx", "httpcore")):
            raise unreachable("huggingface", repo_id, endpoint, exc) from None
        raise


def _list_huggingface(repo_id: str, revision: str, endpoint: str) -> HubListing:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=endpoint)
    with huggingface_errors(repo_id, revision, endpoint):
        info = api.repo_info(repo_id, revision=revision)
        if not info.sha:
            raise HubError(f"{redact(endpoint)}: repo info of {repo_id}@{revision} has no "
                           "commit sha")
        entries = list(api.list_repo_tree(repo_id, recursive=True, revision=info.sha))
    files = []
    try:
        for e in entries:
            if not isinstance(e, RepoFile):
                continue
            sha = e.lfs.sha256 if e.lfs is not None else None
            files.append(_listed_file(e.path, e.size, sha, None if sha else e.blob_id))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise not_a_listing("huggingface", repo_id, endpoint, exc) from None
    return HubListing("huggingface", repo_id, revision, info.sha, endpoint, files)


def _list_modelscope(repo_id: str, revision: str, endpoint: str) -> HubListing:
    import requests
    from modelscope_hub.api import HubApi
    from modelscope_hub.errors import NotExistError

    try:
        entries = HubApi(endpoint=endpoint).list_repo_files(repo_id, "model", revision=revision)
    except NotExistError:
        raise InputError(f"{repo_id}@{revision} not found on modelscope at {redact(endpoint)}; fix "
                         "weights.*.repo_id / revision in the recipe") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # before requests':
        # its JSONDecodeError is a RequestException too
        raise not_a_listing("modelscope", repo_id, endpoint, exc) from None
    except (requests.RequestException, OSError) as exc:
        raise unreachable("modelscope", repo_id, endpoint, exc) from None
    except Exception as exc:
        if type(exc).__module__.startswith("modelscope_hub"):
            raise unreachable("modelscope", repo_id, endpoint, exc) from None
        raise
    try:
        files = [_listed_file(e.path, e.size, (e.sha256 or "").lower() or None, None)
                 for e in entries if getattr(e, "type", "blob") != "tree"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise not_a_listing("modelscope", repo_id, endpoint, exc) from None
    # the listing names no repo-wide commit: list_files() records the one history resolved
    return HubListing("modelscope", repo_id, revision, None, endpoint, files)


# --- client output ------------------------------------------------------------------------

CLIENT_LOGGERS = ("huggingface_hub", "modelscope_hub", "modelscope")


@contextlib.contextmanager
def client_output_to(log: Path) -> Iterator[None]:
    """Send the hub clients' log lines to ``log`` and silence their progress bars.

    Stages never print; the clients log to stderr and draw tqdm bars there. modelscope's
    downloader draws its bars unconditionally, so its module's tqdm is swapped for a
    disabled one for the duration (restored after).
    """
    import logging

    class Redacting(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return redact(super().format(record))

    open_private_log(log).close()  # 0600 before the handler appends to it
    # huggingface_hub gives its logger a stderr handler when first imported
    # (utils/logging.py:179): import it before the swap, or that handler comes back
    with contextlib.suppress(ImportError):
        import huggingface_hub.utils.logging  # noqa: F401
    handler = logging.FileHandler(log, encoding="utf-8")
    handler.setFormatter(Redacting("%(asctime)s %(name)s %(levelname)s %(message)s"))
    saved = []
    for name in CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, list(logger.handlers), logger.propagate))
        logger.handlers = [handler]
        logger.propagate = False
    restore_tqdm = _silence_modelscope_bars()
    try:
        yield
    finally:
        restore_tqdm()
        for logger, handlers, propagate in saved:
            logger.handlers = handlers
            logger.propagate = propagate
        handler.close()


def _silence_modelscope_bars() -> Callable[[], None]:
    try:
        from modelscope_hub import _download as ms_download
    except ImportError:
        return lambda: None
    original = getattr(ms_download, "tqdm", None)
    if original is None:
        return lambda: None

    class SilentBar(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    ms_download.tqdm = SilentBar

    def restore() -> None:
        ms_download.tqdm = original

    return restore


# --- local copies --------------------------------------------------------------------------


def hf_download_dir(local_dir: Path) -> Path:
    """Where huggingface_hub keeps its notes and partial files for a ``local_dir`` download."""
    return local_dir / ".cache" / "huggingface" / "download"


def client_metadata_paths(hub: str, local_dir: Path, path: str) -> list[Path]:
    """Files a client keeps beside a local copy; removing them forces a clean re-fetch."""
    if hub == "huggingface":
        # partial files are not listed here: fetch() drops huggingface_hub's stale ones
        base = hf_download_dir(local_dir) / path
        return [base.with_name(base.name + ".metadata")]
    return []


def forget_local_copy(hub: str, local_dir: Path, path: str) -> None:
    """Delete a bad local copy and the client's notes on it, so the next fetch starts clean."""
    local = confined(local_dir, path, f"{hub} local copy in {local_dir}")
    for p in [local, *client_metadata_paths(hub, local_dir, path)]:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def git_blob_oid(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    # git blob id, not security
    return hash_file(hashlib.sha1(f"blob {path.stat().st_size}\0".encode()), path, on_bytes)


def check_content(local: Path, expected: HubFile,
                  on_bytes: Callable[[int], None] | None = None) -> str | None:
    """None when ``local`` matches ``expected``; otherwise one line saying what differs."""
    try:
        size = local.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != expected.size:
        return f"size {size} B, the hub lists {expected.size} B"
    if expected.sha256:
        got = file_sha256(local, on_bytes)
        if got != expected.sha256.lower():
            return f"sha256 {got[:12]}…, the hub lists {expected.sha256[:12]}…"
    elif expected.git_oid:
        got = git_blob_oid(local, on_bytes)
        if got != expected.git_oid:
            return f"git blob id {got[:12]}…, the hub lists {expected.git_oid[:12]}…"
    return None


# --- fetching ------------------------------------------------------------------------------


def fetch(listing: HubListing, files: list[HubFile], local_dir: Path, cache_dir: Path, *,
          max_workers: int = 4, on_file_done: Callable[[HubFile], None] | None = None,
          on_poll: Callable[[], None] | None = None,
          stall_s: float = STALL_SECONDS) -> dict[str, str]:
    """Download ``files`` into ``local_dir`` with the hub's client (it resumes what it can).

    Returns {path: error line} for the files that failed (the others are on disk).
    ``on_poll`` is called about once a second while downloads run (byte progress). A hub
    that drips (under STALL_BYTES_PER_S for ``stall_s`` seconds) fails the files still in
    flight as stalled; their partial bytes stay for the next run to resume.
    """
    local_dir.mkdir(parents=True, exist_ok=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    one = _fetch_one_huggingface if listing.hub == "huggingface" else _fetch_one_modelscope
    if listing.hub == "huggingface":
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # stages never print; progress goes through ctx.progress
        drop_stale_partials(local_dir)
    todo: queue.SimpleQueue[HubFile | None] = queue.SimpleQueue()
    done: queue.SimpleQueue[tuple[HubFile, str | None]] = queue.SimpleQueue()
    for f in files:
        todo.put(f)

    def worker() -> None:
        while (f := todo.get()) is not None:
            try:
                one(listing, f, local_dir, cache_dir)
            except Exception as exc:  # any client error becomes one line for this file
                text = redact(str(exc).splitlines()[0]) if str(exc) else ""
                done.put((f, f"{type(exc).__name__}: {text[:200]}"))
            else:
                done.put((f, None))

    # daemon threads, not an executor: on Ctrl-C the command exits at once instead of
    # waiting for every in-flight file; finished files stay, partial ones are redone or resumed
    workers = max(1, min(max_workers, len(files)))
    for _ in range(workers):
        todo.put(None)
        threading.Thread(target=worker, daemon=True, name="hub-fetch").start()
    failures: dict[str, str] = {}
    finished: set[str] = set()
    window = [time.monotonic(), partial_bytes(listing.hub, local_dir), 0]  # start, bytes, files
    for _ in files:
        while True:
            try:
                f, error = done.get(timeout=1.0)
                break
            except queue.Empty:
                if on_poll:
                    on_poll()
                if _stalled(window, partial_bytes(listing.hub, local_dir), len(finished),
                            stall_s):
                    why = (f"stalled: under {STALL_BYTES_PER_S} B/s for {stall_s:.0f} s (a hub "
                           "or proxy that drips); rerun to resume from the bytes kept")
                    failures.update({x.path: why for x in files if x.path not in finished
                                     and x.path not in failures})
                    return failures  # the daemon workers end with the command
        finished.add(f.path)
        if error is not None:
            failures[f.path] = error
        elif on_file_done:
            on_file_done(f)
    return failures


def _stalled(window: list[Any], partial: int, finished: int, stall_s: float) -> bool:
    """Whether the transfer has been under STALL_BYTES_PER_S for ``stall_s``; a finished
    file or enough new bytes starts a new window."""
    start, start_bytes, start_files = window
    now = time.monotonic()
    if finished != start_files or partial - start_bytes >= STALL_BYTES_PER_S * stall_s:
        window[:] = [now, partial, finished]
        return False
    return now - start >= stall_s


def drop_stale_partials(local_dir: Path) -> list[Path]:
    """Remove partial files huggingface_hub left behind (a killed run); returns them.

    huggingface_hub 2.x downloads each file into a new per-process temp name and never
    resumes a plain-HTTP partial (Xet-backed repos resume by chunk in hf_xet's cache), so
    leftovers only waste disk. The workspace lock makes sure no other run is writing them.
    """
    root = hf_download_dir(local_dir)
    stale = sorted(root.rglob("*.incomplete")) if root.is_dir() else []
    for p in stale:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return stale


def partial_bytes(hub: str, local_dir: Path) -> int:
    """Bytes sitting in the client's partial downloads under ``local_dir`` (for progress)."""
    root = hf_download_dir(local_dir) if hub == "huggingface" else local_dir
    total = 0
    for p in root.rglob("*.incomplete") if root.is_dir() else ():
        with contextlib.suppress(OSError):
            total += p.stat().st_size
    return total


def _fetch_one_huggingface(listing: HubListing, f: HubFile, local_dir: Path,
                           cache_dir: Path) -> None:
    from huggingface_hub import hf_hub_download

    # revision = the resolved commit, so a branch moving mid-download cannot mix snapshots
    hf_hub_download(listing.repo_id, f.path, revision=listing.resolved or listing.revision,
                    local_dir=local_dir, cache_dir=cache_dir, endpoint=listing.endpoint)


def _fetch_one_modelscope(listing: HubListing, f: HubFile, local_dir: Path,
                          cache_dir: Path) -> None:
    from modelscope_hub.api import HubApi

    HubApi(endpoint=listing.endpoint).download_file(
        # the resolved commit (modelscope_hub api.py:1519-1520: "Branch, tag or commit
        # SHA"), so a branch moving mid-download cannot mix snapshots
        listing.repo_id, "model", f.path, revision=listing.resolved or listing.revision,
        cache_dir=cache_dir,
        local_dir=local_dir, expected_sha256=f.sha256, file_size=f.size)
