"""The context a stage receives: the recipe, its series, the workspace and its options.

``StageContext.open`` is the one place a command turns its global options into a context
(the recipe loaded once, `--set` and the workspace's locked commits applied); the pipeline
hands a copy per stage (``for_stage``) with that stage's typed options (core/options) to the
stage's ``run``, which reads them with ``ctx.options_as(ItsOptions)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dsv4_offload.core.options import StageOptions
from dsv4_offload.core.results import Progress, Task

if TYPE_CHECKING:
    from dsv4_offload.core.host import HostFacts
    from dsv4_offload.recipe import Recipe, Series
    from dsv4_offload.workspace.store import Workspace


OptionsT = TypeVar("OptionsT", bound=StageOptions)


def _own(options: StageOptions | Mapping[str, Any]) -> StageOptions | Mapping[str, Any]:
    """Typed options as they are (frozen); a mapping copied, so no two contexts share it."""
    return options if isinstance(options, StageOptions) else dict(options)


@dataclass
class StageContext:
    recipe: Recipe
    series: Series
    workspace: Workspace
    # the stage's typed options (the pipeline's: `run`'s RunOptions); a context made by hand
    # (a test, the report) may hold a plain mapping, which ``options_as`` reads by the type
    options: StageOptions | Mapping[str, Any] = field(default_factory=dict)
    progress: Progress = field(default_factory=Progress)
    stage: str = ""
    verbose: bool = False
    # the host's facts once probed: doctor's run leaves them for its fingerprint right after
    # (npu-smi and every --version not run twice); a test puts a captured host here
    host_facts: HostFacts | None = None

    @classmethod
    def open(cls, recipe: str | None, overrides: list[str], workspace: str | None, *,
             options: StageOptions | Mapping[str, Any] | None = None,
             progress: Progress | None = None, stage: str = "", verbose: bool = False
             ) -> StageContext:
        """The recipe (bundled name or file) with the workspace's tune overlay, its `--set`
        items and the workspace's locked commits, its series, and the workspace
        (``--workspace``, else the default)."""
        from dsv4_offload.recipe import load_recipe_and_series
        from dsv4_offload.workspace.store import Workspace

        ws = Workspace.from_option(workspace)
        loaded, series = load_recipe_and_series(recipe, overrides, locks=ws.sources_lock_file,
                                                overlay=ws.tune_overlay)
        return cls(recipe=loaded, series=series, workspace=ws, options=_own(options or {}),
                   progress=progress or Progress(), stage=stage, verbose=verbose)

    def for_stage(self, stage: str, options: StageOptions | Mapping[str, Any] | None = None
                  ) -> StageContext:
        """The same recipe, workspace and progress for one stage, with its own options."""
        return replace(self, stage=stage,
                       options=_own(options if options is not None else self.options))

    def options_as(self, kind: type[OptionsT]) -> OptionsT:
        """This context's options as the stage's type ``kind`` (``kind.of``)."""
        return kind.of(self.options)

    @property
    def log_dir(self) -> Path:
        return self.workspace.log_dir(self.stage)

    def event(self, event: str, **fields: Any) -> None:
        """One event of this stage on the pipelined run's stream (core/events); nothing
        when the stage runs on its own."""
        from dsv4_offload.core import events

        events.emit(event, stage=self.stage, **fields)

    @contextmanager
    def task(self, description: str, total: float | None = None, unit: str = "") -> Iterator[Task]:
        t = self.progress.task(description, total, unit)
        try:
            yield t
        finally:
            t.close()

