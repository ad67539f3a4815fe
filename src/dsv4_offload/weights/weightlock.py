"""The weights lock: what each weight set's revision resolved to at download, and its base.

Both sets name a branch (`main` on the Hub, `master` on ModelScope) read as of a date
(weights/history.py), or a full commit. The first download records, per (hub, repo,
revision), the commit it resolved to, that commit's date and the base model its card and
config name. A later run that would resolve the same revision differently is drift (a
W8A8 set of one base with MXFP4 experts of another serves garbage without an error): the
locked commit is fetched instead, with a warning. An entry of an older lock that holds a
ModelScope listing digest instead of a commit stays readable: the same listing is the same
state, and takes the commit. The two sets' bases are compared before conversion.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.results import Problem, Severity
from dsv4_offload.workspace.store import atomic_write_json

LOCK_FILE = "weights.lock.json"
# `status` asks a hub where a locked branch points at most this often (the head is cached
# in the lock), and waits this long for an answer
HEAD_TTL_S = 6 * 3600
HEAD_TIMEOUT_S = 5.0
# config.json fields that differ between models of another shape: a pair whose configs
# disagree on one is not one model
SIGNATURE_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "n_routed_experts",
                  "moe_intermediate_size", "vocab_size")


def lock_path(workspace_root: Path) -> Path:
    return workspace_root / LOCK_FILE


def read_lock(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def read_shared_lock(path: Path) -> dict[str, Any]:
    """A lock handed over with --lock FILE: read strictly (a one-line error naming it)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"--lock {path}: cannot read it ({exc.strerror}); give the "
                         f"{LOCK_FILE} of a host that downloaded this recipe") from None
    except ValueError as exc:
        raise InputError(f"--lock {path}: not JSON ({exc}); give the {LOCK_FILE} of a host "
                         "that downloaded this recipe") from None
    if not isinstance(doc, dict):
        raise InputError(f"--lock {path}: not a weights lock (a JSON object of entries); give "
                         f"the {LOCK_FILE} of a host that downloaded this recipe")
    return doc


def adopt(shared: dict[str, Any], path: Path, own: dict[str, Any],
          keys: dict[str, str]) -> dict[str, Any]:
    """``own`` with the entries ``shared`` holds for ``keys`` ({set: key}); a set the shared
    lock lacks, or that this workspace already locked at another commit, is refused."""
    doc = dict(own)
    for name, entry_key in keys.items():
        entry = shared.get(entry_key)
        commit = entry.get("resolved") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(commit, str) \
                or not re.fullmatch(r"[0-9a-f]{40}", commit):
            raise InputError(f"--lock {path}: no commit for '{entry_key}' (the recipe's {name} "
                             "set); export the lock of a host that downloaded this recipe with "
                             "this version, or download that set without --lock")
        mine = own.get(entry_key)
        held = mine.get("resolved") if isinstance(mine, dict) else None
        if held and held != commit:
            raise InputError(f"--lock {path}: '{entry_key}' is commit {commit} there, this "
                             f"workspace locked {held}; to follow the shared lock, delete "
                             f"'{entry_key}' from this workspace's {LOCK_FILE} (or use a fresh "
                             "workspace)")
        doc[entry_key] = {**entry, "from_lock": str(path)}
    return doc


def moved_past(doc: dict[str, Any], sets: dict[str, tuple[str, str, str]]) -> list[str]:
    """A line per set ({name: (hub, repo, revision)}) whose branch head, as the last
    download saw it (recorded in the lock: no hub is asked here), is past the locked
    commit."""
    lines = []
    for name, (hub, repo_id, revision) in sets.items():
        entry = doc.get(key(hub, repo_id, revision))
        head = entry.get("head") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(head, dict) \
                or not head.get("commit") or head.get("commit") == entry.get("resolved"):
            continue
        lines.append(
            f"{name}: {repo_id}@{revision} has moved past the lock: its head was "
            f"{head['commit']} ({head.get('committed') or 'date unknown'}) when seen "
            f"{head.get('seen') or '?'}, the lock holds {entry.get('resolved')} "
            f"({entry.get('committed') or 'date unknown'}); to move on, change "
            f"weights.{name}.not_after and run `dsv4-offload download --update {name}`")
    return lines


