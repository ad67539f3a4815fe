"""`verify-gguf`: each level catches the damage it is for, and names where it is."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from conftest import run_cli_inproc as run_cli  # the commands in process: not the process

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import Status
from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.stages import convert, verify_gguf
from dsv4_offload.weights.checkpoint import MoeDims, write_synthetic_checkpoint
from dsv4_offload.weights.gguf_io import OWN_MANIFEST, LayerLayout, parse_manifest
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

DIMS = MoeDims(layers=3, experts=8, experts_per_token=6, hidden=64, intermediate=32)
FILE = "dsv4_layer{}_mxfp4.gguf"


def make_ctx(root: Path, stage: str = "verify-gguf", **options: object) -> StageContext:
    recipe, series = load_recipe_and_series(None)
    return StageContext(recipe=recipe, series=series, workspace=Workspace(root),
                        options=dict(options), stage=stage)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", DIMS, seed=11)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Path:
    ws = tmp_path_factory.mktemp("pristine")
    result = convert.run(make_ctx(ws, "convert", source=str(checkpoint), jobs=1))
    assert result.status is Status.OK
    return ws / "gguf"


@pytest.fixture
def workspace(tmp_path: Path, pristine: Path) -> Path:
    """A fresh copy of a good conversion, free to damage."""
    shutil.copytree(pristine, tmp_path / "gguf")
    return tmp_path


def layout(layer: int) -> LayerLayout:
    recipe, _ = load_recipe_and_series(None)
    return LayerLayout.for_layer(layer, DIMS, recipe.conversion)


def good_manifest(tmp_path: Path, pristine: Path) -> Path:
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
             for p in sorted(pristine.glob("*.gguf"))]
    path = tmp_path / "published.sha256"
    path.write_text("".join(lines))
    return path


def verify(ws: Path, checkpoint: Path, *args: str):  # type: ignore[no-untyped-def]
    return run_cli("-w", str(ws), "verify-gguf", "--source", str(checkpoint), *args)


def test_good_files_pass_all_levels_and_get_a_manifest(workspace: Path, checkpoint: Path,
                                                       pristine: Path) -> None:
    first = verify(workspace, checkpoint, "--deep", "3")
    assert first.code == 0, first
    assert "L1 ok, L2 recorded, L3 ok" in first.out  # no published digests for these dims
    own = parse_manifest((workspace / "gguf" / OWN_MANIFEST).read_text(), OWN_MANIFEST)
    assert sorted(own) == [FILE.format(i) for i in range(3)]
    again = run_cli("-w", str(workspace), "--json", "verify-gguf", "--source", str(checkpoint),
                    "--no-kernel")  # level 4 (kt-kernel): tests/test_layerforward.py
    assert again.code == 0, again
    doc = again.json()
    assert doc["status"] == "ok" and doc["data"]["data"]["levels"] == {"1": "ok", "2": "ok",
                                                                       "3": "ok", "4": "off"}
    assert doc["data"]["data"]["deep_layers"] == [1]  # one layer by default: the middle one
    # the published-style manifest agrees with ours
    with_manifest = verify(workspace, checkpoint, "--manifest",
                           str(good_manifest(workspace, pristine)), "--deep", "0")
    assert with_manifest.code == 0, with_manifest


def test_level1_catches_truncation_and_a_missing_file(workspace: Path, checkpoint: Path) -> None:
    path = workspace / "gguf" / FILE.format(1)
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 17)
    (workspace / "gguf" / FILE.format(2)).unlink()
    result = run_cli("-w", str(workspace), "--json", "verify-gguf", "--source", str(checkpoint))
    assert result.code == 1, result
    messages = [p["message"] for p in result.json()["data"]["problems"]]
    assert messages == [f"layer 1: {path} is {size - 17} B, expected {size} B (truncated)",
                        f"layer 2: {workspace / 'gguf' / FILE.format(2)} is missing"]
    human = verify(workspace, checkpoint)  # the same, rendered for a person
    assert human.code == 1 and "level 1 failed" in " ".join(human.out.split())


def test_structure_check_names_the_kv(workspace: Path, checkpoint: Path) -> None:
    path = workspace / "gguf" / FILE.format(0)
    data = bytearray(path.read_bytes())
    key = b"deepseek2.expert_count"
    at = data.index(key) + len(key) + 4  # value after the uint32 type tag
    data[at] = 9
    path.write_bytes(bytes(data))
    result = run_cli("-w", str(workspace), "--json", "verify-gguf", "--source", str(checkpoint))
    assert result.code == 1, result
    problems = result.json()["data"]["problems"]
    assert any("layer 0" in p["message"] and "'deepseek2.expert_count' = 9, expected 8"
               in p["message"] for p in problems), problems


def test_level2_catches_a_single_flipped_bit(workspace: Path, checkpoint: Path,
                                             pristine: Path) -> None:
    manifest = good_manifest(workspace, pristine)
    path = workspace / "gguf" / FILE.format(2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2 + 5] ^= 0x10
    path.write_bytes(bytes(data))
    result = run_cli("-w", str(workspace), "--json", "verify-gguf", "--source", str(checkpoint),
                     "--manifest", str(manifest), "--deep", "0")
    assert result.code == 1, result
    doc = result.json()["data"]
    assert doc["data"]["levels"]["2"] == "failed"
    errors = [p["message"] for p in doc["problems"] if p["severity"] == "error"]
    assert len(errors) == 1 and errors[0].startswith(f"layer 2: {FILE.format(2)} sha256")
    assert str(manifest) in errors[0]
    assert not (workspace / "gguf" / OWN_MANIFEST).exists()  # nothing vouched for on failure


def test_level3_names_layer_tensor_expert_and_row_of_a_flipped_scale(
        workspace: Path, checkpoint: Path) -> None:
    up = layout(2).tensors[1]
    row, block = 3, 1
    at = up.expert_offset(5) + row * up.row_bytes + block * 17  # the E8M0 byte of that block
    path = workspace / "gguf" / FILE.format(2)
    data = bytearray(path.read_bytes())
    original = data[at]
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    result = run_cli("-w", str(workspace), "--json", "verify-gguf", "--source", str(checkpoint),
                     "--deep", "3")
    assert result.code == 1, result
    errors = [p["message"] for p in result.json()["data"]["problems"]
              if p["severity"] == "error"]
    assert errors == [
        f"layer 2: tensor blk.2.ffn_up_exps.weight (w3), expert 5, row {row}, block {block}: "
        f"scale (E8M0) 0x{original ^ 1:02x} in the file, 0x{original:02x} from the source "
        f"(1 of {up.rows} rows differ)"]


def test_level3_catches_two_swapped_experts(workspace: Path, checkpoint: Path) -> None:
    down = layout(0).tensors[2]
    path = workspace / "gguf" / FILE.format(0)
    data = bytearray(path.read_bytes())
    a, b = down.expert_offset(2), down.expert_offset(6)
    n = down.expert_bytes
    data[a:a + n], data[b:b + n] = data[b:b + n], data[a:a + n]
    path.write_bytes(bytes(data))
    result = verify_gguf.run(make_ctx(workspace, source=str(checkpoint), deep=3, jobs=2))
    assert result.status is Status.FAILED
    errors = [p.message for p in result.problems if p.severity == "error"]
    assert len(errors) == 2
    assert errors[0].startswith("layer 0: tensor blk.0.ffn_down_exps.weight (w2), expert 2, row 0")
    assert errors[0].endswith("it holds expert 6's data (experts out of order)")
    assert errors[1].startswith("layer 0: tensor blk.0.ffn_down_exps.weight (w2), expert 6, row 0")
    assert errors[1].endswith("it holds expert 2's data (experts out of order)")


def test_without_a_source_the_recipe_dims_apply(workspace: Path, tmp_path: Path) -> None:
    result = verify_gguf.run(make_ctx(workspace, source=str(tmp_path / "nowhere")))
    # no config.json to read: the recipe's (real) dims apply, and the small files fail L1
    assert result.status is Status.FAILED and result.data["levels"] == {"1": "failed"}
    assert "is 26688 B, expected 3422552640 B (truncated)" in result.problems[0].message


@pytest.mark.parametrize("deep, severity", [(None, "warning"), (2, "error")])
def test_level3_without_a_source(tmp_path: Path, deep: int | None, severity: str) -> None:
    report = verify_gguf.Report()
    layouts = {layer: layout(layer) for layer in range(3)}
    paths = {layer: tmp_path / FILE.format(layer) for layer in range(3)}
    ctx = make_ctx(tmp_path, source=str(tmp_path / "nowhere"), deep=deep)
    verify_gguf._level3(ctx, layouts, paths, None, 1, report)
    assert report.levels == {"3": "skipped"}
    assert [(p.severity, p.check) for p in report.problems] == [(severity, "level3")]


def test_rewritten_layers_leave_our_manifest(workspace: Path, checkpoint: Path) -> None:
    assert verify_gguf.run(make_ctx(workspace, source=str(checkpoint), deep=0)).ok
    convert.run(make_ctx(workspace, "convert", source=str(checkpoint), layers="1", force=True,
                         jobs=1))
    own = parse_manifest((workspace / "gguf" / OWN_MANIFEST).read_text(), OWN_MANIFEST)
    assert sorted(own) == [FILE.format(0), FILE.format(2)]


def test_recipe_digests_apply_to_the_real_dims(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    names = {layer: ctx.recipe.conversion.file_name(layer) for layer in (0, 42)}
    digests, origin = verify_gguf.expected_digests(ctx, names, True, tmp_path)
    assert digests == {
        "dsv4_layer0_mxfp4.gguf":
            "88e06863d0d6290d5c77ad575f4d9adfd40788c88d036011e2bc0e6d8cb492ca",
        "dsv4_layer42_mxfp4.gguf":
            "ac66c8564f66e7e1191f416efabc738584732583d3913aad94d3b9e3b8827400"}
    assert "conversion.digests" in origin
    assert verify_gguf.expected_digests(ctx, names, False, tmp_path)[0] is None


def test_manifest_format_errors_name_the_line(tmp_path: Path) -> None:
    text = f"{'a' * 64}  dsv4_layer0_mxfp4.gguf\n{'b' * 64} *dir/dsv4_layer1_mxfp4.gguf\n"
    assert parse_manifest(text, "m") == {"dsv4_layer0_mxfp4.gguf": "a" * 64,
                                         "dsv4_layer1_mxfp4.gguf": "b" * 64}
    with pytest.raises(InputError, match="m:2: not a sha256sum line"):
        parse_manifest(f"{'a' * 64}  x.gguf\nnot a digest\n", "m")
    with pytest.raises(InputError, match="no digests"):
        parse_manifest("\n", "m")


def test_deep_layers_are_evenly_spaced() -> None:
    assert verify_gguf.deep_layers(list(range(43)), 3) == [0, 21, 42]
    assert verify_gguf.deep_layers(list(range(43)), 1) == [21]
    assert verify_gguf.deep_layers([3, 5], 9) == [3, 5]
    assert verify_gguf.deep_layers([3, 5], 0) == []


@pytest.mark.slow  # hashes 3.4 GB (of a hole): ~10 s here
def test_real_dims_are_checked_against_the_published_digests(tmp_path: Path) -> None:
    """A real-size layer file (header + a hole) passes level 1 and fails the recipe's digest.

    Fast tests of its seams, the recipe's digests chosen for the real dims and a digest
    mismatch at level 2 on small files:
    tests/test_verify_gguf.py::test_recipe_digests_apply_to_the_real_dims
    tests/test_verify_gguf.py::test_level2_catches_a_single_flipped_bit
    """
    recipe, _ = load_recipe_and_series(None)
    real = MoeDims(43, 256, 6, 4096, 2048)
    layout0 = LayerLayout.for_layer(0, real, recipe.conversion)
    path = tmp_path / "gguf" / FILE.format(0)
    path.parent.mkdir()
    with open(path, "wb") as fh:
        fh.write(layout0.header)
        fh.truncate(layout0.file_bytes)
    result = verify_gguf.run(make_ctx(tmp_path, source=str(tmp_path / "no-source"), layers="0"))
    assert result.data["levels"] == {"1": "ok", "2": "failed", "3": "skipped"}
    messages = [(p.severity, p.message) for p in result.problems]
    assert messages[0][0] == "error" and messages[0][1].startswith(
        f"layer 0: {FILE.format(0)} sha256 ")
    assert "88e06863d0d6290d" in messages[0][1] and "conversion.digests" in messages[0][1]
    assert messages[1] == ("warning", f"level 3: no source checkpoint at "
                           f"{tmp_path / 'no-source'} to compare with")


def test_a_fetched_delivery_manifest_must_agree_with_the_recipe(tmp_path: Path) -> None:
    recipe, _ = load_recipe_and_series(None)
    conv = recipe.conversion
    text = "".join(f"{d}  {conv.file_name(k)}\n" for k, d in sorted(conv.digests.items()))
    manifest = conv.digests_manifest
    assert manifest is not None

    def ctx_with(content: str) -> StageContext:
        pin = hashlib.sha256(content.encode()).hexdigest()
        recipe2, series = load_recipe_and_series(
            None, [f"conversion.digests_manifest.sha256={pin}"])
        ctx = StageContext(recipe=recipe2, series=series, workspace=Workspace(tmp_path),
                           options={}, stage="verify-gguf")
        path = ctx.workspace.source_dir(recipe2, manifest.source) / manifest.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        return ctx

    assert verify_gguf.check_delivery_manifest(ctx_with(text)) is not None
    wrong = text.replace(conv.digests[7], "0" * 64)
    with pytest.raises(InputError, match=r"conversion.digests\[7\] is c9f4045ef7f3d520… but"):
        verify_gguf.check_delivery_manifest(ctx_with(wrong))
    ctx = ctx_with(text)
    path = ctx.workspace.source_dir(ctx.recipe, manifest.source) / manifest.path
    path.write_text(text + "\n")  # modified after the pin
    with pytest.raises(InputError, match="delivery checkout is modified"):
        verify_gguf.check_delivery_manifest(ctx)


def test_a_file_that_is_not_gguf_fails_the_structure_check(workspace: Path,
                                                           checkpoint: Path) -> None:
    path = workspace / "gguf" / FILE.format(1)
    data = bytearray(path.read_bytes())
    data[:4] = b"GGML"
    path.write_bytes(bytes(data))
    result = verify_gguf.run(make_ctx(workspace, source=str(checkpoint), deep=0))
    assert result.data["levels"] == {"1": "failed"}
    assert [p.message.split(" (")[0] for p in result.problems] == [
        f"layer 1: {FILE.format(1)}: not a readable GGUF file"]


def test_an_unreadable_manifest_is_an_input_error(workspace: Path, checkpoint: Path) -> None:
    with pytest.raises(InputError, match="--manifest .*missing.sha256: No such file"):
        verify_gguf.run(make_ctx(workspace, source=str(checkpoint),
                                 manifest=str(workspace / "missing.sha256")))
