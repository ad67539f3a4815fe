"""The sections of a recipe and the patch series: sources, series, builds, weights,
conversion, serving, selftest and host requirements (acceptance: accept_section.py)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from dsv4_offload.core.errors import InputError
from dsv4_offload.recipe.fields import (
    HEX40,
    HEX_PREFIX,
    Commit,
    GitUrl,
    Name,
    RelPath,
    Sha256,
    Strict,
    no_duplicates,
)

# --- sources -------------------------------------------------------------------------------


def _commit_prefix(value: str) -> str:
    if not isinstance(value, str) or not HEX_PREFIX.match(value):
        raise ValueError("must be 7 to 39 lowercase hex digits (a full SHA goes in 'commit')")
    return value


CommitPrefix = Annotated[str, AfterValidator(_commit_prefix)]

# the hot-tail window, a variable of the server's env, read by the delivery's sglang patch
# (cann-recipes-infer @ 1a7fbd3, integration/sglang/dsv4-flash-single-npu-moe-offload/sglang/
# 0003-sglang-streaming-prefill-depool.patch line 42: int(os.environ.get(NAME, "0") or "0"));
# unset, empty and 0 are all "off", whole-prompt selection (its lines 32 and 933: only N > 0
# restricts to the last N prompt tokens)
HOT_TAIL_ENV = "KT_HOT_TAIL_TOKENS"


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

    # the full SHA a commit_prefix resolved to, from the workspace's lock (recipe.sourcelock)
    _locked_commit: str | None = PrivateAttr(None)

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
        locked = self._locked_commit
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
        self._locked_commit = commit


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
    risk: str = Field(
        "", description="what serving without it risks: a patch of our own that a recipe may "
        "leave out (`series_skip`) says so here, and every command that loads such a recipe "
        "warns with it")


class Series(Strict):
    schema_version: Literal[1] = Field(1, alias="schema", description="always `1`")
    name: Name = Field(description="plain name of the series")
    description: str = Field("", description="a sentence")
    patches: list[PatchEntry] = Field(
        min_length=1, description="the patches, in the order they apply"
    )

    # the file it was read from (set by recipe.load; patches of our own resolve against it)
    _file: Path | None = PrivateAttr(None)
    # the patches of the file that the recipe leaves out (its `series_skip`), set by recipe.load
    _skipped: tuple[PatchEntry, ...] = PrivateAttr(())

    @model_validator(mode="after")
    def _unique_names(self) -> Series:
        no_duplicates([p.name for p in self.patches], "patches", "name")
        return self

    @property
    def file(self) -> Path | None:
        return self._file

    @property
    def skipped(self) -> tuple[PatchEntry, ...]:
        """Patches of the series file that the recipe's ``series_skip`` leaves out."""
        return self._skipped

    def holds(self, name: str) -> bool:
        """Whether the patch ``name`` is applied (in the series and not left out)."""
        return any(p.name == name for p in self.patches)

    def skip_warnings(self) -> list[str]:
        """One line per patch left out, saying what serving without it risks."""
        return [f"series {self.name}: patch '{p.name}' is left out (recipe series_skip): "
                f"{p.risk}" for p in self._skipped]

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

    glob: str = Field(min_length=1, description="relative to the workdir; exactly one match "
                      "written by the step (older ones are ignored)")
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
    umask: str | None = Field(
        None, pattern=r"^0?[0-7]{3}$",
        description="the umask the command runs with, e.g. 0022; afterwards no file it made "
        "may be group- or world-writable")
    chmod_go_w: bool = Field(False, description="`chmod -R go-w` the workdir first, checked")
    context: Literal["plain", "cann"] = Field(
        "plain",
        description="the shell the step runs in: `plain` = the environment `build` runs in; "
        "`cann` = that environment with the CANN home's set_env.sh sourced first (nounset "
        "off) and ASCEND_HOME_PATH and ASCEND_TOOLKIT_HOME set to the CANN home, which is "
        "$CANN_HOME when exported, else `build.vars.cann_home` (a `--set` of it wins over both); "
        "the step's env and source_env come after")
    source_env: list[str] = Field(
        [], description="more scripts sourced (nounset off) before the command and the checks, "
        "after the context's")
    required_when_env: dict[str, str] = Field(
        {}, description="serve.env values (one exported where `build` runs wins, as the "
        "launcher lets it) under which an `optional` step is required: it then fails the build "
        "like any other, and its compiler and CANN headers are checked before the first step")
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


TOOL_PYTHON = "{tool_python}"  # build.python: the interpreter running this tool (its venv)


