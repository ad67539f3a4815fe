"""YAML read with line numbers, so that every validation error names the file, the line,
the field and what to write instead."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    ValidationError,
)

from dsv4_offload.core.errors import InputError

# --- loading -------------------------------------------------------------------------------


# libyaml's parser is ~10x faster than the pure-Python one (status and --help read recipes)
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _LineLoader(_SafeLoader):  # type: ignore[misc,valid-type]
    """A YAML loader that remembers the line of every mapping key and sequence item."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    mapping = loader.construct_mapping(node, deep=True)
    lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        lines[key] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.SequenceNode):
            lines[(key, "items")] = [n.start_mark.line + 1 for n in value_node.value]
    keys = [loader.construct_object(k, deep=True) for k, _ in node.value]
    dup = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if dup is not None:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate key '{dup}'", node.start_mark
        )
    return Located(mapping, lines, node.start_mark.line + 1)


class Located(dict):  # type: ignore[type-arg]
    """A dict that knows where each of its keys stands: (file, line).

    The loader records bare line numbers; ``_stamp`` adds the file once it is known, so a
    recipe merged from several files (``extends:``) still points each error at its own file.
    """

    def __init__(self, data: dict[Any, Any], lines: dict[Any, Any], line: Any) -> None:
        super().__init__(data)
        self.lines = lines
        self.line = line


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def line_of(doc: Any, loc: tuple[Any, ...]) -> Any:
    """Where a pydantic error location stands, as deep as the document allows.

    A (file, line) pair for stamped documents, else a bare line number (or None).
    """
    line = getattr(doc, "line", None)
    node, parent, parent_key = doc, None, None
    for part in loc:
        if isinstance(node, Located) and part in node:
            line = node.lines.get(part, line)
            parent, parent_key, node = node, part, node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            items = None
            if isinstance(parent, Located):
                items = parent.lines.get((parent_key, "items"))
            if items:
                line = items[part]
            parent, parent_key, node = None, None, node[part]
        else:
            break
    return line


def located_at(path: str, at: Any) -> str:
    """`file:line` for an error: the stamped file if there is one, else `path`."""
    if isinstance(at, tuple):
        path, at = at
    return f"{path}:{at}" if at else path


def _stamp(doc: Any, file: str) -> Any:
    """Turn every bare line number of a freshly read document into (file, line)."""
    if isinstance(doc, Located):
        for key, value in list(doc.lines.items()):
            if isinstance(value, int):
                doc.lines[key] = (file, value)
            elif isinstance(value, list):
                doc.lines[key] = [(file, v) if isinstance(v, int) else v for v in value]
        if isinstance(doc.line, int):
            doc.line = (file, doc.line)
        for value in doc.values():
            _stamp(value, file)
    elif isinstance(doc, list):
        for value in doc:
            _stamp(value, file)
    return doc


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or str(part).startswith(
            ("function-", "tagged-union")
        ):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def located_error(path: str, doc: Any, exc: ValidationError,
                  set_at: list[tuple[str, tuple[Any, ...]]] | None = None) -> InputError:
    """The first validation error as one line: file and line (or the `--set` item that put
    the value there; ``set_at`` is ``overrides.override_locations``), field, what to do."""
    err = exc.errors()[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
    field = _format_loc(loc)
    at = line_of(doc, loc)
    for key, key_loc in set_at or []:
        n = min(len(key_loc), len(loc))
        if loc and key_loc[:n] == loc[:n]:
            path = f"--set {key} (over {path})"
            at = None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = ("unknown key; remove it or check its spelling against `dsv4-offload recipe "
               "reference` (every key, with its meaning)")
    elif err["type"] == "missing":
        msg = "required field is missing; add it"
    where = located_at(path, at)
    more = len(exc.errors()) - 1
    suffix = f" (+{more} more)" if more else ""
    return InputError(f"{where}: {field}: {msg}{suffix}")


MAX_YAML_BYTES = 4 << 20  # recipes and series are a few KiB
MAX_EXPANDED_NODES = 200_000  # after aliases are expanded; a bundled recipe has ~2,000


def expanded_nodes(node: yaml.Node, limit: int = MAX_EXPANDED_NODES) -> int:
    """How many nodes the document has once every alias is expanded (stops past ``limit``).

    PyYAML shares an aliased node instead of copying it, so nine nested anchors of ten
    aliases each load instantly, then expand to 10^9 items in whatever walks them.
    """
    sizes: dict[int, int] = {}

    def size(n: yaml.Node, depth: int) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if depth > 200:
            return limit + 1
        total = 1
        if isinstance(n, yaml.SequenceNode):
            for child in n.value:
                total += size(child, depth + 1)
                if total > limit:
                    break
        elif isinstance(n, yaml.MappingNode):
            for key, value in n.value:
                total += size(key, depth + 1) + size(value, depth + 1)
                if total > limit:
                    break
        sizes[id(n)] = total
        return total

    return size(node, 0)


def read_yaml(path: Path) -> Any:
    """A recipe or series file: a mapping, every key's line known."""
    doc = read_yaml_any(path)
    if not isinstance(doc, dict):
        kind = type(doc).__name__
        raise InputError(f"{path}: the document must be a mapping of keys, not {kind}")
    return _stamp(doc, str(path))


def read_yaml_any(path: Path) -> Any:
    """Any YAML document from a user's file: a regular file of sane size, aliases bounded;
    every failure one InputError line naming the file."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: not a regular file (a FIFO, socket or device); give a "
                             "YAML file")
        if st.st_size > MAX_YAML_BYTES:
            raise InputError(f"{path}: {st.st_size} B is far too big for a recipe or series "
                             f"(limit {MAX_YAML_BYTES >> 20} MiB); give the right file")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(
            f"{path}: file not found; give a bundled name or an existing file"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read ({exc}); give a readable UTF-8 YAML file") from None
    try:
        loader = _LineLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None and expanded_nodes(node) > MAX_EXPANDED_NODES:
                raise InputError(
                    f"{path}: the document expands to over {MAX_EXPANDED_NODES} values through "
                    "its aliases (*name); write the values out or use fewer nested aliases")
            doc = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{path}{line}: invalid YAML: {problem}; fix the syntax") from None
    except RecursionError:
        raise InputError(f"{path}: nested too deeply to be a recipe, series or probes "
                         "file; give the right file") from None
    return doc


def plain(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: plain(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [plain(v) for v in doc]
    return doc


