"""Recipe and patch-series models: loading, overrides and one-line validation errors.

A recipe pins everything a deployment needs (sources, series, builds, weights, conversion,
serving, acceptance, host requirements). A series lists the patches to apply, in order.
Both are YAML, validated by pydantic with unknown keys rejected; every error names the
file, the line, the field and what to write instead.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from dsv4_offload.errors import InputError

DATA_DIR = Path(__file__).parent / "data"
BUNDLED_RECIPES = DATA_DIR / "recipes"
BUNDLED_SERIES = DATA_DIR / "patches"
DEFAULT_RECIPE = "dsv4-flash-910b"
SCHEMA_VERSION = 1

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# --- field types ---------------------------------------------------------------------------


def _commit(value: str) -> str:
    if not isinstance(value, str) or not _HEX40.match(value):
        raise ValueError(
            "must be a full 40-hex-digit lowercase commit SHA (a tag or short SHA such as "
            "'b3173' is ambiguous); write the full SHA"
        )
    return value


def _sha256(value: str) -> str:
    if not isinstance(value, str) or not _HEX64.match(value):
        raise ValueError("must be a 64-hex-digit lowercase sha256 digest; write `sha256sum FILE`'s")
    return value


def _name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(
            "must be a plain name (letters, digits, '.', '_', '-'; no spaces or slashes)"
        )
    return value


def _relative_path(value: str) -> str:
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts or value.strip() in ("", "."):
        raise ValueError(
            "must be a relative path that stays inside its root (no leading '/', no '..')"
        )
    return value


def _url(value: str) -> str:
    if not re.match(r"^(https?|ssh|git|file)://\S+$|^[\w.-]+@[\w.-]+:\S+$", value):
        raise ValueError("must be a git URL (https://, ssh://, git://, file:// or user@host:path)")
    return value


Commit = Annotated[str, AfterValidator(_commit)]
Sha256 = Annotated[str, AfterValidator(_sha256)]
Name = Annotated[str, AfterValidator(_name)]
RelPath = Annotated[str, AfterValidator(_relative_path)]
GitUrl = Annotated[str, AfterValidator(_url)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- sources -------------------------------------------------------------------------------


class Source(Strict):
    """A git repository pinned at a full commit and where it goes in the workspace."""

    name: Name = Field(description="unique plain name; patches name it as their `target`")
    url: GitUrl = Field(description="git URL of the upstream repository")
    mirrors: list[GitUrl] = Field(
        [], description="more git URLs, tried in order after any `--mirror NAME=URL`"
    )
    commit: Commit = Field(
        description="the full 40-hex commit; a tag or short SHA is refused (`b3173` is both)"
    )
    ref: str | None = Field(None, description="human-readable tag or branch; never used alone")
    path: RelPath = Field(description="checkout path, relative to the workspace")
    submodule_of: Name | None = Field(
        None, description="taken as this source's submodule, at the commit above"
    )
    patched: bool = Field(True, description="whether the series may target it")
    license: str | None = Field(None, description="its license, for provenance")


class RemoteFile(Strict):
    """A file inside a pinned source (e.g. the delivery), checked by sha256."""

    source: Name = Field(description="the source that holds the file")
    path: RelPath = Field(description="path inside that source's checkout")
    sha256: Sha256 = Field(description="sha256 of the file, checked before use")


# --- series --------------------------------------------------------------------------------


class PatchOrigin(Strict):
    """Where a patch comes from: a path inside a pinned source, or a file in this repo."""

    source: Name | None = Field(
        None, description="a pinned source that holds the patch (with `path`)"
    )
    path: RelPath | None = Field(None, description="the patch's path inside that source")
    file: RelPath | None = Field(None, description="path relative to the series file")

    @model_validator(mode="after")
    def _one_origin(self) -> PatchOrigin:
        if (self.file is None) == (self.source is None):
            raise ValueError("give either 'source' + 'path' (a pinned source) or 'file' (ours)")
        if self.source is not None and self.path is None:
            raise ValueError("'source' needs a 'path' inside that source")
        return self


class PatchEntry(Strict):
    name: Name = Field(description="unique plain name of the patch")
    target: Name = Field(description="the source the patch applies to")
    origin: PatchOrigin = Field(
        description="where the patch comes from: `{source, path}` or `{file}`"
    )
    sha256: Sha256 = Field(
        description="sha256 of the patch file, checked before any repository is touched"
    )
    strip: int = Field(1, ge=0, le=5, description="leading path components to strip (`patch -p`)")
    method: Literal["plain", "mbox"] = Field(
        description="`plain` diff, or `mbox` (applied with `git am`)"
    )
    upstream: Literal["not-submitted", "submitted", "merged", "local"] = Field(
        "not-submitted", description="its state upstream"
    )
    description: str = Field(min_length=1, description="one line saying what it changes")


class Series(Strict):
    schema_version: Literal[1] = Field(1, alias="schema", description="always `1`")
    name: Name = Field(description="plain name of the series")
    description: str = Field("", description="a sentence")
    patches: list[PatchEntry] = Field(
        min_length=1, description="the patches, in the order they apply"
    )

    @model_validator(mode="after")
    def _unique_names(self) -> Series:
        _no_duplicates([p.name for p in self.patches], "patches", "name")
        return self

    def for_target(self, target: str) -> list[PatchEntry]:
        return [p for p in self.patches if p.target == target]


# --- builds --------------------------------------------------------------------------------


class BuildStep(Strict):
    name: Name = Field(description="unique plain name (`dsv4-offload build NAME`)")
    workdir: RelPath = Field(description="relative to the workspace")
    command: list[str] = Field(
        min_length=1, description="argv; `{python}` is replaced by `build.python`"
    )
    env: dict[str, str] = Field({}, description="environment added for the step")
    expect_markers: list[str] = Field([], description="log lines that must appear")
    forbid_markers: list[str] = Field([], description="log lines that must not appear")
    check_import: str | None = Field(None, description="python module that must import after")
    optional: bool = Field(False, description="a failure warns instead of failing the build")
    description: str = Field("", description="a sentence for humans")


class Build(Strict):
    python: str = Field(
        "python3.11", description="the interpreter the extensions are built with and bind to"
    )
    steps: list[BuildStep] = Field(min_length=1, description="build steps, in order")

    @model_validator(mode="after")
    def _unique(self) -> Build:
        _no_duplicates([s.name for s in self.steps], "steps", "name")
        return self


# --- weights -------------------------------------------------------------------------------


class WeightSet(Strict):
    hub: Literal["huggingface", "modelscope"] = Field(description="where the weights are published")
    repo_id: str = Field(pattern=r"^[\w.-]+/[\w.-]+$", description="`owner/name` on that hub")
    revision: str = Field("main", description="branch, tag or commit on the hub")
    allow_patterns: list[str] = Field(
        [], description="glob patterns of the files to download (default all)"
    )
    dir: RelPath = Field(description="download directory, relative to the workspace")
    expected_bytes: int = Field(gt=0, description="approximate total size, for disk planning")
    role: str = Field("", description="what the set is used for, for humans")


class Weights(Strict):
    w8a8: WeightSet = Field(
        description="the W8A8 checkpoint served on the NPU (attention, shared expert, router)"
    )
    mxfp4: WeightSet = Field(
        description="the MXFP4 checkpoint whose routed experts are converted to GGUF for the CPU"
    )

    @model_validator(mode="after")
    def _sibling_dirs(self) -> Weights:
        # the launcher derives the MXFP4 checkpoint from the W8A8 dir by dropping "-W8A8"
        if not self.w8a8.dir.endswith("-W8A8") or self.w8a8.dir[: -len("-W8A8")] != self.mxfp4.dir:
            raise ValueError(
                "mxfp4.dir must equal w8a8.dir without its '-W8A8' suffix (the server derives "
                "one from the other); e.g. w8a8.dir 'weights/X-W8A8', mxfp4.dir 'weights/X'"
            )
        return self


# --- conversion ----------------------------------------------------------------------------


class Conversion(Strict):
    layers: int = Field(43, gt=0, description="number of MoE layers to convert (0..layers-1)")
    gguf_dir: RelPath = Field("gguf", description="output directory, relative to the workspace")
    file_template: str = Field(
        "dsv4_layer{layer}_mxfp4.gguf",
        description="GGUF file name per layer; must contain `{layer}`"
    )
    gguf_name_template: str = Field(
        "dsv4-flash-layer{layer}-moe-mxfp4",
        description="`general.name` written into each GGUF; must contain `{layer}`"
    )
    architecture: str = Field(
        "deepseek2", description="`general.architecture` written into each GGUF"
    )
    experts: int = Field(256, gt=0, description="routed experts per layer")
    experts_per_token: int = Field(6, gt=0, description="experts each token is routed to")
    hidden_size: int = Field(4096, gt=0, description="model hidden size")
    moe_intermediate_size: int = Field(2048, gt=0, description="intermediate size of one expert")
    alignment: int = Field(32, gt=0, description="GGUF tensor-data alignment in bytes")
    expected_file_bytes: int = Field(gt=0, description="exact size of one converted layer file")
    digests: dict[int, Sha256] = Field(
        {}, description="layer number -> sha256 of the converted file, checked by verify-gguf"
    )
    digests_manifest: RemoteFile | None = Field(
        None, description="the delivery's `sha256sum`-format manifest of the converted files"
    )

    @field_validator("file_template", "gguf_name_template")
    @classmethod
    def _has_layer(cls, value: str) -> str:
        if "{layer}" not in value:
            raise ValueError("must contain the placeholder '{layer}'")
        if "/" in value:
            raise ValueError("must be a file name, without '/'")
        return value

    @model_validator(mode="after")
    def _digests_in_range(self) -> Conversion:
        bad = [k for k in self.digests if not 0 <= k < self.layers]
        if bad:
            raise ValueError(f"digests has layer {bad[0]} outside 0..{self.layers - 1}")
        return self

    def file_name(self, layer: int) -> str:
        return self.file_template.replace("{layer}", str(layer))


# --- serving -------------------------------------------------------------------------------


class Serve(Strict):
    command: list[str] | None = Field(
        None,
        description="replaces `python -m sglang.launch_server` (own builds, stand-ins); "
        "elements may use {python} {host} {port} {model_path}; the derived flags go where an "
        "element '{flags}' stands, else after the command (see pass_flags)",
    )
    pass_flags: bool = Field(
        True, description="give `command` the derived sglang flags; false for other servers"
    )
    python: str = Field("python3", description="interpreter that runs the server")
    host: str = Field("0.0.0.0", description="address the server listens on (`--host`)")
    port: int = Field(8020, gt=0, lt=65536, description="port the server listens on (`--port`)")
    device_type: str = Field("npu", description="sglang `--device`")
    attention_backend: str = Field("ascend", description="sglang `--attention-backend`")
    quantization: str = Field(
        "compressed-tensors", description="sglang `--quantization` of the NPU weights"
    )
    dtype: str = Field("bfloat16", description="sglang `--dtype`")
    kt_method: str = Field("LLAMAFILE", description="kt-kernel CPU expert kernel (`--kt-method`)")
    reserved_cores: int = Field(
        4, ge=0, description="cores kept free of CPU-infer threads (NPU callback, python, OS)"
    )
    kml_lib_dir: str | None = Field(
        "/usr/local/kml/lib", description="Kunpeng Math Library, put first on LD_LIBRARY_PATH "
        "when the directory exists"
    )
    health_paths: list[str] = Field(
        ["/health", "/health_generate"], description="readiness: each must answer 200, in order"
    )
    page_size: int = Field(128, gt=0, description="KV-cache page size in tokens (`--page-size`)")
    mem_fraction_static: float = Field(
        0.81, gt=0, lt=1,
        description="fraction of HBM for weights and KV cache (`--mem-fraction-static`)"
    )
    kt_num_gpu_experts: int = Field(
        32, ge=0, description="routed experts kept resident on the NPU (about 1 GB of HBM each)"
    )
    gpu_experts_ladder: list[int] = Field(
        [32, 24, 16], description="fewer resident experts to retry with when KV-cache setup fails"
    )
    threads_per_numa: int = Field(16, gt=0, description="CPU-infer threads per NUMA node")
    chunked_prefill_size: int = Field(
        8192, gt=0,
        description="a positive multiple of `page_size`, at least `longest_prompt_tokens`"
    )
    longest_prompt_tokens: int = Field(
        2577, gt=0, description="the longest prompt expected; one prefill chunk must cover it"
    )
    context_length: int = Field(
        65536, gt=0, description="maximum context in tokens (`--context-length`)"
    )
    max_prefill_tokens: int = Field(65535, gt=0, description="`--max-prefill-tokens`")
    watchdog_timeout: int = Field(
        18000, gt=0,
        description="seconds before sglang's watchdog kills a stuck step (`--watchdog-timeout`)"
    )
    max_running_requests: int = Field(
        1, gt=0, description="concurrent requests (`--max-running-requests`)"
    )
    extra_args: list[str] = Field([], description="more server arguments, appended as given")
    env: dict[str, str] = Field({}, description="environment set for the server")
    unset_env: list[str] = Field([], description="variables removed from the server's environment")
    cann_set_env: list[str] = Field(
        [], description="CANN `set_env.sh` scripts whose environment is captured once and applied"
    )
    nsa_compressor_mode: Literal["auto", "split", "single"] = Field(
        "auto", description="`auto`: `split` on CANN 8.5, `single` on CANN >= 9"
    )
    readiness_timeout_s: float = Field(
        900, gt=0, description="seconds to wait for the health paths to answer"
    )
    stop_timeout_s: float = Field(
        30, gt=0, description="seconds between SIGTERM and SIGKILL on stop"
    )

    @model_validator(mode="after")
    def _prefill_rules(self) -> Serve:
        if self.chunked_prefill_size % self.page_size:
            raise ValueError(
                f"chunked_prefill_size {self.chunked_prefill_size} must be a positive multiple "
                f"of page_size {self.page_size}; e.g. 8192"
            )
        if self.chunked_prefill_size < self.longest_prompt_tokens:
            raise ValueError(
                f"chunked_prefill_size {self.chunked_prefill_size} must be >= "
                f"longest_prompt_tokens {self.longest_prompt_tokens} (the NSA compressor needs "
                "one chunk to cover the prompt)"
            )
        return self


# --- acceptance ----------------------------------------------------------------------------


class Probe(Strict):
    name: Name = Field(description="unique plain name")
    prompt: str = Field(min_length=1, description="the prompt sent")
    expect_any: list[str] = Field(min_length=1, description="the answer must contain one")
    max_new_tokens: int = Field(64, gt=0, description="tokens to generate")
    chat: bool = Field(False, description="send as a chat message instead of a raw completion")


class Degeneration(Strict):
    max_char_run: int = Field(
        12, gt=1, description="longest run of one repeated character allowed in an answer"
    )
    max_token_run: int = Field(6, gt=1, description="longest run of one repeated token allowed")
    max_ngram_repeats: int = Field(4, gt=1, description="times one n-gram may repeat")
    ngram: int = Field(4, gt=1, description="n of those n-grams")


class Throughput(Strict):
    prompt_buckets: list[int] = Field(
        [128, 1024, 4096], description="prompt lengths in tokens to measure decode speed at"
    )
    new_tokens: int = Field(128, gt=0, description="tokens generated per measurement")
    repeats: int = Field(3, gt=0, description="measurements per bucket (the median counts)")
    warmup: int = Field(1, ge=0, description="unmeasured requests first")
    reference_tok_s: float = Field(gt=0, description="the delivery's decode speed, tokens/s")
    reference_range: tuple[float, float] = Field(description="[low, high] tokens/s accepted")


class Acceptance(Strict):
    api: Literal["native", "openai"] = Field(
        "native", description="`native` sglang `/generate` or `openai` `/v1/completions`"
    )
    request_timeout_s: float = Field(300, gt=0, description="seconds per request")
    probes: list[Probe] = Field(
        min_length=1, description="prompts whose answers must contain an expected string"
    )
    determinism_probe: Name = Field(
        description="the probe sent twice at temperature 0; both answers must match"
    )
    degeneration: Degeneration = Field(
        Degeneration(), description="thresholds that flag repetitive output"
    )
    log_markers_required: list[str] = Field(
        [], description="regular expressions the server log must match"
    )
    log_markers_forbidden: list[str] = Field(
        [], description="regular expressions the server log must not match"
    )
    throughput: Throughput = Field(description="decode-speed measurement and its reference")
    gpqa_reference_pct: float | None = Field(
        None, description="the delivery's GPQA score, for comparison"
    )

    @model_validator(mode="after")
    def _refs(self) -> Acceptance:
        _no_duplicates([p.name for p in self.probes], "probes", "name")
        if self.determinism_probe not in {p.name for p in self.probes}:
            raise ValueError(f"determinism_probe '{self.determinism_probe}' is not a probe name")
        return self


# --- host ----------------------------------------------------------------------------------


class Host(Strict):
    arch: str = Field("aarch64", description="CPU architecture (`uname -m`)")
    cpu_flags_required: list[str] = Field(
        ["asimd", "asimddp"], description="CPU flags that must be present (/proc/cpuinfo)"
    )
    cpu_flags_build_off: list[str] = Field(
        ["sve", "bf16", "i8mm"],
        description="flags the builds must keep off even when the CPU has them"
    )
    min_cores: int = Field(32, gt=0, description="minimum CPU cores")
    memory_min_gib: float = Field(160, gt=0, description="RAM below which doctor fails")
    memory_recommended_gib: float = Field(256, gt=0, description="RAM below which doctor warns")
    disk_min_gib: float = Field(
        415, gt=0, description="free disk in the workspace below which doctor fails"
    )
    disk_recommended_gib: float = Field(600, gt=0, description="free disk below which doctor warns")
    npu_models: list[str] = Field(min_length=1, description="accepted NPU model names (npu-smi)")
    hbm_min_gib: float = Field(32, gt=0, description="minimum HBM per NPU")
    npu_device_nodes: list[str] = Field(
        [], description="device files that must exist (e.g. /dev/davinci0)"
    )
    cann_min_version: str = Field("8.5.0", description="minimum CANN toolkit version")
    python: str = Field("3.11", description="required Python version (major.minor)")
    tools: dict[str, str] = Field({}, description="tool -> minimum version")
    libraries: list[str] = Field(
        ["hwloc", "numa"], description="development libraries the builds need (headers or .so)"
    )
    docker: Literal["required", "recommended", "unused"] = Field(
        "recommended", description="whether a container runtime is needed"
    )


# --- recipe --------------------------------------------------------------------------------


class Platform(Strict):
    npu: str = Field(description="NPU family (910B, A3)")
    cann: str = Field(description="CANN version the recipe was made for")
    image: str | None = Field(None, description="container image of the delivery, if any")
    cc: str | None = Field(None, description="C compiler for the builds (default gcc)")
    cxx: str | None = Field(None, description="C++ compiler for the builds (default g++)")


class Recipe(Strict):
    schema_version: Literal[1] = Field(1, alias="schema", description="always `1`")
    name: Name = Field(description="plain name (letters, digits, `.`, `_`, `-`)")
    description: str = Field("", description="a sentence")
    platform: Platform = Field(description="the NPU, CANN version and toolchain")
    series: str = Field(description="bundled series name or a path relative to the recipe")
    delivery: Name = Field(description="the source that holds the series and scripts")
    tree_root: Name = Field(description="the source whose checkout is the workspace tree")
    sources: list[Source] = Field(
        min_length=1, description="git repositories pinned at full commits"
    )
    build: Build = Field(description="what `build` compiles")
    weights: Weights = Field(description="the two weight sets `download` fetches")
    conversion: Conversion = Field(description="GGUF conversion of the routed experts")
    serve: Serve = Field(
        description="server flags, environment and the rules that derive values from the host"
    )
    acceptance: Acceptance = Field(description="what `accept` checks")
    host: Host = Field(description="what `doctor` requires of the host")

    @model_validator(mode="after")
    def _cross_refs(self) -> Recipe:
        names = [s.name for s in self.sources]
        _no_duplicates(names, "sources", "name")
        _no_duplicates([s.path for s in self.sources], "sources", "path")
        for ref, label in ((self.delivery, "delivery"), (self.tree_root, "tree_root")):
            if ref not in names:
                raise ValueError(f"{label} '{ref}' is not a source name; use one of {names}")
        for s in self.sources:
            if s.submodule_of is not None and s.submodule_of not in names:
                raise ValueError(f"source '{s.name}': submodule_of '{s.submodule_of}' is unknown")
        manifest = self.conversion.digests_manifest
        if manifest and manifest.source not in names:
            raise ValueError("conversion.digests_manifest.source is not a source name")
        return self

    def source(self, name: str) -> Source:
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(name)


def _no_duplicates(values: list[Any], where: str, field: str) -> None:
    seen: set[Any] = set()
    for v in values:
        if v in seen:
            raise ValueError(f"duplicate {field} '{v}' in {where}; each must be unique")
        seen.add(v)


# --- loading -------------------------------------------------------------------------------


# libyaml's parser is ~10x faster than the pure-Python one (status and --help read recipes)
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _LineLoader(_SafeLoader):  # type: ignore[misc,valid-type]
    """A YAML loader that remembers the line of every mapping key and sequence item."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    mapping = loader.construct_mapping(node, deep=True)
    lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        lines[key] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.SequenceNode):
            lines[(key, "items")] = [n.start_mark.line + 1 for n in value_node.value]
    keys = [loader.construct_object(k, deep=True) for k, _ in node.value]
    dup = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if dup is not None:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate key '{dup}'", node.start_mark
        )
    return _Located(mapping, lines, node.start_mark.line + 1)


