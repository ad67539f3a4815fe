"""The native MXFP4 checkpoint: config.json, the safetensors index, shards and expert tensors.

Everything is validated before a byte is converted: a missing index, shard or tensor, a
wrong dtype or shape, a truncated shard or a config that disagrees with the tensors each
raise one InputError line naming the file, the tensor and the fix.

safetensors headers are parsed here rather than through the `safetensors` package: its
numpy backend cannot represent F8_E8M0 (the scales), and the converter needs each
tensor's byte range, to map just that tensor for the time it takes to repack it (the
source pages then never pile up in our RSS).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import stat
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.errors import InputError
from dsv4_offload.workspace.store import create_exclusive

if TYPE_CHECKING:
    import numpy as np

# numpy and mxfp4 (which needs numpy) load inside the functions that use them: `status`
# fingerprints `convert` with this module's file names and must not pay for numpy

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
WEIGHT_DTYPE = "I8"  # two E2M1 codes per byte, consecutive order
SCALE_DTYPE = "F8_E8M0"
DTYPE_BYTES = {"I8": 1, "U8": 1, "F8_E8M0": 1, "F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4,
               "I32": 4, "I64": 8, "F64": 8, "BOOL": 1, "I16": 2, "U16": 2}
# (checkpoint projection, GGUF tensor role), in the order the GGUF file stores them
PROJECTIONS: tuple[tuple[str, str], ...] = (("w1", "gate"), ("w3", "up"), ("w2", "down"))
CONFIG_KEYS = {
    "layers": "num_hidden_layers",
    "experts": "n_routed_experts",
    "experts_per_token": "num_experts_per_tok",
    "hidden": "hidden_size",
    "intermediate": "moe_intermediate_size",
}
# far above any real model, far below what would make a loop or a shape absurd
CONFIG_LIMITS = {"layers": 4096, "experts": 65536, "experts_per_token": 4096,
                 "hidden": 1 << 20, "intermediate": 1 << 22}
MAX_TENSOR_DIMS = 8
REFETCH = "rerun `dsv4-offload download mxfp4` (it resumes and re-checks sizes)"
_EXPERT_KEY = re.compile(
    r"^(model\.)?layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$"
)


@dataclass(frozen=True)
class MoeDims:
    """The MoE dimensions a conversion needs, as config.json states them."""

    layers: int
    experts: int
    experts_per_token: int
    hidden: int
    intermediate: int

    def projection_shape(self, projection: str) -> tuple[int, int]:
        """(N rows, K reduce dim) of one expert projection."""
        if projection == "w2":
            return self.hidden, self.intermediate
        return self.intermediate, self.hidden

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in CONFIG_KEYS}


def expert_key(layer: int, expert: int, projection: str, kind: str, prefix: str = "") -> str:
    return f"{prefix}layers.{layer}.ffn.experts.{expert}.{projection}.{kind}"


def expert_layer(key: str) -> int | None:
    """The layer of an expert tensor's name (with or without the ``model.`` prefix), else
    None: the index's weight_map tells which shard holds which layer's experts."""
    m = _EXPERT_KEY.match(key)
    return int(m.group(2)) if m else None


def expected_expert_tensor(dims: MoeDims, projection: str, kind: str
                           ) -> tuple[str, tuple[int, int]]:
    """(dtype, shape) the checkpoint must hold for one expert tensor."""
    from dsv4_offload.weights import mxfp4

    n, k = dims.projection_shape(projection)
    if kind == "weight":
        return WEIGHT_DTYPE, (n, k // 2)
    return SCALE_DTYPE, (n, k // mxfp4.BLOCK_ELEMENTS)


def _read_json(path: Path, if_missing: str) -> Any:
    """A checkpoint JSON file; missing or broken is one InputError line ending in the fix."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: missing; {if_missing}") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc}); {REFETCH}") from None


