"""`accept` against the stand-in (started by the real launcher, or by hand as a server
started elsewhere): every behaviour of a broken server ends in its verdict."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import HOST_RECIPE
from conftest import run_cli_inproc as run_cli  # the command in process: not the process
from serve_helpers import (
    STANDIN,
    context,
    free_port,
    leftovers,
    make_workspace,
    standin_overrides,
)

from dsv4_offload.core.results import Status
from dsv4_offload.serving import supervisor as sv
from dsv4_offload.stages import accept, serve

# small, fast versions of the delivery's method: two buckets, 16 tokens, 2 repeats
SMALL = ["acceptance.throughput.prompt_buckets=[130, 400]",
         "acceptance.throughput.new_tokens=16", "acceptance.throughput.repeats=2",
         "acceptance.throughput.warmup=1", "acceptance.throughput.reference_tok_s=1",
         "acceptance.throughput.reference_range=[1, 2]"]


def _serve_then_accept(tmp_path: Path, tag: str, *args: str, sets: list[str] | None = None,
                       **accept_options):
    ws = make_workspace(tmp_path / "ws")
    overrides = standin_overrides(tag, free_port(), *args) + SMALL + (sets or [])
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


def _failed(result) -> list[str]:
    return [c["name"] for c in result.data["checks"] if c["ok"] is False]


def _check(result, name: str) -> dict:
    return next(c for c in result.data["checks"] if c["name"] == name)


def _problem(result, name: str):
    return next(p for p in result.problems if p.check == f"accept.{name}")


def test_good_server_passes_with_the_delivery_method_report_chart_and_provenance(
        tmp_path, no_leftovers):
    ws, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good")
    assert result.status is Status.OK, result.summary
    names = [c["name"] for c in result.data["checks"]]
    assert names[:5] == ["GET /health", "GET /health_generate", "probe capital-zh",
                         "probe capital-en", "determinism"]
    # the probes again after the long prompts, and their answers against the first ones
    # (a prompt over the streaming threshold moved the resident experts: issue 34)
    assert names[5:11] == ["decode throughput", "probe capital-zh after the long prompts",
                           "probe capital-en after the long prompts",
                           "answers survive a streamed prompt",
                           "no </think> leak after a streamed prompt",
                           "server alive after the run"]
    survive = _check(result, "answers survive a streamed prompt")
    assert survive["observed"].startswith("similarity before/after a ")
    assert "streamed prompt: mean 1.00 over 2 greedy probes" in survive["observed"]
    assert result.data["switches"]["source"].startswith("the server's environment, /proc/")
    assert result.data["switches"]["values"]["KT_DYNAMIC_RESIDENT"] == "1"
    # accept's own prompt over the streaming threshold (512) makes the residency lines due
    assert names[11:] == ["log has 'weights loaded'", "log has 'depool slot reserved'",
                          "log has 'inline residency done'", "log has 'resident write verified'",
                          "log has 'KV pool sized'", "log has 'NPU graph captured'",
                          "log without 'streaming prefill fell back'",
                          "log without 'resident write failed'",
                          "log without 'GGUF dedup without a template'",
                          "log without 'slot reserve failed at load'"]
    buckets = result.data["throughput"]
    assert [b["target"] for b in buckets] == [130, 400]
    for b in buckets:  # counted in the server's own tokens, never above the bucket
        assert b["target"] - 60 <= b["prompt_tokens"] <= b["target"], b
        assert len(b["runs"]) == 2 and all(r["tokens"] == 16 for r in b["runs"])
        assert b["median"] and b["min"] <= b["median"] <= b["max"]
    tp = _check(result, "decode throughput")["data"]
    assert (tp["chunk"], tp["chunk_source"], tp["calibrated"]) == (8192, "/get_server_info",
                                                                   True)
    report = json.loads(Path(result.outputs["report"]).read_text())
    assert report["status"] == "ok" and report["chart"].endswith(".png")
    assert Path(report["chart"]).read_bytes()[:4] == b"\x89PNG"
    prov = json.loads(ws.provenance_file.read_text())
    assert prov["acceptance"]["status"] == "ok"
    assert "tok/s" in result.summary


@pytest.mark.parametrize(("mode", "failed", "detail"), [
    ("garbage", "probe capital-zh", "does not mention 北京"),
    ("garbled", "probe capital-zh", "garbled text: "),
    ("repeat-char", "probe capital-en", "one character repeated"),
    ("empty-200", "probe capital-zh", "empty text with HTTP 200"),
    ("nondeterministic", "determinism", "greedy answers differ"),
])
def test_bad_answers_fail_with_the_reason(tmp_path, no_leftovers, mode, failed, detail):
    ws, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", mode)
    assert result.status is Status.FAILED
    assert failed in _failed(result)
    assert detail in _check(result, failed)["detail"]
    assert _check(result, "decode throughput")["detail"] == "skipped: earlier checks failed"
    assert "\n" not in _problem(result, failed).message  # one clear line
    prov = json.loads(ws.provenance_file.read_text())
    assert prov["acceptance"]["status"] == "failed"


def test_a_coherent_answer_cycling_one_sentence_passes_with_a_note(tmp_path, no_leftovers):
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "sentence-loop")
    assert result.status is Status.OK, result.summary
    for probe in ("probe capital-zh", "probe capital-en"):
        check = _check(result, probe)
        assert check["ok"] and "-token sentence" in check["data"]["note"], check


def test_a_bucket_longer_than_the_servers_chunk_is_skipped_with_how_to_measure_it(
        tmp_path, no_leftovers):
    # the recipe says 8192, the server itself says 512: a 1000-token prompt would kill it
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good", "--chunk", "512",
                                   sets=["acceptance.throughput.prompt_buckets=[130, 1000]"])
    assert result.status is Status.WARN, result.summary
    buckets = {b["target"]: b for b in result.data["throughput"]}
    assert buckets[130]["median"] and buckets[130]["prompt_tokens"] <= 130
    why = buckets[1000]["skipped"]
    assert "chunked prefill 512 (/get_server_info)" in why
    assert "CHUNKED_PREFILL_SIZE=32768" in why
    assert _check(result, "server alive after the run")["ok"]  # nothing crossed the chunk
    note = _problem(result, "throughput")
    assert note.severity == "warning" and note.message.startswith("bucket 1000 skipped: ")


def test_run_serves_with_the_guides_32768_chunk_and_accept_measures_all_five_buckets(
        tmp_path, no_leftovers):
    # as `run` does: serve with accept_chunk (registry run_options), then accept with the
    # recipe's own buckets (130 / 1000 / 8000 / 16000 / 32000), natural prose of our own
    ws = make_workspace(tmp_path / "ws")
    # 20 ms a token: at the stand-in's default 2 ms a loaded host's client read all 8 tokens
    # of a bucket in one piece (no decode time to measure), failing CI twice
    overrides = standin_overrides(no_leftovers, free_port(), "--mode", "good",
                                  "--token-delay", "0.02") + [
        "acceptance.throughput.prompt_buckets=[130, 1000, 8000, 16000, 32000]",
        "acceptance.throughput.new_tokens=8", "acceptance.throughput.repeats=1",
        "acceptance.throughput.warmup=1", "acceptance.throughput.reference_tok_s=1",
        "acceptance.throughput.reference_range=[1, 2]", "acceptance.request_timeout_s=60"]
    started = serve.run(context(ws, overrides, "serve", detach=True, accept_chunk=True))
    assert started.ok, started.as_dict()
    try:
        record = sv.read_record(ws.serve_record)
        assert record is not None
        i = record.argv.index("--chunked-prefill-size")
        assert record.argv[i + 1] == "32768"
        result = accept.run(context(ws, overrides, "accept"))
    finally:
        sv.stop_recorded(ws.serve_record, 3)
    assert result.status is Status.OK, result.summary
    tp = _check(result, "decode throughput")["data"]
    assert (tp["chunk"], tp["chunk_source"]) == (32768, "/get_server_info")
    buckets = result.data["throughput"]
    assert [b["target"] for b in buckets] == [130, 1000, 8000, 16000, 32000]
    for b in buckets:  # measured, never above the bucket, close below it
        assert "skipped" not in b and b["median"], b
        assert 0.95 * b["target"] - 30 <= b["prompt_tokens"] <= b["target"], b
    # prompts above KT_PREFILL_STREAM_THRESHOLD were sent: the residency line is required
    assert _check(result, "log has 'inline residency done'")["ok"]


def test_without_server_info_the_chunk_comes_from_the_serve_record(tmp_path, no_leftovers):
    sets = ["serve.chunked_prefill_size=512", "serve.longest_prompt_tokens=256",
            "acceptance.throughput.prompt_buckets=[130, 1000]"]
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good",
                                   "--no-server-info", sets=sets)
    tp = _check(result, "decode throughput")["data"]
    assert (tp["chunk"], tp["chunk_source"]) == (512, "the serve record's command line")
    assert "chunked prefill 512" in result.data["throughput"][1]["skipped"]
    assert _check(result, "server alive after the run")["ok"]


def test_the_fallback_only_long_prompts_cause_is_caught_in_the_log(tmp_path, no_leftovers):
    # prompts of >= 330 tokens log sglang/0003's fallback line: the 400 bucket's warm-up and
    # 2 runs, and the one prompt over the streaming threshold that accept sends after them
    # (the calibration prompts are shorter)
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good",
                                   "--fallback-over", "330")
    assert result.status is Status.FAILED
    assert _failed(result) == ["log without 'streaming prefill fell back'"]
    check = _check(result, "log without 'streaming prefill fell back'")
    assert check["detail"].startswith("4x, first: \"[") and "hybrid fallback" in check["detail"]
    assert _check(result, "decode throughput")["ok"]  # the throughput itself was fine


def test_a_log_without_the_guides_lines_fails_each_with_its_fix(tmp_path, no_leftovers):
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good",
                                   "--no-startup-lines")
    assert result.status is Status.FAILED
    assert _failed(result) == ["log has 'weights loaded'", "log has 'depool slot reserved'",
                               "log has 'KV pool sized'", "log has 'NPU graph captured'"]
    assert "5x slower" in _check(result, "log has 'NPU graph captured'")["fix"]
    assert "AscendC op" in _check(result, "log has 'depool slot reserved'")["fix"]


def test_a_server_dying_halfway_through_the_throughput_phase_fails(tmp_path, no_leftovers):
    # streamed answer 5 is bucket 400's first run: each bucket streams a warm-up and 2 runs
    # (the probes and the calibration are not streamed)
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good",
                                   "--die-in-stream", "5")
    assert result.status is Status.FAILED
    assert "decode throughput" in _failed(result)
    assert "server alive after the run" in _failed(result)
    problem = _problem(result, "decode throughput")
    assert problem.message.startswith(
        f"decode throughput: bucket 400 tokens: run 1: {result.data['url']}/generate: the "
        "stream ended after ")
    assert problem.message.endswith(" tokens without [DONE] (is the server up?)")
    assert "dying in the middle of streamed answer 5" in problem.fix  # the log's last lines


def test_a_server_that_stops_answering_mid_stream_fails_within_the_timeout(tmp_path,
                                                                          no_leftovers):
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good",
                                   "--hang-in-stream", "2", sets=["acceptance.request_timeout_s=2"])
    assert result.status is Status.FAILED
    assert result.data["elapsed"] < 17  # a 2 s request timeout: not the 5 s of the others
    problem = _problem(result, "decode throughput")
    assert problem.message.startswith("decode throughput: bucket 130 tokens: run 1: ")
    assert "the stream broke after" in problem.message
    assert "hanging in the middle of streamed answer 2" in problem.fix


def test_throughput_below_the_reference_fails_unless_the_gate_is_off(tmp_path, no_leftovers):
    slow = ["--token-delay", "0.02"]  # ~50 tok/s at most: below the reference 100
    # a gated reference (the A3's is; the 910B's is report-only until measured on the pin)
    sets = ["acceptance.throughput.reference_tok_s=100",
            "acceptance.throughput.reference_range=[100, 120]",
            "acceptance.throughput.report_only=false",
            "acceptance.throughput.new_tokens=8", "acceptance.throughput.repeats=1"]
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good", *slow, sets=sets)
    assert result.status is Status.FAILED
    problem = _problem(result, "decode throughput")
    assert problem.severity == "error"
    assert problem.message.startswith("decode throughput: bucket ")
    assert "below the reference 100" in problem.message
    _, result = _serve_then_accept(tmp_path / "nogate", no_leftovers, "--mode", "good", *slow,
                                   sets=sets, no_throughput_gate=True)
    assert result.status is Status.WARN
    assert _problem(result, "decode throughput").severity == "warning"


def test_server_crashing_mid_acceptance_is_reported(tmp_path, no_leftovers):
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "crash-after",
                                   "--crash-after", "1")
    assert result.status is Status.FAILED
    assert "is the server up?" in _check(result, "server answers")["detail"]


def test_hanging_server_fails_within_the_request_timeout(tmp_path, no_leftovers):
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "hang",
                                   sets=["acceptance.request_timeout_s=1"])
    assert result.status is Status.FAILED
    assert result.data["elapsed"] < 11  # a 1 s request timeout: not the 5 s of the others
    assert "no answer within 1s" in _check(result, "server answers")["detail"]


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
    # no /get_server_info on the OpenAI path: the serve record gives the chunk
    assert _check(result, "decode throughput")["data"]["chunk_source"] == (
        "the serve record's command line")
    assert all(b["prompt_tokens"] <= b["target"] for b in result.data["throughput"])


def test_accept_without_a_server_fails_fast(tmp_path):
    ws = make_workspace(tmp_path / "ws")
    ctx = context(ws, [], "accept", url=f"http://127.0.0.1:{free_port()}")
    result = accept.run(ctx)
    assert result.status is Status.FAILED
    assert "is the server up?" in result.problems[0].message


# --- a server started elsewhere (the delivery's script, a container): --server-log -----------


def _standin_elsewhere(tmp_path: Path, tag: str, *args: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / "kt_serve.log"
    fh = open(log, "w")  # noqa: SIM115 - the server writes it until the test stops it
    proc = subprocess.Popen([sys.executable, str(STANDIN), "--tag", tag, "--port", str(port),
                             *args], stdout=fh, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    fh.close()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        if "fired up" in log.read_text():
            break
        time.sleep(0.05)
    return proc, url, log


def _cli_accept(tmp_path: Path, url: str, *args: str, env: dict[str, str] | None = None):
    sets = [a for s in SMALL + ["acceptance.request_timeout_s=5"] for a in ("--set", s)]
    # the checks run on this host, against a stand-in server (HOST_RECIPE)
    return run_cli("--workspace", str(tmp_path / "ws"), "-r", str(HOST_RECIPE), *sets, "--json",
                   "accept", "--url", url,
                   *args, env=env, timeout=120)


def test_server_log_of_a_server_started_elsewhere_is_read_after_the_long_prompts(
        tmp_path, no_leftovers):
    proc, url, log = _standin_elsewhere(tmp_path, no_leftovers, "--fallback-over", "330")
    try:
        result = _cli_accept(tmp_path, url, "--server-log", str(log), "--quick")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert result.code == 1, result
    doc = result.json()["data"]
    failed = [c["name"] for c in doc["data"]["checks"] if c["ok"] is False]
    assert failed == ["log without 'streaming prefill fell back'"]
    assert doc["data"]["log"] == str(log)
    tp = next(c for c in doc["data"]["checks"] if c["name"] == "decode throughput")
    assert tp["data"]["quick"] and tp["data"]["repeats"] == 1
    assert "error: " not in result.err


def test_server_log_that_does_not_exist_is_one_clear_error(tmp_path):
    result = _cli_accept(tmp_path, "http://127.0.0.1:9", "--server-log", str(tmp_path / "no"))
    assert result.code == 2
    assert result.err.strip().splitlines() == [
        f"error: --server-log {tmp_path / 'no'}: no such file; give the log the server writes "
        "(e.g. `... 2>&1 | tee /tmp/kt_serve.log`)"]


# --- GPQA-diamond through evalscope -----------------------------------------------------------

# A stand-in for the `evalscope` executable: records its arguments, then writes the report
# where evalscope does (<work-dir>/<timestamp>/reports/<model>/gpqa_diamond.json: the
# evaluator's get_report_path + benchmark name) with the fields of evalscope's Report model
# (evalscope/report/report.py: name, dataset_name, model_name, score = the first metric's
# score, a 0-1 accuracy; metrics -> categories -> subsets).
FAKE_EVALSCOPE = """\
#!{python}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
calls = Path(os.environ["FAKE_EVALSCOPE_CALLS"])
with open(calls, "a") as fh:
    fh.write(json.dumps(args) + "\\n")
