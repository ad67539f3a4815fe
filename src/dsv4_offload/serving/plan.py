"""The server's exact command line and environment, derived from the recipe and the host.

The plan follows the delivery's launcher (cann-recipes-infer ``launch_ds4flash_npu.sh``) and
the brief's launch line: ``build_plan`` is composed of one function per part of that script,
each naming the lines it stands for. They apply the rules in serving.rules (pure but for a
few file reads at the edge); the flags, in the script's order, are in serving.flags; the
CANN ``set_env`` scripts' environment is read in serving.cann.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.build.interpreter import server_pythonpath
from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.serving.extra_args import Needs
from dsv4_offload.serving.extra_args import check as check_extra
from dsv4_offload.serving.flags import FLAG_FIELDS, command, sglang_flags
from dsv4_offload.serving.rules import (
    ENV_KNOBS,
    ENVIRONMENT,
    FLAG_KNOBS,
    HOST,
    OP_DIR_ENV,
    OPTION,
    RECIPE,
    RULE,
    SCRIPTS,
    SET,
    TUNED,
    WORKSPACE,
    chunked_prefill,
    connect_url,
    cpu_plan,
    cpuinfer_problem,
    dram_advice,
    env_number,
    experts_problem,
    is_loopback,
    mem_fraction_problem,
    missing_layer_files,
    missing_op_files,
    nsa_compressor_mode,
    numa_warning,
    op_dir,
    pick_device,
    read_api_key,
    threadpool_problem,
    weight_template,
)

if TYPE_CHECKING:
    from dsv4_offload.core.host import HostFacts
    from dsv4_offload.recipe import Recipe, Serve
    from dsv4_offload.workspace.store import Workspace


@dataclass
class ServePlan:
    """Everything needed to start the server, and why each derived value is what it is."""

    argv: list[str]
    env: dict[str, str]  # the child's full environment
    env_set: dict[str, str]  # what the plan set or changed relative to the inherited env
    env_unset: list[str]
    url: str  # where a client on this host reaches the server
    derived: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # where each flag ("--kt-cpuinfer") and each variable the plan sets comes from
    origins: dict[str, str] = field(default_factory=dict)
    api_key_file: str | None = None  # read by the process that starts the server, only

    def shell(self) -> str:
        """The plan as one copy-pasteable shell line (only the variables the plan sets)."""
        unset = f"unset {' '.join(self.env_unset)}; " if self.env_unset else ""
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env_set.items()))
        return f"{unset}{exports} {shlex.join(self.argv)}".strip()

    def script(self) -> list[str]:
        """The plan as a readable shell script: unset, one export a line, one flag a line."""
        lines = [f"unset {' '.join(self.env_unset)}"] if self.env_unset else []
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(self.env_set.items())]
        parts: list[str] = [shlex.quote(self.argv[0])]
        for arg in self.argv[1:]:
            if arg.startswith("--"):
                parts.append(shlex.quote(arg))
            else:  # a flag's value, or the program's leading arguments
                parts[-1] += " " + shlex.quote(arg)
        lines.append(" \\\n    ".join(parts))
        return lines

    def flag_values(self) -> list[tuple[str, str]]:
        """(flag, value) pairs in argv order; a bare switch has the value ''."""
        start = self.argv.index("--model-path") if "--model-path" in self.argv else 0
        pairs: list[tuple[str, str]] = []
        for arg in self.argv[start:]:
            if arg.startswith("--"):
                pairs.append((arg, ""))
            elif pairs and pairs[-1][1] == "":
                pairs[-1] = (pairs[-1][0], arg)
        return pairs

    def origin_lines(self) -> list[str]:
        """One line per flag and per variable set: name, value and where it comes from."""
        lines = [f"{flag} {value}".rstrip() + f"  [{self.origins.get(flag, RECIPE)}]"
                 for flag, value in self.flag_values()]
        # what the plan sets, and the launcher knobs the user exported (inherited as they are)
        shown = set(self.env_set) | {k for k, o in self.origins.items() if k in self.env
                                     and not k.startswith("--") and o.startswith(ENVIRONMENT)}
        lines += [f"{k}={self.env[k]}  [{self.origins.get(k, ENVIRONMENT)}]"
                  for k in sorted(shown)]
        return lines

    def as_dict(self) -> dict[str, Any]:
        return {"argv": self.argv, "env_set": dict(sorted(self.env_set.items())),
                "env_unset": self.env_unset, "url": self.url, "derived": self.derived,
                "notes": self.notes, "warnings": self.warnings,
                "origins": dict(sorted(self.origins.items())), "shell": self.shell()}


# --- build_plan's parts, one for each part of the launcher ----------------------------------


@dataclass
class _Draft:
    """What build_plan's parts read (the inputs) and add to (origins, notes, warnings)."""

    recipe: Recipe
    host: HostFacts
    workspace: Workspace
    base_env: Mapping[str, str]
    sets: frozenset[str]
    origins: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def serve(self) -> Serve:
        return self.recipe.serve

    @property
    def own_command(self) -> bool:
        return self.recipe.serve.command is not None

    def recipe_origin(self, field_name: str) -> str:
        key = f"serve.{field_name}"
        if key in self.sets:
            return SET
        overlay = self.recipe.origin.overlay if self.recipe.origin else None
        if overlay is not None and any(k == key or k.startswith(key + ".")
                                       for k in self.recipe.overlay_keys):
            return f"{TUNED} ({overlay})"
        return RECIPE

    def from_env(self, name: str) -> str:
        return f"{ENVIRONMENT} ({name}, launcher {FLAG_KNOBS[name][1]})"

    def launcher_number(self, name: str, kind: type[int] | type[float],
                        recipe_value: float) -> float:
        """The launcher's ``${NAME:-default}``: an exported value wins over the recipe's."""
        value = env_number(self.base_env, name, kind)
        if value is None:
            return recipe_value
        self.origins[FLAG_KNOBS[name][0]] = self.from_env(name)
        return value

    def effective(self, key: str) -> str | None:
        """A variable as the server sees it: an exported knob, else serve.env, else inherited."""
        if key in ENV_KNOBS and self.base_env.get(key):
            return self.base_env[key]
        return self.serve.env.get(key, self.base_env.get(key))