def parse_config(path: Path) -> MoeDims:
    """MoeDims from a config.json; each missing or malformed field is one clear error."""
    from dsv4_offload.weights import mxfp4

    doc = _read_json(path, f"the MXFP4 checkpoint is incomplete: {REFETCH}")
    if not isinstance(doc, dict):
        raise InputError(f"{path}: expected a JSON object; {REFETCH}")
    values: dict[str, int] = {}
    for attr, key in CONFIG_KEYS.items():
        value = doc.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InputError(
                f"{path}: field '{key}' is {value!r}, expected a positive integer; {REFETCH}"
            )
        if value > CONFIG_LIMITS[attr]:
            raise InputError(
                f"{path}: field '{key}' is {value}, over {CONFIG_LIMITS[attr]} (no model has "
                f"that many); the file is damaged or not this model's config; {REFETCH}")
        values[attr] = value
    dims = MoeDims(**values)
    for what, k in (("hidden_size", dims.hidden), ("moe_intermediate_size", dims.intermediate)):
        if k % mxfp4.BLOCK_ELEMENTS:
            raise InputError(
                f"{path}: field '{what}' = {k} is not a multiple of {mxfp4.BLOCK_ELEMENTS} "
                "(the MXFP4 block); this is not an MXFP4 checkpoint"
            )
    return dims


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: where its bytes are."""

    name: str
    shard: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in the shard file
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one shard, checked against the file's size (catches truncation)."""
    try:
        st = path.stat()
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
            raise InputError(f"{path}: not a regular file (a FIFO, socket or device); put the "
                             f"shard itself there; {REFETCH}")
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise InputError(f"{path}: truncated ({size} B, no safetensors header); {REFETCH}")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(size - 8, 100 * 2**20):
                raise InputError(
                    f"{path}: header length {header_len} B does not fit the {size} B file; "
                    f"the shard is truncated or not safetensors; {REFETCH}"
                )
            raw = fh.read(header_len)
    except FileNotFoundError:
        raise InputError(f"{path}: shard missing (listed in {INDEX_FILE}); {REFETCH}") from None
    except OSError as exc:
        raise InputError(f"{path}: unreadable ({exc.strerror}); check permissions") from None
    doc = _header_json(path, raw)
    base = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in doc.items():
        if name == "__metadata__":
            continue
        dtype, shape, start, end = _header_entry(path, name, info)
        count = math.prod(shape)
        if dtype in DTYPE_BYTES and end - start != count * DTYPE_BYTES[dtype]:
            raise InputError(
                f"{path}: '{name}' spans {end - start} B but {dtype}{list(shape)} needs "
                f"{count * DTYPE_BYTES[dtype]} B; {REFETCH}"
            )
        if base + end > size:
            raise InputError(
                f"{path}: truncated: {size} B on disk but '{name}' ends at byte {base + end}; "
                f"{REFETCH}"
            )
        entries[name] = TensorEntry(name, path, dtype, shape, base + start, end - start)
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries.values() if e.nbytes)
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:], strict=False):
        if start_b < end_a:
            raise InputError(f"{path}: tensors '{a}' and '{b}' overlap in the file; the header "
                             f"is damaged; {REFETCH}")
    return entries


SAMPLES = 8
SAMPLE_BYTES = 64 << 10


