"""The download stage: the W8A8 (NPU) and MXFP4 (conversion source) weights, verified by us.

For each weight set: ask the hub for its listing at the recipe's revision (the resolved
commit is what we fetch and record), check what is already on disk, make sure the disk
can take the rest, fetch the missing files with the hub's client (finished files are
kept; modelscope resumes a partial file by range, huggingface_hub resumes Xet-backed files
by chunk and restarts a plain-HTTP one), and check each file against the listing as soon
as it is complete: size always, sha256 or git blob id where the hub gives one.

The MXFP4 set goes first (the converter reads it), the W8A8 set after (only serve needs
it); within a set, config and index first, then the shards in the order of the layers
whose experts they hold (weights/downloads.py), one file at a time unless
``weights.streams`` says more. The set's record (listing, verified files, failed files) is
rewritten atomically after every verdict: a `convert --follow` beside us reads it to start
each layer as soon as its shards are verified, and a SIGKILL loses at most the files in
flight. Hashes of files already verified are cached by (size, mtime), so a rerun with
everything present hashes nothing and fetches nothing. A corrupt file is named, removed,
noted in the record, and fetched again on the next run (``--repair`` re-hashes everything).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_offload.core import proxies
from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.host import nearest_existing
from dsv4_offload.core.options import StageOptions
from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.core.runner import open_private_log, redact
from dsv4_offload.weights import downloads, history, hubs
from dsv4_offload.weights import weightlock as wlock
from dsv4_offload.weights.checkpoint import INDEX_FILE
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import atomic_write_json, read_json

WEIGHT_SETS = ("w8a8", "mxfp4")
DOWNLOAD_ORDER = ("mxfp4", "w8a8")  # the converter's source first: serve alone needs W8A8
MAX_STREAMS = 16
HASH_WORKERS = 2  # sha256 runs ~1.5 GB/s per thread; two saturate most disks
GIB = 1 << 30
SIZE_TOLERANCE = 0.2  # listing total vs recipe expected_bytes before we warn


class DownloadOptions(StageOptions):
    which: str | None = None  # one weight set (default: both)
    endpoint: str | dict[str, str] | None = None  # one URL for every hub, or {hub: URL}
    local_dir_only: bool = False  # no traffic: check what is on disk
    repair: bool = False  # fetch again the files whose digest failed
    streams: int | None = None  # files at once (default: weights.streams)
    lock: str | None = None  # a weights lock to share (another host's weights.lock.json)
    update: str | None = None  # one weight set whose lock entry moves to today's resolution


Options = DownloadOptions


@dataclass
class SetReport:
    """What happened to one weight set."""

    name: str
    listing: hubs.HubListing | None = None
    fetched: list[str] = field(default_factory=list)
    fetched_bytes: int = 0
    hashed_bytes: int = 0
    bad: dict[str, str] = field(default_factory=dict)  # path -> what is wrong (after fetching)
    refetched: dict[str, str] = field(default_factory=dict)  # corrupt before, fetched again
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    moved_to: str | None = None  # drift: the commit the revision moved to (not fetched)
    updated_from: dict[str, Any] | None = None  # --update: the lock entry before
    commit: history.Commit | None = None  # what the revision resolved to through the history
    head: history.Commit | None = None  # where the branch points today (status reads it)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)


class DownloadLog:
    """The stage log: one line per decision, so a failure can be traced afterwards."""

    def __init__(self, path: Path) -> None:
        self.path = path
        open_private_log(path).close()  # 0600: hub URLs and client messages land here

    def write(self, text: str) -> None:
        with open_private_log(self.path) as fh:
            fh.write(f"{now_iso()} {redact(text)}\n")


STALL_ENV = "DSV4_DOWNLOAD_STALL_S"


def stall_seconds() -> float:
    """Seconds under 1 KB/s before a download counts as stalled ($DSV4_DOWNLOAD_STALL_S)."""
    raw = os.environ.get(STALL_ENV, "").strip()
    if not raw:
        return hubs.STALL_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value < 86400:
        raise InputError(f"{STALL_ENV}={raw!r}: give seconds, more than 0 (the default is "
                         f"{hubs.STALL_SECONDS:.0f})")
    return value


@contextlib.contextmanager
def _loopback_bypass(ctx: StageContext, sets: list[str], log: DownloadLog) -> Iterator[None]:
    """A mirror on loopback is reached directly: its host joins NO_PROXY/no_proxy for the
    hub clients (they read the process environment), restored afterwards."""
    hosts = []
    for name in sets:
        spec = getattr(ctx.recipe.weights, name)
        try:
            host = proxies.host_of(hubs.resolve_endpoint(spec.hub,
                                                         endpoint_override(ctx, spec.hub)))
        except InputError:
            continue  # download_set reports the bad endpoint
        if proxies.is_loopback(host):
            hosts.append(host)
    if not hosts:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("no_proxy", "NO_PROXY")}
    os.environ.update({k: v for k, v in proxies.bypassing(os.environ, hosts).items()
                       if k in saved})
    log.write(f"loopback endpoint: {', '.join(hosts)} added to NO_PROXY/no_proxy")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def requested_sets(ctx: StageContext) -> list[str]:
    which = ctx.options_as(DownloadOptions).which
    if which in (None, "", "all"):
        return list(DOWNLOAD_ORDER)
    if which not in WEIGHT_SETS:
        raise InputError(f"download: unknown weight set '{which}'; use one of "
                         f"{', '.join(WEIGHT_SETS)} (or nothing for both)")
    return [which]


def endpoint_override(ctx: StageContext, hub: str) -> str | None:
    """The `endpoint` option: one URL for every hub, or a {hub: URL} mapping."""
    value = ctx.options_as(DownloadOptions).endpoint
    if isinstance(value, dict):
        return value.get(hub)
    return value


def streams(ctx: StageContext) -> int:
    """Files fetched at once: --streams, else weights.streams."""
    value = ctx.options_as(DownloadOptions).streams or ctx.recipe.weights.streams
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if not 1 <= count <= MAX_STREAMS:
        raise InputError(f"download: streams {value!r}: give 1 to {MAX_STREAMS} files at once "
                         "(--streams N or weights.streams in the recipe)")
    return count


def run(ctx: StageContext) -> StageResult:
    sets = requested_sets(ctx)
    stall_seconds()  # a bad value is refused before any traffic
    streams(ctx)
    options = ctx.options_as(DownloadOptions)
    if options.update is not None and options.update not in sets:
        raise InputError(f"download --update {options.update}: give a weight set this run "
                         f"downloads ({', '.join(sets)})")
    if options.update is not None and options.lock is not None:
        raise InputError("download: --update moves this workspace's lock, --lock takes another "
                         "one; give one of them")
    log = DownloadLog(ctx.log_dir / "download.log")
    if options.lock is not None:  # a fleet's lock: its commits become this workspace's
        taken = wlock.adopt_file(Path(options.lock), wlock.lock_path(ctx.workspace.root),
                                 {n: _spec_key(ctx, n) for n in sets})
        log.write(f"lock: took {', '.join(taken)} from {options.lock}")
    with hubs.client_output_to(log.path), _loopback_bypass(ctx, sets, log):
        reports = [download_set(ctx, name, log) for name in sets]
    locked = _lock(ctx, reports)
    for r in reports:
        if r.updated_from is not None and r.ok:
            r.problems.append(wlock.update_problem(r.name, _spec_key(ctx, r.name),
                                                  r.updated_from, locked))
    problems = [p for r in reports for p in r.problems]
    data = {r.name: _report_data(ctx, r) for r in reports}
    outputs = _outputs(ctx, reports)
    pair = wlock.pair_problem(locked.get(_spec_key(ctx, "w8a8")),
                              locked.get(_spec_key(ctx, "mxfp4")))
    if pair is not None and pair.severity == "error":
        return StageResult(Status.FAILED, pair.message.split(";")[0], data=data,
                           problems=[*problems, pair], log=str(log.path))
    if pair is not None:
        problems.append(pair)
    if not all(r.ok for r in reports):
        bad = [r.name for r in reports if not r.ok]
        return StageResult(Status.FAILED, f"weights not complete: {', '.join(bad)}", data=data,
                           problems=problems, log=str(log.path))
    others = [n for n in WEIGHT_SETS if n not in sets and n not in outputs]
    for name in others:
        problems.append(Problem(
            "warning", f"the {name} weights have not been downloaded yet",
            fix=f"run `dsv4-offload download {name}` before serving", check=name))
    status = Status.WARN if any(p.severity == "warning" for p in problems) else Status.OK
    fetched = sum(r.fetched_bytes for r in reports)
    summary = ", ".join(
        f"{r.name}: {len(r.listing.files) if r.listing else 0} files verified" for r in reports)
    if fetched:
        summary += f" ({fetched / GIB:.2f} GiB fetched)"
    return StageResult(status, summary, data=data, problems=problems, outputs=outputs,
                       log=str(log.path))


def _spec_key(ctx: StageContext, name: str) -> str:
    """The lock's key of the recipe's weight set ``name``."""
    spec = getattr(ctx.recipe.weights, name)
    return wlock.key(spec.hub, spec.repo_id, spec.revision)


def _lock(ctx: StageContext, reports: list[SetReport]) -> dict[str, Any]:
    """Record what each verified set resolved to and its base model (weights.lock.json)."""
    path = wlock.lock_path(ctx.workspace.root)
    doc = wlock.read_lock(path)
    for r in reports:
        listing, spec = r.listing, getattr(ctx.recipe.weights, r.name)
        if not r.ok or listing is None or listing.endpoint == "local":
            continue
        entry_key = wlock.key(listing.hub, listing.repo_id, listing.revision)
        old = doc.get(entry_key)
        old = old if isinstance(old, dict) else {}
        # the same state as locked: the same commit, or (a lock written before commits were
        # resolved on ModelScope) the same listing
        same = old.get("resolved") == listing.resolved \
            or old.get("identity") == f"listing:{listing.digest()}"
        committed = r.commit.date if r.commit and r.commit.sha == listing.resolved \
            else old.get("committed")
        doc[entry_key] = {
            "set": r.name, "hub": listing.hub, "repo_id": listing.repo_id,
            "revision": listing.revision,
            "not_after": spec.not_after.isoformat() if spec.not_after else None,
            "resolved": listing.resolved, "committed": committed,
            "listing_digest": listing.digest(),
            "identity": wlock.identity(listing.resolved, listing.digest()),
            "locked": (old.get("locked") if same or r.moved_to else None) or now_iso(),
            # drift: where the revision points now, while the locked commit was fetched
            **({"revision_moved_to": r.moved_to} if r.moved_to else {}),
            # a fleet's lock (--lock FILE) this entry came from
            **({"from_lock": old["from_lock"]} if old.get("from_lock") and (same or r.moved_to)
               else {}),
            # the branch's head as last seen, for `status` (which never asks the hub)
            **({"head": {"commit": r.head.sha, "committed": r.head.date, "seen": now_iso()}}
               if r.head else {"head": old["head"]} if isinstance(old.get("head"), dict)
               else {}),
            "base_model": wlock.base_model(ctx.workspace.weights_dir(ctx.recipe, r.name),
                                           spec.repo_id, is_source=r.name == "mxfp4")}
    if any(r.ok for r in reports):
        atomic_write_json(path, doc)
    return doc


def _report_data(ctx: StageContext, r: SetReport) -> dict[str, Any]:
    listing = r.listing
    return {
        "dir": str(ctx.workspace.weights_dir(ctx.recipe, r.name)),
        "hub": listing.hub if listing else None,
        "repo_id": listing.repo_id if listing else None,
        "revision": listing.revision if listing else None,
        "resolved": listing.resolved if listing else None,
        "endpoint": redact(listing.endpoint) if listing else None,
        "files": len(listing.files) if listing else 0,
        "bytes": listing.total_bytes if listing else 0,
        "fetched": r.fetched,
        "fetched_bytes": r.fetched_bytes,
        "hashed_bytes": r.hashed_bytes,
        "refetched_corrupt": r.refetched,
        "bad": r.bad,
        "missing": r.missing,
        "extra_local_files": r.extra,
        "revision_moved_to": r.moved_to,
    }


def _outputs(ctx: StageContext, reports: list[SetReport]) -> dict[str, Any]:
    """Stable facts only (they feed convert's fingerprint): no times, no byte counts fetched."""
    # a set not asked for this time keeps what the last successful run recorded (the state
    # record is already 'running' now; provenance keeps the last done outputs) while it
    # still describes the recipe's repo and revision
    previous = read_json(ctx.workspace.provenance_file, {}).get("download") or {}
    outputs: dict[str, Any] = {}
    for name in WEIGHT_SETS:
        entry, spec = previous.get(name), getattr(ctx.recipe.weights, name)
        if isinstance(entry, dict) and (entry.get("hub"), entry.get("repo_id"),
                                        entry.get("revision")) == (spec.hub, spec.repo_id,
                                                                   spec.revision):
            outputs[name] = entry
    for r in reports:
        if r.ok and r.listing is not None:
            outputs[r.name] = {
                "hub": r.listing.hub, "repo_id": r.listing.repo_id,
                "revision": r.listing.revision, "resolved": r.listing.resolved,
                "listing_digest": r.listing.digest(), "files": len(r.listing.files),
                "bytes": r.listing.total_bytes,
                "dir": str(ctx.workspace.weights_dir(ctx.recipe, r.name)),
            }
    return outputs


# --- one weight set ------------------------------------------------------------------------


def _locked_listing(ctx: StageContext, name: str, listing: hubs.HubListing,
                    locked: dict[str, Any], was: str, endpoint: str, report: SetReport,
                    log: DownloadLog) -> hubs.HubListing | None:
    """Drift: the revision now resolves to another commit than the lock holds.

    Both hubs serve any commit by its sha (huggingface_hub ``revision=<sha>``; modelscope_hub
    api.py:1519-1520 and :1755, "Branch, tag or commit SHA"): the locked commit is listed
    and fetched instead, with a warning. A lock written before ModelScope's commits were
    resolved holds a listing digest there, no commit to ask for: refused, as before.
    """
    spec = getattr(ctx.recipe.weights, name)
    lock_file = wlock.lock_path(ctx.workspace.root)
    now = listing.resolved or f"a listing with digest {listing.digest()}"
    since = locked.get("locked", "?")
    what = f"{name}: {spec.repo_id}@{spec.revision} now resolves to {now}, locked at {was} " \
        f"on {since}"
    entry = wlock.key(spec.hub, spec.repo_id, spec.revision)
    move = (f"to move on purpose, pin the new commit (--set weights.{name}.revision="
            f"{listing.resolved}) or run `dsv4-offload download --update {name}`, and download "
            "both sets again, so that they stay one model"
            if listing.resolved else
            f"to move on purpose, delete the entry '{entry}' from {lock_file} and download "
            "both sets again, so that they stay one model")
    sha = locked.get("resolved")
    if isinstance(sha, str) and sha:
        try:
            pinned = hubs.list_files(spec.hub, spec.repo_id, spec.revision, spec.allow_patterns,
                                     endpoint, commit=sha)
        except InputError as exc:
            report.problems.append(Problem(
                "error", f"{what}, and the locked commit cannot be listed any more ({exc})",
                fix=move[0].upper() + move[1:], check="drift"))
            return None
        log.write(f"{name}: drift: {spec.revision} moved to {now}; fetching the locked {sha}")
        report.moved_to = listing.resolved
        report.problems.append(Problem(
            "warning", f"{what}: the branch moved; fetching the locked commit {sha} instead "
            "(a W8A8 set of one base with MXFP4 experts of another serves garbage)",
            fix=move[0].upper() + move[1:], check="drift"))
        return pinned
    report.problems.append(Problem(
        "error", f"{what} (drift: the hub moved; a W8A8 set of one base with MXFP4 experts of "
        "another serves garbage); the lock cannot fetch the locked state: it holds a listing "
        "digest from before ModelScope commits were resolved, not a commit to ask for",
        fix=f"pin a commit of the old weights if you know it (weights.{name}.revision), or "
        f"{move}", check="drift"))
    return None


def download_set(ctx: StageContext, name: str, log: DownloadLog) -> SetReport:
    spec = getattr(ctx.recipe.weights, name)
    local_dir = ctx.workspace.weights_dir(ctx.recipe, name)
    record_path = ctx.workspace.weights_record(name)
    options = ctx.options_as(DownloadOptions)
    offline = options.local_dir_only or hubs.offline_by_env(spec.hub)
    repair = options.repair
    report = SetReport(name)
    record = downloads.read_record(record_path, spec)

    if offline:
        if record is None:
            return check_structure_only(ctx, name, local_dir, record_path, report, log)
        listing = hubs.HubListing.from_dict(record["listing"], str(record_path))
        log.write(f"{name}: offline, using the listing recorded {record.get('listed')}")
    else:
        endpoint = hubs.resolve_endpoint(spec.hub, endpoint_override(ctx, spec.hub))
        rule = f" as of {spec.not_after.isoformat()}" if spec.not_after and not spec.is_commit \
            else ""
        log.write(f"{name}: resolving {spec.hub} {spec.repo_id}@{spec.revision}{rule} at "
                  f"{endpoint}")
        try:
            report.commit, report.head = history.resolve(spec.hub, spec.repo_id,
                                                         spec.revision, spec.not_after, endpoint)
            log.write(f"{name}: {spec.revision}{rule} is commit {report.commit.sha} of "
                      f"{report.commit.date or 'an unknown date'}; listing it")
            listing = hubs.list_files(spec.hub, spec.repo_id, spec.revision,
                                      spec.allow_patterns, endpoint, commit=report.commit.sha)
        except hubs.HubError as exc:
            said = proxies.hint(os.environ)
            if said and not proxies.is_loopback(proxies.host_of(endpoint)):
                exc.hint = f"{exc.hint}; {said} (a mirror it cannot reach: add its host to " \
                    "NO_PROXY, or unset the proxy)" if exc.hint else said
            raise

        log.write(f"{name}: {len(listing.files)} files, {listing.total_bytes} B, "
                  f"resolved {listing.resolved or '-'}, listing digest {listing.digest()}")
        if not spec.is_commit and spec.not_after is None:
            report.problems.append(Problem(
                "warning", f"{name}: {spec.repo_id}@{spec.revision} has no date rule: it "
                f"resolved to the branch's head today ({listing.resolved}, "
                f"{report.commit.date if report.commit else '?'}); a host set up later may get "
                "other weights from the same recipe",
                fix=f"give weights.{name}.not_after (the bundled recipes use the delivery's "
                f"date, 2026-08-06) or a full commit as weights.{name}.revision",
                check="pin"))
        locked = wlock.read_lock(wlock.lock_path(ctx.workspace.root)).get(
            wlock.key(spec.hub, spec.repo_id, spec.revision))
        if options.update == name:  # moving on deliberately: today's resolution wins
            report.updated_from = locked if isinstance(locked, dict) else {}
            locked = None
        was = wlock.drift(locked, listing.resolved, listing.digest())
        if was is not None and locked is not None:
            pinned = _locked_listing(ctx, name, listing, locked, was, endpoint, report, log)
            if pinned is None:
                report.listing = listing
                return report
            listing = pinned
    report.listing = listing
    if not offline and abs(listing.total_bytes - spec.expected_bytes) > \
            SIZE_TOLERANCE * spec.expected_bytes:
        report.problems.append(Problem(
            "warning", f"{name}: {spec.repo_id}@{spec.revision} lists "
            f"{listing.total_bytes / GIB:.1f} GiB, the recipe expects about "
            f"{spec.expected_bytes / GIB:.1f} GiB (weights.{name}.expected_bytes)",
            fix=f"check weights.{name}.repo_id, revision and allow_patterns (another "
            "quantization or revision?); update expected_bytes if the hub is right",
            check="size"))
    verified: dict[str, Any] = {} if repair or record is None else dict(record["verified"])
    if record is not None and record["listing"].get("resolved") != listing.resolved:
        verified = {}  # another commit: cached verdicts do not carry over

    # 1. what is on disk already
    to_check, to_fetch = [], []
    for f in listing.files:
        local = hubs.confined(local_dir, f.path, f"weights.{name} listing")
        try:
            st = local.stat()
        except FileNotFoundError:
            to_fetch.append(f)
            continue
        except NotADirectoryError:
            blocker = next((p for p in reversed(local.parents) if p.is_file()), local)
            raise InputError(f"{blocker}: a file where the directory of {f.path} should be; "
                             "move it aside and rerun") from None
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{local}: not a regular file (a directory, FIFO or device) where "
                             "the listed file goes; move it aside and rerun")
        if downloads.still_verified(verified.get(f.path), f, st.st_size, st.st_mtime_ns):
            continue
        if st.st_size != f.size:
            log.write(f"{name}: {f.path}: size {st.st_size} B, listed {f.size} B")
            report.refetched[f.path] = f"size {st.st_size} B, the hub lists {f.size} B"
            to_fetch.append(f)
        else:
            to_check.append(f)
    # from here the record names this listing and only what is verified now; failures of
    # an earlier run are forgotten (this run fetches those files again)
    book = _Book(ctx, name, record_path, listing, spec.allow_patterns, verified,
                 record.get("listed") if offline and record is not None else None)
    book.forget([f.path for f in to_check + to_fetch])
    for f, why in _verify(ctx, name, local_dir, to_check, book, report, log).items():
        report.refetched[f.path] = why
        to_fetch.append(f)
    if not offline:  # offline, a bad copy is all there is: report it, keep it
        for path in report.refetched:
            hubs.forget_local_copy(listing.hub, local_dir, path)
    report.extra = _extra_files(local_dir, listing)

    # 2. fetch what is missing or was bad
    if to_fetch and offline:
        report.missing = sorted(f.path for f in to_fetch)
        described = [f"{p} ({report.refetched.get(p, 'missing')})" for p in report.missing]
        report.problems.append(Problem(
            "error", f"{name}: {len(to_fetch)} file(s) not as listed in {local_dir}: "
            f"{_sample(described)}",
            fix=f"rerun `dsv4-offload download {name}` with network access (without "
            "--local-dir-only)", check=name))
        report.refetched = {}
    elif to_fetch:
        need = sum(f.size for f in to_fetch)
        short = _disk_shortfall(local_dir, need)
        if short is not None:
            report.missing = sorted(f.path for f in to_fetch)
            report.problems.append(Problem(
                "error", f"{name}: {need / GIB:.1f} GiB still to download but only "
                f"{short / GIB:.1f} GiB free under {local_dir}",
                fix="free space there, or point the workspace (--workspace DIR) or "
                f"weights.{name}.dir at a bigger disk", check="disk"))
        else:
            _fetch(ctx, name, listing, to_fetch, local_dir, book, report, log)
    book.write()
    for path, why in report.bad.items():
        report.problems.append(Problem(
            "error", f"{name}: {local_dir / path}: {why} after download; removed",
            fix=f"rerun `dsv4-offload download {name}` to fetch it again (if it keeps failing, "
            "the hub or a proxy serves bad data: try another --endpoint)", check=name))
    for path, why in report.refetched.items():
        if path not in report.bad and path not in report.missing:
            report.problems.append(Problem(
                "info", f"{name}: {path} was corrupt on disk ({why}); fetched again",
                check=name))
    if report.extra:
        report.problems.append(Problem(
            "info", f"{name}: {len(report.extra)} local file(s) not in the hub listing: "
            f"{_sample(report.extra)}", fix="leftovers of another revision can be deleted",
            check=name))
    return report