class _Located(dict):  # type: ignore[type-arg]
    """A dict that knows where each of its keys stands: (file, line).

    The loader records bare line numbers; ``_stamp`` adds the file once it is known, so a
    recipe merged from several files (``extends:``) still points each error at its own file.
    """

    def __init__(self, data: dict[Any, Any], lines: dict[Any, Any], line: Any) -> None:
        super().__init__(data)
        self.lines = lines
        self.line = line


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _line_of(doc: Any, loc: tuple[Any, ...]) -> Any:
    """Where a pydantic error location stands, as deep as the document allows.

    A (file, line) pair for stamped documents, else a bare line number (or None).
    """
    line = getattr(doc, "line", None)
    node, parent, parent_key = doc, None, None
    for part in loc:
        if isinstance(node, _Located) and part in node:
            line = node.lines.get(part, line)
            parent, parent_key, node = node, part, node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            items = None
            if isinstance(parent, _Located):
                items = parent.lines.get((parent_key, "items"))
            if items:
                line = items[part]
            parent, parent_key, node = None, None, node[part]
        else:
            break
    return line


def _where(path: str, at: Any) -> str:
    """`file:line` for an error: the stamped file if there is one, else `path`."""
    if isinstance(at, tuple):
        path, at = at
    return f"{path}:{at}" if at else path


