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

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.registry import STAGE_NAMES

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
BUNDLED_RECIPES = DATA_DIR / "recipes"
BUNDLED_SERIES = DATA_DIR / "patches"
DEFAULT_RECIPE = "dsv4-flash-910b"

_HEX40 = re.compile(r"^[0-9a-f]{40}$")
_HEX_PREFIX = re.compile(r"^[0-9a-f]{7,39}$")
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


def _commit_prefix(value: str) -> str:
    if not isinstance(value, str) or not _HEX_PREFIX.match(value):
        raise ValueError("must be 7 to 39 lowercase hex digits (a full SHA goes in 'commit')")
    return value


CommitPrefix = Annotated[str, AfterValidator(_commit_prefix)]


class Source(Strict):
    """A git repository pinned at a full commit and where it goes in the workspace.

    A source the upstream pins only by an abbreviated SHA says so with ``commit_prefix`` and
    ``branch``: ``fetch`` resolves it once on that branch and locks the full SHA.
    """

    name: Name = Field(description="unique plain name; patches name it as their `target`")
    url: GitUrl = Field(description="git URL of the upstream repository")
    mirrors: list[GitUrl] = Field(
        [],
        description="more git URLs, tried in order after any `--mirror NAME=URL`")
    commit: Commit | None = Field(
        None,
        description="the full 40-hex commit; a tag or short SHA is refused (`b3173` is "
        "both); leave it out only for a `commit_prefix` pin")
    commit_prefix: CommitPrefix | None = Field(
        None, description="an abbreviated SHA, resolved once on 'branch' and then locked")
    branch: str | None = Field(None, description="the branch a commit_prefix is resolved on")
    ref: str | None = Field(None, description="human-readable tag or branch; never used alone")
    path: RelPath = Field(description="checkout path, relative to the workspace")
    submodule_of: Name | None = Field(
        None, description="taken as this source's submodule, at the commit above"
    )
    patched: bool = Field(True, description="whether the series may target it")
    license: str | None = Field(None, description="its license, for provenance")

    @model_validator(mode="after")
    def _one_pin(self) -> Source:
        if (self.commit is None) == (self.commit_prefix is None):
            raise ValueError(f"source '{self.name}': give either 'commit' (a full 40-hex SHA) or "
                             "'commit_prefix' + 'branch' (an abbreviated SHA the upstream "
                             "publishes), not both or neither")
        if self.commit_prefix is not None and not self.branch:
            raise ValueError(f"source '{self.name}': commit_prefix needs 'branch', the branch "
                             "it is resolved on (e.g. master)")
        return self

    @property
    def pinned(self) -> str:
        """The full commit; a prefix-pinned one once ``fetch`` resolved and locked it."""
        if self.commit is not None:
            return self.commit
        locked: str | None = getattr(self, "_locked_commit", None)
        if locked is None:
            raise InputError(f"source '{self.name}' is pinned by the prefix "
                             f"{self.commit_prefix} on {self.branch}: run `dsv4-offload fetch` "
                             "to resolve and lock it")
        return locked

    def lock(self, commit: str) -> None:
        """Record the full SHA a commit_prefix resolved to (not a field: the fingerprint of
        the recipe stays the prefix; the full SHA reaches later stages through fetch's outputs)."""
        if self.commit_prefix is None or not commit.startswith(self.commit_prefix):
            raise InputError(f"source '{self.name}': {commit} does not match its "
                             f"commit_prefix {self.commit_prefix}")
        object.__setattr__(self, "_locked_commit", commit)


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
        description="where the patch comes from: `{source, path}` or `{file}`")
    sha256: Sha256 = Field(
        description="sha256 of the patch file, checked before any repository is touched")
    strip: int = Field(1, ge=0, le=5, description="leading path components to strip (`patch -p`)")
    # unidiff-zero: a diff of pure additions without context lines (`@@ -N,0 +M,K @@`), our
    # own patches' form, so they hold only lines we wrote; `git apply --unidiff-zero`
    method: Literal["plain", "mbox", "unidiff-zero"] = Field(
        description="`plain` diff, `mbox` (applied with `git am`), or `unidiff-zero`: "
        "this project's own zero-context diff of pure additions (`git apply --unidiff-zero`)")
    upstream: Literal["not-submitted", "submitted", "merged", "local"] = Field(
        "not-submitted",
        description="its state upstream")
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


