"""Help texts that name what the recipe holds, read when the help is shown.

A command made with ``cls=RecipeHelpCommand`` may write ``{steps}`` in its docstring and its
parameters' help: ``--help`` replaces it with the build steps of the recipe in effect
(``-r``, else the bundled default), read from its YAML the way completion reads it, so the
help never lists steps a recipe does not have. Nothing is read unless help is asked for.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand

from dsv4_offload.cli import complete


def recipe_fields(ctx: Any) -> dict[str, str]:
    """The placeholders' values for the recipe `ctx`'s root names (or the default)."""
    spec = complete._recipe_spec(ctx)
    steps = complete._named(spec, "build", "steps")
    return {"steps": ", ".join(steps) if steps else "(none: the recipe could not be read)"}


def fill(text: str | None, values: dict[str, str]) -> str | None:
    if not text:
        return text
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


class RecipeHelpCommand(TyperCommand):
    """A command whose help text names the recipe's build steps (``{steps}``)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        values = recipe_fields(ctx)
        params: list[Any] = list(self.params)
        saved = (self.help, [(p, getattr(p, "help", None)) for p in params])
        self.help = fill(self.help, values)
        for param, text in saved[1]:
            if text:
                param.help = fill(text, values)
        try:
            super().format_help(ctx, formatter)
        finally:
            self.help = saved[0]
            for param, text in saved[1]:
                param.help = text