def check_structure_only(ctx: StageContext, name: str, local_dir: Path, record_path: Path,
                         report: SetReport, log: DownloadLog) -> SetReport:
    """Weights copied in by hand, never listed: check they are whole, as far as files tell.

    Every shard the index names must exist and open (safetensors checks that its header's
    offsets cover the file exactly, so a truncated copy fails). No hashes exist to compare
    with, so the result is a warning, and no record is written: the next online run
    verifies everything.
    """
    spec = getattr(ctx.recipe.weights, name)
    no_record = (f"run `dsv4-offload download {name}` once with network access (or copy "
                 f"{record_path} from the machine that downloaded them)")
    shards = sorted(local_dir.glob("*.safetensors")) if local_dir.is_dir() else []
    if not shards:
        report.problems.append(Problem(
            "error", f"{name}: no hub listing recorded for {spec.repo_id}@{spec.revision} and "
            f"no *.safetensors in {local_dir}", fix=no_record, check=name))
        return report
    wanted = {p.name for p in shards}
    index = local_dir / "model.safetensors.index.json"
    if index.is_file():
        doc = read_json(index, {})
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict):
            report.problems.append(Problem(
                "error", f"{name}: {index}: no 'weight_map' object", fix=no_record, check=name))
            return report
        wanted |= {hubs.listed_path(v, f"{index}: weight_map") for v in weight_map.values()}
    from safetensors import safe_open

    bad: list[str] = []
    for shard in sorted(wanted):
        try:
            with safe_open(str(local_dir / shard), framework="numpy"):
                pass
        except Exception as exc:  # safetensors raises its own error types; any is a bad copy
            bad.append(shard)
            log.write(f"{name}: {shard}: {type(exc).__name__}: {str(exc)[:200]}")
    if bad:
        report.missing = bad
        report.problems.append(Problem(
            "error", f"{name}: {len(bad)} shard(s) missing or truncated in {local_dir}: "
            f"{_sample(bad)}", fix=no_record, check=name))
        return report
    files = [hubs.HubFile(rel, (local_dir / rel).stat().st_size) for rel in _local_files(local_dir)]
    report.listing = hubs.HubListing(spec.hub, spec.repo_id, spec.revision, None, "local",
                                     files)
    report.problems.append(Problem(
        "warning", f"{name}: no hub listing recorded, so only the structure was checked "
        f"({len(wanted)} shards open and are whole); nothing was hashed",
        fix=f"run `dsv4-offload download {name}` online once to verify sizes and sha256",
        check=name))
    return report


