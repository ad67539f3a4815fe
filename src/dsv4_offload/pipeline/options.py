"""Each stage's typed options: found in its module, built from `run`'s and the given ones.

A stage module declares ``Options`` (a core/options.StageOptions model). The pipeline builds
a stage's options from three sources, in this order: the options of `run` the stage
declares too (``offered``: --mirror for fetch, --device for doctor and serve), then
``given`` (the registry row's ``run_options``, a scheduler's jobs and follow, a stand-alone
command's options read off the wire), each name checked against the type.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from dsv4_offload.core.options import StageOptions
from dsv4_offload.core.registry import spec
from dsv4_offload.pipeline.fingerprint import load_stage_module

BUNDLED_STAGES = "dsv4_offload.stages"


def options_type(name: str) -> type[StageOptions]:
    """The stage's ``Options``; a stage package swapped in (DSV4_STAGE_PACKAGE) that declares
    none takes the bundled stage's, as it takes the same command line; a stage of its own
    that declares none takes no options."""
    stage = spec(name)
    declared = getattr(load_stage_module(stage), "Options", None)
    if declared is None:
        bundled = f"{BUNDLED_STAGES}.{stage.name.replace('-', '_')}"
        try:
            declared = getattr(importlib.import_module(bundled), "Options", StageOptions)
        except ModuleNotFoundError as exc:
            if exc.name != bundled:
                raise
            declared = StageOptions
    if not (isinstance(declared, type) and issubclass(declared, StageOptions)):
        raise TypeError(f"stage '{name}': its module's Options is not a StageOptions model")
    return declared


def stage_options(name: str, offered: StageOptions | Mapping[str, Any] | None = None,
                  given: Mapping[str, Any] | None = None) -> StageOptions:
    """Stage ``name``'s options: ``offered`` where it declares them, then ``given``, whose
    every name must be one of its options (an InputError names the stage and the option)."""
    kind = options_type(name)
    base = kind.shared(offered) if offered is not None else kind()
    if not given:
        return base
    return kind.parse(name, {**base.given(), **given})


def from_wire(stage: str, data: Mapping[str, Any]) -> StageOptions:
    """The stage's options from their wire form (``StageOptions.to_wire``)."""
    return options_type(stage).parse(stage, data)
