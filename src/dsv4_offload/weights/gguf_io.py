"""The per-layer GGUF layout shared by `convert` and `verify-gguf`.

One file per MoE layer: GGUF v3, seven KV pairs in a fixed order, three MXFP4 tensors
(gate, up, down experts; C-order [E, N, K/32*17] bytes, GGUF dims [K, N, E]) back to back
after the header, which is padded to the alignment. The header bytes come from the `gguf`
package's GGUFWriter (it reproduces the delivery's bytes exactly); the tensor data is
written by the converter itself so that a 3.4 GB layer never sits in memory.
"""

from __future__ import annotations

import functools
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.errors import InputError
from dsv4_offload.weights import mxfp4
from dsv4_offload.weights.checkpoint import PROJECTIONS, MoeDims

if TYPE_CHECKING:
    from dsv4_offload.recipe import Conversion

GGUF_VERSION = 3
QUANTIZATION_VERSION = 2


@dataclass(frozen=True)
class TensorLayout:
    """One stacked expert tensor of a layer file."""

    name: str
    role: str  # gate | up | down
    projection: str  # w1 | w3 | w2 in the checkpoint
    experts: int
    rows: int  # N
    k: int  # reduce dim, the MXFP4 block direction
    offset: int  # absolute, in the file

    @property
    def row_bytes(self) -> int:
        return mxfp4.block_row_bytes(self.k)

    @property
    def expert_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def nbytes(self) -> int:
        return self.experts * self.expert_bytes

    @property
    def gguf_shape(self) -> tuple[int, int, int]:
        """Dims as GGUF lists them (innermost first)."""
        return self.k, self.rows, self.experts

    def expert_offset(self, expert: int) -> int:
        return self.offset + expert * self.expert_bytes


@dataclass(frozen=True)
class LayerLayout:
    """Everything about one layer file: KV values, header bytes, tensor offsets, size."""

    layer: int
    dims: MoeDims
    architecture: str
    model_name: str
    alignment: int

    @classmethod
    def for_layer(cls, layer: int, dims: MoeDims, conversion: Conversion) -> LayerLayout:
        return cls(layer, dims, conversion.architecture,
                   conversion.gguf_name_template.replace("{layer}", str(layer)),
                   conversion.alignment)

    def kv(self) -> list[tuple[str, Any]]:
        """KV pairs in file order (the order the delivery's converter writes them)."""
        a = self.architecture
        return [
            ("general.architecture", a),
            ("general.quantization_version", QUANTIZATION_VERSION),
            ("general.name", self.model_name),
            (f"{a}.expert_count", self.dims.experts),
            (f"{a}.expert_used_count", self.dims.experts_per_token),
            (f"{a}.embedding_length", self.dims.hidden),
            (f"{a}.expert_feed_forward_length", self.dims.intermediate),
        ]

    def tensor_names(self) -> list[tuple[str, str, str]]:
        return [(f"blk.{self.layer}.ffn_{role}_exps.weight", role, projection)
                for projection, role in PROJECTIONS]

    @property
    def header(self) -> bytes:
        """Header + KV + tensor infos, padded with zeros to the data offset."""
        return _header_bytes(self)

    @property
    def data_offset(self) -> int:
        return len(self.header)

    @property
    def tensors(self) -> list[TensorLayout]:
        out = []
        offset = self.data_offset
        for name, role, projection in self.tensor_names():
            n, k = self.dims.projection_shape(projection)
            t = TensorLayout(name, role, projection, self.dims.experts, n, k, offset)
            out.append(t)
            offset += t.nbytes
        return out

    @property
    def file_bytes(self) -> int:
        last = self.tensors[-1]
        return last.offset + last.nbytes


def recipe_dims(conversion: Conversion) -> MoeDims:
    """The dims the recipe states (the real model's), for when no source config is at hand."""
    return MoeDims(conversion.layers, conversion.experts, conversion.experts_per_token,
                   conversion.hidden_size, conversion.moe_intermediate_size)


