"""The pipeline: stage order, fingerprints, state, the serial run and the stage graph.

This package's face; the work lives in its modules, one idea each:
``fingerprint`` (a stage's inputs), ``status`` (what a stage's record says now),
``groups`` (the process groups of a running stage), ``options`` (each stage's typed
options, built and checked), ``serial`` (`run --serial`, the plan
and the hand-over to the container) and ``schedule`` (the pipelined `run`).
"""

from __future__ import annotations

from dsv4_offload.core.registry import STAGE_NAMES, STAGES, StageSpec, spec
from dsv4_offload.pipeline.fingerprint import (
    changed_inputs,
    fingerprint,
    load_stage_module,
    model_digest,
    recipe_inputs,
)
from dsv4_offload.pipeline.groups import leftover_processes, sweep_leftovers
from dsv4_offload.pipeline.options import from_wire, options_type, stage_options
from dsv4_offload.pipeline.serial import (
    PlanItem,
    RunOutcome,
    dispatch_stage,
    evaluate,
    plan,
    run_pipeline,
    run_stage,
    stage_range,
)
from dsv4_offload.pipeline.status import (
    NOT_APPLICABLE,
    StageStatus,
    not_applicable_reason,
    pipeline_status,
    stage_status,
)

__all__ = [
    "NOT_APPLICABLE", "STAGES", "STAGE_NAMES", "PlanItem", "RunOutcome",
    "StageSpec", "StageStatus", "changed_inputs", "dispatch_stage", "evaluate", "fingerprint",
    "from_wire", "leftover_processes", "load_stage_module", "model_digest",
    "not_applicable_reason", "options_type", "pipeline_status", "plan", "recipe_inputs",
    "run_pipeline", "run_stage", "spec", "stage_options", "stage_range", "stage_status",
    "sweep_leftovers",
]