class _Book:
    """The set's record, rewritten atomically after every verdict (from the hash threads),
    with a ``file.verified`` / ``file.failed`` event for each."""

    def __init__(self, ctx: StageContext, name: str, path: Path, listing: hubs.HubListing,
                 allow_patterns: list[str], verified: dict[str, Any],
                 listed: str | None) -> None:
        self.ctx, self.name, self.path, self.listing = ctx, name, path, listing
        self.allow_patterns, self.verified, self.listed = allow_patterns, verified, listed
        self.failed: dict[str, Any] = {}
        self._lock = threading.Lock()

    def write(self) -> None:
        with self._lock:
            self._write()

    def _write(self) -> None:
        # offline, the listing is the recorded one: keep when it was listed
        downloads.write_record(self.path, self.listing, self.allow_patterns, self.verified,
                               self.failed, listed=self.listed)

    def forget(self, paths: list[str]) -> None:
        """Files about to be checked or fetched: not verified until they are again."""
        with self._lock:
            for path in paths:
                self.verified.pop(path, None)
            self._write()

    def good(self, f: hubs.HubFile, local: Path) -> None:
        with self._lock:
            self.verified[f.path] = downloads.verified_entry(local, f)
            self.failed.pop(f.path, None)
            self._write()
        self.ctx.event("file.verified", set=self.name, path=f.path, bytes=f.size)

    def bad(self, f: hubs.HubFile, why: str, final: bool) -> None:
        """A file that does not match: ``final`` when this run will not fetch it again."""
        with self._lock:
            self.verified.pop(f.path, None)
            if final:
                self.failed[f.path] = downloads.failed_entry(why)
            self._write()
        if final:
            self.ctx.event("file.failed", set=self.name, path=f.path, bytes=f.size, error=why)