n = len(calls.read_text().splitlines())
scores = os.environ["FAKE_GPQA_SCORES"].split(",")
score = scores[n - 1]
if os.environ.get("FAKE_EVALSCOPE_PROBE"):
    # reach the server the way evalscope's HTTP client does: urllib honours http_proxy and
    # no_proxy from the environment
    import urllib.request
    url = args[args.index("--api-url") + 1].replace("/v1/chat/completions", "/v1/models")
    try:
        urllib.request.urlopen(url, timeout=5).read()
    except OSError as exc:
        print(f"Traceback: {{exc}}", file=sys.stderr)
        sys.exit(1)
if score == "fail":
    print("Traceback: connection refused", file=sys.stderr)
    sys.exit(1)
work = Path(args[args.index("--work-dir") + 1])
model = args[args.index("--model") + 1]
s = float(score)
subset = {{"name": "default", "score": s, "num": 198, "is_aggregate": False}}
category = {{"name": ["default"], "num": 198, "score": s, "macro_score": s,
            "subsets": [subset]}}
report = {{"name": "gpqa_diamond_report", "dataset_name": "gpqa_diamond",
          "dataset_pretty_name": "GPQA-Diamond", "dataset_description": "",
          "model_name": model, "score": s,
          "metrics": [{{"name": "mean_acc", "num": 198, "score": s, "macro_score": s,
                       "categories": [category]}}],
          "analysis": "N/A", "perf_metrics": None, "num": 198}}