class StepCheck(Strict):
    """A command that must succeed before or after a step; a failure names it and its fix."""

    name: Name = Field(description="named in the log and in a failure")
    run: list[str] = Field(min_length=1, description="argv; placeholders as in command")
    when: Literal["before", "after"] = Field("before", description="before or after the command")
    cwd: Literal["workdir", "neutral"] = Field(
        "workdir", description="'neutral': an empty directory and no PYTHONPATH, so no source "
        "tree shadows an installed package")
    fix: str = Field(min_length=1, description="what to do when it fails")
    why: str = Field("", description="where the upstream says so (file:line)")


class FileEdit(Strict):
    """A workaround edit of a fetched file: ``append`` to the first line matching ``line``."""

    file: RelPath = Field(description="relative to the step's workdir")
    line: str = Field(min_length=1, description="regular expression of the line to extend")
    append: str = Field(min_length=1, description="text added at the end of that line")
    unless: str = Field(min_length=1, description="already applied when the file contains it")
    why: str = Field("", description="where the upstream applies it (file:line)")


class RunPackage(Strict):
    """A CANN ``.run`` package the step's command produced, installed after it."""

    glob: str = Field(min_length=1, description="relative to the workdir; the first match")
    args: list[str] = Field([], description="arguments of the .run package")


class BuildStep(Strict):
    name: Name = Field(description="unique plain name (`dsv4-offload build NAME`)")
    workdir: RelPath | None = Field(None, description="relative to the workspace (default: it)")
    command: list[str] = Field([], description="argv; empty for a step of checks only")
    env: dict[str, str] = Field({}, description="environment added for the step")
    expect_markers: list[str] = Field([], description="log lines that must appear")
    forbid_markers: list[str] = Field([], description="log lines that must not appear")
    log_sources: list[Name] | None = Field(
        None, description="sources whose code prints this step's markers (`patch audit`); "
        "default: the source holding workdir and those nested in it; [] = the command itself "
        "(pip, cmake) prints them: not audited")
    check_import: str | None = Field(None, description="python module that must import after")
    optional: bool = Field(False, description="a failure warns instead of failing the build")
    description: str = Field("", description="a sentence for humans")
    umask: str | None = Field(None, pattern=r"^0?[0-7]{3}$",
                              description="the umask the command runs with, e.g. 0022")
    chmod_go_w: bool = Field(False, description="`chmod -R go-w` the workdir first, checked")
    source_env: list[str] = Field(
        [], description="scripts sourced (nounset off) before the command and the checks")
    edits: list[FileEdit] = Field(
        [], description="workaround edits of fetched files, applied (once) before the command")
    remove_first: list[RelPath] = Field(
        [], description="leftovers of an earlier build removed before the command (relative "
        "to the workdir; their parent made writable first, as read-only installs leave it)")
    install_run: RunPackage | None = Field(
        None, description="a CANN .run package the command produced, installed after it")
    require_installed: list[str] = Field(
        [], description="distributions whose installed version must match build.constraints")
    checks: list[StepCheck] = Field(
        [], description="commands that must succeed before or after the step")

    @model_validator(mode="after")
    def _something_to_do(self) -> BuildStep:
        if not (self.command or self.checks or self.require_installed):
            raise ValueError(f"step '{self.name}': give a command, checks or require_installed")
        if (self.install_run or self.expect_markers) and not self.command:
            raise ValueError(f"step '{self.name}': install_run and expect_markers need a command")
        return self


