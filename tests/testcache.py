"""Where the test cache lives: the things the long tests make once and keep between runs.

``$DSV4_TEST_CACHE``, else ``$XDG_CACHE_HOME/dsv4-offload-tests``, else
``~/.cache/dsv4-offload-tests`` (the README says what is in it, its size and how to clear
it). Standard library only: `.ci/run` imports it with the system python before the venv.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The test cache's directory (not created here)."""
    moved = os.environ.get("DSV4_TEST_CACHE")
    if moved:
        return Path(moved).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "dsv4-offload-tests"
