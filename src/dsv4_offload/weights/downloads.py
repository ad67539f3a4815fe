"""What `download` leaves for a `convert` running beside it: the per-set record of verified
files, the order files travel in, and a reader of both (with the download's liveness).

The record (``<workspace>/.dsv4/weights/<set>.json``) holds the hub listing, every file
verified so far (path -> size, mtime, the hash it matched) and every file that failed in
this download (path -> reason, and the download process that found it). `download`
rewrites it atomically after each file it verifies or fails, so it is the truth at any
moment: a SIGKILL loses at most the files in flight, and a reader never sees half a record.

The order: ``config.json`` and the safetensors index first, then the shards in the order of
the layers whose expert tensors they hold, read from the index's ``weight_map`` (tensor ->
shard), never from file names; then the rest in listing order. A converter that follows the
download can start on layer 0 while layer 1's shard is still on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core import procs
from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.states import StageState
from dsv4_offload.weights.checkpoint import CONFIG_FILE, INDEX_FILE, expert_layer
from dsv4_offload.weights.hubs import HubFile, HubListing
from dsv4_offload.workspace.store import atomic_write_json, read_json

if TYPE_CHECKING:
    from dsv4_offload.recipe.model import Recipe
    from dsv4_offload.workspace.store import Workspace

RECORD_SCHEMA = 1
HEAD_FILES = (CONFIG_FILE, INDEX_FILE)  # before any shard: they say what the shards hold


# --- the per-set record --------------------------------------------------------------------


def read_record(path: Path, spec: Any) -> dict[str, Any] | None:
    """The previous listing and verdicts, if they describe the same repo, revision, patterns."""
    record = read_json(path, None)
    if record is None:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("listing"), dict) \
            or not isinstance(record.get("verified"), dict) \
            or not isinstance(record.get("failed", {}), dict):
        raise InputError(f"{path}: not a weights record; delete it and rerun "
                         "`dsv4-offload download` (files on disk are re-hashed, not re-fetched)")
    same = (record["listing"].get("hub") == spec.hub
            and record["listing"].get("repo_id") == spec.repo_id
            and record.get("revision") == spec.revision
            and record.get("allow_patterns") == list(spec.allow_patterns))
    return record if same else None


def write_record(path: Path, listing: HubListing, allow_patterns: list[str],
                 verified: dict[str, Any], failed: dict[str, Any] | None = None,
                 listed: str | None = None) -> None:
    atomic_write_json(path, {
        "schema": RECORD_SCHEMA, "listed": listed or now_iso(), "revision": listing.revision,
        "allow_patterns": list(allow_patterns), "listing": listing.as_dict(),
        "verified": verified, "failed": failed or {},
    })


def verified_entry(local: Path, f: HubFile) -> dict[str, Any]:
    """What the record keeps of a file that matched the listing (its stat at that moment)."""
    st = local.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": f.sha256,
            "git_oid": f.git_oid}


def failed_entry(reason: str) -> dict[str, Any]:
    """A failed file, signed by this process: a reader trusts it only while this very
    download runs (a failure of an earlier run is retried by the next one)."""
    me = procs.identity()
    return {"reason": reason, "pid": me.pid, "pid_start_time": me.start_time, "at": now_iso()}


def still_verified(entry: Any, f: HubFile, size: int, mtime_ns: int) -> bool:
    return (isinstance(entry, dict) and entry.get("size") == size == f.size
            and entry.get("mtime_ns") == mtime_ns and entry.get("sha256") == f.sha256
            and entry.get("git_oid") == f.git_oid)


def unchanged_on_disk(local: Path, entry: Any) -> bool:
    """``local`` is still the file a record entry describes (same size and mtime)."""
    if not isinstance(entry, dict):
        return False
    try:
        st = local.stat()
    except OSError:
        return False
    return st.st_size == entry.get("size") and st.st_mtime_ns == entry.get("mtime_ns")


# --- the order files travel in -------------------------------------------------------------


def read_weight_map(path: Path) -> dict[str, str] | None:
    """The index's tensor -> shard map, or None when the file is absent or not an index (the
    order then falls back to the listing's; the converter says what is wrong with it)."""
    doc = read_json(path, None) if path.is_file() else None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        return None
    return {str(k): v for k, v in weight_map.items() if isinstance(v, str)}


