"""Recipe commands: ``recipe list|show|validate|schema|reference``.

Only typer and cli.kit at import time; the recipe models load inside commands.
"""

from __future__ import annotations

from typing import Any

import typer

from dsv4_offload.cli.kit import emit, load_context, options_of, warn_skipped_patches

recipe_app = typer.Typer(help="List, show and validate recipes and patch series.",
                         no_args_is_help=True)


def register(app: typer.Typer) -> None:
    recipe_app.command("list")(recipe_list)
    recipe_app.command("show")(recipe_show)
    recipe_app.command("validate")(recipe_validate)
    recipe_app.command("schema")(recipe_schema)
    recipe_app.command("reference")(recipe_reference)
    app.add_typer(recipe_app, name="recipe")


def recipe_list(ctx: typer.Context) -> None:
    """The bundled recipes."""
    from dsv4_offload.recipe import bundled_recipe_names, load_recipe

    data = []
    for name in bundled_recipe_names():
        r = load_recipe(name)
        data.append({"name": name, "npu": r.platform.npu, "cann": r.platform.cann,
                     "description": r.description})
    emit(ctx, command="recipe list", status="ok", data=data, lines=_list_lines(data),
         payload=True)


def _list_lines(data: list[dict[str, str]]) -> list[str]:
    """One recipe a line: name, NPU and CANN in columns as wide as their longest value, the
    description wrapped at word boundaries to the terminal, under its own column."""
    import textwrap

    from dsv4_offload.cli.render import console

    wide = {k: max(len(str(d[k])) for d in data) for k in ("name", "npu", "cann")}
    lines = []
    for d in data:
        head = (f"{d['name']:{wide['name']}}  {d['npu']:{wide['npu']}}  "
                f"CANN {d['cann']:{wide['cann']}}  ")
        text = textwrap.wrap(d["description"], max(30, console().width - len(head)),
                             break_on_hyphens=False) or [""]
        lines.append(head + text[0])
        lines.extend(" " * len(head) + more for more in text[1:])
    return lines


def _redacted(node: Any, redact: Any) -> Any:
    """The recipe document with credentials a user wrote into its URLs masked."""
    if isinstance(node, dict):
        return {k: _redacted(v, redact) for k, v in node.items()}
    if isinstance(node, list):
        return [_redacted(v, redact) for v in node]
    return redact(node) if isinstance(node, str) else node


def recipe_show(
    ctx: typer.Context,
    file: str | None = typer.Argument(None, metavar="[NAME|PATH]",
                                      help="A bundled recipe's name or a recipe YAML "
                                      "(default: --recipe)."),
) -> None:
    """The resolved recipe (with --set overrides applied), as YAML or JSON."""
    import yaml

    from dsv4_offload.core.runner import redact
    from dsv4_offload.recipe import load_recipe

    # a NAME or FILE as `recipe validate` takes it: the recipe alone, no workspace read
    recipe = load_recipe(file, options_of(ctx).overrides) if file else load_context(ctx).recipe
    data = _redacted(recipe.model_dump(mode="json", by_alias=True), redact)
    emit(ctx, command="recipe show", status="ok", data=data,
         lines=[yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip()],
         payload=True)


def recipe_validate(
    ctx: typer.Context,
    file: str | None = typer.Argument(None, metavar="[PATH]",
                                      help="Recipe or series YAML (default: --recipe)."),
) -> None:
    """Validate a recipe and its series, or a series file; exit 2 with one line when invalid."""
    from dsv4_offload.recipe import (
        load_recipe_and_series,
        load_series,
        looks_like_series,
    )
    from dsv4_offload.serving.extra_args import recipe_check
    from dsv4_offload.stages.doctor import recipe_rows

    g = options_of(ctx)
    warnings: list[str] = []
    if file and looks_like_series(file):
        series = load_series(__import__("pathlib").Path(file))
        data = {"series": series.name, "patches": len(series.patches), "file": file}
        line = f"{file}: valid series '{series.name}' ({len(series.patches)} patches)"
    else:
        recipe, series = load_recipe_and_series(file or g.recipe, g.overrides)
        # the rules serve's launch plan applies, said now rather than after the downloads
        recipe_check(recipe.serve)
        # doctor's rows judged from the recipe alone (core/preflight), said here too
        warnings = [f"{r.name}: {r.observed}" + (f"; {r.fix}" if r.fix else "")
                    for r in recipe_rows(recipe) if r.status != "ok"]
        warn_skipped_patches(series)
        data = {"recipe": recipe.name, "file": str(recipe.file), "series": series.name,
                "sources": len(recipe.sources), "patches": len(series.patches),
                "warnings": warnings,
                "left_out": [p.name for p in series.skipped]}
        line = (f"{recipe.file}: valid recipe '{recipe.name}' "
                f"({len(recipe.sources)} sources, series '{series.name}' with "
                f"{len(series.patches)} patches)")
        if warnings and not g.json:  # on stderr, as status says its warnings
            from rich.markup import escape

            from dsv4_offload.cli.render import err_console

            for w in warnings:
                err_console().print(f"[yellow]warning[/yellow]: {escape(w)}", soft_wrap=True)
    emit(ctx, command="recipe validate", status="warn" if warnings else "ok", data=data,
         lines=[line])


def recipe_schema(ctx: typer.Context) -> None:
    """The recipe's JSON schema (for editors and CI linters)."""
    import json
    import sys

    from dsv4_offload.recipe.reference import json_schema

    schema = json_schema()
    if options_of(ctx).json:
        emit(ctx, command="recipe schema", status="ok", data=schema)
    else:
        sys.stdout.write(json.dumps(schema, indent=2, ensure_ascii=False) + "\n")


def recipe_reference(ctx: typer.Context) -> None:
    """docs/recipe-reference.md, generated from the recipe models (Markdown)."""
    import sys

    from dsv4_offload.recipe.reference import reference_markdown

    text = reference_markdown()
    if options_of(ctx).json:
        emit(ctx, command="recipe reference", status="ok", data={"markdown": text})
    else:
        sys.stdout.write(text)