class Build(Strict):
    python: str = Field(
        "python3.11",
        description="the interpreter the extensions are built with and bind to")
    vars: dict[Name, str] = Field(
        {}, description="{name} placeholders of steps; ~ and $VAR are expanded")
    files: dict[Name, RemoteFile] = Field(
        {}, description="files of pinned sources, checked by sha256 before any step: {file:NAME}")
    constraints: Name | None = Field(
        None, description="a build.files entry passed as pip constraints to every step")
    steps: list[BuildStep] = Field(min_length=1, description="build steps, in order")

    @model_validator(mode="after")
    def _unique(self) -> Build:
        _no_duplicates([s.name for s in self.steps], "steps", "name")
        if self.constraints is not None and self.constraints not in self.files:
            raise ValueError(f"constraints '{self.constraints}' is not a build.files name")
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
    api_key_file: str | None = Field(
        None, description="file holding sglang's --api-key (the key itself is never stored); "
        "--api-key-file overrides it")
    port: int = Field(8020, gt=0, lt=65536, description="port the server listens on (`--port`)")
    device_type: str = Field("npu", description="sglang `--device`")
    attention_backend: str = Field("ascend", description="sglang `--attention-backend`")
    quantization: str = Field(
        "compressed-tensors",
        description="sglang `--quantization` of the NPU weights")
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
        description="fraction of HBM for weights and KV cache (`--mem-fraction-static`)")
    mem_fraction_floor: float = Field(
        0.81, gt=0, lt=1, description="lowest usable fraction: below it the KV pool holds less "
        "than the context length (guide appendix G.1)")
    mem_fraction_ladder: list[float] = Field(
        [0.85, 0.83, 0.82, 0.81], description="fractions an HBM retry steps down through, to the "
        "floor, before it lowers the resident experts (guide appendix G.1)")
    kt_num_gpu_experts: int = Field(
        32, ge=0,
        description="routed experts kept resident on the NPU (about 1 GB of HBM each)")
    kt_num_gpu_experts_max: int = Field(
        40, ge=0, description="measured ceiling at context 65536 (launcher L299-300)")
    gpu_experts_ladder: list[int] = Field(
        [32, 24, 16],
        description="fewer resident experts to retry with when KV-cache setup fails")
    cpuinfer_default: int = Field(
        32, gt=0, description="CPU-infer threads on a single-NUMA host (launcher L126)")
    threads_per_numa: int = Field(16, gt=0, description="CPU-infer threads per NUMA node")
    chunked_prefill_size: int = Field(
        8192, gt=0,
        description="a positive multiple of `page_size`, at least `longest_prompt_tokens`")
    longest_prompt_tokens: int = Field(
        2577, gt=0,
        description="the longest prompt expected; one prefill chunk must cover it")
    context_length: int = Field(
        65536, gt=0,
        description="maximum context in tokens (`--context-length`)")
    max_prefill_tokens: int = Field(65535, gt=0, description="`--max-prefill-tokens`")
    watchdog_timeout: int = Field(
        18000, gt=0,
        description="seconds before sglang's watchdog kills a stuck step (`--watchdog-timeout`)")
    max_running_requests: int = Field(
        1, gt=0,
        description="concurrent requests (`--max-running-requests`)")
    extra_args: list[str] = Field([], description="more server arguments, appended as given")
    env: dict[str, str] = Field({}, description="environment set for the server")
    unset_env: list[str] = Field([], description="variables removed from the server's environment")
    cann_set_env: list[str] = Field(
        [],
        description="CANN `set_env.sh` scripts whose environment is captured once and applied")
    nsa_compressor_mode: Literal["auto", "split", "single"] = Field(
        "auto",
        description="`auto`: `split` on CANN 8.5, `single` on CANN >= 9")
    readiness_timeout_s: float = Field(
        900, gt=0,
        description="seconds to wait for the health paths to answer")
    stop_timeout_s: float = Field(
        30, gt=0,
        description="seconds between SIGTERM and SIGKILL on stop")

    @model_validator(mode="after")
    def _prefill_rules(self) -> Serve:
        if self.kt_num_gpu_experts > self.kt_num_gpu_experts_max:
            raise ValueError(
                f"kt_num_gpu_experts {self.kt_num_gpu_experts} is above the measured ceiling "
                f"kt_num_gpu_experts_max {self.kt_num_gpu_experts_max} (launcher L299-300: about "
                "1 GB of HBM each); use 40 or fewer"
            )
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
    """The guide's "garbled, all repeated characters or NaN" (§8, G345) as thresholds."""

    max_char_run: int = Field(
        12, gt=1,
        description="longest run of one repeated character allowed in an answer")
    max_token_run: int = Field(6, gt=1, description="one token repeated more times fails")
    max_loop_repeats: float = Field(
        4, gt=1, description="a loop of 2 to min_sentence_period-1 tokens repeated more fails")
    min_sentence_period: int = Field(
        8, gt=2, description="a cycle this long or longer is a repeated sentence: it passes "
        "with a note (greedy decoding does this)")
    max_scripts: int = Field(3, gt=0, description="more writing systems mixed is token soup "
                             "(a Chinese answer may quote a Latin and a Cyrillic name)")
    min_script_share: float = Field(
        0.05, gt=0, lt=1, description="a writing system counts only above this share of letters")
    max_symbol_share: float = Field(
        0.3, gt=0, lt=1, description="more symbols than this share of the text is garbage")


