"""The serve stage through the real launcher and supervisor, against the stand-in server."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from serve_helpers import (
    context,
    free_port,
    leftovers,
    make_workspace,
    standin_overrides,
)

from dsv4_offload.core.results import Status
from dsv4_offload.serving import supervisor as sv
from dsv4_offload.stages import serve


def _serve(tmp_path: Path, tag: str, *args: str, timeout: float = 20, **options):
    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    ctx = context(ws, standin_overrides(tag, port, *args, timeout=timeout), "serve", **options)
    return ctx, port


def test_detached_serve_returns_once_ready_and_stop_leaves_nothing(tmp_path, no_leftovers):
    ctx, port = _serve(tmp_path, no_leftovers, "--mode", "good", detach=True)
    result = serve.run(ctx)
    assert result.status is Status.OK, result.as_dict()
    assert result.outputs["url"] == f"http://127.0.0.1:{port}"
    assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    record = sv.read_record(ctx.workspace.serve_record)
    assert record is not None and record.state == "running" and sv.pid_alive(record.server_pid)
    # the server is not our child: the supervisor holds it, in a session of its own
    assert os.getsid(record.supervisor_pid) == record.supervisor_pid
    assert os.getpgid(record.server_pid) == record.server_pid
    log = Path(result.outputs["log"]).read_text()
    assert "KV Cache is allocated" in log and "--kt-cpuinfer" in log
    # a second serve finds it running
    again = serve.run(ctx)
    assert again.status is Status.OK and "already running" in again.summary
    stopped, how = sv.stop_recorded(ctx.workspace.serve_record, 3)
    assert how == "SIGINT" and stopped is not None and stopped.state == "stopped"
    assert not leftovers(no_leftovers)


def test_foreground_serve_streams_the_log_and_returns_when_the_server_stops(tmp_path,
                                                                            no_leftovers):
    ctx, port = _serve(tmp_path, no_leftovers, "--mode", "good")
    seen: list[str] = []
    ctx.progress.message = seen.append  # type: ignore[method-assign]
    box = {}
    runner = threading.Thread(target=lambda: box.update(result=serve.run(ctx)))
    runner.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not any("ready at" in s for s in seen):
        time.sleep(0.05)
    assert any("KV Cache is allocated" in s for s in seen)
    server = next(p for p in leftovers(no_leftovers)
                  if "standin_server" in " ".join(p.info["cmdline"]))
    assert server.ppid() == os.getpid()  # the tool itself supervises in the foreground
    os.killpg(server.pid, signal.SIGINT)
    runner.join(20)
    assert box["result"].status is Status.OK
    assert box["result"].summary == "server ran and exited cleanly"


def test_slow_start_is_waited_for(tmp_path, no_leftovers):
    ctx, _ = _serve(tmp_path, no_leftovers, "--mode", "slow-start", "--start-delay", "2",
                    detach=True)
    result = serve.run(ctx)
    assert result.status is Status.OK
    assert result.outputs["attempts"][0]["seconds"] >= 1.5
    sv.stop_recorded(ctx.workspace.serve_record, 3)


def test_not_ready_within_the_timeout_fails_and_stops_the_server(tmp_path, no_leftovers):
    ctx, _ = _serve(tmp_path, no_leftovers, "--mode", "slow-start", "--start-delay", "60",
                    timeout=2, detach=True)
    t0 = time.monotonic()
    result = serve.run(ctx)
    assert time.monotonic() - t0 < 40  # stopped at the 2 s timeout, not the 60 s start
    assert result.status is Status.FAILED
    assert "not ready within 2s" in result.problems[0].message
    assert "readiness_timeout_s" in result.problems[0].fix


@pytest.mark.parametrize(("key", "fix"), [
    ("llamafile", "CPUINFER_ARM_SVE=OFF"),
    ("numa", "NUMA nodes"),
    ("libmxfp4fused", "build ascendc-op"),
    ("quant-type", "verify-gguf"),
    ("gguf-missing", "dsv4-offload convert"),
])
def test_known_fatal_line_stops_the_wait_at_once_with_its_fix(tmp_path, no_leftovers, key, fix):
    # the stand-in prints the line and stays up, like a wedged server: the line alone decides
    # a long readiness timeout, so "at once" is told apart from it on a loaded machine too
    ctx, _ = _serve(tmp_path, no_leftovers, "--mode", "fatal", "--fatal", key, detach=True,
                    timeout=90)
    t0 = time.monotonic()
    result = serve.run(ctx)
    assert time.monotonic() - t0 < 30  # far below the 90 s readiness timeout
    assert result.status is Status.FAILED
    problem = result.problems[0]
    assert problem.check == f"serve.{key}" and fix in problem.fix
    assert result.data["tail"], "the log tail is shown"
    assert len(result.data["attempts"]) == 1


@pytest.mark.parametrize("key", ["kv-cache", "hbm-oom"])
def test_memory_failures_walk_down_the_ladder_then_fail(tmp_path, no_leftovers, key):
    ctx, _ = _serve(tmp_path, no_leftovers, "--mode", "fatal", "--fatal", key)
    result = serve.run(ctx)
    assert result.status is Status.FAILED
    assert [a["kt_num_gpu_experts"] for a in result.data["attempts"]] == [32, 24, 16]
    assert "tried 32, 24, 16 resident experts" in result.problems[0].message
    assert result.problems[0].check == f"serve.{key}"


def test_kv_cache_failure_retries_with_fewer_experts_and_records_what_worked(tmp_path,
                                                                             no_leftovers):
    ctx, _ = _serve(tmp_path, no_leftovers, "--mode", "kv-ladder", "--kv-max-experts", "24",
                    detach=True)
    result = serve.run(ctx)
    assert result.status is Status.WARN
    assert result.outputs["kt_num_gpu_experts"] == 24
    assert [a["outcome"] for a in result.outputs["attempts"]] == ["fatal", "ready"]
    assert "--set serve.kt_num_gpu_experts=24" in result.problems[-1].fix
    record = sv.read_record(ctx.workspace.serve_record)
    assert record is not None and record.kt_num_gpu_experts == 24
    sv.stop_recorded(ctx.workspace.serve_record, 3)
    # the next start goes straight to what worked, and says so
    again = serve.run(ctx)
    assert again.status is Status.OK
    assert [a["kt_num_gpu_experts"] for a in again.outputs["attempts"]] == [24]
    assert any("32 failed KV-cache setup" in p.message for p in again.problems)
    sv.stop_recorded(ctx.workspace.serve_record, 3)


def test_server_exiting_before_ready_shows_its_last_lines(tmp_path, no_leftovers):
    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    script = "import sys; print('loading'); print('boom: config.json unreadable'); sys.exit(4)"
    overrides = standin_overrides(no_leftovers, port)
    overrides[0] = f"serve.command=['{sys.executable}', '-c', \"{script}\", '{no_leftovers}']"
    overrides.append("serve.pass_flags=false")
    result = serve.run(context(ws, overrides, "serve"))
    assert result.status is Status.FAILED
    assert "exited (code 4) before it was ready" in result.problems[0].message
    assert any("boom" in line for line in result.data["tail"])


def test_serve_is_done_while_the_server_is_up_and_stale_once_it_dies(tmp_path, no_leftovers):
    from dsv4_offload import pipeline

    ctx, _ = _serve(tmp_path, no_leftovers, "--mode", "good", detach=True)
    assert serve.fingerprint_inputs(ctx) == {"server": "never started"}
    result = pipeline.run_stage(ctx, "serve", dict(ctx.options))
    assert result.ok, result.as_dict()
    state = ctx.workspace.state()
    status = pipeline.stage_status(ctx, pipeline.spec("serve"), state)
    assert status.state == "done", status  # started: `serve` stays done
    sv.stop_recorded(ctx.workspace.serve_record, 3)
    status = pipeline.stage_status(ctx, pipeline.spec("serve"), state)
    assert status.state == "stale" and "input.server" in status.reason  # `run` restarts it


def test_kml_library_goes_first_on_the_library_path_when_present(tmp_path, no_leftovers):
    kml = tmp_path / "kml" / "lib"
    kml.mkdir(parents=True)
    ctx, _ = _serve(tmp_path, no_leftovers, "--mode", "good")
    ctx = context(ctx.workspace, [*standin_overrides(no_leftovers, free_port()),
                                  f"serve.kml_lib_dir={kml}"], "serve")
    plan = serve.make_plan(ctx)
    assert plan.env["LD_LIBRARY_PATH"].split(":")[0] == str(kml)
    missing = context(ctx.workspace, [*standin_overrides(no_leftovers, free_port()),
                                      f"serve.kml_lib_dir={tmp_path / 'none'}"], "serve")
    assert str(tmp_path / "none") not in serve.make_plan(missing).env.get("LD_LIBRARY_PATH", "")


def test_detached_spec_with_the_server_env_does_not_stay_on_disk(tmp_path, no_leftovers):
    ctx, _ = _serve(tmp_path, no_leftovers, "--mode", "good", detach=True)
    result = serve.run(ctx)
    assert result.status is Status.OK, result.as_dict()
    assert not ctx.workspace.serve_spec.exists()
    sv.stop_recorded(ctx.workspace.serve_record, 3)


def test_ready_reads_hbm_left_and_the_kv_pools_into_the_serve_record(tmp_path, no_leftovers):
    # the stand-in prints the scheduler's and the DSv4 pool's start-up lines in their formats
    ctx, _ = _serve(tmp_path, no_leftovers, "--mode", "good", "--swa-size", "65536",
                    detach=True)
    try:
        result = serve.run(ctx)
        assert result.status is Status.OK, result.as_dict()
        record = sv.read_record(ctx.workspace.serve_record)
        assert record is not None
        assert record.extra["startup"] == {
            "available_gpu_mem_gb": 8.75, "max_total_num_tokens": 131072,
            "kv_pool_tokens": 131072, "swa_pool_tokens": 65536, "kv_pool_gb": 3.41}
        assert result.outputs["startup"]["swa_pool_tokens"] == 65536
        assert not [p for p in result.problems if p.check == "serve.swa-pool"]
    finally:
        sv.stop_recorded(ctx.workspace.serve_record, 3)


def test_a_declared_prompt_longer_than_the_swa_pool_is_a_warning_with_the_fix(tmp_path,
                                                                            no_leftovers):
    ctx, _ = _serve(tmp_path, no_leftovers, "--mode", "good", "--swa-size", "9088",
                    detach=True, longest_prompt=16000)
    try:
        result = serve.run(ctx)
        assert result.status is Status.OK, result.as_dict()
        (warning,) = [p for p in result.problems if p.check == "serve.swa-pool"]
        assert warning.severity == "warning"
        assert warning.message.startswith("the longest declared prompt (16000 tokens) exceeds "
                                          "the SWA KV pool (9088 tokens")
        assert "--swa-full-tokens-ratio" in warning.message
        assert "serve.kt_num_gpu_experts" in warning.message
    finally:
        sv.stop_recorded(ctx.workspace.serve_record, 3)


def test_no_interpreter_for_the_server_is_a_host_failure_not_a_usage_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 21: what the host has installed fails serve with exit 1, never 2."""
    from dsv4_offload.core.errors import Dsv4Error, InputError

    monkeypatch.delenv("PYTHON_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no python3.11/python3 to probe
    ctx = context(make_workspace(tmp_path / "ws"), [], "serve")
    with pytest.raises(Dsv4Error, match="no python interpreter imports") as err:
        serve._python(ctx, True)
    assert not isinstance(err.value, InputError) and err.value.exit_code == 1
    python, origin, note = serve._python(ctx, False)  # --print: shown, with the reason
    assert origin == "recipe" and "no python interpreter imports" in note