# the device a plan printed on a host without an NPU shows (serve --print)
DEVICE_PLACEHOLDER = "<N>"

def _cpu_pools(d: _Draft) -> tuple[int, int]:
    """L123-131: (KT_THREADPOOL_COUNT, KT_CPUINFER), exported or derived from the host."""
    env_pools = env_number(d.base_env, "KT_THREADPOOL_COUNT", int)
    env_threads = env_number(d.base_env, "KT_CPUINFER", int)
    host = d.host
    nodes = max(1, len(host.numa_nodes))
    if env_pools is not None and not 1 <= env_pools <= nodes:
        raise InputError(
            f"KT_THREADPOOL_COUNT={env_pools} in the environment: this host has {nodes} NUMA "
            f"node(s) and kt-kernel binds subpool i to node i (\"NUMA node N not found\" "
            f"otherwise, launcher L127-129); export a value from 1 to {nodes} or unset it"
        )
    recipe_pools = d.serve.kt_threadpool_count
    if env_pools is None and recipe_pools is not None:
        problem = threadpool_problem(recipe_pools, nodes)
        if problem:
            raise InputError(f"serve.kt_threadpool_count={recipe_pools}: {problem}")
    cpus = cpu_plan(d.serve, host.numa_nodes, host.cores,
                    int(env_pools or 0) or recipe_pools)
    pools, threads = cpus.pools, cpus.threads
    # host facts: warnings with their consequence (doctor's NUMA row says the same)
    d.warnings += [w for w in (cpus.warning,
                               None if env_pools == 1 else numa_warning(host.numa_nodes)) if w]
    d.origins["--kt-threadpool-count"] = (
        d.from_env("KT_THREADPOOL_COUNT") if env_pools else
        d.recipe_origin("kt_threadpool_count") if recipe_pools is not None else
        f"{HOST} ({nodes} NUMA node(s))")
    d.origins["--kt-cpuinfer"] = f"{HOST} ({pools} pool(s), {host.cores} cores)"
    if env_threads is None and d.serve.kt_cpuinfer is not None:
        threads = d.serve.kt_cpuinfer
        problem = cpuinfer_problem(threads, pools, host.cores, d.serve.reserved_cores)
        if problem:
            raise InputError(f"serve.kt_cpuinfer={threads}: {problem}")
        d.origins["--kt-cpuinfer"] = d.recipe_origin("kt_cpuinfer")
    if env_threads is not None:
        if env_threads < pools:
            raise InputError(f"KT_CPUINFER={env_threads} in the environment: fewer threads than "
                             f"the {pools} subpool(s); export at least {pools} or unset it")
        threads = int(env_threads)
        d.origins["--kt-cpuinfer"] = d.from_env("KT_CPUINFER")
        if threads >= host.cores:
            d.warnings.append(f"KT_CPUINFER={threads} takes every core of this {host.cores}-core "
                              "host: the pool thrashes (launcher L124-125); leave headroom")
    return pools, threads