def _stamp(doc: Any, file: str) -> Any:
    """Turn every bare line number of a freshly read document into (file, line)."""
    if isinstance(doc, _Located):
        for key, value in list(doc.lines.items()):
            if isinstance(value, int):
                doc.lines[key] = (file, value)
            elif isinstance(value, list):
                doc.lines[key] = [(file, v) if isinstance(v, int) else v for v in value]
        if isinstance(doc.line, int):
            doc.line = (file, doc.line)
        for value in doc.values():
            _stamp(value, file)
    elif isinstance(doc, list):
        for value in doc:
            _stamp(value, file)
    return doc


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or str(part).startswith(
            ("function-", "tagged-union")
        ):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _first_error(path: str, doc: Any, exc: ValidationError,
                 overrides: list[str] | None = None) -> InputError:
    err = exc.errors()[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
    field = _format_loc(loc)
    at = _line_of(doc, loc)
    for key, set_at in _override_locs(doc, overrides or []):
        n = min(len(set_at), len(loc))
        if loc and set_at[:n] == loc[:n]:
            path = f"--set {key} (over {path})"
            at = None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key; remove it or check its spelling against docs/recipe-reference.md"
    elif err["type"] == "missing":
        msg = "required field is missing; add it"
    where = _where(path, at)
    more = len(exc.errors()) - 1
    suffix = f" (+{more} more)" if more else ""
    return InputError(f"{where}: {field}: {msg}{suffix}")


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(
            f"{path}: file not found; give a bundled name or an existing file"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read ({exc}); give a readable UTF-8 YAML file") from None
    try:
        doc = yaml.load(text, Loader=_LineLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{path}{line}: invalid YAML: {problem}; fix the syntax") from None
    if not isinstance(doc, dict):
        kind = type(doc).__name__
        raise InputError(f"{path}: the document must be a mapping of keys, not {kind}")
    return _stamp(doc, str(path))


def _plain(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _plain(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_plain(v) for v in doc]
    return doc


def resolve_recipe_path(spec: str | None) -> Path:
    """A bundled recipe name, or a path to a YAML file."""
    spec = spec or DEFAULT_RECIPE
    candidate = Path(spec)
    if candidate.suffix in (".yaml", ".yml") or "/" in spec or candidate.exists():
        return candidate
    bundled = BUNDLED_RECIPES / f"{spec}.yaml"
    if not bundled.exists():
        names = ", ".join(bundled_recipe_names())
        raise InputError(f"recipe '{spec}' is not bundled; use one of: {names}, or a file path")
    return bundled


def bundled_recipe_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_RECIPES.glob("*.yaml"))


# --- overrides (--set) ---------------------------------------------------------------------
#
# `--set KEY=VALUE` takes the spelling `status` prints for a changed input
# (pipeline._flatten: `recipe.sources[sglang].commit`, list items named by their `name`, else
# by index), plain dotted paths (`sources.0.commit`), and `[i]`/`[name]` selectors. The path
# is walked against the pydantic models, so a typo names the nearest fields, and the value
# is parsed as YAML (flow lists and mappings) unless the field holds a string.

_SEGMENT = re.compile(r"\[([^\]]*)\]|([^.\[\]]+)")


def _override_parts(key: str) -> list[str]:
    """`recipe.a[b].c.0` -> ['a', 'b', 'c', '0']; raises on a malformed path."""
    parts: list[str] = []
    pos = 0
    while pos < len(key):
        if parts and key[pos] == ".":
            pos += 1
        match = _SEGMENT.match(key, pos)
        if match is None or match.end() == pos:
            raise InputError(f"--set {key}: malformed key at '{key[pos:]}'; write dotted.key, "
                             "list items as [name] or [0], e.g. sources[sglang].commit")
        parts.append(match.group(1) if match.group(1) is not None else match.group(2))
        pos = match.end()
    if not parts:
        raise InputError(f"--set {key!r}: empty key; expected dotted.key=value")
    if parts[0] == "recipe" and len(parts) > 1:
        parts = parts[1:]  # status prefixes recipe fields with 'recipe.'
    return parts


def _unwrap(tp: Any) -> Any:
    """The type under Annotated[...] and Optional[...]."""
    import typing

    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
            continue
        args = typing.get_args(tp)
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
            rest = [a for a in args if a is not type(None)]
            if len(rest) == 1:
                tp = rest[0]
                continue
        return tp


def _model_field(model: type[BaseModel], key: str) -> tuple[str, Any] | None:
    """(key as written in YAML, its type) for a field of `model` named or aliased `key`."""
    for name, info in model.model_fields.items():
        if key in (name, info.alias):
            return info.alias or name, info.annotation
    return None


def _item_type(tp: Any) -> Any:
    import typing

    args = typing.get_args(tp)
    return args[0] if args else Any


def _is_text(tp: Any) -> bool:
    """A field that holds a string keeps the raw text ('1111...' is a commit, not an int)."""
    import typing

    tp = _unwrap(tp)
    if tp is str:
        return True
    return typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp))


def _nearest(word: str, choices: list[str]) -> str:
    import difflib

    near = difflib.get_close_matches(word, choices, n=3, cutoff=0.5)
    return f"did you mean {', '.join(near)}?" if near else f"valid: {', '.join(choices)}"


def _set_one(doc: dict[str, Any], key: str, raw: str) -> tuple[Any, ...]:
    """Set one override in `doc` (in place); returns the resolved location, as pydantic's."""
    import typing

    parts = _override_parts(key)
    if parts[0] == "series" and len(parts) > 1:
        raise InputError(f"--set {key}: patch entries live in the series file, not the recipe; "
                         "edit that file, or point --set series=<file> at another")
    node: Any = doc
    tp: Any = Recipe
    loc: list[Any] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = ".".join(str(p) for p in loc) or "the recipe"
        kind = _unwrap(tp)
        origin = typing.get_origin(kind)
        idx: Any
        if isinstance(node, list):
            names = [v.get("name") for v in node if isinstance(v, dict)]
            if part.isdigit():
                idx = int(part)
                if idx >= len(node):
                    raise InputError(f"--set {key}: '{part}' is not an index of {here} "
                                     f"({len(node)} items: 0..{len(node) - 1})")
            elif part in names:
                idx = names.index(part)
            else:
                known = [str(n) for n in names if n is not None]
                raise InputError(f"--set {key}: '{part}' is not an item of {here}; "
                                 + (_nearest(part, known) if known else "give an index"))
            sub = _item_type(kind) if origin in (list, tuple) else Any
        elif isinstance(node, dict):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found = _model_field(kind, part)
                if found is None:
                    fields = [info.alias or n for n, info in kind.model_fields.items()]
                    raise InputError(f"--set {key}: '{part}' is not a key of {here}; "
                                     f"{_nearest(part, fields)}")
                idx, sub = found
            else:
                # an open mapping (serve.env, host.tools, conversion.digests): any key
                args = typing.get_args(kind)
                key_tp, sub = (args[0], args[1]) if len(args) == 2 else (Any, Any)
                idx = int(part) if part.isdigit() and (key_tp is int or int(part) in node) else part
            if not last and idx not in node:
                inner = _unwrap(sub)
                is_map = typing.get_origin(inner) is dict or (
                    isinstance(inner, type) and issubclass(inner, BaseModel))
                if not is_map:
                    whole = ".".join([*map(str, loc), part])
                    what = "list" if typing.get_origin(inner) in (list, tuple) else "value"
                    raise InputError(f"--set {key}: {whole} is a {what}, not a mapping; "
                                     f"set it whole, e.g. --set '{whole}=...'")
                node[idx] = {}
        else:
            prev = ".".join(str(p) for p in loc)
            raise InputError(f"--set {key}: {prev} is a value, not a mapping or list; "
                             f"set it whole with --set {prev}=...")
        loc.append(idx)
        if last:
            if _is_text(sub):
                node[idx] = raw
            else:
                try:
                    node[idx] = yaml.safe_load(raw) if raw != "" else ""
                except yaml.YAMLError as exc:
                    problem = getattr(exc, "problem", None) or "invalid YAML"
                    raise InputError(f"--set {key}: value {raw!r} is not valid YAML ({problem}); "
                                     "quote it, e.g. --set 'serve.env={A: \"1\"}'") from None
        else:
            node, tp = node[idx], sub
    return tuple(loc)


def apply_overrides(doc: dict[str, Any], overrides: list[str], path: str) -> dict[str, Any]:
    """Apply `key=value` overrides (see the rules above) to a copy of `doc`."""
    doc = _plain(doc)
    for item in overrides:
        if "=" not in item:
            raise InputError(f"--set {item!r}: expected dotted.key=value, e.g. serve.port=8021")
        key, raw = item.split("=", 1)
        _set_one(doc, key.strip(), raw)
    return doc


def _override_locs(doc: Any, overrides: list[str]) -> list[tuple[str, tuple[Any, ...]]]:
    """Each override key with the location it resolves to in `doc` (for error messages)."""
    out = []
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        try:
            out.append((key, _set_one(_plain(doc), key, item.split("=", 1)[-1])))
        except InputError:
            continue
    return out


# --- inheritance ---------------------------------------------------------------------------
#
# A recipe may say `extends: <bundled name or file>` and state only what differs. Mappings
# merge key by key; a list whose items all carry a `name` (sources, build steps, probes) merges
# item by item on that name: a known name merges into its item, a new one is appended (or put
# where `insert_before:`/`insert_after:` says), `remove: true` drops it. Any other value,
# `null` included, replaces the base's. The merged document is validated as a whole, and each
# error names the file and line its offending key came from.

_EXTENDS_DEPTH = 8
_LIST_DIRECTIVES = ("remove", "insert_before", "insert_after")


def _named_items(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, dict) and isinstance(v.get("name"), str) for v in value
    )


