"""Commands for the GGUF experts: ``convert`` and ``verify-gguf``.

Only typer and cli.kit at import time; numpy, gguf and the stages load inside commands.
"""

from __future__ import annotations

import typer

from dsv4_offload.cli import kit

_LAYERS_HELP = "Layers to do: a range and/or a list, e.g. 0-42, 3,5,7 or 0-3,9 (default all)."
_SOURCE_HELP = "The native MXFP4 checkpoint (default: the workspace's MXFP4 weights dir)."
_GGUF_DIR_HELP = "Where the layer files go (default: <workspace>/<conversion.gguf_dir>)."
_JOBS_HELP = "Layers in parallel (default: from the cores and MemAvailable, 2 GiB per job)."


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)
    app.command("verify-gguf")(verify_gguf)


def convert(
    ctx: typer.Context,
    source: str | None = typer.Option(None, "--source", metavar="DIR", help=_SOURCE_HELP),
    gguf_dir: str | None = typer.Option(None, "--gguf-dir", metavar="DIR", help=_GGUF_DIR_HELP),
    layers: str | None = typer.Option(None, "--layers", metavar="SPEC", help=_LAYERS_HELP),
    jobs: int | None = typer.Option(None, "--jobs", "-j", min=1, metavar="N", help=_JOBS_HELP),
    force: bool = typer.Option(False, "--force", help="Redo layers whose files are present."),
    follow: bool = typer.Option(
        False, "--follow", hidden=True,
        help="Beside a running `download`: convert and check each layer as soon as its "
        "shards are verified; return when the download has ended (a pipelined run)."),
) -> None:
    """The native MXFP4 experts into one GGUF file per layer (a lossless bit repack).

    \b
    1. Read the dims from the source's config.json and check every expert tensor of the
       chosen layers (index, shards, dtypes, shapes, sizes) before writing anything.
    2. Skip layers whose file exists with the exact expected size (unless --force);
       check free disk for the rest.
    3. Per layer, stream expert by expert: read, repack to 17-byte MXFP4 blocks, write
       into `<file>.tmp`; fsync; rename. --jobs layers at once, in processes.
    """
    from dsv4_offload.stages.convert import ConvertOptions

    kit.run_stage(ctx, "convert", ConvertOptions(source=source, gguf_dir=gguf_dir,
                                                 layers=layers, jobs=jobs, force=force,
                                                 follow=follow))


def verify_gguf(
    ctx: typer.Context,
    deep: int | None = typer.Option(
        None, "--deep", metavar="N", min=0,
        help="Compare N evenly spaced layers bit for bit with the source (default 1; 0: off)."),
    manifest: str | None = typer.Option(
        None, "--manifest", metavar="FILE",
        help="sha256sum-format digests to check against (default: the recipe's digests)."),
    source: str | None = typer.Option(None, "--source", metavar="DIR", help=_SOURCE_HELP),
    gguf_dir: str | None = typer.Option(None, "--gguf-dir", metavar="DIR", help=_GGUF_DIR_HELP),
    layers: str | None = typer.Option(None, "--layers", metavar="SPEC", help=_LAYERS_HELP),
    jobs: int | None = typer.Option(None, "--jobs", "-j", min=1, metavar="N",
                                    help="Files hashed in parallel (default: from the cores)."),
    kernel: bool = typer.Option(
        True, "--kernel/--no-kernel",
        help="Level 4: run one layer through the built kt-kernel (default: on)."),
) -> None:
    """Prove the layer files: sizes and structure, digests, bit-exact against the source.

    \b
    1. Level 1: every file present with the exact size; its header read back with the
       gguf reader (magic, version, KV, tensor names, type 39, dims, offsets).
    2. Level 2: sha256 of every file (read once, in parallel) against --manifest, else
       the recipe's published digests, else our own earlier manifest.
    3. Level 3: --deep N layers compared expert by expert with the native source.
    4. Level 4: one layer (recipe selftest.real_layer.layer) through the built kt-kernel
       against a numpy reference from the source, cosine >= 0.9999 (guide appendix D).
    On success the digests go to gguf-sha256.txt beside the files. Exit 1 on a difference,
    naming the layer, tensor, expert and row.
    """
    from dsv4_offload.stages.verify_gguf import VerifyGgufOptions

    kit.run_stage(ctx, "verify-gguf", VerifyGgufOptions(
        deep=deep, manifest=manifest, source=source, gguf_dir=gguf_dir, layers=layers,
        jobs=jobs, kernel=kernel))