def _dram(d: _Draft, pools: int) -> None:
    """The DRAM this plan needs (GGUF x 1 with one pool, x 2 with several) against the
    host's MemAvailable; short, a warning with the KT_THREADPOOL_COUNT=1 choice."""
    if d.host.mem_available_kib is None:
        return
    status, said = dram_advice(d.recipe, pools, d.host.mem_available_kib / 2**20)
    if status != "ok":
        d.warnings.append(f"DRAM: {said}")


def _chunk(d: _Draft, longest_prompt: int | None) -> int:
    """L118 (checked as L33-37 asks): CHUNKED_PREFILL_SIZE, exported or the recipe's.

    The recipe's is raised to cover --longest-prompt (guide §7).
    """
    s = d.serve
    env_chunk = env_number(d.base_env, "CHUNKED_PREFILL_SIZE", int)
    if env_chunk is not None:
        if env_chunk <= 0 or env_chunk % s.page_size:
            raise InputError(
                f"CHUNKED_PREFILL_SIZE={env_chunk} in the environment: must be a positive "
                f"multiple of the page size {s.page_size} (launcher L33-37: -1 overruns "
                "kt-kernel's buffer); export e.g. 8192 or 32768, or unset it")
        if longest_prompt and longest_prompt > env_chunk:
            raise InputError(
                f"--longest-prompt {longest_prompt} exceeds CHUNKED_PREFILL_SIZE={env_chunk} "
                "from the environment (a prompt longer than the chunk fails, guide §7); raise "
                "or unset CHUNKED_PREFILL_SIZE")
        d.origins["--chunked-prefill-size"] = d.from_env("CHUNKED_PREFILL_SIZE")
        return int(env_chunk)
    chunk = chunked_prefill(s, longest_prompt)
    if chunk > s.chunked_prefill_size:  # only --longest-prompt can exceed the recipe's
        d.notes.append(f"chunked prefill raised from {s.chunked_prefill_size} to {chunk} to "
                       f"cover a {longest_prompt}-token prompt")
        d.origins["--chunked-prefill-size"] = f"{OPTION} (--longest-prompt)"
    elif chunk < s.chunked_prefill_size:
        d.notes.append(f"chunked prefill lowered from {s.chunked_prefill_size} to {chunk}: "
                       f"serve.max_prefill_tokens is {s.max_prefill_tokens}")
    return chunk


def _gpu_experts(d: _Draft, retry: int | None) -> int:
    """L323 (ceiling L299-300): KT_NUM_GPU_EXPERTS, or a retry's count from the HBM ladder."""
    s = d.serve
    base = int(d.launcher_number("KT_NUM_GPU_EXPERTS", int, s.kt_num_gpu_experts))
    experts = base if retry is None else retry
    if experts != base:
        d.origins["--kt-num-gpu-experts"] = f"{RULE} (retry after a KV/HBM failure)"
    problem = experts_problem(s, experts)
    if problem:
        raise InputError(f"KT_NUM_GPU_EXPERTS={experts}: {problem}")
    return experts


