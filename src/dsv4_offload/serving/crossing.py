"""The files a user names that a process in the container must read: visible at the same
path there (the workspace and the recipe's same-path mounts), checked before any container
work; a secret (an API key file) not visible is copied owner-only into the workspace's
private directory and crosses by that path, never on an argv; anything else is refused with
the fix."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.inputs import read_user_text
from dsv4_offload.core.options import SECRET_SUFFIX, StageOptions
from dsv4_offload.workspace.store import atomic_write_bytes

if TYPE_CHECKING:
    from dsv4_offload.recipe import Recipe
    from dsv4_offload.workspace.store import Workspace

OptionsT = TypeVar("OptionsT", bound=StageOptions)
KEYS_DIR = "keys"  # under the workspace's private state directory
# an option whose command-line flag is not its name with dashes (accept's server log)
FLAGS = {"log": "--server-log"}


def visible(path: Path, mounts: list[str]) -> bool:
    """Whether ``path`` (resolved) lies under a mount at its own path."""
    real = path.resolve()
    for mount in mounts:
        host, _, inside = mount.partition(":")
        inside = inside.split(":")[0]
        if host.rstrip("/") == inside.rstrip("/") and real.is_relative_to(Path(host).resolve()):
            return True
    return False


def private_copy(workspace: Workspace, name: str, path: Path) -> Path:
    """``path``'s bytes in an owner-only file under the workspace's private directory (0700,
    the file 0600: mkstemp's mode), named by its digest so a rerun reuses it."""
    data = read_user_text(path, "secret file", 4096, "give the file itself").encode()
    keys = workspace.meta_dir / KEYS_DIR
    keys.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(keys, 0o700)
    dest = keys / f"{name}-{hashlib.sha256(data).hexdigest()[:12]}"
    if not dest.is_file():
        atomic_write_bytes(dest, data)
    return dest


def forget(workspace: Workspace, *paths: str | None) -> None:
    """Remove the private copies among ``paths`` (its users are done with them: accept after
    its run, serve when its server stops); a path elsewhere is the user's and stays."""
    keys = (workspace.meta_dir / KEYS_DIR).resolve()
    for text in paths:
        if text and Path(text).resolve().parent == keys:
            Path(text).unlink(missing_ok=True)


def copies(before: StageOptions, after: StageOptions) -> list[str]:
    """The private copies ``cross`` made: the crossing paths it changed."""
    was, now = before.crossing_paths(), after.crossing_paths()
    return [now[k] for k in now if now[k] != was.get(k)]


def cross(options: OptionsT, mounts: list[str], workspace: Workspace, where: str) -> OptionsT:
    """``options`` as the container will read them: each named file checked, a secret that is
    not visible copied (``private_copy``), any other refused with the fix."""
    updates: dict[str, str] = {}
    for name, text in options.crossing_paths().items():
        flag = FLAGS.get(name, "--" + name.replace("_", "-"))
        path = Path(text).expanduser().absolute()
        if not path.exists():
            raise InputError(f"{flag} {path}: no such file; give a file that exists")
        if visible(path, mounts):
            continue
        if name.endswith(SECRET_SUFFIX):
            updates[name] = str(private_copy(workspace, name, path))
            continue
        raise InputError(f"{flag} {path}: not visible in {where}, which sees the workspace "
                         f"and the recipe's mounts at their own paths; copy it into "
                         f"{workspace.root} and pass that path")
    return options.model_copy(update=updates) if updates else options


def check_recipe_files(recipe: Recipe, stage: str, mounts: list[str], where: str) -> None:
    """The recipe's own file paths the server's stages read in the container: visible, or
    refused with the fix."""
    key = recipe.serve.api_key_file
    if stage in ("serve", "accept") and key and not visible(
            Path(key).expanduser().absolute(), mounts):
        raise InputError(f"serve.api_key_file {key}: not visible in {where}, which sees the "
                         "workspace and the recipe's mounts at their own paths; pass it as "
                         "`serve --api-key-file FILE` (it then crosses owner-only) or put it "
                         "under the workspace")