class LogMarker(Strict):
    """A server log line to look for; a plain string in the recipe is its pattern."""

    pattern: str = Field(min_length=1, description="a Python regular expression")
    name: str = Field("", description="a short name shown in the report")
    when_env: dict[str, str] = Field(
        {}, description="checked only when the server's environment has these values")
    fix: str = Field("", description="what to do when the check fails")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"pattern": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _compiles(self) -> LogMarker:
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"pattern {self.pattern!r} is not a regular expression ({exc})"
                             ) from None
        return self

    @property
    def label(self) -> str:
        return repr(self.name or self.pattern)


class Throughput(Strict):
    """decode_throughput_test.sh's method: buckets, warm-up per bucket, new tokens, repeats."""

    prompt_buckets: list[int] = Field(
        [130, 1000, 8000, 16000, 32000], min_length=1,
        description="prompt lengths in tokens to measure decode speed at")
    new_tokens: int = Field(1000, gt=0, description="tokens generated per measurement")
    repeats: int = Field(3, gt=0, description="measurements per bucket (the median counts)")
    warmup: int = Field(1, ge=0, description="full generations discarded before each bucket")
    quick_new_tokens: int = Field(64, gt=0, description="accept --quick: tokens per request")
    reference_tok_s: float = Field(gt=0, description="the delivery's decode speed, tokens/s")
    reference_range: tuple[float, float] = Field(description="[low, high] tokens/s accepted")


class Acceptance(Strict):
    api: Literal["native", "openai"] = Field(
        "native",
        description="`native` sglang `/generate` or `openai` `/v1/completions`")
    request_timeout_s: float = Field(300, gt=0, description="seconds per request")
    probes: list[Probe] = Field(
        min_length=1,
        description="prompts whose answers must contain an expected string")
    determinism_probe: Name = Field(
        description="the probe sent twice at temperature 0; both answers must match")
    degeneration: Degeneration = Field(
        Degeneration(),
        description="thresholds that flag repetitive output")
    log_markers_required: list[LogMarker] = Field(
        [],
        description="lines the server log must show, read after all of accept's traffic: a "
        "regular expression, or {name, pattern, when_env, fix}")
    log_markers_forbidden: list[LogMarker] = Field(
        [],
        description="lines the server log must never show (same forms as the required ones)")
    throughput: Throughput = Field(description="decode-speed measurement and its reference")
    gpqa_reference_pct: float | None = Field(
        None,
        description="the delivery's GPQA score, for comparison")

    @model_validator(mode="after")
    def _refs(self) -> Acceptance:
        _no_duplicates([p.name for p in self.probes], "probes", "name")
        if self.determinism_probe not in {p.name for p in self.probes}:
            raise ValueError(f"determinism_probe '{self.determinism_probe}' is not a probe name")
        return self


# --- selftest ------------------------------------------------------------------------------


class SelftestEmulator(Strict):
    """Run the self-test's child under a user-mode emulator (an aarch64 build on x86)."""

    command: str = Field("qemu-aarch64", description="the user-mode emulator")
    cpu: str = Field("cortex-a76", description="qemu -cpu model (cortex-a76: Kunpeng-920 class)")
    sysroot: RelPath = Field(description="the guest's root (qemu -L), relative to the workspace")
    python: RelPath = Field(description="the guest python, inside the sysroot")
    pythonpath: list[str] = Field(
        [], description="extra PYTHONPATH entries (numpy...), relative to the workspace unless "
        "absolute; kt-kernel's python dir comes first by itself")