def _mem_fraction(d: _Draft, retry: float | None) -> float:
    """L316: MEM_FRACTION, or a retry's fraction from the HBM ladder (guide appendix G.1)."""
    s = d.serve
    base = float(d.launcher_number("MEM_FRACTION", float, s.mem_fraction_static))
    fraction = base if retry is None else retry
    if fraction != base:
        d.origins["--mem-fraction-static"] = f"{RULE} (retry after an HBM failure)"
    if not 0 < fraction < 1:
        raise InputError(f"MEM_FRACTION={fraction:g}: must be between 0 and 1 (default 0.81, "
                         "guide appendix G.1); fix or unset it")
    warning = mem_fraction_problem(s, fraction, d.effective("KT_PREFILL_STREAM") == "1")
    if warning:
        d.warnings.append(warning)
    return fraction


def _quantization(d: _Draft) -> str:
    """L119: QUANTIZATION, exported or the recipe's."""
    if d.base_env.get("QUANTIZATION"):
        d.origins["--quantization"] = d.from_env("QUANTIZATION")
        return d.base_env["QUANTIZATION"]
    return d.serve.quantization


def _env_knobs(d: _Draft) -> dict[str, str]:
    """L78-290, every ``export X="${X:-default}"`` (ENV_KNOBS): the exported value, else serve.env.

    Returns what the plan sets; an exported knob is inherited as it is, with its origin.
    """
    knob_env: dict[str, str] = {}
    for key, value in d.serve.env.items():
        if key in ENV_KNOBS and d.base_env.get(key):
            d.origins[key] = f"{ENVIRONMENT} (launcher {ENV_KNOBS[key]})"
        else:
            knob_env[key] = value
            d.origins[key] = (SET if ("serve.env" in d.sets or f"serve.env.{key}" in d.sets)
                              else d.recipe_origin(f"env.{key}"))
    for key in ENV_KNOBS:
        if d.base_env.get(key) and key not in d.serve.env:
            d.origins[key] = f"{ENVIRONMENT} (launcher {ENV_KNOBS[key]})"
    return knob_env


def _skip_warmup(d: _Draft, knob_env: dict[str, str]) -> bool:
    """L288-296: SKIP_WARMUP, else skip sglang's warm-up unless KT_PREFILL_STREAM=1.

    Streaming prefill never runs the CPU MoE, so the launcher keeps sglang's warm-up on to
    warm kt-kernel, and exports KT_STREAM_WARMUP only then (L290): it is dropped from
    ``knob_env`` otherwise.
    """
    stream_on = d.effective("KT_PREFILL_STREAM") == "1"
    if (not stream_on and "KT_STREAM_WARMUP" in knob_env
            and not d.base_env.get("KT_STREAM_WARMUP")):
        del knob_env["KT_STREAM_WARMUP"]
        d.origins.pop("KT_STREAM_WARMUP", None)
    skip_env = d.base_env.get("SKIP_WARMUP")
    d.origins["--skip-server-warmup"] = (f"{ENVIRONMENT} (SKIP_WARMUP, launcher L289-296)"
                                         if skip_env else f"{RULE} (KT_PREFILL_STREAM, L288-296)")
    return (skip_env != "0") if skip_env else not stream_on


def _extra_flags(d: _Draft) -> list[str]:
    """L278-279 and L213-216: serve.extra_args, EXTRA_FLAGS, --disable-cuda-graph to profile."""
    extra = list(d.serve.extra_args)
    for arg in extra:
        if arg.startswith("--"):
            d.origins.setdefault(arg, d.recipe_origin("extra_args"))
    if d.base_env.get("EXTRA_FLAGS"):
        # split on whitespace like `read -r -a` (L278-279)
        for arg in d.base_env["EXTRA_FLAGS"].split():
            extra.append(arg)
            if arg.startswith("--"):
                d.origins.setdefault(arg, f"{ENVIRONMENT} (EXTRA_FLAGS, launcher L278)")
    if d.effective("SGLANG_NPU_PROFILE_ENABLE") == "1" and "--disable-cuda-graph" not in extra:
        extra.append("--disable-cuda-graph")  # L213-216
        d.origins["--disable-cuda-graph"] = (f"{RULE} (SGLANG_NPU_PROFILE_ENABLE=1, "
                                             "launcher L213)")
    return extra


