"""`--set`: the spelling `status` prints, indices, YAML flow values, open maps, near-miss keys."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import SMALL_RECIPE

from dsv4_offload.core.errors import InputError
from dsv4_offload.recipe import load_recipe

# the commands in this process (conftest.run_cli_inproc): what they answer is the point
CLI_IN_PROCESS = True

SGLANG_OTHER = "1" * 40


def _kt(recipe):  # type: ignore[no-untyped-def]
    return next(s for s in recipe.build.steps if s.name == "kt-kernel")


def test_status_spelling_and_indices_reach_the_same_field() -> None:
    base = load_recipe()
    at = [s.name for s in base.sources].index("sglang")
    for key in ("sources[sglang].commit", "recipe.sources[sglang].commit",
                f"sources.{at}.commit", f"sources[{at}].commit", "sources.sglang.commit"):
        recipe = load_recipe(None, [f"{key}={SGLANG_OTHER}"])
        assert recipe.source("sglang").commit == SGLANG_OTHER, key
        others = [s.commit for s in recipe.sources if s.name != "sglang"]
        assert others == [s.commit for s in base.sources if s.name != "sglang"], key


def test_nested_named_item_env_and_new_keys_in_open_maps() -> None:
    recipe = load_recipe(None, ["build.steps[kt-kernel].env.CPUINFER_ARM_SVE=ON",
                                "serve.env.NEWVAR=1", "build.steps[kt-kernel].env.EXTRA=007"])
    assert _kt(recipe).env["CPUINFER_ARM_SVE"] == "ON"
    assert _kt(recipe).env["EXTRA"] == "007"  # a string map keeps the text, not the int 7
    assert recipe.serve.env["NEWVAR"] == "1"
    assert set(load_recipe().serve.env) < set(recipe.serve.env)


def test_yaml_flow_lists_and_mappings() -> None:
    recipe = load_recipe(None, ["serve.gpu_experts_ladder=[24,16]", 'serve.env={A: "1", B: x}',
                                "serve.extra_args=[--foo, '--bar=1']"])
    assert recipe.serve.gpu_experts_ladder == [24, 16]
    assert recipe.serve.env == {"A": "1", "B": "x"}
    assert recipe.serve.extra_args == ["--foo", "--bar=1"]


def test_string_fields_keep_the_raw_text() -> None:
    recipe = load_recipe(None, ["sources[sglang].ref=0123", "serve.host=127.0.0.1"])
    assert recipe.source("sglang").ref == "0123" and recipe.serve.host == "127.0.0.1"


@pytest.mark.parametrize(("item", "expect"), [
    ("serve.prot=1", r"^--set serve\.prot: 'prot' is not a key of serve; did you mean port\b"),
    ("weights.w8a8.revison=x", r"'revison' is not a key of weights\.w8a8; did you mean revision"),
    ("build.steps[kt-kernl].env.A=1",
     r"'kt-kernl' is not an item of build\.steps; did you mean kt-kernel"),
    ("sources.99.commit=x", r"'99' is not an index of sources \(\d+ items"),
    ("serve.port.x=1", r"serve\.port is a value, not a mapping"),
    ("serve.gpu_experts_ladder.x=1", r"'x' is not an item of serve\.gpu_experts_ladder"),
    ("sources[sglang.commit=1", r"malformed key"),
    ("serve.env={A: [1=2", r"is not valid YAML"),
    ("series.patches[x].sha256=1", r"patch entries live in the series file"),
])
def test_bad_keys_say_what_is_valid(item: str, expect: str) -> None:
    with pytest.raises(InputError) as err:
        load_recipe(None, [item])
    assert re.search(expect, str(err.value)), str(err.value)
    assert "\n" not in str(err.value)


def test_a_bad_value_is_blamed_on_the_override_in_any_spelling() -> None:
    with pytest.raises(InputError) as err:
        load_recipe(None, ["sources[sglang].commit=nothex"])
    assert str(err.value).startswith("--set sources[sglang].commit (over "), str(err.value)


@pytest.mark.parametrize(("item", "expect"), [
    # the server reads the window with int() at import (sglang/0003 line 42): refused at load
    ("serve.env.KT_HOT_TAIL_TOKENS=-64", r"env\.KT_HOT_TAIL_TOKENS '-64' is not a whole number"),
    ("tune.hot_tail_tokens=[0, -32]",
     r"tune\.hot_tail_tokens\[1\]: Input should be greater than or equal to 0"),
])
def test_a_hot_tail_window_the_server_cannot_read_is_refused_at_load(item: str,
                                                                     expect: str) -> None:
    with pytest.raises(InputError) as err:
        load_recipe(None, [item])
    assert re.search(expect, str(err.value)), str(err.value)
    assert load_recipe(None, ["serve.env.KT_HOT_TAIL_TOKENS=64"]).serve.env[
        "KT_HOT_TAIL_TOKENS"] == "64"


def test_the_field_status_names_can_be_set_back(cli, tmp_path: Path, fake_stages_env) -> None:
    """status prints the changed field; --set takes that very text (issue 11)."""
    ws = tmp_path / "ws"
    # the pipeline on one host (HOST_RECIPE says why), past the disk preflight (SMALL_RECIPE),
    # as far as fetch: the row this test reads
    host = ("-r", str(SMALL_RECIPE))
    assert cli("run", "--to", "fetch", "-w", str(ws), *host, env=fake_stages_env).code == 0
    at = [s.name for s in load_recipe().sources].index("sglang")

    def fetch_state(*sets: str) -> dict:  # type: ignore[type-arg]
        res = cli("status", "--json", "-w", str(ws), *host, *sets, env=fake_stages_env)
        assert res.code == 0, res
        return next(s for s in res.json()["data"]["stages"] if s["name"] == "fetch")

    changed = fetch_state("--set", f"sources.{at}.commit={SGLANG_OTHER}")
    assert changed["state"] == "stale", changed
    field = re.fullmatch(r"changed: (\S+)", changed["reason"])
    assert field, changed["reason"]
    # the printed name, fed back, makes the same change ...
    assert fetch_state("--set", f"{field[1]}={SGLANG_OTHER}") == changed
    # ... and setting it back to the pinned commit undoes the change
    pinned = load_recipe().source("sglang").commit
    back = fetch_state("--set", f"sources.{at}.commit={SGLANG_OTHER}",
                       "--set", f"{field[1]}={pinned}")
    assert back["state"] == "done", back