def _merge_named(base: list[Any], base_at: list[Any], over: list[Any], over_at: list[Any],
                 where: str) -> tuple[list[Any], list[Any]]:
    items = list(zip(base, base_at, strict=False))
    for item, at in zip(over, over_at, strict=False):
        name = item["name"]
        here = _where(where, at)
        index = next((i for i, (b, _) in enumerate(items) if b["name"] == name), None)
        directives = {k: item[k] for k in _LIST_DIRECTIVES if k in item}
        body = _Located({k: v for k, v in item.items() if k not in _LIST_DIRECTIVES},
                        item.lines, item.line)
        if directives.get("remove"):
            if index is None:
                raise InputError(f"{here}: remove: '{name}' is not an item of the base recipe; "
                                 "check the name")
            del items[index]
            continue
        if index is not None:
            items[index] = (_merge(items[index][0], body, where), items[index][1])
            if not ({"insert_before", "insert_after"} & directives.keys()):
                continue
            body = items.pop(index)[0]
        anchor = directives.get("insert_before") or directives.get("insert_after")
        if anchor is None:
            items.append((body, at))
            continue
        pos = next((i for i, (b, _) in enumerate(items) if b["name"] == anchor), None)
        if pos is None:
            raise InputError(f"{here}: insert_before/insert_after: '{anchor}' is not an item "
                             "of the list; name an existing item")
        items.insert(pos if "insert_before" in directives else pos + 1, (body, at))
    return [i for i, _ in items], [a for _, a in items]