def _check_extra(d: _Draft, planned: Sequence[str], chunk: int, port: int) -> None:
    """serve.extra_args and EXTRA_FLAGS against sglang's flags (serving.extra_args)."""
    if not d.serve.pass_flags:
        return  # another server's own arguments
    needs = Needs(page_size=d.serve.page_size, chunk=chunk,
                  chunk_why=d.origins.get("--chunked-prefill-size", RECIPE), port=port,
                  planned=frozenset(a for a in planned if a.startswith("--")))
    d.warnings += check_extra(d.serve.extra_args, lambda _f: "serve.extra_args", needs)
    d.warnings += check_extra(d.base_env.get("EXTRA_FLAGS", "").split(),
                              lambda _f: "EXTRA_FLAGS, launcher L278", needs)


def _eager_env(d: _Draft, extra: Sequence[str]) -> dict[str, str]:
    """KT_FORCE_SYNC_SUBMIT=1 with --disable-cuda-graph (not the launcher's: guide appendix G).

    Eager mode garbles the output (CPU MoE async submits not flushed) unless it is 1;
    appendix F pairs it with --disable-cuda-graph. A value already set is kept, with a warning.
    """
    if "--disable-cuda-graph" not in extra:
        return {}
    sync_submit = d.effective("KT_FORCE_SYNC_SUBMIT")
    if sync_submit not in (None, "1"):
        d.warnings.append(f"KT_FORCE_SYNC_SUBMIT={sync_submit} with --disable-cuda-graph: eager "
                          "mode garbles the output unless it is 1 (guide appendix G)")
    if sync_submit is not None:
        return {}
    d.origins["KT_FORCE_SYNC_SUBMIT"] = f"{RULE} (--disable-cuda-graph: guide appendix G)"
    d.notes.append("--disable-cuda-graph (eager mode): KT_FORCE_SYNC_SUBMIT=1 set, else the "
                   "output is garbled (guide appendix G)")
    return {"KT_FORCE_SYNC_SUBMIT": "1"}


def _device(d: _Draft, requested: int | None, fraction: float, placeholder: bool = False
            ) -> tuple[str | None, str]:
    """L251-255: ASCEND_RT_VISIBLE_DEVICES kept, else NPU_DEVICE_ID; here --device first.

    Else the idlest healthy card; none is an error unless serve.command brings its own, or
    for a printed plan (``placeholder``), which shows DEVICE_PLACEHOLDER and says so.
    """
    dev, reason = pick_device(d.host.npus, requested,
                              d.base_env.get("ASCEND_RT_VISIBLE_DEVICES")
                              or d.base_env.get("NPU_DEVICE_ID"),
                              models=d.recipe.host.npu_models, mem_fraction=fraction)
    if dev is None and placeholder and not d.own_command:
        d.notes.append(f"{reason}: the device is a placeholder, {DEVICE_PLACEHOLDER}; on the "
                       "target the idlest healthy card is taken (or --device N)")
        return DEVICE_PLACEHOLDER, f"{reason}: a placeholder in this printed plan"
    if dev is None and not d.own_command:
        raise Dsv4Error(
            f"serve: {reason}; check `npu-smi info` (run `dsv4-offload doctor`) or pass "
            "--device N"
        )
    if dev is None:
        d.notes.append(f"{reason}; ASCEND_RT_VISIBLE_DEVICES left unset (serve.command set)")
    return dev, reason