class Build(Strict):
    python: str = Field(
        "python3.11",
        description="the interpreter the extensions are built with and bind to; "
        "`{tool_python}`: the one running this tool (its own venv, e.g. for a rehearsal)")
    vars: dict[Name, str] = Field(
        {}, description="{name} placeholders of steps; ~ and $VAR are expanded")
    files: dict[Name, RemoteFile] = Field(
        {}, description="files of pinned sources, checked by sha256 before any step: {file:NAME}")
    constraints: Name | None = Field(
        None, description="a build.files entry passed as pip constraints to every step")
    umask: str | None = Field(
        None, pattern=r"^0?[0-7]{3}$",
        description="the umask of the whole build run (every step, command and check), set "
        "once before the first step and restored after the last; a step's own `umask` is "
        "then also checked on the files its command made")
    steps: list[BuildStep] = Field(min_length=1, description="build steps, in order")

    @model_validator(mode="after")
    def _unique(self) -> Build:
        no_duplicates([s.name for s in self.steps], "steps", "name")
        if self.constraints is not None and self.constraints not in self.files:
            raise ValueError(f"constraints '{self.constraints}' is not a build.files name")
        cann = [s.name for s in self.steps if s.context == "cann"]
        if cann and "cann_home" not in self.vars:
            raise ValueError(f"step '{cann[0]}' runs in the cann context, which needs "
                             "build.vars.cann_home (the CANN home whose set_env.sh it sources)")
        return self

    @property
    def interpreter(self) -> str:
        """``python`` with ``{tool_python}`` made the interpreter running this tool."""
        import sys

        return sys.executable if self.python == TOOL_PYTHON else self.python


# --- weights -------------------------------------------------------------------------------


class WeightSet(Strict):
    hub: Literal["huggingface", "modelscope"] = Field(description="where the weights are published")
    repo_id: str = Field(pattern=r"^[\w.-]+/[\w.-]+$", description="`owner/name` on that hub")
    revision: str = Field(
        "main", description="a full 40-hex commit, or a branch or tag (which moves: give it "
        "`not_after`)")
    not_after: dt.date | None = Field(
        None, description="with a branch or tag: take the newest commit of its history at or "
        "before this day (UTC, inclusive), so every host resolves the same commit; the bundled "
        "recipes give the delivery's date, 2026-08-06 (cann-recipes-infer 1a7fbd34); unused when "
        "revision is a full commit, its own pin")
    allow_patterns: list[str] = Field(
        [], description="glob patterns of the files to download (default all)"
    )
    dir: RelPath = Field(description="download directory, relative to the workspace")
    expected_bytes: int = Field(gt=0, description="approximate total size, for disk planning")
    role: str = Field("", description="what the set is used for, for humans")

    @property
    def is_commit(self) -> bool:
        """Whether ``revision`` is a full commit (it then resolves to itself everywhere)."""
        return bool(HEX40.match(self.revision))


class Weights(Strict):
    w8a8: WeightSet = Field(
        description="the W8A8 checkpoint served on the NPU (attention, shared expert, router)"
    )
    mxfp4: WeightSet = Field(
        description="the MXFP4 checkpoint whose routed experts are converted to GGUF for the CPU"
    )
    streams: int = Field(
        1, ge=1, le=16,
        description="files `download` fetches at once (`--streams` overrides it); one by "
        "default: the link is the limit, and files then arrive in the order the converter "
        "needs them (MXFP4 first, its shards in layer order, W8A8 last)")

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
    kt_threadpool_count: int | None = Field(
        None, gt=0, description="kt-kernel subpools (`--kt-threadpool-count`); null: one per NUMA "
        "node (launcher L127-131); an exported KT_THREADPOOL_COUNT wins")
    kt_cpuinfer: int | None = Field(
        None, gt=0, description="CPU-infer threads (`--kt-cpuinfer`); null: derived from the "
        "pools and the cores (launcher L123-126); an exported KT_CPUINFER wins")
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
        hot_tail = self.env.get(HOT_TAIL_ENV)
        # read as int(value or "0") at the server's import: anything else stops it there
        if hot_tail is not None and hot_tail.strip() and not hot_tail.strip().isdigit():
            raise ValueError(
                f"env.{HOT_TAIL_ENV} {hot_tail!r} is not a whole number of tokens (the "
                "server reads it with int() and stops); use 0 (off) or e.g. 64")
        return self


