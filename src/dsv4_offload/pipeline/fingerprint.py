"""Fingerprints: a stage's inputs as a flat map ``input name -> short digest``.

Recipe fields are flattened to leaves, so ``status`` can name the one that changed; the
stage module may declare extra inputs (``fingerprint_inputs``); the fingerprint and outputs
of the stages it needs come in too.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from typing import Any

from pydantic import BaseModel

from dsv4_offload.core.registry import StageSpec, spec
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.placement import runs_in_container
from dsv4_offload.workspace.records import State


def _digest(value: Any) -> str:
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _flatten(prefix: str, value: Any, out: dict[str, str], exclude: tuple[str, ...]) -> None:
    if any(prefix == e or prefix.startswith(e + ".") for e in exclude):
        return
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            _flatten(f"{prefix}.{key}", sub, out, exclude)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, sub in enumerate(value):
            # name list items by their 'name' when they have one: stable under reordering
            label = sub.get("name", i) if isinstance(sub, dict) else i
            _flatten(f"{prefix}[{label}]", sub, out, exclude)
    else:
        out[prefix] = _digest(value)


def recipe_inputs(ctx: StageContext, stage: StageSpec) -> dict[str, str]:
    dumped = ctx.recipe.model_dump(mode="json", by_alias=True)
    out: dict[str, str] = {}
    for dotted in stage.recipe_fields:
        if dotted == "series":
            _flatten("series", ctx.series.model_dump(mode="json", by_alias=True), out, ())
            continue
        node: Any = dumped
        for part in dotted.split("."):
            node = node[part]
        _flatten("recipe." + dotted, node, out, tuple("recipe." + e for e in stage.exclude))
    return out


def load_stage_module(stage: StageSpec) -> Any | None:
    """The stage's module, or None where this version has none."""
    try:
        return importlib.import_module(stage.module)
    except ModuleNotFoundError as exc:
        if exc.name == stage.module:
            return None
        raise


def fingerprint(ctx: StageContext, stage: StageSpec, state: State,
                _memo: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    memo = {} if _memo is None else _memo
    if stage.name in memo:
        return memo[stage.name]
    fp = recipe_inputs(ctx, stage)
    module = load_stage_module(stage)
    extra = getattr(module, "fingerprint_inputs", None) if module else None
    if extra is not None and runs_in_container(ctx.recipe, stage.name):
        # its tool versions are the container's: the host takes those the container recorded
        # (the container's own run computes them afresh when it runs the stage)
        record = state.record(stage.name)
        recorded = (record.fingerprint if record is not None else None) or {}
        fp.update({k: v for k, v in recorded.items() if k.startswith("input.")})
    elif extra is not None:
        sub_ctx = ctx.for_stage(stage.name)
        for key, value in extra(sub_ctx).items():
            fp[f"input.{key}"] = str(value)
    for need in stage.needs:
        upstream = fingerprint(ctx, spec(need), state, memo)
        need_record = state.record(need)
        fp[f"stage.{need}"] = _digest([upstream, need_record.outputs if need_record else None])
    memo[stage.name] = fp
    return fp


def changed_inputs(old: dict[str, str], new: dict[str, str]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]




def model_digest(value: BaseModel) -> str:
    return _digest(value.model_dump(mode="json", by_alias=True))
