"""The recipe's lock: the full SHAs that abbreviated pins (``commit_prefix`` on a
``branch``) resolved to, read from a workspace's ``.dsv4/sources.lock.json``. ``fetch``
resolves and writes them (``sources.git.write_source_lock``); the loader applies them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4_offload.core.errors import InputError
from dsv4_offload.recipe.fields import HEX40

if TYPE_CHECKING:
    from dsv4_offload.recipe.model import Recipe


def read_source_locks(lock_file: Path) -> dict[str, dict[str, str]]:
    """``name -> {commit_prefix, branch, commit, resolved}`` from the workspace lock file."""
    try:
        doc = json.loads(lock_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise InputError(f"{lock_file}: unreadable JSON ({exc}); move it aside and rerun (the "
                         "stage redoes its work)") from None
    locks = doc.get("sources") if isinstance(doc, dict) else None
    if not isinstance(locks, dict):
        return {}
    return {k: v for k, v in locks.items() if isinstance(v, dict)}


def apply_source_locks(recipe: Recipe, lock_file: Path) -> list[str]:
    """Give each prefix-pinned source the full SHA locked for it; the names left unlocked."""
    locks = read_source_locks(lock_file)
    unlocked = []
    for source in recipe.sources:
        if source.commit_prefix is None:
            continue
        entry = locks.get(source.name) or {}
        commit = entry.get("commit", "")
        if (entry.get("commit_prefix") == source.commit_prefix
                and entry.get("branch") == source.branch and HEX40.match(commit)
                and commit.startswith(source.commit_prefix)):
            source.lock(commit)
        else:
            unlocked.append(source.name)
    return unlocked