class Tune(Strict):
    """What `dsv4-offload tune` searches: each knob's values, limited by the serve rules."""

    experts: list[int] = Field(
        [16, 24, 32, 40], min_length=1,
        description="resident experts to try (serve.kt_num_gpu_experts); above "
        "serve.kt_num_gpu_experts_max never started")
    mem_fraction: list[float] = Field(
        [0.81, 0.82, 0.83, 0.85], min_length=1,
        description="--mem-fraction-static values to try (serve.mem_fraction_static); the "
        "MEM_FRACTION rule (guide appendix G.1) prunes what it forbids")
    threadpools: list[int] = Field(
        [], description="kt-kernel subpools to try (serve.kt_threadpool_count); []: 1, the "
        "host's NUMA nodes and the powers of two between; above the NUMA nodes never started")
    cpuinfer: list[int] = Field(
        [16, 32, 64, 96, 128, 160], min_length=1,
        description="CPU-infer threads to try (serve.kt_cpuinfer); fewer than the pools or "
        "more than the cores less serve.reserved_cores never started")
    hot_tail_tokens: list[Annotated[int, Field(ge=0)]] = Field(
        [0, 32, 64, 128], min_length=1,
        description="KT_HOT_TAIL_TOKENS values to try (serve.env; 0: off, the launcher's "
        "default); the guide measures 64 at -4 %..+8 %")
    buckets: list[int] = Field(
        [1000, 8000], min_length=1,
        description="prompt sizes (tokens) of each trial's throughput probe; the objective is "
        "the mean of their median tok/s")
    repeats: int = Field(3, gt=0, description="runs per bucket; the median counts")
    new_tokens: int = Field(256, gt=0, description="decoded tokens per run")
    budget: str = Field("20", description="default --budget: trials (`20`) or time (`30m`)")
    seed: int = Field(0, description="the sampler's seed (Optuna TPE)")


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


class RealLayer(Strict):
    """One converted layer through kt-kernel against its source (the guide's appendix D).

    verify-gguf's level 4 runs it on a layer of the conversion; with ``rehearse`` the
    selftest stage runs it on a synthetic checkpoint of the real layout, converted by this
    tool (the rehearsals, which download nothing). The tokens are routed to ``experts``
    experts spread over the layer (first and last included), so a real 256-expert layer
    takes seconds: kt-kernel maps the file and reads only the routed experts' pages.
    """

    enabled: bool = Field(True, description="verify-gguf level 4 runs (false: skipped, said so)")
    layer: int = Field(16, ge=0, description="the layer to run (appendix D runs layer 16); "
                       "when it is not among the verified layers, the middle one of them")
    experts: int = Field(8, gt=0, description="distinct experts the tokens are routed to")
    tokens: list[int] = Field([4, 16], min_length=1,
                              description="one forward per entry (<10 forward_one, else many)")
    # 0.9999: guide appendix D (dsv4_flash_single_card_inference_guide.md:567 at 1a7fbd34)
    min_cosine: float = Field(0.9999, gt=0, le=1, description="cosine against numpy, per run")
    # Q8_0 activations give ~1-1.5 % (ktkernel-x86-notes §5); the delivery's own check allows
    # 3 % of max |error| / max |ref| (cpu_moe_reference_check_mxfp4.py:216, :287 at 1a7fbd34)
    max_rel_l2: float = Field(0.03, gt=0, description="rel-L2 against numpy, per run")
    timeout_s: float = Field(300, gt=0, description="per forward, import and load included")
    threads: int = Field(2, gt=0, description="kt-kernel worker threads")
    seed: int = Field(1, ge=0, description="seed of the tokens and routing")
    rehearse: bool = Field(False, description="the selftest stage also runs it on a synthetic "
                           "converted layer of the real layout (for recipes without weights)")
    synthetic_dims: Literal["conversion", "selftest"] = Field(
        "conversion", description="dims of that synthetic layer: the conversion's real ones "
        "(256 x 4096 x 2048: ~3.2 GB written twice, ~20 s) or the selftest's small ones")

    @model_validator(mode="after")
    def _tokens(self) -> RealLayer:
        if any(t <= 0 for t in self.tokens):
            raise ValueError("tokens must be positive counts, e.g. [4, 16]")
        return self


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
    real_layer: RealLayer = Field(
        default_factory=RealLayer, description="a converted layer through kt-kernel "
        "(verify-gguf level 4; guide appendix D)")

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
    memory_margin_gib: float = Field(
        16, ge=0, description="DRAM the plan needs besides the GGUF set (the server's python, "
        "torch, buffers): added to GGUF x 1 (one threadpool) or x 2 (several)")
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


