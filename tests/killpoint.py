"""Run the CLI and kill it at a chosen point, deterministically: the kill matrix's driver.

    python tests/killpoint.py WHERE:WHAT:N:SIG -- CLI ARGS...

- ``before:KIND:N:SIG`` / ``after:KIND:N:SIG``: around the N-th event of KIND the process
  emits (core/events.emit: every stage calls it, run alone or in a pipelined run);
- ``wbefore:KIND:N:SIG`` / ``wafter:KIND:N:SIG``: around the N-th event of KIND a pipelined
  `run` writes itself (the scheduler's ``run.started``, ``stage.done`` ...);
- ``seen:KIND:N:SIG``: right after a pipelined `run` has read the N-th event of KIND its
  stage processes wrote;
- ``replace:SUFFIX:N:SIG``: right after the N-th ``os.replace`` onto a name ending in SUFFIX
  (a layer file taking its final name: the window between the rename and what follows).

SIG is KILL or TERM, sent by the process to itself. Nothing of the tool is changed but
these two functions, wrapped to count; the work itself runs for real.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any


def _arm(spec: str) -> None:
    where, what, nth, sig_name = spec.split(":")
    target, sig = int(nth), getattr(signal, f"SIG{sig_name}")
    seen = [0]

    def hit() -> bool:
        seen[0] += 1
        return seen[0] == target

    def fire() -> None:
        os.kill(os.getpid(), sig)
        if sig == signal.SIGTERM:
            return  # handled as an interrupt where the tool handles it
        signal.pause()

    if where == "replace":
        real_replace: Callable[..., None] = os.replace

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            real_replace(src, dst, *args, **kwargs)
            if str(dst).endswith(what) and hit():
                fire()

        os.replace = replace
        return
    from dsv4_offload.core import events

    if where in ("wbefore", "wafter"):  # a pipelined run's own events, written directly
        real_write = events.write

        def write(path: Any, doc: dict[str, Any]) -> None:
            matched = doc.get("event") == what and hit()
            if matched and where == "wbefore":
                fire()
            real_write(path, doc)
            if matched and where == "wafter":
                fire()

        events.write = write
        return
    if where == "seen":  # a pipelined run, right after it reads the N-th KIND of its stages
        real_read = events.read_new

        def read_new(path: Any, offset: int) -> tuple[list[dict[str, Any]], int]:
            docs, offset = real_read(path, offset)
            if any([doc.get("event") == what and hit() for doc in docs]):
                fire()
            return docs, offset

        events.read_new = read_new
        return
    real_emit = events.emit

    def emit(event: str, **fields: Any) -> None:
        matched = event == what and hit()
        if matched and where == "before":
            fire()
        real_emit(event, **fields)
        if matched and where == "after":
            fire()

    events.emit = emit


def main() -> int:
    args = sys.argv[1:]
    if len(args) < 2 or args[1] != "--":
        sys.stderr.write(__doc__ or "")
        return 2
    _arm(args[0])
    sys.argv = ["dsv4-offload", *args[2:]]
    from dsv4_offload.cli import main as cli

    return int(cli() or 0)


if __name__ == "__main__":
    sys.exit(main())
