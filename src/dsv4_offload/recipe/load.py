"""Loading a recipe (bundled name or file, `extends:` chains, `--set`, the workspace's
locked commits) and its patch series: the one place a recipe becomes a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import (
    ValidationError,
)

from dsv4_offload.core.errors import InputError
from dsv4_offload.recipe.fields import BUNDLED_RECIPES, BUNDLED_SERIES, DEFAULT_RECIPE
from dsv4_offload.recipe.model import Origin, Recipe
from dsv4_offload.recipe.overlay import read_overlay
from dsv4_offload.recipe.overrides import apply_overrides, override_locations
from dsv4_offload.recipe.sections import Series
from dsv4_offload.recipe.sourcelock import apply_source_locks
from dsv4_offload.recipe.yamldoc import (
    Located,
    line_of,
    located_at,
    located_error,
    plain,
    read_yaml,
    read_yaml_any,
)


def resolve_recipe_path(spec: str | None) -> Path:
    """A bundled recipe name, or a path to a YAML file."""
    spec = spec or DEFAULT_RECIPE
    candidate = Path(spec)
    if candidate.suffix in (".yaml", ".yml") or "/" in spec or candidate.exists():
        return candidate
    bundled = BUNDLED_RECIPES / f"{spec}.yaml"
    if not bundled.exists():
        names = ", ".join(bundled_recipe_names())
        raise InputError(f"recipe '{spec}' is not bundled; use one of: {names}, or a file path")
    return bundled


def bundled_recipe_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_RECIPES.glob("*.yaml"))




# --- inheritance ---------------------------------------------------------------------------
#
# A recipe may say `extends: <bundled name or file>` and state only what differs. Mappings
# merge key by key; a list whose items all carry a `name` (sources, build steps, probes) merges
# item by item on that name: a known name merges into its item, a new one is appended (or put
# where `insert_before:`/`insert_after:` says), `remove: true` drops it. Any other value,
# `null` included, replaces the base's. The merged document is validated as a whole, and each
# error names the file and line its offending key came from.

_EXTENDS_DEPTH = 8
_LIST_DIRECTIVES = ("remove", "insert_before", "insert_after")


def _named_items(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, dict) and isinstance(v.get("name"), str) for v in value
    )


def _merge_named(base: list[Any], base_at: list[Any], over: list[Any], over_at: list[Any],
                 where: str) -> tuple[list[Any], list[Any]]:
    items = list(zip(base, base_at, strict=False))
    for item, at in zip(over, over_at, strict=False):
        name = item["name"]
        here = located_at(where, at)
        index = next((i for i, (b, _) in enumerate(items) if b["name"] == name), None)
        directives = {k: item[k] for k in _LIST_DIRECTIVES if k in item}
        body = Located({k: v for k, v in item.items() if k not in _LIST_DIRECTIVES},
                        item.lines, item.line)
        if directives.get("remove"):
            if index is None:
                raise InputError(f"{here}: remove: '{name}' is not an item of the base recipe; "
                                 "check the name")
            del items[index]
            continue
        if index is not None:
            items[index] = (_merge(items[index][0], body, where), items[index][1])
            if not ({"insert_before", "insert_after"} & directives.keys()):
                continue
            body = items.pop(index)[0]
        anchor = directives.get("insert_before") or directives.get("insert_after")
        if anchor is None:
            items.append((body, at))
            continue
        pos = next((i for i, (b, _) in enumerate(items) if b["name"] == anchor), None)
        if pos is None:
            raise InputError(f"{here}: insert_before/insert_after: '{anchor}' is not an item "
                             "of the list; name an existing item")
        items.insert(pos if "insert_before" in directives else pos + 1, (body, at))
    return [i for i, _ in items], [a for _, a in items]


def _merge(base: Any, over: Any, where: str) -> Any:
    """`over` laid on `base` (see the rules above); both keep their (file, line) marks."""
    if not (isinstance(base, Located) and isinstance(over, Located)):
        return over
    out = Located(dict(base), dict(base.lines), over.line)
    for key, value in over.items():
        out.lines[key] = over.lines.get(key)
        items = (key, "items")
        if key in base and _named_items(base[key]) and _named_items(value):
            merged, at = _merge_named(base[key], base.lines.get(items) or [],
                                      value, over.lines.get(items) or [], where)
            out[key], out.lines[items] = merged, at
        else:
            out[key] = _merge(base[key], value, where) if key in base else value
            if items in over.lines:
                out.lines[items] = over.lines[items]
            else:
                out.lines.pop(items, None)
    return out


def _base_path(spec: Any, child: Path, at: Any) -> Path:
    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"{located_at(str(child), at)}: extends: expected a bundled recipe name "
                         "or a YAML file path")
    candidate = Path(spec)
    if candidate.suffix in (".yaml", ".yml") or "/" in spec:
        return candidate if candidate.is_absolute() else child.parent / candidate
    bundled = BUNDLED_RECIPES / f"{spec}.yaml"
    if not bundled.exists():
        names = ", ".join(bundled_recipe_names())
        raise InputError(f"{located_at(str(child), at)}: extends: '{spec}' is not a bundled "
                         f"recipe; use one of: {names}, or a file path")
    return bundled


def _read_recipe(path: Path, seen: tuple[Path, ...] = ()) -> tuple[Any, list[Path]]:
    """The recipe document at `path` with its `extends:` chain merged in, and the chain."""
    doc = read_yaml(path)
    spec = doc.get("series")
    is_path = isinstance(spec, str) and (spec.endswith((".yaml", ".yml")) or "/" in spec)
    if seen and is_path and not Path(spec).is_absolute():
        # a base's series path is relative to the base's file, not to the recipe extending it
        doc["series"] = str(path.parent / spec)
    if "extends" not in doc:
        return doc, [path]
    at = doc.lines.get("extends")
    base_path = _base_path(doc["extends"], path, at)
    if base_path.resolve() in seen or base_path.resolve() == path.resolve():
        raise InputError(f"{located_at(str(path), at)}: extends: '{doc['extends']}' leads back to "
                         "itself; break the cycle")
    if len(seen) >= _EXTENDS_DEPTH:
        raise InputError(f"{located_at(str(path), at)}: extends: more than {_EXTENDS_DEPTH} "
                         "levels; flatten the chain")
    if "name" not in doc:
        raise InputError(f"{located_at(str(path), doc.line)}: name: a recipe that extends another "
                         "must name itself; add `name:`")
    base, chain = _read_recipe(base_path, (*seen, path.resolve()))
    del doc["extends"]
    doc.lines.pop("extends", None)
    return _merge(base, doc, str(path)), [path, *chain]


def load_recipe(spec: str | None = None, overrides: list[str] | None = None,
                locks: Path | None = None, overlay: Path | None = None) -> Recipe:
    """The one way a recipe is made: the file (and what it extends), the workspace's tune
    ``overlay`` when the file exists (recipe/overlay.py), then the `--set` items, validated
    as a whole; prefix-pinned sources take the full SHAs of ``locks`` (a workspace's
    sources.lock.json) when given."""
    path = resolve_recipe_path(spec)
    if looks_like_series(str(path)):
        raise InputError(
            f"{path} is a patch series, not a recipe: give it to a recipe with --set "
            f"series={path.resolve()} (or `series:` in a recipe file); `dsv4-offload recipe "
            f"validate {path}` checks it")
    located, chain = _read_recipe(path)
    overlay_keys: tuple[str, ...] = ()
    if overlay is not None and overlay.is_file():
        laid, overlay_keys = read_overlay(overlay)
        located = _merge(located, laid, str(overlay))
    else:
        overlay = None
    doc = apply_overrides(located, overrides, str(path)) if overrides else located
    try:
        recipe = Recipe.model_validate(plain(doc))
    except ValidationError as exc:
        raise located_error(str(path), located, exc,
                            override_locations(located, overrides or [])) from None
    recipe._origin = Origin(path, tuple(chain), tuple(overrides or ()), overlay, overlay_keys)
    if locks is not None and any(s.commit_prefix for s in recipe.sources):
        apply_source_locks(recipe, locks)
    return recipe


def resolve_series_path(recipe: Recipe) -> Path:
    spec = recipe.series
    if spec.endswith((".yaml", ".yml")) or "/" in spec:
        base = recipe.file
        path = Path(spec)
        return path if path.is_absolute() or base is None else base.parent / path
    return BUNDLED_SERIES / f"{spec}.yaml"


def load_series(path: Path, recipe: Recipe | None = None) -> Series:
    doc = read_yaml(path)
    try:
        series = Series.model_validate(plain(doc))
    except ValidationError as exc:
        raise located_error(str(path), doc, exc) from None
    if recipe is not None:
        names = [s.name for s in recipe.sources]
        wanted = recipe.series_targets
        for i, patch in enumerate(series.patches):
            if wanted and patch.target not in wanted:
                continue  # a target this recipe does not build (checked below as a whole)
            where = located_at(str(path), line_of(doc, ("patches", i)))
            for field, ref in (("target", patch.target), ("origin.source", patch.origin.source)):
                if ref is not None and ref not in names:
                    where = located_at(str(path), line_of(doc, ("patches", i, *field.split("."))))
                    raise InputError(
                        f"{where}: patches[{i}].{field}: '{ref}' is not a source of recipe "
                        f"'{recipe.name}'; use one of {names}"
                    )
            if patch.origin.file is not None:
                own = (path.parent / patch.origin.file).resolve()
                if not own.is_relative_to(path.parent.resolve()):
                    raise InputError(f"{where}: patches[{i}].origin.file escapes the series dir")
        series = _skip_patches(path, series, recipe)
        if wanted:
            kept = [p for p in series.patches if p.target in wanted]
            if not kept:
                raise InputError(f"{path}: no patch of series '{series.name}' targets "
                                 f"{wanted} (recipe '{recipe.name}' series_targets); check both")
            series = series.model_copy(update={"patches": kept})
    series._file = path
    return series


def _skip_patches(path: Path, series: Series, recipe: Recipe) -> Series:
    """The series without the recipe's ``series_skip`` patches, each checked: in the series,
    and one of our own fixes that says what leaving it out risks."""
    if not recipe.series_skip:
        return series
    where = f"recipe {recipe.file or recipe.name}: series_skip"
    by_name = {p.name: p for p in series.patches}
    for name in recipe.series_skip:
        patch = by_name.get(name)
        if patch is None:
            raise InputError(f"{where}: '{name}' is not a patch of series '{series.name}' "
                             f"({path}); use one of {list(by_name)}")
        if patch.upstream != "local" or not patch.risk:
            raise InputError(f"{where}: '{name}' is the delivery's patch, not one of this "
                             "project's own fixes; only those (upstream: local, with a risk) "
                             "may be left out")
    skipped = tuple(by_name[n] for n in recipe.series_skip)
    kept = series.model_copy(update={"patches": [p for p in series.patches
                                                 if p.name not in recipe.series_skip]})
    kept._skipped = skipped
    return kept


def load_recipe_and_series(
    spec: str | None = None, overrides: list[str] | None = None, locks: Path | None = None,
    overlay: Path | None = None,
) -> tuple[Recipe, Series]:
    recipe = load_recipe(spec, overrides, locks, overlay)
    return recipe, load_series(resolve_series_path(recipe), recipe)


def looks_like_series(path: str) -> bool:
    """Whether a YAML file is a patch series (it has `patches:`) rather than a recipe."""
    try:
        doc = read_yaml_any(Path(path))
    except InputError:
        return False
    return isinstance(doc, dict) and "patches" in doc and "sources" not in doc

