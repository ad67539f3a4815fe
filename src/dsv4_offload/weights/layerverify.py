"""The checks of one layer's GGUF file, shared by `convert` (each layer right after it is
written, when it follows a download) and `verify-gguf` (the whole set), and the record of
the layers already checked.

- the file: present, the exact size, and a header that reads back with the `gguf` reader
  as the converter's (``file_problems``);
- its sha256 against known digests (``expected_digests``: --manifest, the recipe's
  published ones, or our own manifest);
- bit for bit against the native source, expert by expert, after the repack
  (``compare_with_source``; ``experts`` limits it to a sample, ``sample_experts``).

A layer that passed them is recorded in ``.dsv4-layer-checks.json`` beside the files (its
size, mtime and digest): `verify-gguf` then reuses the digest instead of reading the file
again while it is unchanged, so the work after the download's last byte stays small.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.digests import file_sha256
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.inputs import read_user_text
from dsv4_offload.weights.downloads import unchanged_on_disk

if TYPE_CHECKING:
    from dsv4_offload.workspace.context import StageContext

MAX_DIFFS_PER_LAYER = 8
SAMPLE_EXPERTS = 4  # compared bit for bit per layer when convert checks its own output
CHECKS_FILE = ".dsv4-layer-checks.json"  # beside the layer files: name -> what passed


def redo(layer: int) -> str:
    return f"rerun `dsv4-offload convert --layers {layer} --force`"


# --- the file ------------------------------------------------------------------------------


def file_problems(layer: int, layout: Any, path: Path) -> list[tuple[str, str, str]]:
    """(message, fix, check) for each thing wrong with one layer file: missing, the wrong
    size, or a header that differs from the converter's."""
    from dsv4_offload.weights.gguf_io import structural_problems

    try:
        size = path.stat().st_size
    except (FileNotFoundError, NotADirectoryError):
        return [(f"layer {layer}: {path} is missing",
                 f"run `dsv4-offload convert --layers {layer}`", "level1")]
    if size != layout.file_bytes:
        return [(f"layer {layer}: {path} is {size} B, expected {layout.file_bytes} B "
                 f"({'truncated' if size < layout.file_bytes else 'too long'})",
                 redo(layer), "level1")]
    found = structural_problems(path, layout)
    if not found:
        with open(path, "rb") as fh:
            head = fh.read(layout.data_offset)
        if head != layout.header:
            at = next(i for i, (a, b) in enumerate(zip(head, layout.header, strict=True))
                      if a != b)
            found = [f"header byte {at} differs from the converter's header"]
    return [(f"layer {layer}: {path.name}: {text}", redo(layer), "structure") for text in found]


# --- the digest ----------------------------------------------------------------------------


def _thread_safe(advance: Any) -> Any:
    """``advance`` callable from several threads (a Task's advance is a read-modify-write)."""
    if advance is None:
        return None
    lock = threading.Lock()

    def locked_advance(n: int) -> None:
        with lock:
            advance(n)

    return locked_advance


def hash_files(paths: list[Path], jobs: int, advance: Any = None) -> dict[Path, str]:
    locked_advance = _thread_safe(advance)
    with cf.ThreadPoolExecutor(max(1, jobs), thread_name_prefix="sha256") as pool:
        digests = pool.map(lambda p: file_sha256(p, locked_advance), paths)
        return dict(zip(paths, digests, strict=True))


def expected_digests(ctx: StageContext, names: dict[int, str], real_dims: bool,
                     out_dir: Path, manifest: str | None = None
                     ) -> tuple[dict[str, str] | None, str]:
    """(file name -> digest, where they come from), or (None, why not) if there are none;
    ``manifest`` is the stage's --manifest."""
    from dsv4_offload.weights.gguf_io import OWN_MANIFEST, parse_manifest, read_own_manifest

    if manifest:
        path = Path(manifest)
        text = read_user_text(path, "manifest", 1 << 20, "give a sha256sum file",
                              label=f"--manifest {path}")
        return parse_manifest(text, str(path)), str(path)
    conv = ctx.recipe.conversion
    if real_dims and conv.digests:
        check_delivery_manifest(ctx)
        return {names[k]: v for k, v in conv.digests.items() if k in names}, \
            "the recipe's published digests (conversion.digests)"
    own = read_own_manifest(out_dir)
    if own is not None:
        return own, str(out_dir / OWN_MANIFEST)
    return None, "no published digests for these dims and no manifest"