def _fetch(ctx: StageContext, name: str, listing: hubs.HubListing, files: list[hubs.HubFile],
           local_dir: Path, book: _Book, report: SetReport, log: DownloadLog) -> None:
    """Fetch ``files``: config and index first, then the rest in the order the index
    gives (weights/downloads.py); each file is verified and recorded as soon as it is
    complete, while the next one travels."""
    need = sum(f.size for f in files)
    log.write(f"{name}: fetching {len(files)} file(s), {need} B: "
              f"{_sample([f.path for f in files])}")
    workers = streams(ctx)
    head = downloads.download_order([f for f in files if f.path in downloads.HEAD_FILES], None)
    rest = [f for f in files if f.path not in downloads.HEAD_FILES]
    finished = [0]
    failures: dict[str, str] = {}

    def file_done(f: hubs.HubFile) -> None:
        finished[0] += f.size
        task.update(completed=finished[0])
        verifier.submit(f)

    def poll() -> None:
        task.update(completed=finished[0] + hubs.partial_bytes(listing.hub, local_dir))

    with ctx.task(f"download {name}", total=need, unit="B") as task, \
            _Verifier(ctx, name, local_dir, book, report, log, need) as verifier:
        for batch in (head, rest):
            if batch is rest and rest:
                verifier.wait()  # the index is verified (or not) before it orders the rest
                weight_map = downloads.read_weight_map(local_dir / INDEX_FILE)
                batch = downloads.download_order(rest, weight_map)
                log.write(f"{name}: order: {_sample([f.path for f in batch], 6)}")
            if not batch:
                continue
            stalled = next((why for why in failures.values() if why.startswith("stalled")), None)
            if stalled is not None:  # the hub drips: the rest would only drip as well
                failed = {f.path: stalled for f in batch}
            else:
                failed = hubs.fetch(listing, batch, local_dir, ctx.workspace.hub_cache_dir,
                                    max_workers=workers, on_file_done=file_done,
                                    on_poll=poll, stall_s=stall_seconds())
            failures.update(failed)
            for f in batch:
                if f.path in failed:
                    log.write(f"{name}: {f.path}: download failed: {failed[f.path]}")
                    book.bad(f, f"download failed: {failed[f.path]}", final=True)
        verifier.wait()
    report.missing.extend(sorted(failures))
    if failures:
        report.problems.append(Problem(
            "error", f"{name}: {len(failures)} file(s) failed to download: "
            f"{_sample(sorted(failures))} ({next(iter(failures.values()))})",
            fix=f"rerun `dsv4-offload download {name}`: finished files are kept", check=name))
    done = [f for f in files if f.path not in failures]
    report.fetched = sorted(f.path for f in done)
    report.fetched_bytes = sum(f.size for f in done)