@functools.lru_cache(maxsize=256)
def _header_bytes(layout: LayerLayout) -> bytes:
    # GGUFWriter only writes to a path; the header is a few hundred bytes, so a scratch
    # file costs nothing and keeps the exact bytes the package produces
    import gguf
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="dsv4-gguf-header-") as scratch:
        path = Path(scratch) / "header.gguf"
        writer = gguf.GGUFWriter(path, layout.architecture)
        if layout.alignment != gguf.GGUF_DEFAULT_ALIGNMENT:
            writer.add_custom_alignment(layout.alignment)
        for key, value in layout.kv()[1:]:  # the writer adds general.architecture itself
            if isinstance(value, str):
                writer.add_string(key, value)
            else:
                writer.add_uint32(key, value)
        for name, _role, projection in layout.tensor_names():
            n, k = layout.dims.projection_shape(projection)
            row_bytes = mxfp4.block_row_bytes(k)
            nbytes = layout.dims.experts * n * row_bytes
            writer.add_tensor_info(name, (layout.dims.experts, n, row_bytes), np.dtype(np.uint8),
                                   nbytes, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        writer.write_header_to_file(path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        raw = path.read_bytes()
    return raw + bytes(-len(raw) % layout.alignment)


def structural_problems(path: Path, layout: LayerLayout) -> list[str]:
    """Check a layer file with the `gguf` reader: magic, version, KV, tensor infos, offsets.

    The file is untrusted: whatever the third-party reader raises on a damaged header (a
    struct or numpy error, a non-UTF-8 string, an absurd count) is one problem line.
    """
    try:
        if not path.is_file():
            return ["not a regular file (a FIFO, socket or device)"]
        with warnings.catch_warnings():  # numpy's overflow warnings on absurd counts
            warnings.simplefilter("ignore", RuntimeWarning)
            return _structural_problems(path, layout)
    except MemoryError:
        return ["not a readable GGUF file (its header asks for more memory than there is)"]
    except Exception as exc:  # the gguf package's reader raises many types on bad input
        text = str(exc).splitlines()[0][:160] if str(exc) else ""
        return [f"not a readable GGUF file ({type(exc).__name__}: {text})"]


def _structural_problems(path: Path, layout: LayerLayout) -> list[str]:
    import gguf

    reader = gguf.GGUFReader(path)
    problems = []
    version = reader.get_field("GGUF.version")
    if version is None or version.contents() != GGUF_VERSION:
        problems.append(f"GGUF version {version and version.contents()}, expected {GGUF_VERSION}")
    keys = [f.name for f in reader.fields.values() if not f.name.startswith("GGUF.")]
    want = layout.kv()
    if keys != [k for k, _ in want]:
        problems.append(f"KV keys {keys}, expected {[k for k, _ in want]}")
    for key, value in want:
        field = reader.get_field(key)
        got = field.contents() if field is not None else None
        if got != value:
            problems.append(f"KV '{key}' = {got!r}, expected {value!r}")
    got_tensors = list(reader.tensors)
    want_tensors = layout.tensors
    if [t.name for t in got_tensors] != [t.name for t in want_tensors]:
        problems.append(
            f"tensors {[t.name for t in got_tensors]}, expected {[t.name for t in want_tensors]}"
        )
        return problems
    for got_t, want_t in zip(got_tensors, want_tensors, strict=True):
        if int(got_t.tensor_type) != mxfp4.GGML_TYPE_MXFP4:
            problems.append(f"{got_t.name}: type {int(got_t.tensor_type)}, expected "
                            f"{mxfp4.GGML_TYPE_MXFP4} (MXFP4)")
        if tuple(int(d) for d in got_t.shape) != want_t.gguf_shape:
            problems.append(f"{got_t.name}: dims {[int(d) for d in got_t.shape]}, expected "
                            f"{list(want_t.gguf_shape)}")
        if got_t.data_offset != want_t.offset or got_t.n_bytes != want_t.nbytes:
            problems.append(f"{got_t.name}: data at {got_t.data_offset} ({got_t.n_bytes} B), "
                            f"expected {want_t.offset} ({want_t.nbytes} B)")
    if reader.data_offset != layout.data_offset:
        problems.append(f"data offset {reader.data_offset}, expected {layout.data_offset}")
    return problems


# --- sha256 manifests (sha256sum format) ---------------------------------------------------

OWN_MANIFEST = "gguf-sha256.txt"  # written beside the layer files after a verified set
_MANIFEST_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


def parse_manifest(text: str, source: str) -> dict[str, str]:
    """`sha256sum` output -> {file name: digest}; a malformed line is one clear error."""
    digests: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = _MANIFEST_LINE.match(line.rstrip("\r"))
        if m is None:
            raise InputError(
                f"{source}:{number}: not a sha256sum line ('<64 hex>  <file>'): {line[:60]!r}"
            )
        digests[Path(m.group(2)).name] = m.group(1).lower()
    if not digests:
        raise InputError(f"{source}: no digests in the manifest; give a `sha256sum` output file")
    return digests


def format_manifest(digests: dict[str, str]) -> str:
    return "".join(f"{digest}  {name}\n" for name, digest in digests.items())


def read_own_manifest(gguf_dir: Path) -> dict[str, str] | None:
    path = gguf_dir / OWN_MANIFEST
    try:
        return parse_manifest(path.read_text(encoding="utf-8"), str(path))
    except FileNotFoundError:
        return None


def write_own_manifest(gguf_dir: Path, digests: dict[str, str]) -> Path:
    """Merge `digests` into the manifest beside the files (atomically)."""
    from dsv4_offload.workspace.store import atomic_write_bytes

    merged = {**(read_own_manifest(gguf_dir) or {}), **digests}
    ordered = dict(sorted(merged.items(), key=lambda kv: _natural_key(kv[0])))
    path = gguf_dir / OWN_MANIFEST
    atomic_write_bytes(path, format_manifest(ordered).encode())
    return path


def forget_manifest_entries(gguf_dir: Path, names: list[str]) -> None:
    """Drop rewritten files from our manifest: it must only vouch for verified bytes."""
    from dsv4_offload.workspace.store import atomic_write_bytes

    path = gguf_dir / OWN_MANIFEST
    if not path.exists():
        return
    try:
        current = parse_manifest(path.read_text(encoding="utf-8"), str(path))
    except InputError:
        current = {}  # a damaged manifest of ours vouches for nothing: it goes
    kept = {name: digest for name, digest in current.items() if name not in names}
    if current and kept == current:
        return
    if kept:
        atomic_write_bytes(path, format_manifest(kept).encode())
    else:
        path.unlink()


def _natural_key(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))