def check_delivery_manifest(ctx: StageContext) -> Path | None:
    """If the delivery's manifest has been fetched, it must agree with the inline digests.

    The recipe carries the 43 digests itself (usable before `fetch`); when the pinned
    manifest file is in the workspace too, a disagreement means the recipe was edited
    wrongly, and which one to trust is the user's call.
    """
    from dsv4_offload.weights.gguf_io import parse_manifest

    conv = ctx.recipe.conversion
    pinned = conv.digests_manifest
    if pinned is None:
        return None
    path = ctx.workspace.source_dir(ctx.recipe, pinned.source) / pinned.path
    try:
        raw = path.read_bytes()
    except OSError:
        return None  # not fetched: the inline digests stand alone
    if hashlib.sha256(raw).hexdigest() != pinned.sha256:
        raise InputError(
            f"{path}: sha256 differs from conversion.digests_manifest.sha256 in the recipe; "
            "the delivery checkout is modified: rerun `dsv4-offload fetch --force`"
        )
    published = parse_manifest(raw.decode("utf-8", "replace"), str(path))
    for layer, digest in sorted(conv.digests.items()):
        name = conv.file_name(layer)
        if published.get(name) != digest:
            raise InputError(
                f"recipe conversion.digests[{layer}] is {digest[:16]}… but the delivery's "
                f"{path.name} says {str(published.get(name))[:16]}… for {name}; fix the recipe"
            )
    return path


# --- bit for bit against the source ---------------------------------------------------------


def _pread_into(fd: int, out: Any, offset: int, path: Path) -> None:
    view = memoryview(out)
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise InputError(f"{path}: unexpected end of file at byte {offset + done}; it "
                             "changed during the check: rerun `dsv4-offload verify-gguf`")
        done += n


def _equal(a: Any, b: Any) -> bool:
    import numpy as np

    if a.size % 8 == 0:  # compare 8 bytes at a time
        return bool(np.array_equal(a.view(np.uint64), b.view(np.uint64)))
    return bool(np.array_equal(a, b))


def _describe_diff(layer: int, tensor: Any, expert: int, got: Any, want: Any) -> str:
    import numpy as np

    from dsv4_offload.weights import mxfp4

    rows_got = got.reshape(tensor.rows, tensor.row_bytes)
    rows_want = want.reshape(tensor.rows, tensor.row_bytes)
    bad_rows = np.nonzero((rows_got != rows_want).any(axis=1))[0]
    row = int(bad_rows[0])
    blocks_got = rows_got[row].reshape(-1, mxfp4.BLOCK_BYTES)
    blocks_want = rows_want[row].reshape(-1, mxfp4.BLOCK_BYTES)
    block = int(np.nonzero((blocks_got != blocks_want).any(axis=1))[0][0])
    if blocks_got[block, 0] != blocks_want[block, 0]:
        what = (f"scale (E8M0) 0x{int(blocks_got[block, 0]):02x} in the file, "
                f"0x{int(blocks_want[block, 0]):02x} from the source")
    else:
        what = "E2M1 codes differ from the source"
    return (f"layer {layer}: tensor {tensor.name} ({tensor.projection}), expert {expert}, "
            f"row {row}, block {block}: {what} ({len(bad_rows)} of {tensor.rows} rows differ)")