def safetensors_digest(path: Path) -> str:
    """A short sha256 of a shard's header (names, dtypes, shapes, offsets) and of 8 evenly
    spaced 64 KiB samples of its data: a replaced shard is told apart, even one with the
    same tensors and size, by reading half a MiB instead of hashing gigabytes."""
    import hashlib

    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        (header_len,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
        digest.update(head + fh.read(min(header_len, 100 * 2**20)))
        start = 8 + header_len
        span = max(0, size - start - SAMPLE_BYTES)
        for i in range(SAMPLES):
            fh.seek(start + span * i // max(1, SAMPLES - 1))
            digest.update(fh.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number")


def _header_json(path: Path, raw: bytes) -> dict[str, Any]:
    """The header as a JSON object of objects (no NaN/Infinity, no list, no nesting)."""
    try:
        doc = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: safetensors header is not JSON "
                         f"({str(exc).splitlines()[0][:120]}); {REFETCH}") from None
    if not isinstance(doc, dict):
        raise InputError(f"{path}: safetensors header is a JSON {type(doc).__name__}, not an "
                         f"object of tensors; {REFETCH}")
    return doc


def _header_entry(path: Path, name: str, info: Any) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, start, end) of one header entry, each checked for type and range."""
    def bad(why: str) -> InputError:
        return InputError(f"{path}: header entry '{name[:120]}' {why}; {REFETCH}")

    if not isinstance(info, dict):
        raise bad("is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or not re.fullmatch(r"[A-Za-z0-9_]{1,16}", dtype):
        raise bad("has no dtype name")
    if not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape):
        raise bad(f"has a shape that is not a list of up to {MAX_TENSOR_DIMS} sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 48 for x in offsets) \
            or offsets[0] > offsets[1]:
        raise bad("has data_offsets that are not [start, end] with 0 <= start <= end")
    return dtype, tuple(shape), offsets[0], offsets[1]


@dataclass
class Checkpoint:
    """An opened checkpoint directory: config dims, index and lazily read shard headers."""

    root: Path
    dims: MoeDims
    weight_map: dict[str, str]
    prefix: str = ""
    _headers: dict[str, dict[str, TensorEntry]] = field(default_factory=dict)
    _fds: dict[Path, int] = field(default_factory=dict)
    _fd_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def open(cls, root: Path) -> Checkpoint:
        root = Path(root)
        if not root.is_dir():
            raise InputError(
                f"{root}: the MXFP4 checkpoint directory does not exist; run "
                "`dsv4-offload download mxfp4` or pass --source DIR"
            )
        dims = parse_config(root / CONFIG_FILE)
        index_path = root / INDEX_FILE
        doc = _read_json(index_path, REFETCH)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{index_path}: field 'weight_map' is missing or empty; {REFETCH}")
        for key, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or shard.startswith("/") \
                    or any(part in ("", ".", "..") for part in shard.split("/")):
                raise InputError(f"{index_path}: weight_map['{str(key)[:80]}'] = {shard!r:.80} is "
                                 f"not a shard file inside {root}; {REFETCH}")
        prefix = "model." if any(k.startswith("model.layers.") for k in weight_map) else ""
        return cls(root, dims, {str(k): str(v) for k, v in weight_map.items()}, prefix)

    def experts_in_index(self, layer: int) -> set[int]:
        found = set()
        for key in self.weight_map:
            m = _EXPERT_KEY.match(key)
            if m and int(m.group(2)) == layer:
                found.add(int(m.group(3)))
        return found

    def _entry(self, name: str) -> TensorEntry:
        shard_name = self.weight_map.get(name)
        if shard_name is None:
            raise InputError(
                f"{self.root / INDEX_FILE}: tensor '{name}' is not in the weight_map; the "
                f"checkpoint is incomplete or not the native MXFP4 one; {REFETCH}"
            )
        if shard_name not in self._headers:
            self._headers[shard_name] = read_safetensors_header(self.root / shard_name)
        entry = self._headers[shard_name].get(name)
        if entry is None:
            raise InputError(
                f"{self.root / shard_name}: tensor '{name}' is listed in the index but absent "
                f"from the shard; {REFETCH}"
            )
        return entry

    def expert_tensor(self, layer: int, expert: int, projection: str, kind: str) -> TensorEntry:
        """The entry of one expert tensor, checked for dtype and shape against config.json."""
        name = expert_key(layer, expert, projection, kind, self.prefix)
        entry = self._entry(name)
        dtype, shape = expected_expert_tensor(self.dims, projection, kind)
        if entry.dtype != dtype:
            raise InputError(
                f"{entry.shard}: '{name}' has dtype {entry.dtype}, expected {dtype}; this is "
                "not the native MXFP4 checkpoint (check weights.mxfp4.repo_id in the recipe)"
            )
        if entry.shape != shape:
            d = self.dims
            raise InputError(
                f"{entry.shard}: '{name}' has shape {list(entry.shape)} but {CONFIG_FILE} "
                f"(hidden_size {d.hidden}, moe_intermediate_size {d.intermediate}) implies "
                f"{list(shape)}; config and tensors disagree: {REFETCH}"
            )
        return entry

    def layer_tensors(self, layer: int) -> list[tuple[str, list[tuple[TensorEntry, TensorEntry]]]]:
        """Every (weight, scale) entry of a layer, per projection in GGUF order; validated."""
        if not 0 <= layer < self.dims.layers:
            raise InputError(
                f"layer {layer} is outside 0..{self.dims.layers - 1} "
                f"({self.root / CONFIG_FILE} num_hidden_layers); pick --layers in that range"
            )
        present = self.experts_in_index(layer)
        extra = sorted(e for e in present if e >= self.dims.experts)
        if extra:
            raise InputError(
                f"{self.root / INDEX_FILE}: layer {layer} has expert {extra[0]} but "
                f"{CONFIG_FILE} says n_routed_experts {self.dims.experts}; config and tensors "
                f"disagree: {REFETCH}"
            )
        return [
            (projection, [(self.expert_tensor(layer, e, projection, "weight"),
                           self.expert_tensor(layer, e, projection, "scale"))
                          for e in range(self.dims.experts)])
            for projection, _role in PROJECTIONS
        ]

    def _fd(self, shard: Path) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            with self._fd_lock:  # verify reads from several threads
                fd = self._fds.get(shard)
                if fd is None:
                    try:
                        fd = self._fds[shard] = os.open(shard, os.O_RDONLY)
                    except OSError as exc:
                        raise InputError(f"{shard}: cannot open ({exc.strerror}); {REFETCH}"
                                         ) from None
        return fd

    def prefetch(self, entry: TensorEntry) -> None:
        """Ask the kernel to read a tensor ahead, so mapping it next does not wait on disk."""
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(self._fd(entry.shard), entry.offset, entry.nbytes,
                             os.POSIX_FADV_WILLNEED)

    @contextlib.contextmanager
    def mapped(self, entry: TensorEntry) -> Iterator[np.ndarray]:
        """A tensor's bytes straight from the page cache (no copy), unmapped on exit.

        One tensor at a time (a few MB), so mapped pages never pile up in our RSS.
        MAP_POPULATE maps it in one go instead of a page fault per 4 KiB.
        """
        import numpy as np

        start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        try:
            region = mmap.mmap(self._fd(entry.shard), entry.offset + entry.nbytes - start,
                               flags=flags, prot=mmap.PROT_READ, offset=start)
        except OSError as exc:
            raise InputError(
                f"{entry.shard}: cannot map '{entry.name}' ({exc.strerror}); {REFETCH}"
            ) from None
        try:
            yield np.frombuffer(region, np.uint8, entry.nbytes, entry.offset - start)
        finally:
            with contextlib.suppress(BufferError):  # a view still referenced: freed with it
                region.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- synthetic checkpoints (tests and the benchmark) ---------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its bytes come from `data()` only when written (streaming)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Callable[[], bytes]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def write_safetensors(path: Path, tensors: Iterable[TensorSpec]) -> None:
    """Write a safetensors file tensor by tensor (memory stays at one tensor)."""
    specs = list(tensors)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with os.fdopen(create_exclusive(tmp), "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for spec in specs:
                blob = spec.data()
                if len(blob) != spec.nbytes:
                    raise ValueError(f"{spec.name}: data is {len(blob)} B, expected {spec.nbytes}")
                fh.write(blob)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only there when writing failed


def synthetic_layer_tensors(dims: MoeDims, layer: int, seed: int = 0,
                            exponents: tuple[int, int] | None = None) -> Iterator[TensorSpec]:
    """A layer's expert tensors with the real names, dtypes and shapes and random content.

    Codes cover all 256 byte values; exponents are drawn around 2^0 with a few extremes, so
    every E2M1 code and a wide range of scales is exercised. Deterministic for (seed, layer).
    ``exponents`` (lo, hi) draws every E8M0 byte in [lo, hi) instead, without extremes: the
    selftest's layer, whose MoE output must stay finite in bf16.
    """
    import numpy as np

    yield TensorSpec(f"layers.{layer}.ffn_norm.weight", "F32", (dims.hidden,),
                     lambda: np.ones(dims.hidden, np.float32).tobytes())
    for expert in range(dims.experts):
        for projection, _role in PROJECTIONS:
            rng_seed = (seed, layer, expert, int(projection[1]))
            for kind in ("weight", "scale"):
                dtype, shape = expected_expert_tensor(dims, projection, kind)
                yield TensorSpec(expert_key(layer, expert, projection, kind), dtype, shape,
                                 _random_bytes(rng_seed, kind, shape, exponents))


def _random_bytes(seed: tuple[int, ...], kind: str, shape: tuple[int, int],
                  exponents: tuple[int, int] | None = None) -> Callable[[], bytes]:
    def make() -> bytes:
        import numpy as np

        rng = np.random.default_rng(list(seed) + [kind == "scale"])
        n = shape[0] * shape[1]
        if kind == "weight":
            return rng.bytes(n)
        if exponents is not None:
            return rng.integers(exponents[0], exponents[1], n, dtype=np.uint8).tobytes()
        exps = rng.integers(112, 143, n, dtype=np.uint8)
        exps[rng.integers(0, n, max(1, n // 512))] = rng.choice([0, 1, 2, 200, 250], 1)[0]
        return exps.tobytes()
    return make


def _plain_tensors(dims: MoeDims, names: tuple[str, ...]) -> list[TensorSpec]:
    """Small BF16 stand-ins for the non-expert tensors of a shard (nothing here reads them:
    they give the synthetic checkpoint the real one's shape of shards)."""
    return [TensorSpec(name, "BF16", (8, dims.hidden),
                       lambda: bytes(8 * dims.hidden * 2)) for name in names]


def write_synthetic_checkpoint(root: Path, dims: MoeDims, seed: int = 0,
                               layers: Iterable[int] | None = None,
                               exponents: tuple[int, int] | None = None, *,
                               real_layout: bool = False,
                               shard_name: Callable[[int, int], str] | None = None) -> Path:
    """A native-layout MXFP4 checkpoint (config, index, one shard per layer) under `root`.

    ``real_layout`` orders the shards like the real checkpoint's: a shard of embeddings
    first, then one shard per layer, then a last one with the head. ``shard_name(i, n)``
    names the i-th of n shards (1-based; default ``model-{i:05d}-of-{n:05d}.safetensors``),
    e.g. to make names and layers disagree.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    todo = list(range(dims.layers) if layers is None else layers)
    name_of = shard_name or (lambda i, n: f"model-{i:05d}-of-{n:05d}.safetensors")
    count = len(todo) + (2 if real_layout else 0)
    first = 2 if real_layout else 1
    weight_map: dict[str, str] = {}
    if real_layout:
        for i, names in ((1, ("embed.weight",)), (count, ("norm.weight", "head.weight"))):
            specs = _plain_tensors(dims, names)
            write_safetensors(root / name_of(i, count), specs)
            weight_map.update({s.name: name_of(i, count) for s in specs})
    for i, layer in enumerate(todo):
        shard = name_of(i + first, count)
        specs = list(synthetic_layer_tensors(dims, layer, seed, exponents))
        write_safetensors(root / shard, specs)
        weight_map.update({s.name: shard for s in specs})
    config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
              "expert_dtype": "fp4", "n_shared_experts": 1, "vocab_size": 129280}
    config.update({key: getattr(dims, attr) for attr, key in CONFIG_KEYS.items()})
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    index = {"metadata": {"total_size": sum(
        (root / s).stat().st_size for s in set(weight_map.values()))}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return root
