"""accept's residency check: greedy answers before and after a prompt that streams."""

from __future__ import annotations

import os
from pathlib import Path

from dsv4_offload.acceptance import residency as rs

BEFORE = {"capital-en": " Paris. Paris is the capital and the largest city of France.",
          "capital-zh": "北京。北京是中华人民共和国的首都，也是全国的政治和文化中心。"}
# the stand-in server's answers once the resident slots hold stale weights
DRIFTED = {"capital-en": " Paris</think> is where the river bends twice and the old bridges "
                         "hold museums.",
           "capital-zh": "北京</think>城市的历史很长，人口众多，交通方便，有很多公园和博物馆。"}
ON = rs.Switches({"KT_PREFILL_STREAM": "1", "KT_DYNAMIC_RESIDENT": "1", "KT_MXFP4_DEPOOL": "1"},
                 "test")


def test_similarity_is_one_for_the_same_answer_and_low_for_another_text() -> None:
    assert rs.similarity(BEFORE["capital-en"], BEFORE["capital-en"]) == 1.0
    assert rs.similarity(BEFORE["capital-en"], DRIFTED["capital-en"]) < 0.5
    # a late divergence (the last words differ) keeps most of the text
    late = BEFORE["capital-en"][:-7] + "Europe."
    assert rs.similarity(BEFORE["capital-en"], late) > 0.85


def test_drift_fails_and_names_the_residency_write_as_the_cause() -> None:
    drift = rs.Drift(BEFORE, DRIFTED, streamed_tokens=640)
    survive, think = rs.check_drift(drift, 0.75, 512, ON, fix_applied=False)
    assert survive.ok is False and survive.gate
    assert survive.observed.startswith("similarity before/after a 640-token streamed prompt: "
                                       "mean 0.")
    assert "_apply_resident_layer_depool" in survive.fix
    assert "sglang-resident-write-through" in survive.fix and "KT_DYNAMIC_RESIDENT=0" in survive.fix
    assert think.ok is False
    assert think.observed == ("2 of 2 non-thinking answers carry </think> after it, 0 of 2 "
                              "before")


def test_unchanged_answers_pass_and_a_short_long_prompt_is_no_proof() -> None:
    same = rs.Drift(BEFORE, dict(BEFORE), streamed_tokens=700)
    assert [c.ok for c in rs.check_drift(same, 0.75, 512, ON, True)] == [True, True]
    short = rs.Drift(BEFORE, DRIFTED, streamed_tokens=400)
    (skipped,) = rs.check_drift(short, 0.75, 512, ON, True)
    assert skipped.ok is None and "under the streaming threshold 512" in skipped.observed


def test_the_cause_follows_the_switches_and_the_series() -> None:
    off = rs.Switches({"KT_DYNAMIC_RESIDENT": "0", "KT_PREFILL_STREAM": "1",
                       "KT_MXFP4_DEPOOL": "1"}, "test")
    assert rs.cause(off, True).startswith("dynamic residency is off on this server")
    assert "runs a build without it: `dsv4-offload patch status`, then `build sglang`" in \
        rs.cause(ON, fix_applied=True)


def test_switches_come_from_the_servers_own_environment(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "environ").write_bytes(
        b"PATH=/usr/bin\0KT_PREFILL_STREAM=1\0KT_DYNAMIC_RESIDENT=0\0KT_MXFP4_DEPOOL=1\0"
        b"KT_PREFILL_STREAM_THRESHOLD=1024\0")
    got = rs.server_switches(4242, {"KT_DYNAMIC_RESIDENT": "1"}, proc)
    assert got.values == {"KT_PREFILL_STREAM": "1", "KT_DYNAMIC_RESIDENT": "0",
                          "KT_MXFP4_DEPOOL": "1", "KT_PREFILL_STREAM_THRESHOLD": "1024"}
    assert got.residency_on is False and got.threshold == 1024
    assert got.source == "the server's environment, /proc/4242/environ"
    # a pid whose environment cannot be read: what the workspace launched it with
    recorded = rs.server_switches(4343, {"KT_DYNAMIC_RESIDENT": "1", "HOME": "/root"}, proc)
    assert recorded.values == {"KT_DYNAMIC_RESIDENT": "1"}
    assert recorded.source.startswith("the environment this workspace launches it with")
    unknown = rs.server_switches(None, None, proc)
    assert unknown.residency_on is None and unknown.shown().startswith("not known")
    # this very process, through the real /proc
    mine = rs.server_switches(os.getpid(), None)
    assert mine.source == f"the server's environment, /proc/{os.getpid()}/environ"
