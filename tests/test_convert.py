"""`convert`: synthetic native checkpoints (real names and dtypes, small dims) into GGUF."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import CLI
from conftest import run_cli_inproc as run_cli  # the commands in process: not the process

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import Status
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.stages import convert
from dsv4_offload.weights import conversion as layer_options
from dsv4_offload.weights.checkpoint import (
    INDEX_FILE,
    MoeDims,
    TensorSpec,
    synthetic_layer_tensors,
    write_safetensors,
    write_synthetic_checkpoint,
)
from dsv4_offload.weights.gguf_io import LayerLayout
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

DIMS = MoeDims(layers=3, experts=8, experts_per_token=6, hidden=64, intermediate=32)
FILE = "dsv4_layer{}_mxfp4.gguf"


def make_ctx(root: Path, **options: object) -> StageContext:
    recipe, series = load_recipe_and_series(None)
    return StageContext(recipe=recipe, series=series, workspace=Workspace(root),
                        options=dict(options), stage="convert")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", DIMS)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Path:
    """A workspace converted once through the real CLI, two layers at a time."""
    ws = tmp_path_factory.mktemp("ws")
    result = run_cli("-w", str(ws), "convert", "--source", str(checkpoint), "--jobs", "2")
    assert result.code == 0, result
    assert "converted 3 layer(s)" in result.out
    return ws / "gguf"


def test_convert_with_source_is_done_in_status(converted: Path, checkpoint: Path) -> None:
    """Issue 19: the record keeps the --source it converted from, so `status` (which has no
    --source) judges the stage by that source: done, not stale forever."""
    ws = converted.parent
    res = run_cli("--json", "-w", str(ws), "status")
    assert res.code == 0, res
    st = {s["name"]: s for s in res.json()["data"]["stages"]}
    assert st["convert"]["state"] == "done", st["convert"]
    state = json.loads((ws / ".dsv4" / "state.json").read_text())
    assert state["stages"]["convert"]["outputs"]["source"] == str(checkpoint)


# --- an independent reading of the source ---------------------------------------------------


def read_source_tensor(root: Path, name: str) -> tuple[str, np.ndarray]:
    """(dtype, uint8 array) of one tensor, read with a safetensors parser written here."""
    shard = root / json.loads((root / INDEX_FILE).read_text())["weight_map"][name]
    with open(shard, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        start, end = header[name]["data_offsets"]
        fh.seek(8 + n + start)
        data = np.frombuffer(fh.read(end - start), np.uint8).reshape(header[name]["shape"])
    return header[name]["dtype"], data


def ocp_dequantize(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """OCP MX: E2M1[code] x 2^(e-127), codes in consecutive order (low nibble first)."""
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float64)
    codes = np.stack([weight & 15, weight >> 4], axis=-1).reshape(weight.shape[0], -1)
    magnitude = e2m1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    factor = np.exp2(scale.astype(np.float64) - 127).repeat(32, axis=1)
    return (magnitude * factor).astype(np.float32)


def test_values_equal_an_independent_dequantization(converted: Path, checkpoint: Path) -> None:
    for layer in range(DIMS.layers):
        reader = gguf.GGUFReader(converted / FILE.format(layer))
        assert [t.name for t in reader.tensors] == [
            f"blk.{layer}.ffn_{role}_exps.weight" for role in ("gate", "up", "down")]
        for tensor, projection in zip(reader.tensors, ("w1", "w3", "w2"), strict=True):
            n, k = DIMS.projection_shape(projection)
            assert int(tensor.tensor_type) == 39
            assert [int(d) for d in tensor.shape] == [k, n, DIMS.experts]
            values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
            assert values.shape == (DIMS.experts, n, k)
            for expert in range(DIMS.experts):
                key = f"layers.{layer}.ffn.experts.{expert}.{projection}"
                w_dtype, weight = read_source_tensor(checkpoint, key + ".weight")
                s_dtype, scale = read_source_tensor(checkpoint, key + ".scale")
                assert (w_dtype, s_dtype) == ("I8", "F8_E8M0")
                np.testing.assert_array_equal(values[expert], ocp_dequantize(weight, scale))


def test_header_kv_in_the_delivery_order(converted: Path) -> None:
    reader = gguf.GGUFReader(converted / FILE.format(2))
    kv = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    assert list(kv.items()) == [
        ("general.architecture", "deepseek2"), ("general.quantization_version", 2),
        ("general.name", "dsv4-flash-layer2-moe-mxfp4"), ("deepseek2.expert_count", 8),
        ("deepseek2.expert_used_count", 6), ("deepseek2.embedding_length", 64),
        ("deepseek2.expert_feed_forward_length", 32)]
    assert reader.data_offset == 576
    offsets = [t.data_offset for t in reader.tensors]
    sizes = [t.n_bytes for t in reader.tensors]
    assert offsets == [576, 576 + sizes[0], 576 + sizes[0] + sizes[1]]  # back to back
    assert (converted / FILE.format(2)).stat().st_size == 576 + sum(sizes)


def test_real_size_layout_reads_back_as_type_39(tmp_path: Path) -> None:
    """The real dims: header padded to 576 B, 3 x 1,140,850,688 B, 3,422,552,640 B in all."""
    recipe, _ = load_recipe_and_series(None)
    real = MoeDims(43, 256, 6, 4096, 2048)
    layout = LayerLayout.for_layer(42, real, recipe.conversion)
    assert layout.data_offset == 576
    assert [t.nbytes for t in layout.tensors] == [1_140_850_688] * 3
    assert layout.file_bytes == recipe.conversion.expected_file_bytes == 3_422_552_640
    sparse = tmp_path / "layer42.gguf"  # the header plus a hole: costs no disk
    with open(sparse, "wb") as fh:
        fh.write(layout.header)
        fh.truncate(layout.file_bytes)
    reader = gguf.GGUFReader(sparse)
    assert [(t.name, int(t.tensor_type), [int(d) for d in t.shape]) for t in reader.tensors] == [
        ("blk.42.ffn_gate_exps.weight", 39, [4096, 2048, 256]),
        ("blk.42.ffn_up_exps.weight", 39, [4096, 2048, 256]),
        ("blk.42.ffn_down_exps.weight", 39, [2048, 4096, 256])]


def test_rerun_skips_done_layers_and_force_redoes_identically(
        converted: Path, checkpoint: Path) -> None:
    ws = converted.parent
    before = {p.name: (p.stat().st_mtime_ns, sha256(p)) for p in converted.glob("*.gguf")}
    result = convert.run(make_ctx(ws, source=str(checkpoint)))
    assert result.status is Status.SKIPPED and "already present" in result.summary
    assert {p.name: (p.stat().st_mtime_ns, sha256(p)) for p in converted.glob("*.gguf")} == before
    result = convert.run(make_ctx(ws, source=str(checkpoint), layers="1", force=True, jobs=1))
    assert result.status is Status.OK and result.data["converted"] == [1]
    redone = converted / FILE.format(1)
    assert redone.stat().st_mtime_ns != before[redone.name][0]
    assert sha256(redone) == before[redone.name][1]
    assert not list(converted.glob("*.tmp"))


def test_one_job_and_two_jobs_write_the_same_bytes(
        converted: Path, checkpoint: Path, tmp_path: Path) -> None:
    result = convert.run(make_ctx(tmp_path, source=str(checkpoint), jobs=1))
    assert result.status is Status.OK and result.data["converted"] == [0, 1, 2]
    for layer in range(DIMS.layers):
        name = FILE.format(layer)
        assert sha256(tmp_path / "gguf" / name) == sha256(converted / name)


def test_numpy_fallback_writes_the_same_bytes(converted: Path, checkpoint: Path,
                                              tmp_path: Path) -> None:
    result = run_cli("-w", str(tmp_path), "convert", "--source", str(checkpoint), "-j", "1",
                     env={"DSV4_MXFP4_KERNEL": "numpy"})
    assert result.code == 0, result
    for layer in range(DIMS.layers):
        name = FILE.format(layer)
        assert sha256(tmp_path / "gguf" / name) == sha256(converted / name)


def test_layer_selection_and_jobs_defaults() -> None:
    assert layer_options.parse_layers("0-2,5", 43) == [0, 1, 2, 5]
    assert layer_options.parse_layers("3,5,7", 43) == [3, 5, 7]
    assert layer_options.parse_layers(None, 3) == [0, 1, 2]
    with pytest.raises(InputError, match="outside 0..2"):
        layer_options.parse_layers("0-3", 3)
    with pytest.raises(InputError, match="not a number or a range"):
        layer_options.parse_layers("x", 3)
    meminfo = "MemTotal: 9 kB\nMemAvailable:  4096 kB\n"
    assert layer_options.mem_available_bytes(meminfo) == 4096 * 1024
    assert 1 <= layer_options.default_jobs(100) <= (os.cpu_count() or 1)
    assert layer_options.default_jobs(1) == 1


def test_fingerprinting_the_gguf_stages_loads_no_numpy(tmp_path: Path) -> None:
    # `status` and `run` fingerprint every stage with a record: that must stay cheap
    code = (
        "import sys\n"
        "from dsv4_offload import pipeline\n"
        "from dsv4_offload.recipe import load_recipe_and_series\n"
        "from dsv4_offload.workspace.context import StageContext\n"
        "from dsv4_offload.workspace.store import Workspace\n"
        "recipe, series = load_recipe_and_series()\n"
        f"ws = Workspace({str(tmp_path)!r})\n"
        "ctx = StageContext(recipe=recipe, series=series, workspace=ws)\n"
        "pipeline.fingerprint(ctx, pipeline.spec('verify-gguf'), ws.state())\n"
        "print(sorted(m for m in ('numpy', 'gguf') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- broken checkpoints: one clear line each ------------------------------------------------


def shard_of(root: Path, layer: int) -> Path:
    index = json.loads((root / INDEX_FILE).read_text())
    return root / index["weight_map"][f"layers.{layer}.ffn.experts.0.w1.weight"]


def rewrite_layer(root: Path, layer: int, change: Callable[[TensorSpec], TensorSpec | None],
                  drop_from_index: str | None = None) -> None:
    specs = [change(s) for s in synthetic_layer_tensors(DIMS, layer)]
    write_safetensors(shard_of(root, layer), [s for s in specs if s is not None])
    if drop_from_index:
        index = json.loads((root / INDEX_FILE).read_text())
        del index["weight_map"][drop_from_index]
        (root / INDEX_FILE).write_text(json.dumps(index))


MISSING = "layers.1.ffn.experts.3.w3.scale"


def _drop(name: str) -> Callable[[TensorSpec], TensorSpec | None]:
    return lambda s: None if s.name == name else s


def _retype(name: str, dtype: str) -> Callable[[TensorSpec], TensorSpec]:
    return lambda s: TensorSpec(s.name, dtype, s.shape, s.data) if s.name == name else s


def _reshape(name: str) -> Callable[[TensorSpec], TensorSpec]:
    def change(s: TensorSpec) -> TensorSpec:
        if s.name != name:
            return s
        shape = (s.shape[0] // 2, s.shape[1] * 2)
        return TensorSpec(s.name, s.dtype, shape, s.data)
    return change


def _edit_config(**fields: int) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        config = json.loads((root / "config.json").read_text())
        config.update(fields)
        (root / "config.json").write_text(json.dumps(config))
    return edit


BREAKAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing index": (lambda r: (r / INDEX_FILE).unlink(), f"{INDEX_FILE}: missing"),
    "missing shard": (lambda r: shard_of(r, 1).unlink(), "shard missing"),
    "missing scale (index)": (lambda r: rewrite_layer(r, 1, _drop(MISSING), MISSING),
                              f"tensor '{MISSING}' is not in the weight_map"),
    "missing expert (shard)": (
        lambda r: rewrite_layer(r, 1, _drop("layers.1.ffn.experts.5.w2.weight")),
        "'layers.1.ffn.experts.5.w2.weight' is listed in the index but absent from the shard"),
    "wrong weight dtype": (
        lambda r: rewrite_layer(r, 1, _retype("layers.1.ffn.experts.2.w1.weight", "U8")),
        "has dtype U8, expected I8"),
    "wrong scale dtype": (
        lambda r: rewrite_layer(r, 1, _retype("layers.1.ffn.experts.2.w1.scale", "U8")),
        "has dtype U8, expected F8_E8M0"),
    "wrong shape": (lambda r: rewrite_layer(r, 1, _reshape("layers.1.ffn.experts.4.w2.weight")),
                    "has shape [32, 32] but config.json"),
    "truncated shard": (
        lambda r: os.truncate(shard_of(r, 2), shard_of(r, 2).stat().st_size - 100),
        "truncated"),
    "config hidden_size": (_edit_config(hidden_size=128), "config and tensors disagree"),
    "config expert count": (_edit_config(n_routed_experts=4),
                            "has expert 4 but config.json says n_routed_experts 4"),
    "config field": (_edit_config(moe_intermediate_size=0), "'moe_intermediate_size' is 0"),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_broken_checkpoint_is_one_clear_error_before_any_write(
        breakage: str, checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoint, broken)
    mutate, message = BREAKAGES[breakage]
    mutate(broken)
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")) as exc:
        convert.run(make_ctx(tmp_path / "ws", source=str(broken), jobs=1))
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "ws" / "gguf").exists() or not list((tmp_path / "ws" / "gguf").iterdir())


def test_cli_error_is_one_line_with_exit_2(checkpoint: Path, tmp_path: Path) -> None:
    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoint, broken)
    shard_of(broken, 0).unlink()
    result = run_cli("-w", str(tmp_path / "ws"), "convert", "--source", str(broken))
    assert result.code == 2, result
    assert "shard missing" in result.err and "Traceback" not in result.err
    assert len(result.err.strip().splitlines()) == 1


def test_synthetic_shard_with_wrong_data_leaves_no_temp_file(tmp_path: Path) -> None:
    bad = TensorSpec("t", "I8", (4,), lambda: b"abc")
    with pytest.raises(ValueError, match="data is 3 B, expected 4"):
        write_safetensors(tmp_path / "shard.safetensors", [bad])
    assert list(tmp_path.iterdir()) == []


# --- interruption and full disks ------------------------------------------------------------


MID_SIZE = MoeDims(layers=1, experts=32, experts_per_token=6, hidden=2048, intermediate=1024)


def signal_mid_layer(ws: Path, source: Path, sig: signal.Signals, jobs: int = 1) -> int:
    """Start a conversion, send `sig` once the layer's temp file exists; its exit status."""
    tmp = ws / "gguf" / (FILE.format(0) + ".tmp")
    proc = subprocess.Popen([*CLI, "-w", str(ws), "convert", "--source", str(source),
                             "-j", str(jobs)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not tmp.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        proc.send_signal(sig)
    finally:
        proc.wait(timeout=60)
    return proc.returncode


# Eight layers: on a loaded machine the test may only get to send its signal after the
# first layers are done, and the signal must still land in the middle of a conversion (with
# three, a CI run under full load once saw the whole conversion end before the signal)
SIGNAL_SIZE = dataclasses.replace(MID_SIZE, layers=8)


def complete_or_absent(gguf: Path, dims: MoeDims) -> list[Path]:
    """The final files in `gguf`, each checked to have its complete size."""
    conv = load_recipe_and_series(None)[0].conversion
    finals = sorted(p for p in gguf.iterdir() if p.suffix == ".gguf")
    for p in finals:
        layer = int(p.name.removeprefix("dsv4_layer").split("_")[0])
        assert p.stat().st_size == LayerLayout.for_layer(layer, dims, conv).file_bytes, p
    return finals


@pytest.mark.slow
def test_sigkill_mid_layer_leaves_no_final_file_and_rerun_is_identical(tmp_path: Path) -> None:
    """A standalone convert killed outright in a layer, then rerun. The fast tier's seams (a
    convert killed outright mid-layer, resumed; a signal in a layer of this command):
    tests/test_kills.py::test_convert_follow_killed_anywhere_redoes_no_complete_layer
    tests/test_convert.py::test_ctrl_c_mid_layer_cleans_up_and_exits_130
    """
    source = write_synthetic_checkpoint(tmp_path / "ckpt", SIGNAL_SIZE, seed=3)
    ws = tmp_path / "ws"
    gguf = ws / "gguf"
    code = signal_mid_layer(ws, source, signal.SIGKILL)
    assert code == -signal.SIGKILL, "the conversion ended before it could be killed"
    finals = complete_or_absent(gguf, SIGNAL_SIZE)
    assert len(finals) < SIGNAL_SIZE.layers
    assert [p for p in gguf.iterdir() if p.suffix == ".tmp"]  # the interrupted layer's

    result = run_cli("-w", str(ws), "convert", "--source", str(source))
    assert result.code == 0, result
    assert not [p for p in gguf.iterdir() if p.suffix == ".tmp"]
    reference = convert.run(make_ctx(tmp_path / "ref", source=str(source), jobs=1))
    assert reference.status is Status.OK
    for layer in range(SIGNAL_SIZE.layers):
        name = FILE.format(layer)
        assert sha256(gguf / name) == sha256(tmp_path / "ref" / "gguf" / name)


def test_ctrl_c_mid_layer_cleans_up_and_exits_130(tmp_path: Path) -> None:
    source = write_synthetic_checkpoint(tmp_path / "ckpt", SIGNAL_SIZE, seed=4)
    ws = tmp_path / "ws"
    code = signal_mid_layer(ws, source, signal.SIGINT)
    assert code == 130, "the conversion ended before Ctrl-C reached it"
    assert not [p for p in (ws / "gguf").iterdir() if p.suffix == ".tmp"]
    assert len(complete_or_absent(ws / "gguf", SIGNAL_SIZE)) < SIGNAL_SIZE.layers


def test_ctrl_c_reaches_parallel_workers(tmp_path: Path) -> None:
    dims = MoeDims(layers=2, experts=32, experts_per_token=6, hidden=2048, intermediate=1024)
    source = write_synthetic_checkpoint(tmp_path / "ckpt", dims, seed=5)
    ws = tmp_path / "ws"
    code = signal_mid_layer(ws, source, signal.SIGINT, jobs=2)  # to the parent only
    assert code == 130, "the conversion ended before Ctrl-C reached it"
    left = list((ws / "gguf").iterdir())
    assert not [p for p in left if p.suffix == ".tmp"], left
    expected = LayerLayout.for_layer(0, dims, load_recipe_and_series(None)[0].conversion)
    # finished ones only (beside them, the record of their sources, written before them)
    assert all(p.stat().st_size == expected.file_bytes for p in left if p.suffix == ".gguf")


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the file-size-limit case covers it")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_small_filesystem_fails_before_writing(checkpoint: Path, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "64k") as small:
        result = run_cli("-w", str(tmp_path / "ws"), "convert", "--source", str(checkpoint),
                         "--gguf-dir", str(small / "gguf"))
        assert result.code == 1, result
        assert "not enough free disk" in result.out + result.err
        assert not [p for p in (small / "gguf").iterdir() if p.suffix == ".gguf"]


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of dying


def test_file_size_limit_mid_layer_is_a_clean_error(checkpoint: Path, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    proc = subprocess.run([*CLI, "-w", str(ws), "convert", "--source", str(checkpoint),
                           "-j", "1"], capture_output=True, text=True, timeout=120,
                          preexec_fn=_limit_file_size)
    assert proc.returncode == 1, proc
    assert "File too large" in proc.stderr and "nothing was left at the final name" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((ws / "gguf").glob("*.gguf*")), list((ws / "gguf").iterdir())


def test_keys_with_a_model_prefix_convert_the_same(checkpoint: Path, converted: Path,
                                                   tmp_path: Path) -> None:
    prefixed = tmp_path / "ckpt"
    prefixed.mkdir()
    shutil.copy(checkpoint / "config.json", prefixed / "config.json")
    weight_map = {}
    for layer in range(DIMS.layers):
        shard = f"layer{layer}.safetensors"
        specs = [TensorSpec("model." + s.name, s.dtype, s.shape, s.data)
                 for s in synthetic_layer_tensors(DIMS, layer)]
        write_safetensors(prefixed / shard, specs)
        weight_map.update({s.name: shard for s in specs})
    (prefixed / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    result = convert.run(make_ctx(tmp_path / "ws", source=str(prefixed), jobs=1))
    assert result.status is Status.OK
    for layer in range(DIMS.layers):
        name = FILE.format(layer)
        assert sha256(tmp_path / "ws" / "gguf" / name) == sha256(converted / name)