class _Verifier:
    """Hashes each fetched file as soon as it is complete (HASH_WORKERS threads) and records
    the verdict; a bad file is named, removed with the client's notes, and noted as failed."""

    def __init__(self, ctx: StageContext, name: str, local_dir: Path, book: _Book,
                 report: SetReport, log: DownloadLog, total: int) -> None:
        self.ctx, self.name, self.local_dir, self.book = ctx, name, local_dir, book
        self.report, self.log, self.total = report, log, total
        self._lock = threading.Lock()
        self._futures: list[Any] = []

    def __enter__(self) -> _Verifier:
        self._pool = ThreadPoolExecutor(HASH_WORKERS, thread_name_prefix="verify")
        self._task = self.ctx.progress.task(f"verify {self.name}", self.total, "B")
        return self

    def __exit__(self, *exc: object) -> None:
        # interrupted: files not hashed yet are hashed by the next run (never fetched again)
        self._pool.shutdown(wait=exc[0] is None, cancel_futures=exc[0] is not None)
        self._task.close()

    def submit(self, f: hubs.HubFile) -> None:
        self._futures.append(self._pool.submit(self._one, f))

    def wait(self) -> None:
        for future in self._futures:
            future.result()
        self._futures.clear()

    def _advance(self, n: int) -> None:
        with self._lock:  # a Task's advance is a read-modify-write
            self._task.advance(n)

    def _one(self, f: hubs.HubFile) -> None:
        local = self.local_dir / f.path
        why = hubs.check_content(local, f, self._advance)
        with self._lock:
            self.report.hashed_bytes += f.size
        if why is None:
            self.book.good(f, local)
            return
        self.log.write(f"{self.name}: {f.path}: {why}")
        with self._lock:
            self.report.bad[f.path] = why
        hubs.forget_local_copy(self.book.listing.hub, self.local_dir, f.path)
        self.book.bad(f, why, final=True)