def compare_with_source(path: Path, layout: Any, ckpt: Any, threads: int,
                        advance: Any = None, experts: list[int] | None = None) -> list[str]:
    """Bit-exact comparison of one layer file with the repacked source (every expert, or
    those of ``experts``); returns the differences."""
    import numpy as np

    from dsv4_offload.weights import mxfp4

    entries = ckpt.layer_tensors(layout.layer)
    chosen = list(range(layout.dims.experts)) if experts is None else list(experts)
    threads = max(1, min(threads, len(chosen)))
    advance = _thread_safe(advance)
    fd = os.open(path, os.O_RDONLY)

    def compare_range(lo: int, hi: int) -> list[tuple[int, int, Any, Any]]:
        max_out = max(t.expert_bytes for t in layout.tensors)
        got_buf, want_buf = np.empty(max_out, np.uint8), np.empty(max_out, np.uint8)
        repacker = mxfp4.Repacker()  # one per thread: it owns scratch buffers
        diffs: list[tuple[int, int, Any, Any]] = []
        for t_index, (tensor, (_proj, pairs)) in enumerate(
                zip(layout.tensors, entries, strict=True)):
            for expert in chosen[lo:hi]:
                w_entry, s_entry = pairs[expert]
                got = got_buf[: tensor.expert_bytes]
                want = want_buf[: tensor.expert_bytes]
                _pread_into(fd, got, tensor.expert_offset(expert), path)
                with ckpt.mapped(w_entry) as weight, ckpt.mapped(s_entry) as scale:
                    repacker.repack_into(weight, scale, want)
                    del weight, scale  # let the maps close
                if not _equal(got, want) and len(diffs) < MAX_DIFFS_PER_LAYER:
                    diffs.append((t_index, expert, got.copy(), want.copy()))
                if advance is not None:
                    advance(tensor.expert_bytes)
        return diffs

    try:
        n = len(chosen)
        bounds = [(i * n // threads, (i + 1) * n // threads) for i in range(threads)]
        with cf.ThreadPoolExecutor(threads, thread_name_prefix="deep") as pool:
            found = [d for part in pool.map(lambda b: compare_range(*b), bounds) for d in part]
    finally:
        os.close(fd)
    messages = []
    found.sort(key=lambda d: (d[0], d[1]))
    for t_index, expert, got, want in found[:MAX_DIFFS_PER_LAYER]:
        tensor = layout.tensors[t_index]
        text = _describe_diff(layout.layer, tensor, expert, got, want)
        twin = next((e for t, e, _g, w in found if t == t_index and e != expert
                     and _equal(got, w)), None)
        if twin is not None:
            text += f"; it holds expert {twin}'s data (experts out of order)"
        messages.append(text)
    return messages


def deep_layers(layers: list[int], count: int) -> list[int]:
    """`count` evenly spaced layers of `layers` (first and last included)."""
    if count <= 0 or not layers:
        return []
    if count >= len(layers):
        return list(layers)
    if count == 1:
        return [layers[len(layers) // 2]]
    step = (len(layers) - 1) / (count - 1)
    return sorted({layers[round(i * step)] for i in range(count)})


def sample_experts(experts: int, count: int = SAMPLE_EXPERTS) -> list[int]:
    """``count`` evenly spaced experts of ``experts`` (first and last included)."""
    return deep_layers(list(range(experts)), count)


# --- one layer, all checks (run where the layer was written: a worker process) -------------


@dataclass
class LayerCheck:
    layer: int
    sha256: str | None = None
    experts: list[int] = field(default_factory=list)  # compared bit for bit
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # message, fix, check

    @property
    def ok(self) -> bool:
        return not self.problems


def check_layer(source: Path, layout: Any, path: Path, expected: str | None,
                origin: str, advance: Any = None) -> LayerCheck:
    """Every check of one freshly written layer file: size and header, the sha256 (against
    ``expected`` when known, from ``origin``), and a bit-exact sample of its experts."""
    from dsv4_offload.weights.checkpoint import Checkpoint

    result = LayerCheck(layout.layer)
    result.problems = file_problems(layout.layer, layout, path)
    if result.problems:
        return result
    result.sha256 = file_sha256(path, advance)
    if expected is not None and expected != result.sha256:
        result.problems.append((
            f"layer {layout.layer}: {path.name} sha256 {result.sha256[:16]}… differs from "
            f"{expected[:16]}… ({origin}): the file is corrupt or was built from another "
            "source", redo(layout.layer), "level2"))
    result.experts = sample_experts(layout.dims.experts)
    with Checkpoint.open(source) as ckpt:
        for text in compare_with_source(path, layout, ckpt, 1, advance, result.experts):
            result.problems.append((text, redo(layout.layer), "level3"))
    return result


# --- the record of checked layers ----------------------------------------------------------


def read_layer_checks(out_dir: Path) -> dict[str, Any]:
    from dsv4_offload.workspace.store import read_json

    if not out_dir.is_dir():
        return {}
    doc = read_json(out_dir / CHECKS_FILE, {})
    return doc if isinstance(doc, dict) else {}


def record_layer_check(out_dir: Path, name: str, check: LayerCheck | None, origin: str = ""
                       ) -> None:
    """Record (or with None, forget) that the file ``name`` passed its checks as it is now."""
    from dsv4_offload.workspace.store import atomic_write_json

    doc = read_layer_checks(out_dir)
    if check is None:
        if doc.pop(name, None) is None:
            return
    else:
        st = (out_dir / name).stat()
        doc[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": check.sha256,
                     "digest_source": origin, "experts_compared": check.experts,
                     "checked": now_iso()}
    atomic_write_json(out_dir / CHECKS_FILE, doc)


def still_checked(entry: Any, path: Path) -> bool:
    """``path`` is the very file a check record describes (same size and mtime)."""
    return (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
            and unchanged_on_disk(path, entry))