def _merge(base: Any, over: Any, where: str) -> Any:
    """`over` laid on `base` (see the rules above); both keep their (file, line) marks."""
    if not (isinstance(base, _Located) and isinstance(over, _Located)):
        return over
    out = _Located(dict(base), dict(base.lines), over.line)
    for key, value in over.items():
        out.lines[key] = over.lines.get(key)
        items = (key, "items")
        if key in base and _named_items(base[key]) and _named_items(value):
            merged, at = _merge_named(base[key], base.lines.get(items) or [],
                                      value, over.lines.get(items) or [], where)
            out[key], out.lines[items] = merged, at
        else:
            out[key] = _merge(base[key], value, where) if key in base else value
            if items in over.lines:
                out.lines[items] = over.lines[items]
            else:
                out.lines.pop(items, None)
    return out


def _base_path(spec: Any, child: Path, at: Any) -> Path:
    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"{_where(str(child), at)}: extends: expected a bundled recipe name "
                         "or a YAML file path")
    candidate = Path(spec)
    if candidate.suffix in (".yaml", ".yml") or "/" in spec:
        return candidate if candidate.is_absolute() else child.parent / candidate
    bundled = BUNDLED_RECIPES / f"{spec}.yaml"
    if not bundled.exists():
        names = ", ".join(bundled_recipe_names())
        raise InputError(f"{_where(str(child), at)}: extends: '{spec}' is not a bundled recipe; "
                         f"use one of: {names}, or a file path")
    return bundled


