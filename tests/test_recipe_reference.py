"""docs/recipe-reference.md is generated from the models; `recipe schema` is pydantic's."""

from __future__ import annotations

from conftest import REPO

from dsv4_offload import recipe as R
from dsv4_offload.recipe.reference import REGENERATE, reference_markdown

# the commands in this process (conftest.run_cli_inproc): what they answer is the point
CLI_IN_PROCESS = True


def test_committed_reference_is_up_to_date() -> None:
    committed = (REPO / "docs" / "recipe-reference.md").read_text(encoding="utf-8")
    assert committed == reference_markdown(), (
        f"docs/recipe-reference.md is out of date with recipe.py; regenerate it: {REGENERATE}")


def test_every_field_of_every_model_is_described_in_the_reference() -> None:
    text = reference_markdown()
    models = [m for m in vars(R).values()
              if isinstance(m, type) and issubclass(m, R.Strict) and m is not R.Strict]
    assert len(models) >= 15
    for model in models:
        assert f"### {model.__name__}\n" in text, model.__name__
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
            row = f"| `{info.alias or name}` |"
            section = text.split(f"### {model.__name__}\n", 1)[1].split("\n### ", 1)[0]
            assert row in section, f"{model.__name__}.{name}"


def test_recipe_reference_command_prints_the_file(cli) -> None:
    res = cli("recipe", "reference")
    assert res.code == 0 and res.out == reference_markdown(), res.err


def test_recipe_schema_validates_the_bundled_recipes_shape(cli) -> None:
    res = cli("recipe", "schema")
    assert res.code == 0, res
    schema = res.json()
    assert schema["additionalProperties"] is False and "extends" in schema["properties"]
    assert {"sources", "build", "serve", "acceptance", "host"} <= set(schema["required"])
    serve = schema["$defs"]["Serve"]["properties"]
    assert serve["port"]["default"] == 8020 and serve["port"]["exclusiveMaximum"] == 65536
    shown = cli("recipe", "show", "--json").json()["data"]
    assert set(shown) <= set(schema["properties"])
    wrapped = cli("recipe", "schema", "--json").json()
    assert wrapped["command"] == "recipe schema" and wrapped["data"] == schema