def shard_layers(weight_map: dict[str, str]) -> dict[str, list[int]]:
    """Shard -> the layers whose expert tensors it holds (sorted), from the weight_map."""
    found: dict[str, set[int]] = {}
    for key, shard in weight_map.items():
        layer = expert_layer(key)
        if layer is not None:
            found.setdefault(shard, set()).add(layer)
    return {shard: sorted(layers) for shard, layers in found.items()}


def layer_shards(weight_map: dict[str, str]) -> dict[int, list[str]]:
    """Layer -> the shards holding its expert tensors (sorted), from the weight_map."""
    found: dict[int, set[str]] = {}
    for key, shard in weight_map.items():
        layer = expert_layer(key)
        if layer is not None:
            found.setdefault(layer, set()).add(shard)
    return {layer: sorted(shards) for layer, shards in found.items()}


def download_order(files: list[HubFile], weight_map: dict[str, str] | None) -> list[HubFile]:
    """``files`` in the order a converter following the download needs them: config and
    index, then expert shards by the first layer they hold (ties: the index's order), then
    everything else as listed."""
    holds = shard_layers(weight_map or {})
    first_seen = {shard: i for i, shard in enumerate(dict.fromkeys((weight_map or {}).values()))}
    head = sorted((f for f in files if f.path in HEAD_FILES), key=lambda f: HEAD_FILES.index(
        f.path))
    shards = sorted((f for f in files if f.path in holds),
                    key=lambda f: (holds[f.path][0], first_seen.get(f.path, 0), f.path))
    placed = {f.path for f in head} | {f.path for f in shards}
    return head + shards + [f for f in files if f.path not in placed]


# --- following a download from another process ---------------------------------------------


@dataclass
class DownloadView:
    """One look at a set's download: what is verified, what failed, whether it has ended."""

    verified: set[str] = field(default_factory=set)  # verified and unchanged on disk since
    failed: dict[str, str] = field(default_factory=dict)  # path -> reason
    ended: bool = False
    state: str = ""  # the download's stage record in a few words ("running (pid N)", ...)


def look(ws: Workspace, recipe: Recipe, which: str = "mxfp4") -> DownloadView:
    """The download of ``which`` as its record and the pipeline state show it now.

    The download has ended when its stage record is no longer ``running`` or the process
    it names (pid and start time) is gone. While it runs, only failures it found itself
    count (an earlier run's are retried); once it has ended, every failure recorded counts.
    """
    record = ws.state().record("download")
    if record is None:
        view = DownloadView(ended=True, state="no download recorded")
    elif record.status != StageState.RUNNING:
        view = DownloadView(ended=True, state=f"{record.status}"
                            + (f": {record.error}" if record.error else ""))
    elif not procs.alive(record.pid, record.pid_start_time):
        view = DownloadView(ended=True, state=f"killed (pid {record.pid} is gone)")
    else:
        view = DownloadView(state=f"running (pid {record.pid})")
    spec = getattr(recipe.weights, which)
    local_dir = ws.weights_dir(recipe, which)
    try:
        files = read_record(ws.weights_record(which), spec)
    except InputError:
        files = None  # being replaced by the download, or damaged: it says so itself
    if files is None:
        return view
    for path, entry in files["verified"].items():
        if isinstance(path, str) and unchanged_on_disk(local_dir / path, entry):
            view.verified.add(path)
    runner = (record.pid, record.pid_start_time) if record is not None else (None, None)
    for path, entry in files.get("failed", {}).items():
        if not isinstance(entry, dict) or path in view.verified:
            continue
        if view.ended or (entry.get("pid"), entry.get("pid_start_time")) == runner:
            view.failed[path] = str(entry.get("reason") or "failed")
    return view

