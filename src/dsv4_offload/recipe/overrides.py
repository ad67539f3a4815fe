"""`--set KEY=VALUE`: the one way overrides reach a recipe (applied by the loader)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
)

from dsv4_offload.core.errors import InputError
from dsv4_offload.recipe.model import Recipe
from dsv4_offload.recipe.yamldoc import plain

# --- overrides (--set) ---------------------------------------------------------------------
#
# `--set KEY=VALUE` takes the spelling `status` prints for a changed input
# (pipeline._flatten: `recipe.sources[sglang].commit`, list items named by their `name`, else
# by index), plain dotted paths (`sources.0.commit`), and `[i]`/`[name]` selectors. The path
# is walked against the pydantic models, so a typo names the nearest fields, and the value
# is parsed as YAML (flow lists and mappings) unless the field holds a string.

_SEGMENT = re.compile(r"\[([^\]]*)\]|([^.\[\]]+)")


def _override_parts(key: str) -> list[str]:
    """`recipe.a[b].c.0` -> ['a', 'b', 'c', '0']; raises on a malformed path."""
    parts: list[str] = []
    pos = 0
    while pos < len(key):
        if parts and key[pos] == ".":
            pos += 1
        match = _SEGMENT.match(key, pos)
        if match is None or match.end() == pos:
            raise InputError(f"--set {key}: malformed key at '{key[pos:]}'; write dotted.key, "
                             "list items as [name] or [0], e.g. sources[sglang].commit")
        parts.append(match.group(1) if match.group(1) is not None else match.group(2))
        pos = match.end()
    if not parts:
        raise InputError(f"--set {key!r}: empty key; expected dotted.key=value")
    if parts[0] == "recipe" and len(parts) > 1:
        parts = parts[1:]  # status prefixes recipe fields with 'recipe.'
    return parts


def unwrap(tp: Any) -> Any:
    """The type under Annotated[...] and Optional[...]."""
    import typing

    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
            continue
        args = typing.get_args(tp)
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
            rest = [a for a in args if a is not type(None)]
            if len(rest) == 1:
                tp = rest[0]
                continue
        return tp


def _model_field(model: type[BaseModel], key: str) -> tuple[str, Any] | None:
    """(key as written in YAML, its type) for a field of `model` named or aliased `key`."""
    for name, info in model.model_fields.items():
        if key in (name, info.alias):
            return info.alias or name, info.annotation
    return None


def _item_type(tp: Any) -> Any:
    import typing

    args = typing.get_args(tp)
    return args[0] if args else Any


def _is_text(tp: Any) -> bool:
    """A field that holds a string keeps the raw text ('1111...' is a commit, not an int)."""
    import typing

    tp = unwrap(tp)
    if tp is str:
        return True
    return typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp))


def _nearest(word: str, choices: list[str]) -> str:
    import difflib

    near = difflib.get_close_matches(word, choices, n=3, cutoff=0.5)
    return f"did you mean {', '.join(near)}?" if near else f"valid: {', '.join(choices)}"


def _set_one(doc: dict[str, Any], key: str, raw: str) -> tuple[Any, ...]:
    """Set one override in `doc` (in place); returns the resolved location, as pydantic's."""
    import typing

    parts = _override_parts(key)
    if parts[0] == "series" and len(parts) > 1:
        raise InputError(f"--set {key}: patch entries live in the series file, not the recipe; "
                         "edit that file, or point --set series=<file> at another")
    node: Any = doc
    tp: Any = Recipe
    loc: list[Any] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = ".".join(str(p) for p in loc) or "the recipe"
        kind = unwrap(tp)
        origin = typing.get_origin(kind)
        idx: Any
        if isinstance(node, list):
            names = [v.get("name") for v in node if isinstance(v, dict)]
            if part.isdigit():
                idx = int(part)
                if idx >= len(node):
                    raise InputError(f"--set {key}: '{part}' is not an index of {here} "
                                     f"({len(node)} items: 0..{len(node) - 1})")
            elif part in names:
                idx = names.index(part)
            else:
                known = [str(n) for n in names if n is not None]
                raise InputError(f"--set {key}: '{part}' is not an item of {here}; "
                                 + (_nearest(part, known) if known else "give an index"))
            sub = _item_type(kind) if origin in (list, tuple) else Any
        elif isinstance(node, dict):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found = _model_field(kind, part)
                if found is None:
                    fields = [info.alias or n for n, info in kind.model_fields.items()]
                    raise InputError(f"--set {key}: '{part}' is not a key of {here}; "
                                     f"{_nearest(part, fields)}")
                idx, sub = found
            else:
                # an open mapping (serve.env, host.tools, conversion.digests): any key
                args = typing.get_args(kind)
                key_tp, sub = (args[0], args[1]) if len(args) == 2 else (Any, Any)
                idx = int(part) if part.isdigit() and (key_tp is int or int(part) in node) else part
            if not last and idx not in node:
                inner = unwrap(sub)
                is_map = typing.get_origin(inner) is dict or (
                    isinstance(inner, type) and issubclass(inner, BaseModel))
                if not is_map:
                    whole = ".".join([*map(str, loc), part])
                    what = "list" if typing.get_origin(inner) in (list, tuple) else "value"
                    raise InputError(f"--set {key}: {whole} is a {what}, not a mapping; "
                                     f"set it whole, e.g. --set '{whole}=...'")
                node[idx] = {}
        else:
            prev = ".".join(str(p) for p in loc)
            raise InputError(f"--set {key}: {prev} is a value, not a mapping or list; "
                             f"set it whole with --set {prev}=...")
        loc.append(idx)
        if last:
            if _is_text(sub):
                node[idx] = raw
            else:
                try:
                    node[idx] = yaml.safe_load(raw) if raw != "" else ""
                except yaml.YAMLError as exc:
                    problem = getattr(exc, "problem", None) or "invalid YAML"
                    raise InputError(f"--set {key}: value {raw!r} is not valid YAML ({problem}); "
                                     "quote it, e.g. --set 'serve.env={A: \"1\"}'") from None
        else:
            node, tp = node[idx], sub
    return tuple(loc)


def apply_overrides(doc: dict[str, Any], overrides: list[str], path: str) -> dict[str, Any]:
    """Apply `key=value` overrides (see the rules above) to a copy of `doc`."""
    doc = plain(doc)
    for item in overrides:
        if "=" not in item:
            raise InputError(f"--set {item!r}: expected dotted.key=value, e.g. serve.port=8021")
        key, raw = item.split("=", 1)
        _set_one(doc, key.strip(), raw)
    return doc


def override_locations(doc: Any, overrides: list[str]) -> list[tuple[str, tuple[Any, ...]]]:
    """Each override key with the location it resolves to in `doc` (for error messages)."""
    out = []
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        try:
            out.append((key, _set_one(plain(doc), key, item.split("=", 1)[-1])))
        except InputError:
            continue
    return out