def _read_recipe(path: Path, seen: tuple[Path, ...] = ()) -> tuple[Any, list[Path]]:
    """The recipe document at `path` with its `extends:` chain merged in, and the chain."""
    doc = _read_yaml(path)
    spec = doc.get("series")
    is_path = isinstance(spec, str) and (spec.endswith((".yaml", ".yml")) or "/" in spec)
    if seen and is_path and not Path(spec).is_absolute():
        # a base's series path is relative to the base's file, not to the recipe extending it
        doc["series"] = str(path.parent / spec)
    if "extends" not in doc:
        return doc, [path]
    at = doc.lines.get("extends")
    base_path = _base_path(doc["extends"], path, at)
    if base_path.resolve() in seen or base_path.resolve() == path.resolve():
        raise InputError(f"{_where(str(path), at)}: extends: '{doc['extends']}' leads back to "
                         "itself; break the cycle")
    if len(seen) >= _EXTENDS_DEPTH:
        raise InputError(f"{_where(str(path), at)}: extends: more than {_EXTENDS_DEPTH} levels; "
                         "flatten the chain")
    if "name" not in doc:
        raise InputError(f"{_where(str(path), doc.line)}: name: a recipe that extends another "
                         "must name itself; add `name:`")
    base, chain = _read_recipe(base_path, (*seen, path.resolve()))
    del doc["extends"]
    doc.lines.pop("extends", None)
    return _merge(base, doc, str(path)), [path, *chain]


