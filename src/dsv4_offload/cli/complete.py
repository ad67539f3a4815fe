"""Shell-completion callbacks: stage, build-step, weight-set, recipe and patch-target names.

Called by typer's completion protocol on every <TAB>, so they read the recipe's YAML (and the
files it `extends:`) without validating it: no pydantic models, no workspace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

_RECIPES = Path(__file__).resolve().parent.parent / "data" / "recipes"
_DEPTH = 8


def _recipe_spec(ctx: typer.Context) -> str | None:
    root = ctx.find_root()
    spec = root.params.get("recipe") if root.params else None
    return spec if isinstance(spec, str) else None


def _recipe_file(spec: str | None, near: Path | None = None) -> Path | None:
    spec = spec or "dsv4-flash-910b"  # recipe.DEFAULT_RECIPE, not imported: it loads pydantic
    candidate = Path(spec)
    if candidate.suffix in (".yaml", ".yml") or "/" in spec:
        if near is not None and not candidate.is_absolute():
            candidate = near / candidate
        return candidate if candidate.is_file() else None
    bundled = _RECIPES / f"{spec}.yaml"
    return bundled if bundled.is_file() else None


def _named(spec: str | None, section: str, key: str, near: Path | None = None,
           depth: int = 0) -> list[str]:
    """Names of the items of `section.key` (a named list or a mapping), through `extends:`."""
    import yaml

    path = _recipe_file(spec, near)
    if path is None or depth > _DEPTH:
        return []
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []
    if not isinstance(doc, dict):
        return []
    names: list[str] = []
    base = doc.get("extends")
    if isinstance(base, str):
        names = _named(base, section, key, path.parent, depth + 1)
    node: Any = doc.get(section) if section else doc
    items = node.get(key) if isinstance(node, dict) else None
    if isinstance(items, dict):
        names += [str(k) for k in items if str(k) not in names]
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                continue
            if item.get("remove") or (key == "sources" and item.get("patched") is False):
                names = [n for n in names if n != item["name"]]
            elif item["name"] not in names:
                names.append(item["name"])
    return names


def _matching(names: list[str], incomplete: str) -> list[str]:
    last = incomplete.rsplit(",", 1)  # --only a,b<TAB>
    head = last[0] + "," if len(last) == 2 else ""
    return [head + n for n in names if n.startswith(last[-1])]


def recipes(incomplete: str) -> list[str]:
    """Bundled recipe names."""
    return sorted(p.stem for p in _RECIPES.glob("*.yaml") if p.stem.startswith(incomplete))


def stages(incomplete: str) -> list[str]:
    """Pipeline stage names, in order."""
    from dsv4_offload.core.registry import STAGE_NAMES

    return [s for s in STAGE_NAMES if s.startswith(incomplete)]


def steps(ctx: typer.Context, incomplete: str) -> list[str]:
    """The recipe's build.steps names."""
    return _matching(_named(_recipe_spec(ctx), "build", "steps"), incomplete)


def weight_sets(ctx: typer.Context, incomplete: str) -> list[str]:
    """The recipe's weight-set names (the keys of `weights`)."""
    return _matching(_named(_recipe_spec(ctx), "", "weights"), incomplete)


def targets(ctx: typer.Context, incomplete: str) -> list[str]:
    """Patch targets: the recipe's sources that are patched."""
    return _matching(_named(_recipe_spec(ctx), "", "sources"), incomplete)
