"""Typed stage options (issue 33): each stage declares them, every name is checked, and they
cross processes as their wire form."""

from __future__ import annotations

import importlib
import json

import pytest

from dsv4_offload import pipeline
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.options import RunOptions, StageOptions
from dsv4_offload.core.registry import STAGES
from dsv4_offload.pipeline.schedule import Budget, jobs_for
from dsv4_offload.stages.convert import ConvertOptions
from dsv4_offload.stages.serve import ServeOptions


def test_a_mistyped_option_is_refused_in_one_line_naming_stage_and_option() -> None:
    with pytest.raises(InputError) as caught:
        pipeline.stage_options("convert", given={"jbos": 4})
    message = caught.value.one_line()
    assert "\n" not in message
    assert "stage 'convert' has no option 'jbos'" in message and "jobs" in message


def test_a_bad_value_is_refused_naming_the_option() -> None:
    with pytest.raises(InputError, match="stage 'convert': option 'jobs'"):
        pipeline.from_wire("convert", {"jobs": "many"})


def test_the_wire_form_round_trips_through_json() -> None:
    sent = ConvertOptions(source="/weights/mxfp4", layers="0-2,5", jobs=3, follow=True)
    wire = json.loads(json.dumps(sent.to_wire()))
    assert wire == {"source": "/weights/mxfp4", "layers": "0-2,5", "jobs": 3, "follow": True}
    back = pipeline.from_wire("convert", wire)
    assert back == sent and isinstance(back, ConvertOptions)
    serve = ServeOptions(detach=True, set_keys=("serve.port",), device=None)
    assert pipeline.from_wire("serve", json.loads(json.dumps(serve.to_wire()))) == serve
    # None is not given: the default applies and nothing crosses for it
    assert "device" not in serve.to_wire() and serve.given() == {"detach": True,
                                                                 "set_keys": ("serve.port",)}


def test_every_registered_stage_declares_its_options() -> None:
    for stage in STAGES:
        module = importlib.import_module(f"dsv4_offload.stages.{stage.name.replace('-', '_')}")
        declared = getattr(module, "Options", None)
        assert isinstance(declared, type) and issubclass(declared, StageOptions), stage.name
        assert declared is not StageOptions and declared.model_config.get("frozen"), stage.name
        assert pipeline.options_type(stage.name) is declared


def test_the_registry_run_options_validate() -> None:
    for stage in STAGES:
        options = pipeline.stage_options(stage.name, given=stage.run_options)
        assert options.given() == stage.run_options, stage.name


def test_the_scheduler_jobs_validate_for_the_stages_it_hands_them() -> None:
    cpu = Budget(cores=8, build_jobs=6, convert_beside_build=2, convert_alone=4)
    for stage in STAGES:
        given = {**jobs_for(stage, cpu, compile_pending=True)}
        if stage.streams:
            given["follow"] = True
        pipeline.stage_options(stage.name, given=given)


def test_run_offers_each_stage_only_the_options_it_declares() -> None:
    run = RunOptions(mirrors=("kt=file:///m",), device=3)
    assert pipeline.stage_options("fetch", run).to_wire() == {"mirrors": ["kt=file:///m"]}
    assert pipeline.stage_options("serve", run, {"detach": True}).to_wire() == {
        "device": 3, "detach": True}
    assert pipeline.stage_options("build", run).to_wire() == {}


def test_options_are_frozen() -> None:
    options = ConvertOptions(jobs=2)
    with pytest.raises(ValueError):
        options.jobs = 3  # type: ignore[misc]
