"""Recipes and series: the bundled ones validate; malformed ones fail with one line, exit 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsv4_offload.recipe import (
    BUNDLED_RECIPES,
    BUNDLED_SERIES,
    apply_overrides,
    load_recipe,
    load_recipe_and_series,
)

# the commands' answers, not the process: the CLI runs in this process (conftest.run_cli_inproc)
CLI_IN_PROCESS = True

RECIPE_910B = (BUNDLED_RECIPES / "dsv4-flash-910b.yaml").read_text()
SERIES = (BUNDLED_SERIES / "dsv4-flash.yaml").read_text()


def line_of(text: str, needle: str) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in text")


@pytest.mark.parametrize("name", ["dsv4-flash-910b", "dsv4-flash-a3"])
def test_bundled_recipes_validate(cli, name: str) -> None:
    res = cli("--recipe", name, "recipe", "validate")
    assert res.code == 0, res
    assert f"valid recipe '{name}'" in res.out
    # the A3 recipe adds the five sources of its clean-CANN bring-up
    sources = {"dsv4-flash-910b": 6, "dsv4-flash-a3": 11}[name]
    assert f"{sources} sources" in res.out and "10 patches" in res.out


def test_bundled_recipe_carries_the_brief_facts() -> None:
    recipe, series = load_recipe_and_series("dsv4-flash-910b")
    commits = {s.name: s.commit for s in recipe.sources}
    assert commits["llama.cpp"] == "a94e6ff8774b7c9f950d9545baf0ce35e8d1ed2f"
    assert commits["sglang"] == "298193eb34c9d87debbdb5957edead0a8b9ec988"
    assert recipe.source("sglang").path.endswith("third_party/sglang")
    assert recipe.conversion.expected_file_bytes == 3_422_552_640
    assert len(recipe.conversion.digests) == 43
    assert recipe.conversion.digests[0].startswith("88e06863")
    assert [p.method for p in series.patches].count("mbox") == 1
    assert [p.target for p in series.patches] == ["ktransformers"] * 2 + ["sglang"] * 6 + [
        "llama.cpp"] * 2
    a3 = load_recipe("dsv4-flash-a3")
    assert a3.serve.nsa_compressor_mode == "single"
    kt_kernel = next(s for s in a3.build.steps if s.name == "kt-kernel")
    assert kt_kernel.env["CC"] == "gcc-13"
    assert a3.acceptance.throughput.reference_tok_s == 19
    assert recipe.acceptance.throughput.reference_tok_s == 13


# (description, text to replace, replacement, expected field in the message, line needle)
RECIPE_CASES = [
    ("short commit", "commit: a94e6ff8774b7c9f950d9545baf0ce35e8d1ed2f", "commit: b3173",
     "sources[2].commit", "commit: b3173"),
    ("39-hex commit", "commit: d7b5b49a3ef214a822aba613423551dd56416557",
     "commit: d7b5b49a3ef214a822aba613423551dd5641655", "sources[0].commit", "commit: d7b5b49a"),
    ("short digest", "0: 88e06863d0d6290d5c77ad575f4d9adfd40788c88d036011e2bc0e6d8cb492ca",
     "0: 88e06863d0d6290d5c77ad575f4d9adfd40788c88d036011e2bc0e6d8cb492c",
     "conversion.digests[0]", "0: 88e06863"),
    ("duplicate source name", "  - name: pybind11\n", "  - name: sglang\n", "duplicate name",
     None),
    ("unknown top-level key", "tree_root: ktransformers\n",
     "tree_root: ktransformers\nsourcez: []\n", "sourcez", "sourcez:"),
    ("unknown serve key", "  port: 8020\n", "  port: 8020\n  prot: 1\n", "serve.prot", "prot: 1"),
    ("path escaping the workspace", "path: src/cann-recipes-infer",
     "path: ../cann-recipes-infer", "sources[5].path", "path: ../cann"),
    ("absolute path", "dir: weights/DeepSeek-V4-Flash\n", "dir: /weights/DeepSeek-V4-Flash\n",
     "weights.mxfp4.dir", "dir: /weights"),
    ("prefill not a multiple of the page", "chunked_prefill_size: 8192",
     "chunked_prefill_size: 8000", "multiple of page_size", None),
    ("prefill shorter than the longest prompt", "chunked_prefill_size: 8192",
     "chunked_prefill_size: 2048", "longest_prompt_tokens", None),
    ("missing required field", "delivery: cann-recipes-infer\n", "", "delivery", None),
    ("broken YAML", "  port: 8020\n", "  port: [8020\n", "invalid YAML", None),
    ("weight dirs not siblings", "dir: weights/DeepSeek-V4-Flash\n", "dir: weights/other\n",
     "-W8A8", None),
    ("template without {layer}", "file_template: dsv4_layer{layer}_mxfp4.gguf",
     "file_template: dsv4_layer_mxfp4.gguf", "conversion.file_template", "file_template:"),
    ("determinism probe unknown", "determinism_probe: capital-en", "determinism_probe: nope",
     "not a probe name", None),
    ("delivery not a source", "delivery: cann-recipes-infer", "delivery: cann-recipes",
     "not a source name", None),
    ("mem fraction out of range", "mem_fraction_static: 0.81", "mem_fraction_static: 1.5",
     "serve.mem_fraction_static", "mem_fraction_static: 1.5"),
    ("duplicate YAML key", "  port: 8020\n", "  port: 8020\n  port: 8021\n", "duplicate key",
     None),
    ("url not git", "url: https://github.com/pybind/pybind11", "url: pybind11",
     "sources[3].url", "url: pybind11"),
    ("wrong type for a list", "  gpu_experts_ladder: [32, 24, 16]", "  gpu_experts_ladder: 32",
     "serve.gpu_experts_ladder", "gpu_experts_ladder: 32"),
    ("hot-tail window not a number", '    SGLANG_SET_CPU_AFFINITY: "1"',
     '    SGLANG_SET_CPU_AFFINITY: "1"\n    KT_HOT_TAIL_TOKENS: "64 tokens"',
     "env.KT_HOT_TAIL_TOKENS '64 tokens' is not a whole number", None),
]


@pytest.mark.parametrize("case", RECIPE_CASES, ids=[c[0] for c in RECIPE_CASES])
def test_malformed_recipe_is_one_line_exit_2(cli, tmp_path: Path, case: tuple) -> None:
    _, old, new, expect, line_needle = case
    assert old in RECIPE_910B
    text = RECIPE_910B.replace(old, new, 1)
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("series: dsv4-flash", f"series: {BUNDLED_SERIES}/dsv4-flash.yaml"))
    res = cli("recipe", "validate", str(path))
    assert res.code == 2, res
    lines = res.err.strip().splitlines()
    assert len(lines) == 1, res
    assert "Traceback" not in res.err
    assert lines[0].startswith(f"error: {path}"), lines[0]
    assert expect in lines[0], lines[0]
    if line_needle:
        written = path.read_text()
        assert f"{path}:{line_of(written, line_needle)}:" in lines[0], lines[0]


SERIES_CASES = [
    ("target not a source", "target: sglang\n", "target: sglang-fork\n", "'sglang-fork' is not a"
     " source", "target: sglang-fork"),
    ("sha256 too short", "sha256: 1de31394f8da9cc743eb6cb815a50d44109ae339f7195da463259d7d3608f026",
     "sha256: 1de31394f8da9cc743eb6cb815a50d44109ae339f7195da463259d7d3608f02",
     "patches[8].sha256", "sha256: 1de31394"),
    ("duplicate patch name", "name: sglang-packaging", "name: sglang-npu-kv-triton-fallback",
     "duplicate name", None),
    ("unknown method", "method: mbox", "method: git-am", "patches[8].method", "method: git-am"),
    ("origin with two sources", "origin: {source: cann-recipes-infer, path: integration/sglang/"
     "dsv4-flash-single-npu-moe-offload/sglang/0005",
     "origin: {file: x.patch, source: cann-recipes-infer, path: integration/sglang/"
     "dsv4-flash-single-npu-moe-offload/sglang/0005", "either 'source'", None),
    ("own patch escaping the series dir", "origin: {source: cann-recipes-infer, path: integration/"
     "sglang/dsv4-flash-single-npu-moe-offload/sglang/0005-sglang-packaging.patch}",
     "origin: {file: ../../evil.patch}", "origin.file", None),
    ("strip level negative", "strip: 1\n    method: mbox", "strip: -1\n    method: mbox",
     "patches[8].strip", "strip: -1"),
]


@pytest.mark.parametrize("case", SERIES_CASES, ids=[c[0] for c in SERIES_CASES])
def test_malformed_series_is_one_line_exit_2(cli, tmp_path: Path, case: tuple) -> None:
    _, old, new, expect, line_needle = case
    assert old in SERIES, old
    series = tmp_path / "series.yaml"
    series.write_text(SERIES.replace(old, new, 1))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE_910B.replace("series: dsv4-flash", "series: ./series.yaml"))
    res = cli("recipe", "validate", str(recipe))
    assert res.code == 2, res
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.err, res
    assert lines[0].startswith(f"error: {series}"), lines[0]
    assert expect in lines[0], lines[0]
    if line_needle:
        assert f"{series}:{line_of(series.read_text(), line_needle)}:" in lines[0], lines[0]


def test_set_override_changes_the_recipe_and_is_validated(cli) -> None:
    res = cli("--json", "--set", "serve.port=8021", "--set", "sources.0.ref=v9", "recipe", "show")
    assert res.code == 0, res
    doc = res.json()
    assert doc["schema"] == 1 and doc["command"] == "recipe show"
    assert doc["data"]["serve"]["port"] == 8021
    assert doc["data"]["sources"][0]["ref"] == "v9"
    bad = cli("--set", "serve.port=eighty", "recipe", "validate")
    assert bad.code == 2 and bad.err.startswith("error: --set serve.port"), bad
    missing = cli("--set", "serve.nope.deeper=1", "recipe", "validate")
    assert missing.code == 2 and "'nope' is not a key" in missing.err, missing
    malformed = cli("--set", "serve.port", "recipe", "validate")
    assert malformed.code == 2 and "expected dotted.key=value" in malformed.err, malformed


def test_overrides_do_not_touch_the_original_document() -> None:
    doc = {"serve": {"port": 1, "gpu_experts_ladder": [1, 2]}}
    out = apply_overrides(doc, ["serve.gpu_experts_ladder.1=5", "serve.port=[3]"], "x")
    assert out == {"serve": {"port": [3], "gpu_experts_ladder": [1, 5]}}
    assert doc == {"serve": {"port": 1, "gpu_experts_ladder": [1, 2]}}


def test_recipe_list_and_unknown_recipe(cli) -> None:
    res = cli("--json", "recipe", "list")
    assert res.code == 0
    assert {r["name"] for r in res.json()["data"]} == {
        "dsv4-flash-910b", "dsv4-flash-a3", "dsv4-flash-x86-dev", "dsv4-flash-arm-rehearsal"}
    data = res.json()["data"]
    lines = cli("recipe", "list").out.splitlines()
    column = lines[0].index(data[0]["description"].split()[0])  # where descriptions start
    for line in lines:  # each a recipe's row or its description's next line, aligned
        assert len(line) <= 120 and line[column - 2:column] == "  " and line[column] != " ", line
    # every word of every description, none cut
    words = " ".join(ln[column:] for ln in lines).split()
    assert words == " ".join(d["description"] for d in data).split()
    res = cli("--recipe", "dsv4-nope", "recipe", "validate")
    assert res.code == 2 and "is not bundled" in res.err and re.search("dsv4-flash-a3", res.err)


def test_series_skip_leaves_out_only_our_own_fixes_and_says_what_it_risks(cli) -> None:
    recipe, series = load_recipe_and_series(
        "dsv4-flash-910b", ["series_skip=[sglang-resident-write-through]"])
    assert not series.holds("sglang-resident-write-through")
    assert series.holds("sglang-streaming-prefill-depool")
    (warning,) = series.skip_warnings()
    assert warning.startswith("series dsv4-flash: patch 'sglang-resident-write-through' is "
                              "left out (recipe series_skip): with depool, dynamic residency")
    assert "KT_DYNAMIC_RESIDENT=0" in warning
    res = cli("--set", "series_skip=[sglang-streaming-prefill-depool]", "recipe", "validate")
    assert res.code == 2 and len(res.err.strip().splitlines()) == 1, res
    assert "series_skip: 'sglang-streaming-prefill-depool' is the delivery's patch" in res.err
    res = cli("--set", "series_skip=[no-such-patch]", "recipe", "validate")
    assert res.code == 2 and "'no-such-patch' is not a patch of series 'dsv4-flash'" in res.err