class Selftest(Strict):
    """A tiny synthetic MXFP4 MoE layer through kt-kernel against a numpy reference."""

    experts: int = Field(8, gt=0, description="routed experts of the synthetic layer")
    hidden: int = Field(256, gt=0, description="hidden size")
    intermediate: int = Field(256, gt=0, description="MoE intermediate size (a multiple of 256)")
    top_k: int = Field(2, gt=0, description="experts per token")
    tokens: list[int] = Field([4, 16], min_length=1, description="one forward per entry")
    min_cosine: float = Field(0.9995, gt=0, le=1, description="cosine against numpy, per run")
    max_rel_l2: float = Field(0.03, gt=0, description="activations go through Q8_0: ~1-1.5 %")
    timeout_s: float = Field(120, gt=0, description="per forward, import and load included")
    threads: int = Field(1, gt=0, description="kt-kernel worker threads")
    seed: int = Field(0, ge=0, description="seed of the synthetic weights and tokens")
    api: Literal["auto", "low-level", "wrapper"] = Field(
        "auto", description="auto: KTMoEWrapper where torch_npu imports, else the low-level API")
    emulator: SelftestEmulator | None = Field(
        None, description="run the child under qemu (an aarch64 build on an x86 machine)")
    module_dir: RelPath | None = Field(
        None, description="where kt_kernel_ext*.so is, relative to the workspace (default: "
        "the kt-kernel build step's workdir + /python, where an in-place build puts it)")

    @model_validator(mode="after")
    def _shapes(self) -> Selftest:
        # kt-kernel: MXFP4 blocks of 32 along K, m_block 32 task split (utils/llamafile.py)
        for label, value in (("hidden", self.hidden), ("intermediate", self.intermediate)):
            if value % 32:
                raise ValueError(f"{label} {value} must be a multiple of 32 (MXFP4 block and "
                                 "kt-kernel's m_block)")
        if self.top_k > self.experts:
            raise ValueError(f"top_k {self.top_k} must be <= experts {self.experts}")
        if any(t <= 0 for t in self.tokens):
            raise ValueError("tokens must be positive counts, e.g. [4, 16]")
        return self


# --- host ----------------------------------------------------------------------------------


class Host(Strict):
    arch: str = Field("aarch64", description="CPU architecture (`uname -m`)")
    cpu_flags_required: list[str] = Field(
        ["asimd", "asimddp"],
        description="CPU flags that must be present (/proc/cpuinfo)")
    cpu_flags_build_off: list[str] = Field(
        ["sve", "bf16", "i8mm"],
        description="flags the builds must keep off even when the CPU has them")
    min_cores: int = Field(32, gt=0, description="minimum CPU cores")
    memory_min_gib: float = Field(160, gt=0, description="RAM below which doctor fails")
    memory_recommended_gib: float = Field(256, gt=0, description="RAM below which doctor warns")
    disk_min_gib: float = Field(
        415, gt=0,
        description="free disk in the workspace below which doctor fails")
    disk_recommended_gib: float = Field(600, gt=0, description="free disk below which doctor warns")
    npu_models: list[str] = Field(
        description="NPU models the recipe serves on; [] for a recipe without an NPU (its "
        "doctor then checks no NPU, device node or CANN)")
    hbm_min_gib: float = Field(32, gt=0, description="minimum HBM per NPU")
    npu_device_nodes: list[str] = Field(
        [],
        description="device files that must exist (e.g. /dev/davinci0)")
    cann_min_version: str = Field("8.5.0", description="minimum CANN toolkit version")
    python: str = Field("3.11", description="required Python version (major.minor)")
    tools: dict[str, str] = Field({}, description="tool -> minimum version")
    libraries: list[str] = Field(
        ["hwloc", "numa"],
        description="development libraries the builds need (headers or .so)")
    pkg_config: list[str] = Field([], description="modules `pkg-config --exists` must find")
    python_modules: list[str] = Field([], description="modules the build python must import")
    docker: Literal["required", "recommended", "unused"] = Field(
        "recommended",
        description="whether a container runtime is needed")


# --- recipe --------------------------------------------------------------------------------


