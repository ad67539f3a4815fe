"""Recipe inheritance: `extends:` states only what differs and is validated as a whole."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_recipe import RECIPE_910B, line_of

from dsv4_offload.core.errors import InputError
from dsv4_offload.recipe import (
    BUNDLED_RECIPES,
    BUNDLED_SERIES,
    load_recipe,
    load_recipe_and_series,
)

# the commands in this process (conftest.run_cli_inproc): what they answer is the point
CLI_IN_PROCESS = True


def overlay(tmp_path: Path, text: str, name: str = "overlay.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def dump(spec: str | Path) -> dict:
    return load_recipe(str(spec)).model_dump(mode="json", by_alias=True)


def test_a3_states_only_what_differs() -> None:
    a3_text = (BUNDLED_RECIPES / "dsv4-flash-a3.yaml").read_text()
    assert "extends: dsv4-flash-910b" in a3_text
    assert "digests:" not in a3_text
    a3, b = dump("dsv4-flash-a3"), dump("dsv4-flash-910b")
    # the inherited facts are the 910B's, the stated ones are the A3's: the 910B sources
    # plus the ones of the clean-CANN bring-up, its steps before the 910B's
    assert a3["sources"][:len(b["sources"])] == b["sources"]
    assert [s["name"] for s in a3["sources"][len(b["sources"]):]] == [
        "cann-recipes-ops", "ops-transformer", "sgl-kernel-npu", "pto-isa", "catlass"]
    assert a3["conversion"] == b["conversion"]
    assert a3["platform"]["cann"] == "9.0.0" and a3["serve"]["nsa_compressor_mode"] == "single"
    steps = {s["name"]: s for s in a3["build"]["steps"]}
    assert [s["name"] for s in a3["build"]["steps"]][-len(b["build"]["steps"]):] == [
        s["name"] for s in b["build"]["steps"]]
    # a named list item merges: the kt-kernel env gains CC/CXX and keeps the 910B's switches
    assert steps["kt-kernel"]["env"]["CC"] == "gcc-13"
    assert steps["kt-kernel"]["env"]["CPUINFER_ARM_SVE"] == "OFF"
    assert steps["kt-kernel"]["command"] == b["build"]["steps"][0]["command"]
    assert a3["host"]["tools"] == {**b["host"]["tools"], "gcc": "13.0"}
    assert a3["acceptance"]["gpqa_reference_pct"] is None  # `null` replaces
    assert [p.name for p in load_recipe("dsv4-flash-a3").chain] == [
        "dsv4-flash-a3.yaml", "dsv4-flash-910b.yaml"]


def test_overlay_of_an_overlay_with_named_list_edits(tmp_path: Path) -> None:
    mid = overlay(tmp_path, "extends: dsv4-flash-a3\nname: mid\nserve: {port: 9000}\n", "mid.yaml")
    top = overlay(tmp_path, f"""\
extends: {mid.name}
name: top
sources:
  - name: sglang
    commit: "{"1" * 40}"
  - name: custom_flashinfer
    remove: true
build:
  steps:
    - name: own-first
      insert_before: kt-kernel
      workdir: src/ktransformers
      command: ["true"]
    - name: ascendc-op
      insert_after: kt-kernel
    - name: extra
      workdir: src/ktransformers
      command: ["true"]