def refresh_heads(path: Path, sets: dict[str, tuple[str, str, str]],
                  ttl_s: float = HEAD_TTL_S) -> list[str]:
    """Ask each hub where a locked branch points now, for the sets whose head in the lock
    was seen more than ``ttl_s`` ago (one small request each, a short timeout), and write
    the answers back; returns a line per hub that could not be asked. The caller holds the
    workspace, so no run writes the lock meanwhile."""
    from dsv4_offload.core.clock import now_iso
    from dsv4_offload.weights import history, hubs

    doc, asked, failed = read_lock(path), False, []
    now = dt.datetime.now(dt.timezone.utc)
    for name, (hub, repo_id, revision) in sets.items():
        entry = doc.get(key(hub, repo_id, revision))
        head = entry.get("head") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or not isinstance(head, dict) \
                or (now - _when(head.get("seen"))).total_seconds() < ttl_s:
            continue
        try:
            endpoint = hubs.resolve_endpoint(hub)
            _found, seen = history.resolve(hub, repo_id, revision, None, endpoint,
                                           timeout=HEAD_TIMEOUT_S)
        except Dsv4Error as exc:
            failed.append(f"{name}: could not ask {hub} where {revision} points now "
                          f"({str(exc)[:160]}); the head shown is the one seen last")
            continue
        if seen is not None:
            entry["head"] = {"commit": seen.sha, "committed": seen.date, "seen": now_iso()}
            asked = True
    if asked:
        atomic_write_json(path, doc)
    return failed


def _when(text: Any) -> dt.datetime:
    """A recorded timestamp; an unreadable one is long ago (so it is refreshed)."""
    try:
        when = dt.datetime.fromisoformat(str(text))
    except ValueError:
        return dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


def key(hub: str, repo_id: str, revision: str) -> str:
    return f"{hub}:{repo_id}@{revision}"


def identity(resolved: str | None, listing_digest: str) -> str:
    """What a revision resolved to: the commit sha; the listing digest only where no commit
    is known (hand-copied weights, and ModelScope entries of locks written before)."""
    return resolved or f"listing:{listing_digest}"


def drift(entry: dict[str, Any] | None, resolved: str | None,
          listing_digest: str) -> str | None:
    """The locked identity when the state now differs from it, else None. An entry of an
    older lock that holds a listing digest is the same state when the listing is."""
    if not isinstance(entry, dict) or not entry.get("identity"):
        return None
    held = str(entry["identity"])
    if held.startswith("listing:") and not entry.get("resolved"):
        return None if held == f"listing:{listing_digest}" else held
    return None if held == identity(resolved, listing_digest) else held


def base_model(local_dir: Path, repo_id: str, is_source: bool) -> dict[str, Any]:
    """The base model a set says it comes from: its card's `base_model:` front matter, else
    config.json's `_name_or_path`, else (the native checkpoint) its own repo; the base
    revision where the set states one; and the config fields that define the model's shape."""
    config = _json(local_dir / "config.json")
    card = _card_meta(local_dir / "README.md")
    name, source = _card_base(card), "README.md base_model"
    if not name and isinstance(config.get("_name_or_path"), str) \
            and "/" in config["_name_or_path"]:
        name, source = config["_name_or_path"], "config.json _name_or_path"
    if not name and is_source:
        name, source = repo_id, "the repository itself (the native checkpoint)"
    revision, revision_source = (None, None) if is_source else _stated_revision(card, config)
    signature = {k: config[k] for k in SIGNATURE_KEYS if k in config}
    return {"name": name or None, "source": source if name else "not stated",
            "revision": revision, "revision_source": revision_source,
            "signature": signature}


def _stated_revision(card: dict[str, Any], config: dict[str, Any]) -> tuple[Any, str | None]:
    """The base revision a quantised set states: its card's `base_model_revision`, a
    `base_model: NAME@REV`, or config.json's `_commit_hash` (what transformers records of
    the checkpoint it loaded); (None, None) when it states none."""
    value = card.get("base_model_revision")
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # YAML reads a sha of digits alone as a number
    if isinstance(value, str) and value.strip():
        return value.strip(), "README.md base_model_revision"
    named = _card_base(card)
    if named and "@" in named:
        return named.rsplit("@", 1)[1], "README.md base_model NAME@REV"
    value = config.get("_commit_hash")
    if isinstance(value, str) and value.strip():
        return value.strip(), "config.json _commit_hash"
    return None, None


def pair_verdict(w8a8: dict[str, Any], mxfp4: dict[str, Any]) -> tuple[str, str] | None:
    """(severity, why) for the two sets' lock entries as a pair, None when they agree.

    An error when the W8A8 set is known to come from another base: another model, another
    shape, or a stated base revision that is not the MXFP4 commit. Where the base revision
    is not stated it cannot be known: a warning when the W8A8 commit is older than the
    MXFP4 one (it was made before those weights existed), a note otherwise; both name the
    two commits and their dates.
    """
    wb, mb = w8a8.get("base_model") or {}, mxfp4.get("base_model") or {}
    why = mismatch(wb, mb)
    if why is not None:
        return "error", why
    w_at, m_at = _commit_text(w8a8), _commit_text(mxfp4)
    stated, commit = wb.get("revision"), mxfp4.get("resolved")
    if isinstance(stated, str) and re.fullmatch(r"[0-9a-f]{7,40}", stated.lower()) \
            and isinstance(commit, str):
        if commit.startswith(stated.lower()):
            return None
        return "error", (f"the W8A8 set ({w_at}) was quantised from base revision {stated} "
                         f"({wb.get('revision_source')}), the MXFP4 set is {m_at}")
    said = f"names base revision '{stated}', not a commit" if stated else \
        "states no base revision"
    w_date, m_date = w8a8.get("committed"), mxfp4.get("committed")
    if isinstance(w_date, str) and isinstance(m_date, str) and w_date < m_date:
        return "warning", (f"the W8A8 set ({w_at}) {said} and is older than the MXFP4 set "
                           f"({m_at}): it cannot have been quantised from these MXFP4 weights "
                           "unless they did not change in between")
    return "info", (f"the W8A8 set ({w_at}) {said}, so whether it was quantised from the MXFP4 "
                    f"set ({m_at}) cannot be known; by their dates it can have been")


