"""Damaged and hostile files: readers answer with one line, never a traceback or a hang.

A seeded fuzz of the GGUF layer reader and the safetensors header reader (more cases in
bench/bench_fuzz_readers.py); a FIFO as a shard; a config with absurd counts; an index
that points outside the checkpoint; a YAML alias bomb.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from conftest import HOST_RECIPE, run_cli_inproc
from fuzz_headers import DIMS, LAYOUT, cases, run_reader, valid_gguf, valid_safetensors

from dsv4_offload.core.errors import InputError
from dsv4_offload.weights.checkpoint import (
    Checkpoint,
    MoeDims,
    parse_config,
    read_safetensors_header,
)
from dsv4_offload.weights.gguf_io import structural_problems

CASES = 300


def test_the_undamaged_files_read_cleanly(tmp_path: Path) -> None:
    gguf = tmp_path / "ok.gguf"
    gguf.write_bytes(valid_gguf())
    assert structural_problems(gguf, LAYOUT) == []
    shard = tmp_path / "ok.safetensors"
    shard.write_bytes(valid_safetensors())
    assert sorted(read_safetensors_header(shard)) == ["a", "b"]


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_fuzzed_headers_never_raise_anything_but_one_line(kind: str, tmp_path: Path) -> None:
    path = tmp_path / f"case.{kind}"
    tracebacks: list[str] = []
    clear = 0
    for i, data in enumerate(cases(kind, CASES)):
        path.write_bytes(data)
        try:
            result = run_reader(kind, path)
        except InputError as exc:
            assert "\n" not in exc.one_line() and str(path) in exc.one_line()
            clear += 1
        except Exception as exc:  # what the test is for: none may escape
            tracebacks.append(f"case {i}: {type(exc).__name__}: {exc}"[:200])
        else:
            if kind == "gguf":
                assert isinstance(result, list)
                assert all(isinstance(p, str) and "\n" not in p for p in result)
                clear += bool(result)
    assert tracebacks == []
    assert clear > CASES // 2  # most damage is caught, not silently accepted


def test_a_fifo_as_a_shard_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "model-00001-of-00001.safetensors"
    os.mkfifo(fifo)
    result: list[object] = []

    def read() -> None:
        try:
            read_safetensors_header(fifo)
        except InputError as exc:
            result.append(exc.one_line())

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "reading a FIFO shard hung"
    assert result and "not a regular file" in str(result[0])
    gguf = tmp_path / "layer.gguf"
    os.mkfifo(gguf)
    assert structural_problems(gguf, LAYOUT) == ["not a regular file (a FIFO, socket or device)"]


def test_a_config_with_a_layer_count_of_10_to_the_12_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    doc = {"num_hidden_layers": 10**12, "n_routed_experts": DIMS.experts,
           "num_experts_per_tok": 2, "hidden_size": 64, "moe_intermediate_size": 32}
    config.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="num_hidden_layers"):
        parse_config(config)


def test_an_index_pointing_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    doc = {"num_hidden_layers": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "hidden_size": 64, "moe_intermediate_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(doc))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"layers.0.ffn.experts.0.w1.weight": "../../etc/passwd"}}))
    with pytest.raises(InputError, match="not a shard file inside"):
        Checkpoint.open(tmp_path)


BOMB = """name: bomb
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_a_yaml_alias_bomb_is_refused_in_a_recipe_and_a_probes_file(tmp_path: Path) -> None:
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(BOMB)
    res = run_cli_inproc("--workspace", str(tmp_path / "ws"), "--recipe", str(recipe), "status",
                         timeout=30)
    assert res.code == 2, res
    assert "expands to over" in res.err and str(recipe) in res.err
    assert "Traceback" not in res.err
    res = run_cli_inproc("--workspace", str(tmp_path / "ws"), "--recipe", str(HOST_RECIPE),
                         "accept", "--probes", str(recipe), "--url", "http://127.0.0.1:9",
                         timeout=30)
    assert res.code == 2, res
    assert "expands to over" in res.err


def test_a_fifo_as_a_recipe_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    res = run_cli_inproc("--workspace", str(tmp_path / "ws"), "--recipe", str(fifo), "status",
                         timeout=30)
    assert res.code == 2, res
    assert "not a regular file" in res.err and "Traceback" not in res.err


def test_convert_redoes_and_verify_names_a_layer_whose_source_changed(tmp_path: Path) -> None:
    """Same names, shapes and sizes, other weights: size alone would keep the stale layer."""
    from dsv4_offload.weights.checkpoint import write_synthetic_checkpoint

    dims = DIMS
    src = write_synthetic_checkpoint(tmp_path / "ckpt", dims, seed=1)
    ws = tmp_path / "ws"
    first = run_cli_inproc("-w", str(ws), "--json", "convert", "--source", str(src))
    assert first.code == 0, first
    other = write_synthetic_checkpoint(tmp_path / "other", dims, seed=2, layers=[0, 1])
    shard = "model-00001-of-00002.safetensors"
    assert (other / shard).stat().st_size == (src / shard).stat().st_size
    os.replace(other / shard, src / shard)  # layer 0's shard: other weights, same shape
    verify = run_cli_inproc("-w", str(ws), "--json", "verify-gguf", "--source", str(src),
                            "--deep", "0")
    assert verify.code == 1, verify
    messages = [p["message"] for p in verify.json()["data"]["problems"]]
    assert any(m.startswith("layer 0: ") and "converted from other weights" in m
               and shard in m for m in messages), messages
    again = run_cli_inproc("-w", str(ws), "--json", "convert", "--source", str(src))
    assert again.code == 0, again
    data = again.json()["data"]["data"]
    assert data["converted"] == [0] and data["skipped"] == [1]
    assert shard in data["redone_source_changed"]["0"]
    verify = run_cli_inproc("-w", str(ws), "--json", "verify-gguf", "--source", str(src),
                            "--deep", "0")
    assert verify.code == 0, verify