def _weights(d: _Draft, require_layers: bool) -> tuple[str, str]:
    """L113-116, L307, L324: (MODEL_PATH, KT_GGUF_TEMPLATE), the workspace's W8A8 and GGUF set.

    Every layer file the template names must exist (a note with ``require_layers=False``).
    """
    recipe, base_env = d.recipe, d.base_env
    model_path = str(d.workspace.weights_dir(recipe, "w8a8"))
    weight_path = weight_template(d.workspace, recipe)
    d.origins["--model-path"] = d.origins["--kt-weight-path"] = WORKSPACE
    missing = missing_layer_files(d.workspace, recipe)
    if missing and not require_layers:
        d.notes.append(f"{len(missing)} of {recipe.conversion.layers} GGUF layer files missing "
                       f"(first: {missing[0]}); run `dsv4-offload convert`")
    elif missing:
        raise InputError(
            f"{missing[0]}: GGUF layer file missing ({len(missing)} of "
            f"{recipe.conversion.layers} absent; --kt-weight-path {weight_path} must resolve "
            "for every layer); run `dsv4-offload convert` then `dsv4-offload verify-gguf`"
        )
    if base_env.get("KT_GGUF_TEMPLATE") and base_env["KT_GGUF_TEMPLATE"] != weight_path:
        d.notes.append(f"KT_GGUF_TEMPLATE={base_env['KT_GGUF_TEMPLATE']} from the environment "
                       "is not used: the workspace's GGUF set is served")
    return model_path, weight_path


def _operator(d: _Draft, require_layers: bool) -> tuple[Path, str, bool]:
    """L86: (operator dir, its origin, depool on): with KT_MXFP4_DEPOOL=1, the AscendC operator.

    sglang imports it from $KT_MXFP4_OP_DIR (op_dir); missing files are an error when the
    plan is strict and the server is the delivery's, else a note.
    """
    ops, ops_origin = op_dir(d.workspace, d.recipe, d.base_env)
    depool = d.effective("KT_MXFP4_DEPOOL") == "1"
    absent = missing_op_files(ops) if depool else []
    if absent:
        message = (f"{ops / absent[0]}: the AscendC MXFP4 operator is missing and "
                   "KT_MXFP4_DEPOOL=1 (sglang imports it from $KT_MXFP4_OP_DIR; every prefill "
                   "of 512+ tokens would fall back to hybrid)")
        fix = ("build it: `dsv4-offload build ascendc-op`, or serve without depool: --set "
               "serve.env.KT_MXFP4_DEPOOL=0")
        if require_layers and not d.own_command:
            raise InputError(f"{message}; {fix}")
        d.notes.append(f"{message}; {fix}")
    return ops, ops_origin, depool


def _api_key(d: _Draft, api_key_file: Path | None, port: int) -> bool:
    """Whether to pass --api-key (not the launcher's): the file is validated now."""
    if api_key_file is not None:
        read_api_key(api_key_file)  # validated now; only the starting process keeps the key
        d.origins["--api-key"] = f"{OPTION} (--api-key-file {api_key_file})"
        # upstream sglang's later `--config FILE` (a 0600 YAML) could keep the key off argv;
        # the delivery's launch takes it as a flag, so the exposure is said, not hidden
        d.warnings.append("sglang gets the API key as `--api-key` on its command line: local "
                          "users of this host can read it with `ps`; use a key for this server "
                          "only, or keep untrusted users off the host")
        return True
    if not is_loopback(d.serve.host):
        d.warnings.append(f"the server binds {d.serve.host} with no API key: anyone who reaches "
                          f"port {port} can use it; pass --api-key-file FILE or --set "
                          "serve.host=127.0.0.1")
    return False


def _checkpoint_env(d: _Draft, model_path: str, weight_path: str) -> dict[str, str]:
    """L113-116 and L78-79: KT_GGUF_TEMPLATE, and the checkpoints streaming prefill reads.

    The GGUF dedup path reads the template from the environment too; streaming prefill reads
    config and index from both checkpoints, which the launcher derives unless exported.
    """
    env = {"KT_GGUF_TEMPLATE": weight_path}
    d.origins["KT_GGUF_TEMPLATE"] = WORKSPACE
    for key, value in (("KT_PREFILL_STREAM_CKPT", model_path),
                       ("KT_MXFP4_CKPT", str(d.workspace.weights_dir(d.recipe, "mxfp4")))):
        if not d.base_env.get(key):
            env[key] = value
            d.origins[key] = WORKSPACE
    return env


