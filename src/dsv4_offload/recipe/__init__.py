"""The recipe: what a deployment pins (sources, series, builds, weights, conversion, serving,
acceptance, host requirements) and the patch series it applies.

Both are YAML validated by pydantic with unknown keys rejected; every error names the file,
the line, the field and what to write instead. The modules: ``fields`` (shared field types),
``sections``, ``accept_section`` and ``model`` (the schema), ``yamldoc`` (YAML with line
numbers), ``overrides``
(`--set`), ``sourcelock`` (full SHAs of abbreviated pins), ``load`` (the one way a recipe is made),
``reference`` (docs/recipe-reference.md). This module re-exports what the rest of the package
uses, so callers import from ``dsv4_offload.recipe``.
"""

from dsv4_offload.recipe.accept_section import (
    Acceptance,
    Degeneration,
    LogMarker,
    Probe,
    Residency,
    Throughput,
)
from dsv4_offload.recipe.fields import (
    BUNDLED_RECIPES,
    BUNDLED_SERIES,
    DATA_DIR,
    DEFAULT_RECIPE,
    Strict,
)
from dsv4_offload.recipe.load import (
    bundled_recipe_names,
    load_recipe,
    load_recipe_and_series,
    load_series,
    looks_like_series,
    resolve_recipe_path,
    resolve_series_path,
)
from dsv4_offload.recipe.model import Origin, Pipeline, Platform, Recipe, Runtime
from dsv4_offload.recipe.overrides import apply_overrides
from dsv4_offload.recipe.sections import (
    Build,
    BuildStep,
    Conversion,
    FileEdit,
    Host,
    PatchEntry,
    PatchOrigin,
    RealLayer,
    RemoteFile,
    RunPackage,
    Selftest,
    SelftestEmulator,
    Series,
    Serve,
    Source,
    StepCheck,
    Tune,
    Weights,
    WeightSet,
)

__all__ = [
    "BUNDLED_RECIPES", "BUNDLED_SERIES", "DATA_DIR", "DEFAULT_RECIPE",
    "Acceptance", "Build", "BuildStep", "Conversion", "Degeneration", "FileEdit", "Host",
    "LogMarker", "Origin", "PatchEntry", "PatchOrigin", "Pipeline", "Platform", "Probe",
    "RealLayer", "Recipe", "Residency", "RemoteFile", "RunPackage", "Runtime", "Selftest",
    "SelftestEmulator", "Serve", "Series",
    "Source", "StepCheck", "Strict", "Throughput", "Tune", "WeightSet", "Weights",
    "apply_overrides",
    "bundled_recipe_names", "load_recipe", "load_recipe_and_series", "load_series",
    "looks_like_series", "resolve_recipe_path", "resolve_series_path",
]
