"""Field types every recipe and series model shares: names, commits, digests, paths,
URLs, and the strict base model (unknown keys rejected)."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
BUNDLED_RECIPES = DATA_DIR / "recipes"
BUNDLED_SERIES = DATA_DIR / "patches"
DEFAULT_RECIPE = "dsv4-flash-910b"

HEX40 = re.compile(r"^[0-9a-f]{40}$")
HEX_PREFIX = re.compile(r"^[0-9a-f]{7,39}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# --- field types ---------------------------------------------------------------------------


def _commit(value: str) -> str:
    if not isinstance(value, str) or not HEX40.match(value):
        raise ValueError(
            "must be a full 40-hex-digit lowercase commit SHA (a tag or short SHA such as "
            "'b3173' is ambiguous); write the full SHA"
        )
    return value


def _sha256(value: str) -> str:
    if not isinstance(value, str) or not _HEX64.match(value):
        raise ValueError("must be a 64-hex-digit lowercase sha256 digest; write `sha256sum FILE`'s")
    return value


def _name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(
            "must be a plain name (letters, digits, '.', '_', '-'; no spaces or slashes)"
        )
    return value


def _relative_path(value: str) -> str:
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts or value.strip() in ("", "."):
        raise ValueError(
            "must be a relative path that stays inside its root (no leading '/', no '..')"
        )
    return value


def _url(value: str) -> str:
    if not re.match(r"^(https?|ssh|git|file)://\S+$|^[\w.-]+@[\w.-]+:\S+$", value):
        raise ValueError("must be a git URL (https://, ssh://, git://, file:// or user@host:path)")
    return value


Commit = Annotated[str, AfterValidator(_commit)]
Sha256 = Annotated[str, AfterValidator(_sha256)]
Name = Annotated[str, AfterValidator(_name)]
RelPath = Annotated[str, AfterValidator(_relative_path)]
GitUrl = Annotated[str, AfterValidator(_url)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def no_duplicates(values: list[Any], where: str, field: str) -> None:
    seen: set[Any] = set()
    for v in values:
        if v in seen:
            raise ValueError(f"duplicate {field} '{v}' in {where}; each must be unique")
        seen.add(v)