def _compressor_env(d: _Draft) -> tuple[dict[str, str], str, str]:
    """L162-173: (env, mode, reason) for KT_NSA_COMPRESSOR_MODE, exported or derived.

    Derived from the recipe's setting, or with ``auto`` from the host's CANN version.
    """
    if d.base_env.get("KT_NSA_COMPRESSOR_MODE"):
        return {}, d.base_env["KT_NSA_COMPRESSOR_MODE"], "explicitly set (L172-173)"
    setting = d.serve.nsa_compressor_mode
    mode, reason = nsa_compressor_mode(setting, d.host.cann_version)
    d.origins["KT_NSA_COMPRESSOR_MODE"] = RECIPE if setting != "auto" else f"{HOST} ({reason})"
    return {"KT_NSA_COMPRESSOR_MODE": mode}, mode, reason


def _operator_env(d: _Draft, ops: Path, ops_origin: str, depool: bool) -> dict[str, str]:
    """KT_MXFP4_OP_DIR with depool on (sglang/0003): the workspace's build, or the exported one."""
    if depool and ops_origin == WORKSPACE:
        d.origins[OP_DIR_ENV] = f"{WORKSPACE} (the ascendc-op build directory)"
        return {OP_DIR_ENV: str(ops)}
    if depool and ops_origin == ENVIRONMENT:
        d.origins[OP_DIR_ENV] = ENVIRONMENT
    return {}


def _interpreter_env(d: _Draft, python: str, python_origin: str,
                     script_env: Mapping[str, str]) -> dict[str, str]:
    """ensure_kt_kernel.sh L24 + launcher L46, L55-56: PYTHONPATH, and PYTHON_BIN exported.

    PYTHONPATH comes from build.interpreter.server_pythonpath, the one place it is made: the
    launcher's entries in front of what the shell had by then, which is what CANN's set_env
    scripts made of it when they ran (they run before L46), else the inherited one.
    PYTHON_BIN is left out when serve.command brings its own server.
    """
    inherited = script_env.get("PYTHONPATH") or d.base_env.get("PYTHONPATH")
    env = {"PYTHONPATH": server_pythonpath(d.workspace.tree_dir(d.recipe), inherited)}
    d.origins["PYTHONPATH"] = f"{WORKSPACE} (launcher order, L24 + L46)"
    if not d.own_command:
        env["PYTHON_BIN"] = python  # the launcher exports its choice (L56)
        d.origins["PYTHON_BIN"] = python_origin
    return env


def _toolkit_env(d: _Draft, toolkit: str | None, toolkit_origin: str) -> dict[str, str]:
    """L137-155: ASCEND_TOOLKIT_HOME, as found (serving.cann.toolkit_home) or probed."""
    toolkit = toolkit or d.host.cann_toolkit
    if not toolkit:
        return {}
    d.origins["ASCEND_TOOLKIT_HOME"] = (
        ENVIRONMENT if d.base_env.get("ASCEND_TOOLKIT_HOME") == toolkit else toolkit_origin)
    return {"ASCEND_TOOLKIT_HOME": toolkit}


def _device_env(d: _Draft, dev: str | None, reason: str, requested: int | None
                ) -> dict[str, str]:
    """L251-255: ASCEND_RT_VISIBLE_DEVICES, with where the card came from."""
    if dev is None:
        return {}
    d.origins["ASCEND_RT_VISIBLE_DEVICES"] = (
        f"{OPTION} (--device)" if requested is not None else
        ENVIRONMENT if reason == "kept from the environment" else f"{HOST} ({reason})")
    return {"ASCEND_RT_VISIBLE_DEVICES": dev}