class Runtime(Strict):
    """Where the NPU-side stages run: on this host, or in a container of ``image``.

    The container defaults are the delivery's ``scripts/launch_dsv4_singleCard_cann8.5.0_910b.sh``
    (cann-recipes-infer @ 1a7fbd3); each field names its line there.
    """

    kind: Literal["host", "container"] = Field(
        "host", description="container: those stages run in `image` (dsv4-offload container)")
    image: str | None = Field(None, description="launch script line 21 (IMAGE)")
    name: Name = Field("dsv4_singlecard", description="line 22 (NAME)")
    shm_size: str = Field("16g", pattern=r"^\d+[bkmg]?$", description="line 26 (SHM_SIZE)")
    devices: str = Field(
        "auto", pattern=r"^(auto|\d+(,\d+)*)$",
        description="line 27 (NPU_VISIBLE_DEVICES): auto = every /dev/davinciN, or '0,3'")
    mounts: list[str] = Field(
        ["/usr/local/sbin:/usr/local/sbin", "/usr/local/dcmi:/usr/local/dcmi",
         "/usr/local/bin/npu-smi:/usr/local/bin/npu-smi",
         "/usr/local/Ascend/driver/:/usr/local/Ascend/driver/",
         "/usr/local/Ascend/firmware:/usr/local/Ascend/firmware",
         "/etc/ascend_install.info:/etc/ascend_install.info",
         "/var/queue_schedule:/var/queue_schedule"],
        description="lines 46-52: driver, firmware, npu-smi, dcmi, sbin (HOST:CONTAINER)")
    packages: list[str] = Field(
        ["libhwloc-dev", "libhwloc15", "pkg-config"],
        description="apt packages the image lacks (guide G105-108: lost when recreated)")
    python: str = Field("python3.11", description="the image's python, runs this tool inside")
    tool_dir: str = Field("/opt/dsv4-offload", description="where the tool's wheel goes inside")
    stages: list[str] = Field(
        ["build", "selftest", "serve", "accept"],
        description="stages `run` sends into the container; the others stay on the host")

    @model_validator(mode="after")
    def _image(self) -> Runtime:
        if self.kind == "container" and not self.image:
            raise ValueError("runtime.kind 'container' needs runtime.image, e.g. "
                             "lmsysorg/sglang:deepseek-v4-npu-910b")
        for mount in self.mounts:
            host, sep, inside = mount.partition(":")
            if not sep or not host.startswith("/") or not inside.startswith("/"):
                raise ValueError(f"runtime.mounts: '{mount}' must be /host/path:/container/path")
        return self


class Platform(Strict):
    npu: str = Field(description="NPU family (910B, A3)")
    cann: str = Field(description="CANN version the recipe was made for")
    image: str | None = Field(None, description="container image of the delivery, if any")
    environment: str = Field("", description="the environment the guide brings up, in words")
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
        min_length=1,
        description="git repositories pinned at full commits")
    build: Build = Field(description="what `build` compiles")
    weights: Weights = Field(description="the two weight sets `download` fetches")
    conversion: Conversion = Field(description="GGUF conversion of the routed experts")
    serve: Serve = Field(
        description="server flags, environment and the rules that derive values from the host")
    acceptance: Acceptance = Field(description="what `accept` checks")
    host: Host = Field(description="what `doctor` requires of the host")
    selftest: Selftest = Field(
        Selftest(), description="what `selftest` sends through the built kt-kernel")
    series_targets: list[Name] = Field(
        [], description="apply only the series' patches for these sources ([]: all of them); "
        "a recipe without sglang can still take the delivery's whole series")
    not_applicable: list[str] = Field(
        [], description="pipeline stages that make no sense for this recipe (e.g. an x86 "
        "development recipe ends at selftest): `run` passes them, running them says why")
    runtime: Runtime = Field(
        Runtime(), description="where build, selftest, serve and accept run: host or container")

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
        missing = [t for t in self.series_targets if t not in names]
        if missing:
            raise ValueError(f"series_targets: '{missing[0]}' is not a source name; use one "
                             f"of {names}")
        unknown = [n for n in self.not_applicable if n not in STAGE_NAMES]
        if unknown:
            raise ValueError(f"not_applicable: '{unknown[0]}' is not a stage; stages are "
                             f"{', '.join(STAGE_NAMES)}")
        for step in self.build.steps:
            for name in step.log_sources or []:
                if name not in names:
                    raise ValueError(f"build step '{step.name}': log_sources '{name}' is not a "
                                     f"source name; use one of {names}")
        for key, remote in self.build.files.items():
            if remote.source not in names:
                raise ValueError(f"build.files.{key}.source '{remote.source}' is not a source")
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
    # the `--set` items, so a stage run elsewhere (the container) sees the same recipe
    object.__setattr__(recipe, "_overrides", list(overrides or []))
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
        wanted = recipe.series_targets
        for i, patch in enumerate(series.patches):
            if wanted and patch.target not in wanted:
                continue  # a target this recipe does not build (checked below as a whole)
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
        if wanted:
            kept = [p for p in series.patches if p.target in wanted]
            if not kept:
                raise InputError(f"{path}: no patch of series '{series.name}' targets "
                                 f"{wanted} (recipe '{recipe.name}' series_targets); check both")
            series = series.model_copy(update={"patches": kept})
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