def _verify(ctx: StageContext, name: str, local_dir: Path, files: list[hubs.HubFile],
            book: _Book, report: SetReport, log: DownloadLog) -> dict[hubs.HubFile, str]:
    """Hash files found on disk against the listing; record the good ones (each as soon as
    it is hashed), return the bad ones (fetched again by this run)."""
    if not files:
        return {}
    bad: dict[hubs.HubFile, str] = {}
    total = sum(f.size for f in files)
    lock = threading.Lock()
    with ctx.task(f"verify {name}", total=total, unit="B") as task, \
            ThreadPoolExecutor(max_workers=HASH_WORKERS) as pool:
        def advance(n: int) -> None:
            with lock:
                task.advance(n)

        results = pool.map(lambda f: (f, hubs.check_content(local_dir / f.path, f, advance)),
                           files)
        for f, why in results:
            report.hashed_bytes += f.size
            if why is None:
                book.good(f, local_dir / f.path)
            else:
                book.bad(f, why, final=False)
                bad[f] = why
                log.write(f"{name}: {f.path}: {why}")
    return bad


def _local_files(local_dir: Path) -> list[str]:
    """Files under ``local_dir`` (relative, sorted), without the clients' hidden ones."""
    if not local_dir.is_dir():
        return []
    return sorted(rel.as_posix() for rel in (p.relative_to(local_dir)
                                             for p in local_dir.rglob("*") if p.is_file())
                  if not any(part.startswith(".") for part in rel.parts))


def _extra_files(local_dir: Path, listing: hubs.HubListing) -> list[str]:
    listed = {f.path for f in listing.files}
    return [rel for rel in _local_files(local_dir) if rel not in listed]


def _disk_shortfall(local_dir: Path, need: int) -> int | None:
    """Free bytes where ``local_dir`` lives, if fewer than ``need``; else None."""
    free = shutil.disk_usage(nearest_existing(local_dir)).free
    return free if free < need else None


def _sample(paths: list[str], limit: int = 3) -> str:
    text = ", ".join(paths[:limit])
    return text + (f" and {len(paths) - limit} more" if len(paths) > limit else "")
