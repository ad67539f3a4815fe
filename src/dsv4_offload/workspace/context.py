"""The context a stage receives: the recipe, its series, the workspace and the options.

Opened by the pipeline (or a stand-alone stage command) and handed to the stage's ``run``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.results import Progress, Task

if TYPE_CHECKING:
    from dsv4_offload.recipe import Recipe, Series
    from dsv4_offload.workspace.store import Workspace


@dataclass
class StageContext:
    recipe: Recipe
    series: Series
    workspace: Workspace
    options: dict[str, Any] = field(default_factory=dict)
    progress: Progress = field(default_factory=Progress)
    stage: str = ""
    verbose: bool = False

    @property
    def log_dir(self) -> Path:
        return self.workspace.log_dir(self.stage)

    def option(self, name: str, default: Any = None) -> Any:
        value = self.options.get(name)
        return default if value is None else value

    @contextmanager
    def task(self, description: str, total: float | None = None, unit: str = "") -> Iterator[Task]:
        t = self.progress.task(description, total, unit)
        try:
            yield t
        finally:
            t.close()

