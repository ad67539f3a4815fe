"""`accept` against the stand-in started by the real launcher: every mode ends in its verdict."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from serve_helpers import (
    context,
    free_port,
    leftovers,
    make_workspace,
    standin_overrides,
)

from dsv4_offload import supervisor as sv
from dsv4_offload.stage import Status
from dsv4_offload.stages import accept, serve


def _serve_then_accept(tmp_path: Path, tag: str, *args: str, **accept_options):
    ws = make_workspace(tmp_path / "ws")
    overrides = standin_overrides(tag, free_port(), *args)
    started = serve.run(context(ws, overrides, "serve", detach=True))
    assert started.ok, started.as_dict()
    try:
        t0 = time.monotonic()
        result = accept.run(context(ws, overrides, "accept", **accept_options))
        result.data["elapsed"] = time.monotonic() - t0
    finally:
        sv.stop_recorded(ws.serve_record, 3)
    assert not leftovers(tag)
    return ws, result


def _failed_checks(result) -> list[str]:
    return [c["name"] for c in result.data["checks"] if c["ok"] is False]


def test_good_server_passes_with_throughput_report_chart_and_provenance(tmp_path, no_leftovers):
    ws, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good")
    assert result.status is Status.OK, result.summary
    names = [c["name"] for c in result.data["checks"]]
    assert names[:4] == ["GET /health", "GET /health_generate", "probe capital-zh",
                         "probe capital-en"]
    assert "determinism" in names and "decode throughput" in names
    assert [b["prompt_tokens"] for b in result.data["throughput"]] == [16, 64]
    assert all(b["tok_s"] and b["ttft_s"] is not None for b in result.data["throughput"])
    report = json.loads(Path(result.outputs["report"]).read_text())
    assert report["status"] == "ok" and report["chart"].endswith(".png")
    assert Path(report["chart"]).read_bytes()[:4] == b"\x89PNG"
    prov = json.loads(ws.provenance_file.read_text())
    assert prov["acceptance"]["status"] == "ok"
    assert "tok/s" in result.summary


@pytest.mark.parametrize(("mode", "failed", "detail"), [
    ("garbage", "probe capital-zh", "does not mention 北京"),
    ("repeat-char", "probe capital-en", "one character repeated"),
    ("empty-200", "probe capital-zh", "empty text with HTTP 200"),
    ("nondeterministic", "determinism", "greedy answers differ"),
])
def test_bad_answers_fail_with_the_reason(tmp_path, no_leftovers, mode, failed, detail):
    ws, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", mode)
    assert result.status is Status.FAILED
    assert failed in _failed_checks(result)
    check = next(c for c in result.data["checks"] if c["name"] == failed)
    assert detail in check["detail"]
    last = result.data["checks"][-1]
    assert (last["name"], last["status"], last["detail"]) == (
        "decode throughput", "skipped", "skipped: earlier checks failed")
    prov = json.loads(ws.provenance_file.read_text())
    assert prov["acceptance"]["status"] == "failed"


def test_server_crashing_mid_acceptance_is_reported(tmp_path, no_leftovers):
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "crash-after",
                                   "--crash-after", "1")
    assert result.status is Status.FAILED
    check = next(c for c in result.data["checks"] if c["name"] == "server answers")
    assert "is the server up?" in check["detail"]


def test_hanging_server_fails_within_the_request_timeout(tmp_path, no_leftovers):
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "hang")
    assert result.status is Status.FAILED
    assert result.data["elapsed"] < 15  # request_timeout_s is 5 in these tests
    check = next(c for c in result.data["checks"] if c["name"] == "server answers")
    assert "no answer within 5s" in check["detail"]


def test_openai_api_with_a_chat_probe_file(tmp_path, no_leftovers):
    probes = tmp_path / "probes.yaml"
    probes.write_text("probes:\n"
                      "  - {name: fr-chat, prompt: 'What is the capital of France?',"
                      " expect_any: [Paris], chat: true}\n"
                      "  - {name: fr, prompt: 'The capital of France is', expect_any: [Paris]}\n"
                      "determinism_probe: fr\n")
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good", api="openai",
                                   model="standin", probes=str(probes))
    assert result.status is Status.OK, result.summary
    names = [c["name"] for c in result.data["checks"]]
    assert names[:3] == ["GET /v1/models", "probe fr-chat", "probe fr"]


def test_missing_log_markers_fail(tmp_path, no_leftovers):
    ws = make_workspace(tmp_path / "ws")
    log = tmp_path / "other.log"
    log.write_text("KV Cache is allocated. #tokens: 5\n[KT_STREAM] streaming failed\n")
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good", log=str(log))
    assert result.status is Status.FAILED
    assert _failed_checks(result) == ["log has 'Capture .*graph end'",
                                      "log without 'streaming failed'"]
    del ws


def test_accept_without_a_server_fails_fast(tmp_path):
    ws = make_workspace(tmp_path / "ws")
    ctx = context(ws, [], "accept", url=f"http://127.0.0.1:{free_port()}")
    result = accept.run(ctx)
    assert result.status is Status.FAILED
    assert "is the server up?" in result.problems[0].message
