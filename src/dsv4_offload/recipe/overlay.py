"""The workspace's recipe overlay: serve settings `tune apply` chose, laid on the recipe.

The file is YAML holding one `serve:` mapping; `load_recipe` merges it over the recipe's
`extends:` chain and before the `--set` items (which still win), and remembers the dotted
keys it set so `serve --print` names the overlay as their origin.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dsv4_offload.core.errors import InputError
from dsv4_offload.recipe.yamldoc import Located, located_at, read_yaml

SECTION = "serve"  # the only section an overlay may set
ORIGIN = "tune overlay"  # how `serve --print` names a value the overlay set


def read_overlay(path: Path) -> tuple[Located, tuple[str, ...]]:
    """(the overlay document, its dotted leaf keys); InputError naming the file and fix."""
    doc = read_yaml(path)
    other = [k for k in doc if k != SECTION]
    if other:
        raise InputError(f"{located_at(str(path), doc.lines.get(other[0]))}: {other[0]}: a tune "
                         f"overlay sets only `{SECTION}:`; remove the key, or delete {path} "
                         "(`dsv4-offload tune apply --clear`)")
    section = doc.get(SECTION)
    if not isinstance(section, Mapping):
        raise InputError(f"{located_at(str(path), doc.line)}: {SECTION}: expected a mapping of "
                         "serve settings; rewrite it with `dsv4-offload tune apply`")
    return doc, tuple(leaf_keys(section, SECTION))


def leaf_keys(value: Any, prefix: str) -> list[str]:
    """The dotted paths of a nested mapping's leaves (``serve.env.KT_HOT_TAIL_TOKENS``)."""
    if not isinstance(value, Mapping) or not value:
        return [prefix]
    return [k for key, sub in value.items() for k in leaf_keys(sub, f"{prefix}.{key}")]


def overlay_text(setting: Mapping[str, Any], header: str) -> str:
    """The overlay file for ``setting`` (dotted keys under ``serve.``), with a comment
    header saying where it came from."""
    tree: dict[str, Any] = {}
    for key, value in sorted(setting.items()):
        parts = key.split(".")
        if parts[0] != SECTION or len(parts) < 2:
            raise ValueError(f"{key}: an overlay sets serve.* keys only")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    return comments + yaml.safe_dump(tree, sort_keys=True, allow_unicode=True)
