"""The `dsv4-offload` command line: one module per command area, the shared glue beside them.

``app`` holds the typer application, the global options and the entry point; ``kit`` and
``render`` are what the command modules share; ``serial`` reads a stage process's command
line without typer. The library (recipes, pipeline, stages) lives in the package above and
never prints.
"""

from __future__ import annotations

import sys
from typing import NoReturn


def main(argv: list[str] | None = None) -> NoReturn:
    """Console entry point: a stage process's command line (cli/serial.py) without typer,
    any other through the typer application (cli/app.py)."""
    from dsv4_offload.cli.serial import stage_call, stage_main

    call = stage_call(sys.argv[1:] if argv is None else argv)
    if call is not None:
        stage_main(call)
    from dsv4_offload.cli.app import main as app_main

    app_main(argv)


__all__ = ["main"]
