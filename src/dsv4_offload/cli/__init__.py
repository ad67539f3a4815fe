"""The `dsv4-offload` command line: one module per command area, the shared glue beside them.

``app`` holds the typer application, the global options and the entry point; ``kit`` and
``render`` are what the command modules share. The library (recipes, pipeline, stages)
lives in the package above and never prints.
"""

from __future__ import annotations

from dsv4_offload.cli.app import main

__all__ = ["main"]
