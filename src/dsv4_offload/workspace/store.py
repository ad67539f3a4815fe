"""The workspace: one place for its layout, the lock, the state file and provenance."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core import childrun, procs
from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import InputError, LockedError
from dsv4_offload.workspace.records import (
    STATE_SCHEMA,
    RawRecord,
    RawState,
    StageRecord,
    State,
    load_state,
)

if TYPE_CHECKING:
    from dsv4_offload.recipe import Recipe

DEFAULT_WORKSPACE = "./dsv4-work"
WORKSPACE_ENV = "DSV4_WORKSPACE"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def create_exclusive(path: Path, mode: int = 0o644) -> int:
    """A new file at ``path`` for writing (its fd): a leftover of a killed run is removed
    first, and whatever appears there meanwhile (a symlink planted to redirect the write)
    makes the open fail instead of being followed (O_EXCL, O_NOFOLLOW)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # unlinks a symlink itself, never its target
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   mode)


def atomic_write_json(path: Path, value: Any) -> None:
    text = json.dumps(value, indent=2, sort_keys=False, ensure_ascii=False, default=str) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def _user(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def access_error(path: Path, write: bool = True) -> InputError:
    """One line for a workspace path this user cannot read or write: which directory, who
    owns it, and the fix. An input error (exit 2): the workspace given is not usable."""
    # the nearest directory we can see (os.path: False, not an error, where access stops)
    probe = path if os.path.isdir(path) else path.parent
    while probe.parent != probe and not os.path.exists(probe):
        probe = probe.parent
    try:
        st = probe.stat()
        owner, mode = _user(st.st_uid), f"{st.st_mode & 0o777:04o}"
    except OSError:
        owner, mode = "unknown", "?"
    me = _user(os.geteuid()) if hasattr(os, "geteuid") else "you"
    need = "read and write" if write else "read"
    if me == owner and not (hasattr(os, "geteuid") and os.geteuid() == 0):
        return InputError(
            f"workspace directory {probe} is yours (mode {mode}) but you cannot {need} it; "
            f"`chmod u+rwx {probe}`, or pick another --workspace DIR")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # root is refused only by a read-only or pseudo filesystem (/sys, /proc) or an
        # immutable flag; chown would not help
        return InputError(
            f"workspace directory {probe} is owned by {owner} (mode {mode}) and you ({me}) "
            f"cannot {need} it: a read-only or pseudo filesystem, where chown does not "
            "help; pick another --workspace DIR")
    return InputError(
        f"workspace directory {probe} is owned by {owner} (mode {mode}) and you ({me}) cannot "
        f"{need} it; run as {owner}, or `sudo chown -R {me} {probe}`, or pick another "
        "--workspace DIR")


def through_a_file_error(path: Path) -> InputError | None:
    """One line when a directory on the way to ``path`` is a file (``-w notes.txt/ws``), or
    None. The first file on the way is named."""
    for part in reversed(path.parents):
        if os.path.exists(part) and not os.path.isdir(part):
            return InputError(f"{path}: {part} is a file, not a directory; pick another "
                              "--workspace DIR")
    return None


def denied_error(exc: OSError, root: Path | None = None) -> InputError:
    """The one line for a path this user may not read (or that runs through a file), from
    the ``OSError`` that said so: the access error under the workspace ``root``."""
    me = _user(os.geteuid()) if hasattr(os, "geteuid") else "you"
    if exc.filename is None:  # not a path (a signal to another user's process, ...)
        return InputError(f"permission denied for {me} ({exc.strerror}); run as the user "
                          f"who owns the workspace{f' {root}' if root else ''}")
    path = Path(str(exc.filename))
    if isinstance(exc, NotADirectoryError):
        return through_a_file_error(path) or InputError(
            f"{path}: a directory on the way is a file; pick another --workspace DIR")
    if root is None or path == root or root in path.parents:
        return access_error(path, write=False)
    return InputError(f"{path}: permission denied for {me} ({exc.strerror}); check its "
                      "owner and mode, or run as its owner")


def read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return default
    except PermissionError:
        raise access_error(path, write=False) from None
    except NotADirectoryError as exc:
        raise denied_error(exc) from None
    except (OSError, ValueError) as exc:
        raise InputError(
            f"{path}: unreadable JSON ({exc}); move it aside and rerun (the stage redoes its work)"
        ) from None


def _holder_liveness(holder: str) -> str:
    """The lock line, shown without its start time; told when that process is gone (a
    process that inherited the lock's descriptor holds it then)."""
    words = holder.split()
    if len(words) >= 2 and words[0] == "pid" and words[1].isdigit():
        started = words[-1] if len(words) > 3 and words[-2] == "start" else None
        shown = " ".join(words[:-2]) if started is not None else holder
        if started is not None and not procs.alive(int(words[1]),
                                                   int(started) if started.isdigit() else None):
            return (f"{shown}, which has exited (a process it started still holds the lock; "
                    "`fuser` on the lock file names it)")
        return shown
    return holder


class Workspace:
    """Paths under the workspace root. Every path the tool uses is defined here."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().absolute()
        self._lock_fh: Any = None  # the open lock file while this process holds the lock
        self._borrowed: str | None = None  # the token this process works under, if lent one

    @classmethod
    def from_option(cls, value: str | None) -> Workspace:
        return cls(value or os.environ.get(WORKSPACE_ENV) or DEFAULT_WORKSPACE)

    def check_readable(self) -> None:
        """One line, before anything is read, when this user may not read the workspace (a
        0700 directory of another user) or its path runs through a file; a workspace not
        made yet is fine (the command says so, or makes it)."""
        through = through_a_file_error(self.root)
        if through is not None:
            raise through
        for directory in (self.root, self.meta_dir):
            try:
                exists = directory.is_dir()
            except PermissionError:
                raise access_error(directory, write=False) from None
            if exists and not os.access(directory, os.R_OK | os.X_OK):
                raise access_error(directory, write=False)

    # --- layout ---
    @property
    def meta_dir(self) -> Path:
        return self.root / ".dsv4"

    @property
    def state_file(self) -> Path:
        return self.meta_dir / "state.json"

    @property
    def lock_file(self) -> Path:
        return self.meta_dir / "lock"

    @property
    def records_lock_file(self) -> Path:
        """Held (flock) around each read-modify-write of the state file and provenance: the
        stage processes of a pipelined `run` write them at the same time."""
        return self.meta_dir / "records.lock"

    @property
    def events_file(self) -> Path:
        """The event stream of the last pipelined `run` (core/events); `status` reads it."""
        return self.root / "logs" / "run" / "events.jsonl"

    @property
    def sources_lock_file(self) -> Path:
        """Full SHAs that abbreviated pins (``commit_prefix``) resolved to, once."""
        return self.meta_dir / "sources.lock.json"

    @property
    def provenance_file(self) -> Path:
        return self.root / "provenance.json"

    @property
    def reports_dir(self) -> Path:
        return self.root / "reports"

    def report_file(self, stage: str) -> Path:
        """A stage's JSON report, e.g. reports/doctor.json."""
        return self.reports_dir / f"{stage}.json"

    @property
    def bandwidth_file(self) -> Path:
        """This host's measured memory bandwidth (serving/bandwidth), measured once."""
        return self.meta_dir / "bandwidth.json"

    @property
    def bench_file(self) -> Path:
        """The last `selftest --bench`: what kt-kernel's MoE read per second here."""
        return self.meta_dir / "bench.json"

    @property
    def run_dir(self) -> Path:
        """Pid files and sockets of the supervised server."""
        return self.meta_dir / "run"

    @property
    def serve_record(self) -> Path:
        """The supervised server's record: pids, URL, log (written by the supervisor)."""
        return self.run_dir / "serve.json"

    @property
    def serve_spec(self) -> Path:
        """What the detached supervisor is told to run (argv, env, log); it deletes it once read."""
        return self.run_dir / "serve-spec.json"

    @property
    def serve_supervisor_log(self) -> Path:
        return self.run_dir / "supervisor.log"

    @property
    def tune_dir(self) -> Path:
        """`tune`'s study (Optuna's SQLite storage), its plot, and the applied overlay."""
        return self.root / "tune"

    @property
    def tune_overlay(self) -> Path:
        """The serve settings `tune apply` chose: laid on the recipe by every command."""
        return self.tune_dir / "overlay.yaml"

    @property
    def serve_ladder(self) -> Path:
        """How many resident experts last came up, after a KV-cache failure."""
        return self.run_dir / "serve-ladder.json"

    def log_dir(self, stage: str) -> Path:
        return self.root / "logs" / (stage or "misc")

    def source_dir(self, recipe: Recipe, name: str) -> Path:
        return self.root / recipe.source(name).path

    def tree_dir(self, recipe: Recipe) -> Path:
        return self.source_dir(recipe, recipe.tree_root)

    def weights_dir(self, recipe: Recipe, which: str) -> Path:
        return self.root / getattr(recipe.weights, which).dir

    def gguf_dir(self, recipe: Recipe) -> Path:
        return self.root / recipe.conversion.gguf_dir

    def weights_record(self, which: str) -> Path:
        """Hub listing and verified-file cache of one weight set (download stage)."""
        return self.meta_dir / "weights" / f"{which}.json"

    @property
    def rebase_dir(self) -> Path:
        """`patch rebase` under way: its state file and the sparse work tree per target."""
        return self.root / "rebase"

    @property
    def rebased_dir(self) -> Path:
        """Where `patch rebase` writes <series>@<REF>/ without --out (the bundled data dir
        may be read-only)."""
        return self.root / "rebased"

    @property
    def hub_cache_dir(self) -> Path:
        """The hub clients' cache (locks, refs); the weights themselves go to weights_dir."""
        return self.meta_dir / "hub-cache"

    def ensure(self) -> None:
        try:
            self.meta_dir.mkdir(parents=True, exist_ok=True)
        except PermissionError:
            raise access_error(self.meta_dir) from None
        except OSError as exc:
            raise InputError(
                f"{self.root}: cannot create the workspace ({exc.strerror}); "
                "pick a writable --workspace DIR"
            ) from None
        for directory in (self.root, self.meta_dir):
            if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
                raise access_error(directory)

    # --- lock ---
    @contextlib.contextmanager
    def lock(self, command: str) -> Iterator[None]:
        """An exclusive, non-blocking lock: a second run on this workspace exits at once.

        A process given the token its holder lent (``childrun.HANDOFF_ENV``) runs under the
        holder's lock instead: the holder keeps it, so no third process gets in meanwhile.
        """
        self.ensure()
        try:
            fh = open(self.lock_file, "a+")  # noqa: SIM115 - held for the whole block
        except PermissionError:
            raise access_error(self.lock_file) from None
        except OSError as exc:
            raise InputError(f"{self.lock_file}: cannot open the workspace lock "
                             f"({exc.strerror}); remove it (it must be a plain file) and "
                             "rerun") from None
        try:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                content = fh.read()
                token = childrun.lent_token()
                if token and f"lent {token}\n" in content:
                    fh.close()
                    if childrun.on_lender_pipe():
                        _stop_when_the_lender_dies()
                    self._borrowed = token
                    try:
                        yield  # the holder waits for us with the lock in its hand
                    finally:
                        self._borrowed = None
                    return
                holder = content.strip().splitlines()[0] if content.strip() else \
                    "another dsv4-offload process"
                holder = _holder_liveness(holder)
                raise LockedError(
                    f"workspace {self.root} is in use by {holder}; wait for it to finish or "
                    "use another --workspace"
                ) from None
            fh.seek(0)
            fh.truncate()
            # the start time makes the pid an identity (core/procs): see _holder_liveness
            fh.write(f"pid {os.getpid()} ({command}, since {now_iso()}) "
                     f"start {procs.start_time(os.getpid())}\n")
            fh.flush()
            self._lock_fh = fh
            yield
        finally:
            if self._lock_fh is fh:
                self._lock_fh = None
                with contextlib.suppress(OSError):
                    fh.seek(0)
                    fh.truncate()
            fh.close()

    @contextlib.contextmanager
    def lend_lock(self) -> Iterator[str]:
        """While held: a token another process passes in ``childrun.HANDOFF_ENV`` to work
        under it. A borrower (a stage process of a pipelined `run`) passes on the token it was
        lent: the holder keeps the lock until that borrower is done, and so until its own
        borrowers are (a stage it runs in the container)."""
        import secrets

        fh = self._lock_fh
        if fh is None and self._borrowed is not None:
            yield self._borrowed
            return
        if fh is None:
            raise RuntimeError("lend_lock() needs the workspace lock held by this process")
        token = secrets.token_hex(16)
        fh.seek(0)
        holder = fh.read().splitlines()[0]
        fh.seek(0)
        fh.truncate()
        fh.write(f"{holder}\nlent {token}\n")
        fh.flush()
        try:
            yield token
        finally:
            with contextlib.suppress(OSError):
                fh.seek(0)
                fh.truncate()
                fh.write(f"{holder}\n")
                fh.flush()

    # --- state ---
    def state(self) -> State:
        """The state file, typed (workspace/records); empty when there is none yet."""
        return load_state(read_json(self.state_file, {"schema": STATE_SCHEMA, "stages": {}}),
                          self.state_file)

    def read_state(self) -> RawState:
        """The state file as it is on disk, checked and brought to this version."""
        return self.state().as_raw()

    @contextlib.contextmanager
    def records_locked(self) -> Iterator[None]:
        """Meanwhile no other process of ours reads-modifies-writes the state file or the
        provenance (a blocking flock on a side file; readers need none: every write is an
        atomic rename, so a reader sees the old file or the new one)."""
        try:
            self.meta_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.records_lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except PermissionError:
            raise access_error(self.records_lock_file) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def write_stage_record(self, stage: str, record: StageRecord | RawRecord) -> None:
        """Record the stage's last run (a raw record is read as the file's would be)."""
        if not isinstance(record, StageRecord):
            try:
                record = StageRecord.from_raw(record)
            except ValueError as exc:
                raise ValueError(f"the record of stage '{stage}': {exc}") from None
        with self.records_locked():
            atomic_write_json(self.state_file, self.state().with_record(stage, record).as_raw())

    # --- provenance ---
    def update_provenance(self, section: str, value: Any) -> None:
        with self.records_locked():
            prov = read_json(self.provenance_file, {})
            if not isinstance(prov, dict):
                prov = {}
            prov.setdefault("schema", 1)
            prov[section] = value
            prov["updated"] = now_iso()
            atomic_write_json(self.provenance_file, prov)


CACHE_ENV = "DSV4_CACHE"


def cache_root() -> Path:
    """``$DSV4_CACHE`` or ``~/.cache/dsv4-offload``: shared by every workspace of the user."""
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dsv4-offload"
    )
    return Path(base).expanduser().absolute()


def _stop_when_the_lender_dies() -> None:
    """A borrower of the lock (a stage run in the container for a host process) reads its
    stdin, the lender's pipe; EOF means the lender died (SIGKILL, a dropped SSH session) and
    with it the lock: interrupt this process as Ctrl-C would, so the stage stops, its children
    are killed and its record says interrupted, instead of running on outside the lock."""
    import signal
    import threading

    def watch() -> None:
        # the raw descriptor: a daemon thread blocked in sys.stdin's buffered reader would
        # hold its lock at interpreter shutdown (a fatal error on a normal exit)
        with contextlib.suppress(OSError):
            while os.read(0, 65536):
                pass
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="lender-watch", daemon=True).start()