out = work / "20261203_041500" / "reports" / os.path.basename(model) / "gpqa_diamond.json"
out.parent.mkdir(parents=True)
out.write_text(json.dumps(report, indent=4))
"""


def _fake_evalscope(tmp_path: Path, scores: str) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(parents=True)
    exe = bindir / "evalscope"
    exe.write_text(FAKE_EVALSCOPE.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
            "FAKE_EVALSCOPE_CALLS": str(tmp_path / "calls.jsonl"), "FAKE_GPQA_SCORES": scores}


def test_gpqa_runs_the_delivery_procedure_through_evalscope(tmp_path, no_leftovers):
    env = _fake_evalscope(tmp_path, "0.6919,0.7273,0.7323")  # the guide's 910B rounds (G436)
    proc, url, log = _standin_elsewhere(tmp_path, no_leftovers)
    try:
        result = _cli_accept(tmp_path, url, "--quick", "--gpqa", "3", "--server-log", str(log),
                             env=env)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert result.code == 0, result
    checks = result.json()["data"]["data"]["checks"]
    gpqa = next(c for c in checks if c["name"] == "GPQA-diamond")
    assert gpqa["ok"], gpqa
    assert gpqa["data"]["rounds"] == [69.19, 72.73, 73.23]
    assert (gpqa["data"]["mean"], gpqa["data"]["sd"]) == (71.72, 1.8)  # the guide's G439-441
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 3
    work = calls[0][calls[0].index("--work-dir") + 1]
    assert work.endswith("/R1")
    # gpqa_accuracy_repeat.sh L88-92, flag for flag
    assert calls[0] == [
        "eval", "--model", "standin", "--api-url", f"{url}/v1/chat/completions",
        "--api-key", "EMPTY", "--eval-type", "openai_api", "--datasets", "gpqa_diamond",
        "--generation-config", '{"temperature":1,"top_p":1,"max_tokens":32768,"extra_body":'
        '{"chat_template_kwargs":{"thinking":false,"high_effort":false}}}',
        "--eval-batch-size", "1", "--repeats", "1", "--work-dir", work]


def test_gpqa_fails_on_a_failed_round_or_a_low_mean(tmp_path, no_leftovers):
    proc, url, log = _standin_elsewhere(tmp_path, no_leftovers)
    try:
        failed = _cli_accept(tmp_path / "a", url, "--quick", "--gpqa", "2",
                             env=_fake_evalscope(tmp_path / "a", "0.7,fail"))
        low = _cli_accept(tmp_path / "b", url, "--quick", "--gpqa", "2",
                          env=_fake_evalscope(tmp_path / "b", "0.60,0.62"))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert failed.code == 1, failed
    check = next(c for c in failed.json()["data"]["data"]["checks"]
                 if c["name"] == "GPQA-diamond")
    assert check["detail"].startswith("round(s) [2] failed; 1 of 2 rounds: mean 70.0%")
    assert low.code == 1, low
    check = next(c for c in low.json()["data"]["data"]["checks"] if c["name"] == "GPQA-diamond")
    assert "mean 61.0%" in check["detail"] and check["required"].startswith("mean >= 71.7%")


def test_gpqa_without_evalscope_is_one_line_with_the_install_command(tmp_path):
    bindir = tmp_path / "empty-bin"
    bindir.mkdir()
    result = _cli_accept(tmp_path, "http://127.0.0.1:9", "--gpqa", "1",
                         env={"PATH": str(bindir), "EVALSCOPE": ""})
    assert result.code == 2
    assert result.err.strip().splitlines() == [
        "error: accept --gpqa: evalscope is not installed; pip install evalscope "
        "(or set EVALSCOPE=/path/to/evalscope)"]


@pytest.mark.parametrize(("args", "cause"), [
    # the 400 bucket does not fit a 300-token SWA pool: never admitted, no prefill line
    (["--swa-size", "300"], "no prefill started since the request (earlier requests logged "
     "theirs): the prompt was never admitted, most likely larger than the SWA KV pool (the "
     "SWA pool holds 300 tokens)"),
    # admitted, prefill logged, then nothing within the read timeout
    (["--slow-prefill-over", "300"], "no token came back, but the prefill started "
     "(#new-token: "),
])
def test_a_long_prompt_with_no_token_names_which_of_the_two_causes(tmp_path, no_leftovers,
                                                                  args, cause):
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good", *args,
                                   sets=["acceptance.request_timeout_s=2"])
    assert result.status is Status.FAILED
    check = _check(result, "decode throughput")
    assert check["ok"] is False and check["observed"].startswith("bucket 400")
    assert cause in check["fix"], check["fix"]
    assert "the server failed under load" not in check["fix"]


def test_gpqa_bypasses_an_exported_proxy_for_the_server(tmp_path, no_leftovers):
    # an http_proxy pointing at a closed port: every round would fail through it
    env = {**_fake_evalscope(tmp_path, "0.70,0.71"), "FAKE_EVALSCOPE_PROBE": "1",
           "http_proxy": f"http://127.0.0.1:{free_port()}", "no_proxy": "example.org"}
    proc, url, log = _standin_elsewhere(tmp_path, no_leftovers)
    try:
        result = _cli_accept(tmp_path, url, "--quick", "--gpqa", "2", "--server-log", str(log),
                             env=env)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert result.code == 0, result
    checks = result.json()["data"]["data"]["checks"]
    gpqa = next(c for c in checks if c["name"] == "GPQA-diamond")
    assert gpqa["ok"] and gpqa["data"]["rounds"] == [70.0, 71.0], gpqa


def test_the_evaluator_env_adds_the_server_and_loopback_to_no_proxy():
    from dsv4_offload.acceptance.gpqa import evaluator_env

    env = evaluator_env("http://10.1.2.3:8020/v1/chat/completions",
                        {"http_proxy": "http://proxy:3128", "NO_PROXY": "corp.local"})
    assert env["NO_PROXY"] == "corp.local,10.1.2.3,localhost,127.0.0.1"
    assert env["no_proxy"] == "10.1.2.3,localhost,127.0.0.1"
    assert env["http_proxy"] == "http://proxy:3128"  # kept for everything else


# --- issue 34: answers after a prompt that streams ---------------------------------------------


def test_a_server_whose_resident_write_is_broken_fails_naming_the_write(tmp_path, no_leftovers):
    """The delivery's series unmodified on torch_npu: after the first prompt over the
    streaming threshold the stand-in answers from stale expert weights (still on topic, so
    the keyword probes pass), and prints no verification line."""
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good",
                                   "--resident-write", "broken")
    assert result.status is Status.FAILED
    assert _failed(result) == ["answers survive a streamed prompt",
                               "no </think> leak after a streamed prompt",
                               "log has 'resident write verified'"]
    survive = _check(result, "answers survive a streamed prompt")
    assert survive["observed"].startswith("similarity before/after a ")
    mean = float(survive["observed"].split("mean ")[1].split(" ")[0])
    assert mean < 0.75, survive
    # the cause, from the server's own switches and the series this workspace applies
    assert "_apply_resident_layer_depool" in survive["fix"]
    assert "the series carries the fix (sglang-resident-write-through), so the server runs " \
           "a build without it" in survive["fix"]
    think = _check(result, "no </think> leak after a streamed prompt")
    assert think["observed"] == ("2 of 2 non-thinking answers carry </think> after it, 0 of 2 "
                                 "before")
    # the keyword probes alone would have passed it
    assert _check(result, "probe capital-en after the long prompts")["ok"] is True
    assert "residency switches: KT_PREFILL_STREAM=1" in result.summary


def test_the_fixed_server_passes_and_its_verification_line_is_required(tmp_path, no_leftovers):
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good")
    assert result.status is Status.OK, result.summary
    verified = _check(result, "log has 'resident write verified'")
    assert verified["ok"] and "[KT_STREAM] resident write verified: layer 0 slot 0 holds " \
        "expert" in verified["observed"]
    assert _check(result, "log without 'resident write failed'")["ok"]


def test_without_our_fix_in_the_series_the_line_is_not_required_and_drift_names_the_patch(
        tmp_path, no_leftovers):
    _, result = _serve_then_accept(tmp_path, no_leftovers, "--mode", "good",
                                   "--resident-write", "broken",
                                   sets=["series_skip=[sglang-resident-write-through]"])
    names = [c["name"] for c in result.data["checks"]]
    assert "log has 'resident write verified'" not in names
    assert "log without 'resident write failed'" not in names
    survive = _check(result, "answers survive a streamed prompt")
    assert survive["ok"] is False
    assert "serve with the series' fix sglang-resident-write-through (drop it from the " \
           "recipe's series_skip" in survive["fix"]
