"""Which recipe fields a stage reads while it runs, against its registry row.

A row's ``recipe_fields`` are a hand list: nothing in the code derives them, and a field a
stage reads but its row omits (serve read ``host.npu_models`` for long) leaves the stage
"done" after a change that would change its result. Deriving the list statically cannot
see through the domain packages a stage calls (the read of ``host.npu_models`` is in
serving/plan.py, shared with other stages); a recording at run time sees exactly what the
stage read. So every test that runs a stage module in this process (``X.run(ctx)`` or
``pipeline.run_stage``) records its reads (conftest's ``recipe_reads`` fixture, for every
test) and fails when one is not covered by the row: under one of its ``recipe_fields``,
under those of a stage it needs (their fingerprints are part of its own), or under one of
its ``exclude`` entries (read, but by the row's word not an input of its result).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel

from dsv4_offload.core import registry

_lock = threading.Lock()


def _tree(model: BaseModel, path: str, out: dict[int, tuple[BaseModel, str]]) -> None:
    """Every model under ``model`` by id, with its dotted path (a list item: its list's)."""
    out[id(model)] = (model, path)
    for name in type(model).model_fields:
        value = model.__dict__.get(name)
        sub = f"{path}.{name}" if path else name
        items = ([(sub, v) for v in value] if isinstance(value, (list, tuple)) else
                 [(f"{sub}.{k}", v) for k, v in value.items()] if isinstance(value, dict)
                 else [(sub, value)])
        for where, item in items:
            if isinstance(item, BaseModel):
                _tree(item, where, out)


@contextlib.contextmanager
def recording(recipe: BaseModel) -> Iterator[set[str]]:
    """The dotted paths of the recipe's fields read (in any thread) inside the block."""
    models: dict[int, tuple[BaseModel, str]] = {}
    _tree(recipe, "", models)
    reads: set[str] = set()
    classes = {type(m) for m, _ in models.values()}

    def getattribute(self: Any, name: str) -> Any:
        value = object.__getattribute__(self, name)
        entry = models.get(id(self))
        if entry is not None and entry[0] is self and name in type(self).model_fields:
            reads.add(f"{entry[1]}.{name}" if entry[1] else name)
        return value

    patched = [c for c in classes if "__getattribute__" not in c.__dict__]
    with _lock:
        for cls in patched:
            cls.__getattribute__ = getattribute  # type: ignore[method-assign,assignment]
    try:
        yield reads
    finally:
        with _lock:
            for cls in patched:
                del cls.__getattribute__


def leaves(reads: set[str]) -> set[str]:
    """The reads no other read goes deeper than (a section read only on the way to its
    fields is not a read of the whole section)."""
    return {r for r in reads if not any(o.startswith(r + ".") for o in reads)}


def _needs(stage: registry.StageSpec) -> list[registry.StageSpec]:
    out, todo = [], list(stage.needs)
    while todo:
        name = todo.pop()
        s = registry.spec(name)
        if s not in out:
            out.append(s)
            todo.extend(s.needs)
    return out


# inputs a stage reads that its row does not name yet: adding one changes the stage's
# fingerprint, so every existing workspace would run it again (build: a rebuild of hours);
# left for a decision of their own. Which source is the tree (tree_root) changes what is
# built, tested and served; selftest writes its synthetic layer with conversion's layout.
KNOWN_GAPS: dict[str, tuple[str, ...]] = {
    "build": ("tree_root",),
    "selftest": ("tree_root", "conversion.alignment", "conversion.architecture",
                 "conversion.file_template", "conversion.gguf_name_template"),
    "serve": ("tree_root",),
}


def uncovered(stage: registry.StageSpec, reads: set[str]) -> list[str]:
    """The fields read that neither the row (its recipe_fields, exclude and reads), the rows
    of its needs, the recipe's labels nor a known gap account for."""
    covers = [*stage.recipe_fields, *stage.exclude, *stage.reads, *registry.LABELS,
              *KNOWN_GAPS.get(stage.name, ()),
              *(f for s in _needs(stage) for f in s.recipe_fields)]
    return sorted(r for r in leaves(reads)
                  if not any(r == c or r.startswith(c + ".") for c in covers))


def watch(found: dict[str, set[str]]) -> Callable[[], None]:
    """Wrap the ``run`` of every stage module imported so far, adding what each run reads
    to ``found[stage]``; the returned function unwraps them."""
    undo = []
    for stage in registry.STAGES:
        module = sys.modules.get(f"dsv4_offload.stages.{stage.name.replace('-', '_')}")
        run = getattr(module, "run", None)
        if run is None or getattr(run, "recorded", False):
            continue

        def recorded(ctx: Any, *args: Any, _run: Any = run, _name: str = stage.name,
                     **kwargs: Any) -> Any:
            recipe = getattr(ctx, "recipe", None)
            if not isinstance(recipe, BaseModel):
                return _run(ctx, *args, **kwargs)
            with recording(recipe) as reads:
                try:
                    return _run(ctx, *args, **kwargs)
                finally:
                    found.setdefault(_name, set()).update(reads)

        wrapper = functools.wraps(run)(recorded)
        wrapper.recorded = True  # type: ignore[attr-defined]
        module.run = wrapper  # type: ignore[union-attr]
        undo.append((module, run))

    def unwrap() -> None:
        for module, run in undo:
            module.run = run

    return unwrap
