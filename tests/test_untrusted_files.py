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
from fuzz_headers import DIMS, LAYOUT, cases, run_reader, valid_gguf, valid_safetensors

from dsv4_offload.core.errors import InputError
from dsv4_offload.weights.checkpoint import Checkpoint, parse_config, read_safetensors_header
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