def load_recipe(spec: str | None = None, overrides: list[str] | None = None) -> Recipe:
    path = resolve_recipe_path(spec)
    located, chain = _read_recipe(path)
    doc = apply_overrides(located, overrides, str(path)) if overrides else located
    try:
        recipe = Recipe.model_validate(_plain(doc))
    except ValidationError as exc:
        raise _first_error(str(path), located, exc, overrides or []) from None
    object.__setattr__(recipe, "_path", path)
    object.__setattr__(recipe, "_chain", tuple(chain))
    return recipe


def recipe_chain(recipe: Recipe) -> tuple[Path, ...]:
    """The files a recipe was read from: its own first, then what it extends, in order."""
    return getattr(recipe, "_chain", ())


def recipe_path(recipe: Recipe) -> Path | None:
    return getattr(recipe, "_path", None)


def resolve_series_path(recipe: Recipe) -> Path:
    spec = recipe.series
    if spec.endswith((".yaml", ".yml")) or "/" in spec:
        base = recipe_path(recipe)
        path = Path(spec)
        return path if path.is_absolute() or base is None else base.parent / path
    return BUNDLED_SERIES / f"{spec}.yaml"


def load_series(path: Path, recipe: Recipe | None = None) -> Series:
    doc = _read_yaml(path)
    try:
        series = Series.model_validate(_plain(doc))
    except ValidationError as exc:
        raise _first_error(str(path), doc, exc) from None
    if recipe is not None:
        names = [s.name for s in recipe.sources]
        for i, patch in enumerate(series.patches):
            where = _where(str(path), _line_of(doc, ("patches", i)))
            for field, ref in (("target", patch.target), ("origin.source", patch.origin.source)):
                if ref is not None and ref not in names:
                    where = _where(str(path), _line_of(doc, ("patches", i, *field.split("."))))
                    raise InputError(
                        f"{where}: patches[{i}].{field}: '{ref}' is not a source of recipe "
                        f"'{recipe.name}'; use one of {names}"
                    )
            if patch.origin.file is not None:
                own = (path.parent / patch.origin.file).resolve()
                if not own.is_relative_to(path.parent.resolve()):
                    raise InputError(f"{where}: patches[{i}].origin.file escapes the series dir")
    object.__setattr__(series, "_path", path)
    return series


def series_path(series: Series) -> Path | None:
    return getattr(series, "_path", None)


def load_recipe_and_series(
    spec: str | None = None, overrides: list[str] | None = None
) -> tuple[Recipe, Series]:
    recipe = load_recipe(spec, overrides)
    return recipe, load_series(resolve_series_path(recipe), recipe)


def looks_like_series(path: str) -> bool:
    """Whether a YAML file is a patch series (it has `patches:`) rather than a recipe."""
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(doc, dict) and "patches" in doc and "sources" not in doc