def _commit_text(entry: dict[str, Any]) -> str:
    return f"commit {entry.get('resolved') or entry.get('identity') or '?'} of " \
        f"{entry.get('committed') or 'an unknown date'}"


def mismatch(w8a8: dict[str, Any], mxfp4: dict[str, Any]) -> str | None:
    """Why the two sets are not one model, or None when nothing tells them apart."""
    a, b = w8a8.get("name"), mxfp4.get("name")
    if a and b and _norm(a).split("@")[0] != _norm(b).split("@")[0]:
        return (f"the W8A8 set names base model {a} ({w8a8.get('source')}), the MXFP4 set is "
                f"{b} ({mxfp4.get('source')})")
    sa, sb = w8a8.get("signature") or {}, mxfp4.get("signature") or {}
    differ = [k for k in SIGNATURE_KEYS if k in sa and k in sb and sa[k] != sb[k]]
    if differ:
        return "their config.json disagree on " + ", ".join(
            f"{k} ({sa[k]} vs {sb[k]})" for k in differ)
    return None


def _norm(name: str) -> str:
    return name.strip().lower().rstrip("/")


def _json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


_FRONT = re.compile(r"\A---\s*\n(.*?)\n---\s*\n", re.S)


def _card_meta(readme: Path) -> dict[str, Any]:
    """A model card's YAML front matter ({} when there is none or it does not parse)."""
    try:
        text = readme.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    front = _FRONT.match(text)
    if not front:
        return {}
    import yaml

    try:
        meta = yaml.safe_load(front.group(1))
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}


def _card_base(meta: dict[str, Any]) -> str | None:
    """`base_model:` of a card's front matter (a string or the first item)."""
    value = meta.get("base_model")
    if isinstance(value, list) and value:
        value = value[0]
    return value.strip() if isinstance(value, str) and value.strip() else None


# --- what the download stage says about the lock --------------------------------------------


def adopt_file(shared_path: Path, own_path: Path, keys: dict[str, str]) -> list[str]:
    """--lock FILE: the entries FILE holds for ``keys`` ({set: key}) written into this
    workspace's lock, so that every host of a fleet fetches the same commits."""
    doc = adopt(read_shared_lock(shared_path), shared_path, read_lock(own_path), keys)
    atomic_write_json(own_path, doc)
    return list(keys.values())


def update_problem(name: str, entry_key: str, before: dict[str, Any],
                   doc: dict[str, Any]) -> Problem:
    """--update SET: one line saying from what to what the lock moved."""
    after = doc.get(entry_key) or {}
    was = f"{before.get('resolved') or before.get('identity') or 'nothing'} " \
        f"({before.get('committed') or 'date unknown'})"
    now = f"{after.get('resolved')} ({after.get('committed') or 'date unknown'})"
    if before.get("identity") == after.get("identity"):
        return Problem("info", f"{name}: {entry_key} stays at {now}", check="update")
    return Problem(
        "warning", f"{name}: {entry_key} moved from {was} to {now}; the stages that read "
        "these weights are stale (convert, verify-gguf, serve: `dsv4-offload status` names "
        "them)", fix="run `dsv4-offload run` to redo them with the new weights", check="update")


def pair_problem(w8a8: Any, mxfp4: Any) -> Problem | None:
    """The two sets' lock entries judged as a pair (pair_verdict), as the stage reports it."""
    if not isinstance(w8a8, dict) or not isinstance(mxfp4, dict) \
            or not isinstance(w8a8.get("base_model"), dict) \
            or not isinstance(mxfp4.get("base_model"), dict):
        return None
    verdict = pair_verdict(w8a8, mxfp4)
    if verdict is None:
        return None
    severity, why = verdict
    if severity == "error":
        return Problem("error", f"the weight sets are not one model: {why}; refused before "
                       "conversion (the server would answer garbage with no error)",
                       fix="use the official W8A8 of this exact model (brief: it shares the "
                       "quarot base with the MXFP4 experts): pin both weights.*.revision to "
                       "matching releases", check="pair")
    return Problem(Severity(severity), why,
                   fix="check the W8A8 card on its hub for the base revision it was quantised "
                   "from, and pin weights.mxfp4.revision to that commit", check="pair")
