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


GIT_URL_SCHEMES = ("https", "ssh", "git", "file")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SCP_LIKE = re.compile(r"^[\w.][\w.-]*@[\w.][\w.-]*:\S+$")  # user@host:path, as git reads it


def git_url_problem(url: str) -> str | None:
    """Why ``url`` may not reach git (an option, a transport helper, another scheme); None
    when it is an https, ssh, git or file URL or ssh's user@host:path."""
    if not url or url.startswith("-"):
        return "starts with '-' (git would read it as an option)"
    if any(c.isspace() or ord(c) < 32 for c in url):
        return "contains a space or a control character"
    scheme = _SCHEME.match(url)
    if scheme is None and "::" in url:
        return f"names the transport helper '{url.split('::', 1)[0]}::' (it runs a command)"
    if scheme is not None:
        if scheme[1].lower() not in GIT_URL_SCHEMES:
            return f"its scheme '{scheme[1]}' is not one of {', '.join(GIT_URL_SCHEMES)}"
        rest = url[scheme.end():]
        if rest.startswith("-") or rest.split("@", 1)[-1].startswith("-"):
            return "its host starts with '-' (ssh would read it as an option)"
        return None
    if not _SCP_LIKE.match(url):
        return "is not a git URL"
    return None


def _url(value: str) -> str:
    why = git_url_problem(value)
    if why is not None:
        raise ValueError(f"must be a git URL (https://, ssh://, git://, file:// or "
                         f"user@host:path): this one {why}")
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
