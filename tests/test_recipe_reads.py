"""The recorder that holds each registry row to the recipe fields its stage reads."""

from __future__ import annotations

import dataclasses
import threading

from recipe_reads import leaves, recording, uncovered

from dsv4_offload.core.registry import spec
from dsv4_offload.recipe import load_recipe


def _pick_card(recipe) -> int:  # type: ignore[no-untyped-def]
    """A read deep in a domain function, as serving/plan.py picks a card."""
    return len(recipe.host.npu_models) + recipe.serve.port


def test_the_recorder_sees_reads_in_any_function_and_thread() -> None:
    recipe = load_recipe("dsv4-flash-910b")
    with recording(recipe) as reads:
        _pick_card(recipe)
        worker = threading.Thread(target=lambda: recipe.build.steps[0].name)
        worker.start()
        worker.join()
    assert {"host.npu_models", "serve.port", "build.steps.name"} <= reads
    assert "host" in reads and leaves(reads) >= {"host.npu_models", "serve.port"}
    assert "host" not in leaves(reads)  # a section read on the way to its fields
    recipe.host.npu_models  # noqa: B018  (after the block: not recorded, classes restored)
    assert "__getattribute__" not in type(recipe.host).__dict__


def test_a_row_that_omits_a_field_its_stage_reads_is_caught() -> None:
    """serve reads host.npu_models (serving/plan.py picks a card of those models): a row
    without host, as serve's was, leaves it uncovered; the row as it is covers it."""
    serve = spec("serve")
    reads = {"host", "host.npu_models", "serve", "serve.port", "conversion",
             "conversion.gguf_dir", "name"}
    assert uncovered(serve, reads) == []
    old = dataclasses.replace(serve, recipe_fields=tuple(f for f in serve.recipe_fields
                                                         if f != "host"))
    assert uncovered(old, reads) == ["host.npu_models"]
    # what a stage it needs reads as its input covers it: convert's download weights
    assert uncovered(spec("convert"), {"weights.mxfp4.dir"}) == []
    assert uncovered(spec("download"), {"conversion.gguf_dir"}) == ["conversion.gguf_dir"]
