"""A serve stand-in with a stated start time (behave/serve: ``start N``).

It checks what the server would load is there (both weight sets verified file by file, one
GGUF file per layer with its digest in verify-gguf's manifest), waits N seconds as the
server's load would take, then writes <workspace>/serve.ready (time.time() when ready) and
returns.
"""

from __future__ import annotations

import os
import time

from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.weights import downloads
from dsv4_offload.weights.checkpoint import CONFIG_FILE, parse_config
from dsv4_offload.weights.conversion import gguf_dir
from dsv4_offload.weights.gguf_io import read_own_manifest
from dsv4_offload.workspace.context import StageContext
from pipestages import behave, note, number, ready_file


def missing(ctx: StageContext) -> list[str]:
    """What a server could not load: unverified weight files, GGUF layers not verified."""
    ws, recipe = ctx.workspace, ctx.recipe
    out = []
    for which in ("w8a8", "mxfp4"):
        record = downloads.read_record(ws.weights_record(which), getattr(recipe.weights, which))
        listed = {f["path"] for f in (record or {}).get("listing", {}).get("files", [])}
        view = downloads.look(ws, recipe, which)
        if not listed or listed - view.verified:
            out.append(f"{which}: {len(listed - view.verified)} of {len(listed)} files not "
                       "verified")
    source = ws.weights_dir(recipe, "mxfp4")
    layers = parse_config(source / CONFIG_FILE).layers
    verified = read_own_manifest(gguf_dir(ctx)) or {}
    for layer in range(layers):
        name = recipe.conversion.file_name(layer)
        path = gguf_dir(ctx) / name
        if not path.is_file() or name not in verified:
            out.append(f"{path}: absent or not in verify-gguf's manifest")
    return out


def run(ctx: StageContext) -> StageResult:
    note(ctx, "serve")
    words = behave(ctx, "serve")
    absent = missing(ctx)
    if absent:
        return StageResult(Status.FAILED, "serve stand-in: nothing whole to load",
                           problems=[Problem("error", "; ".join(absent[:3]), "rerun `run`")])
    time.sleep(number(words, "start"))
    path = ready_file(ctx.workspace.root)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{time.time():.6f}\n")
    os.replace(tmp, path)
    return StageResult(Status.OK, "serve stand-in ready", outputs={"stage": "serve"})