""")
    r = load_recipe(str(top))
    assert r.name == "top" and r.serve.port == 9000 and r.platform.npu == "A3"
    assert r.source("sglang").commit == "1" * 40
    assert r.source("sglang").url.endswith("iforgetmyname/sglang")  # the rest is inherited
    assert "custom_flashinfer" not in [s.name for s in r.sources]
    names = [s.name for s in r.build.steps]
    assert names[names.index("verify"):] == [
        "verify", "own-first", "kt-kernel", "ascendc-op", "gguf-py", "sglang", "extra"]
    assert r.build.steps[names.index("kt-kernel")].env["CC"] == "gcc-13"
    assert [p.name for p in r.chain] == ["overlay.yaml", "mid.yaml",
                                                   "dsv4-flash-a3.yaml", "dsv4-flash-910b.yaml"]


def test_set_applies_over_the_merged_recipe(cli) -> None:
    res = cli("--json", "--recipe", "dsv4-flash-a3", "--set", "serve.port=8030", "recipe", "show")
    assert res.code == 0, res
    data = res.json()["data"]
    assert data["serve"]["port"] == 8030 and data["platform"]["npu"] == "A3"


def test_a_base_series_path_stays_relative_to_the_base(tmp_path: Path) -> None:
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "series.yaml").write_text((BUNDLED_SERIES / "dsv4-flash.yaml").read_text())
    (tmp_path / "base" / "base.yaml").write_text(
        RECIPE_910B.replace("series: dsv4-flash", "series: ./series.yaml"))
    child = overlay(tmp_path, "extends: base/base.yaml\nname: child\n")
    recipe, series = load_recipe_and_series(str(child))
    assert series.name == "dsv4-flash" and len(series.patches) == 10


# (description, overlay text, expected text in the one-line error, needle of the line, file)
BAD_OVERLAYS = [
    ("unknown key", "extends: dsv4-flash-910b\nname: x\nserve:\n  portt: 1\n",
     "serve.portt: unknown key", "portt:", "overlay"),
    ("wrong type", "extends: dsv4-flash-910b\nname: x\nserve:\n  port: eighty\n",
     "serve.port:", "port: eighty", "overlay"),
    ("bad item field", "extends: dsv4-flash-910b\nname: x\nsources:\n  - name: sglang\n"
     "    commit: b3173\n", "sources[1].commit", "commit: b3173", "overlay"),
    ("unknown base", "extends: dsv4-nope\nname: x\n", "'dsv4-nope' is not a bundled recipe",
     "extends:", "overlay"),
    ("no name", "extends: dsv4-flash-910b\nserve: {port: 1}\n", "must name itself", None,
     "overlay"),
    ("remove unknown", "extends: dsv4-flash-910b\nname: x\nsources:\n  - name: nope\n"
     "    remove: true\n", "remove: 'nope' is not an item", "- name: nope", "overlay"),
    ("unknown anchor", "extends: dsv4-flash-910b\nname: x\nbuild:\n  steps:\n    - name: a\n"
     "      insert_before: nope\n      workdir: .\n      command: [x]\n",
     "'nope' is not an item", "- name: a", "overlay"),
    ("cycle", "extends: overlay.yaml\nname: x\n", "leads back to itself", "extends:", "overlay"),
    ("extends not a name", "extends: [a]\nname: x\n", "extends: expected a bundled recipe name",
     "extends:", "overlay"),
]


@pytest.mark.parametrize("case", BAD_OVERLAYS, ids=[c[0] for c in BAD_OVERLAYS])
def test_malformed_overlay_is_one_line_naming_its_file_and_line(cli, tmp_path: Path,
                                                                  case: tuple) -> None:
    _, text, expect, needle, _ = case
    path = overlay(tmp_path, text)
    res = cli("recipe", "validate", str(path))
    assert res.code == 2, res
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.err, res
    assert expect in lines[0], lines[0]
    where = f"{path}:{line_of(text, needle)}:" if needle else f"{path}"
    assert lines[0].startswith(f"error: {where}"), lines[0]


def test_an_error_inherited_from_the_base_names_the_base_file(tmp_path: Path) -> None:
    base_text = RECIPE_910B.replace("series: dsv4-flash",
                                    f"series: {BUNDLED_SERIES}/dsv4-flash.yaml")
    base_text = base_text.replace("  port: 8020", "  port: 8020\n  colour: blue")
    base = overlay(tmp_path, base_text, "base.yaml")
    child = overlay(tmp_path, "extends: base.yaml\nname: child\nserve: {port: 1}\n")
    with pytest.raises(InputError) as err:
        load_recipe(str(child))
    assert str(err.value).startswith(f"{base}:{line_of(base_text, 'colour: blue')}: "
                                     "serve.colour: unknown key"), err.value