def _environment(d: _Draft, layers: Sequence[Mapping[str, str]]
                 ) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(env, env_set, env_unset): the inherited env less serve.unset_env, then ``layers``.

    ``layers`` are applied in order (the CANN scripts', the knobs, the derived values); the
    CANN scripts' variables (L150-235) get their origin unless a later layer gave one.
    """
    s = d.serve
    env = {k: v for k, v in d.base_env.items() if k not in set(s.unset_env)}
    env_unset = sorted(k for k in s.unset_env if k in d.base_env)
    for key in layers[0]:
        d.origins.setdefault(key, SCRIPTS)
    for layer in layers:
        env.update(layer)
    env_set = {k: v for k, v in env.items() if d.base_env.get(k) != v}
    return env, env_set, env_unset


def build_plan(
    recipe: Recipe,
    host: HostFacts,
    workspace: Workspace,
    *,
    base_env: Mapping[str, str],
    script_env: Mapping[str, str] | None = None,
    device: int | None = None,
    longest_prompt: int | None = None,
    gpu_experts: int | None = None,
    mem_fraction: float | None = None,
    require_layers: bool = True,
    python: str | None = None,
    python_origin: str = RECIPE,
    toolkit: str | None = None,
    toolkit_origin: str = f"{HOST} (CANN install info)",
    set_keys: Sequence[str] = (),
    api_key_file: Path | None = None,
) -> ServePlan:
    """Derive argv and env, with the origin of each value.

    ``script_env`` is what the CANN scripts set (capture_script_env); ``base_env`` the
    inherited environment, whose launcher knobs (ENV_KNOBS, FLAG_KNOBS) win over the recipe
    as in the launcher; ``gpu_experts``/``mem_fraction`` are a retry's values; ``set_keys``
    the dotted keys of --set overrides. Missing GGUF layer files or, with KT_MXFP4_DEPOOL=1,
    a missing AscendC operator are errors, or with ``require_layers=False`` notes.
    """
    s = recipe.serve
    d = _Draft(recipe, host, workspace, base_env, frozenset(set_keys))
    d.origins.update({flag: d.recipe_origin(name) for flag, name in FLAG_FIELDS.items()})
    pools, threads = _cpu_pools(d)
    _dram(d, pools)
    chunk = _chunk(d, longest_prompt)
    experts = _gpu_experts(d, gpu_experts)
    fraction = _mem_fraction(d, mem_fraction)
    port = int(d.launcher_number("PORT", int, s.port))  # L132
    quantization = _quantization(d)
    knob_env = _env_knobs(d)
    skip_warmup = _skip_warmup(d, knob_env)
    extra = _extra_flags(d)
    eager_env = _eager_env(d, extra)
    dev, dev_reason = _device(d, device, fraction, placeholder=not require_layers)
    model_path, weight_path = _weights(d, require_layers)
    ops, ops_origin, depool = _operator(d, require_layers)
    api_key = _api_key(d, api_key_file, port)
    python = python or s.python  # python_env.sh's choice (build.interpreter), else the recipe's
    flags = sglang_flags(s, model_path=model_path, weight_path=weight_path,
                         gpu_experts=experts, pools=pools, threads=threads, chunk=chunk,
                         mem_fraction=fraction, port=port, quantization=quantization,
                         skip_warmup=skip_warmup, api_key=api_key, extra=extra)
    _check_extra(d, flags[:len(flags) - len(extra)], chunk, port)
    checkpoint_env = _checkpoint_env(d, model_path, weight_path)
    mode_env, mode, mode_reason = _compressor_env(d)
    derived_env = {**checkpoint_env, **mode_env,
                   **_operator_env(d, ops, ops_origin, depool),
                   **_interpreter_env(d, python, python_origin, script_env or {}),
                   **_toolkit_env(d, toolkit, toolkit_origin),
                   **_device_env(d, dev, dev_reason, device), **eager_env}
    env, env_set, env_unset = _environment(d, (dict(script_env or {}), knob_env, derived_env))
    derived = {
        "threadpool_count": pools, "cpuinfer": threads, "numa_nodes": len(host.numa_nodes),
        "cores": host.cores, "chunked_prefill_size": chunk, "kt_num_gpu_experts": experts,
        "mem_fraction_static": fraction,
        "nsa_compressor_mode": mode, "nsa_compressor_mode_reason": mode_reason,
        "device": dev, "device_reason": dev_reason, "weight_path": weight_path,
        "cann_version": host.cann_version, "op_dir": str(ops) if depool else None,
        "python": python,
    }
    return ServePlan(argv=command(s, flags, model_path, python), env=env, env_set=env_set,
                     env_unset=env_unset, url=connect_url(s.host, port), derived=derived,
                     notes=d.notes, warnings=d.warnings, origins=d.origins,
                     api_key_file=str(api_key_file) if api_key_file else None)