def test_a_symlink_planted_at_the_temp_name_is_not_followed(tmp_path: Path) -> None:
    from dsv4_offload.weights.checkpoint import write_synthetic_checkpoint

    src = write_synthetic_checkpoint(tmp_path / "ckpt", DIMS, layers=[0, 1])
    canary = tmp_path / "outside" / "canary"
    canary.parent.mkdir()
    canary.write_bytes(b"keep me\n")
    out = tmp_path / "ws" / "gguf"
    out.mkdir(parents=True)
    os.symlink(canary, out / "dsv4_layer0_mxfp4.gguf.tmp")
    res = run_cli_inproc("-w", str(tmp_path / "ws"), "convert", "--source", str(src),
                         "--layers", "0")
    assert res.code == 0, res
    assert canary.read_bytes() == b"keep me\n"
    assert not (out / "dsv4_layer0_mxfp4.gguf").is_symlink()
    assert (out / "dsv4_layer0_mxfp4.gguf").stat().st_size > 0
    assert sorted(p.name for p in canary.parent.iterdir()) == ["canary"]


def test_a_malformed_layer_sources_record_is_one_line(tmp_path: Path) -> None:
    from dsv4_offload.weights.checkpoint import write_synthetic_checkpoint

    src = write_synthetic_checkpoint(tmp_path / "ckpt", DIMS, layers=[0, 1])
    out = tmp_path / "ws" / "gguf"
    out.mkdir(parents=True)
    (out / ".dsv4-layer-sources.json").write_text("[1, 2")
    res = run_cli_inproc("-w", str(tmp_path / "ws"), "convert", "--source", str(src),
                         "--layers", "0")
    assert "Traceback" not in res.err, res
    assert res.code in (0, 2), res


@pytest.mark.parametrize("record", ['"garbage"', '{"status": 5}', '{"fingerprint": [1]}'])
def test_a_malformed_stage_record_is_one_line(tmp_path: Path, record: str) -> None:
    state = tmp_path / "ws" / ".dsv4" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text('{"schema": 1, "stages": {"doctor": ' + record + "}}")
    res = run_cli_inproc("-w", str(tmp_path / "ws"), "--recipe", str(HOST_RECIPE), "status")
    assert res.code == 2, res
    assert "the record of stage 'doctor' is malformed" in res.err and "Traceback" not in res.err


def test_a_lock_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    lock = tmp_path / "ws" / ".dsv4" / "lock"
    lock.mkdir(parents=True)
    res = run_cli_inproc("-w", str(tmp_path / "ws"), "--recipe", str(HOST_RECIPE), "run", "--to",
                         "doctor")
    assert res.code == 2, res
    assert str(lock) in res.err and "Traceback" not in res.err


def test_a_worker_killed_mid_layer_is_one_line(tmp_path: Path) -> None:
    """A worker the OS kills (out of memory) breaks the process pool: one line, no traceback."""
    import signal
    import subprocess
    import time

    from conftest import CLI

    from dsv4_offload.weights.checkpoint import write_synthetic_checkpoint

    dims = MoeDims(layers=4, experts=32, experts_per_token=6, hidden=2048, intermediate=1024)
    source = write_synthetic_checkpoint(tmp_path / "ckpt", dims, seed=5)
    ws = tmp_path / "ws"
    proc = subprocess.Popen([*CLI, "-w", str(ws), "convert", "--source", str(source), "-j", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = False
    deadline = time.monotonic() + 60
    while not killed and proc.poll() is None and time.monotonic() < deadline:
        if any(p.suffix == ".tmp" for p in (ws / "gguf").glob("*.tmp")):
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            for pid in children:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in cmdline:
                    os.kill(int(pid), signal.SIGKILL)
                    killed = True
                    break
        time.sleep(0.001)
    out, err = proc.communicate(timeout=60)
    if not killed:
        pytest.skip("the conversion ended before a worker could be killed")
    assert proc.returncode == 1, (out, err)
    assert "a conversion worker died" in out + err and "Traceback" not in out + err


@pytest.mark.parametrize("kind", ["fifo", "directory", "huge", "binary"])
def test_an_api_key_file_or_manifest_that_is_not_a_small_text_file_is_one_line(
        tmp_path: Path, kind: str) -> None:
    from dsv4_offload.serving.rules import read_api_key

    path = tmp_path / "input"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        path.write_bytes(b"k" * (2 << 20))
    else:
        path.write_bytes(b"\xff\xfe\x00key")
    result: list[str] = []

    def read() -> None:
        with pytest.raises(InputError) as err:
            read_api_key(path)
        result.append(err.value.one_line())

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "reading the API key file hung"
    assert result and str(path) in result[0] and "\n" not in result[0]
    res = run_cli_inproc("-w", str(tmp_path / "ws"), "verify-gguf", "--manifest", str(path),
                         timeout=30)
    assert "Traceback" not in res.err
