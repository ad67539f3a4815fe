"""The server's exact command line and environment, derived from the recipe and the host.

Pure apart from two reads at the edge, each in its own function: the existence of the GGUF
layer files (``missing_layer_files``) and the CANN ``set_env`` scripts' environment
(``capture_script_env``, run once in bash and cached). The rules follow the delivery's
launcher (cann-recipes-infer ``launch_ds4flash_npu.sh``) and the brief's launch line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.build import bringup
from dsv4_offload.build.interpreter import server_pythonpath
from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.host import choose_npu

if TYPE_CHECKING:
    from dsv4_offload.core.host import HostFacts, NpuInfo
    from dsv4_offload.recipe import Recipe, Serve
    from dsv4_offload.workspace.store import Workspace

# kt-kernel substitutes this itself, once per layer: it must reach the server unexpanded.
LAYER_PLACEHOLDER = "{layer_idx}"
SGLANG_MODULE = "sglang.launch_server"

# Line numbers below are cann-recipes-infer @ 1a7fbd34,
# integration/sglang/dsv4-flash-single-npu-moe-offload/scripts/tools/launch_ds4flash_npu.sh.

# Variables the launcher exports as `export X="${X:-default}"`: a value the user exported
# wins over the recipe's default, as in the launcher.
ENV_KNOBS: dict[str, str] = {
    "KT_PREFILL_STREAM_CKPT": "L78", "KT_MXFP4_CKPT": "L79",
    "KT_MXFP4_DEPOOL": "L86", "KT_MXFP4_GGUF_DEDUP": "L88", "KT_DYNAMIC_RESIDENT": "L89",
    "KT_PREFILL_STREAM": "L90", "KT_SIDE_STREAM": "L91", "KT_PREFILL_STREAM_THRESHOLD": "L98",
    "KT_NSA_COMPRESSOR_MODE": "L162", "SGLANG_SET_CPU_AFFINITY": "L190",
    "TASK_QUEUE_ENABLE": "L191", "STREAMS_PER_DEVICE": "L192", "PYTORCH_NPU_ALLOC_CONF": "L193",
    "IS_DEEPSEEK_V4": "L194", "USE_FUSED_COMPRESSOR": "L195", "LI_KV_DTYPE_INT8": "L196",
    "USE_PA_DECODE": "L197", "USE_PA_PREFILL": "L198", "USE_FUSED_HC_POST_ASCENDC": "L199",
    "USE_FUSED_HC_PRE_ASCENDC": "L200", "USE_NPU_MOE_GATING_TOP_K": "L201",
    "USE_FUSED_TRANSPOSE_BATCHMATMUL": "L202", "USE_ROPE_PARTIAL_IN_PLACE_ASCENDC": "L203",
    "ASCEND_USE_FIA": "L204", "SGLANG_NPU_PROFILE_ENABLE": "L206",
    "SGLANG_NPU_PROFILE_DECODE_TOKEN": "L207", "SGLANG_NPU_PROFILE_DIR": "L208",
    "SGLANG_NPU_PROFILE_LEVEL": "L209", "SGLANG_NPU_PROFILE_ANALYSE": "L210",
    "SGLANG_NPU_PROFILE_DISABLE_GRAPH": "L211", "SGLANG_NPU_PROFILE_KEEP_EAGER_AFTER": "L212",
    "KT_STREAM_WARMUP": "L290",
}
# Launcher variables that become flags: env name -> (flag, line).
FLAG_KNOBS: dict[str, tuple[str, str]] = {
    "QUANTIZATION": ("--quantization", "L119"),
    "MEM_FRACTION": ("--mem-fraction-static", "L316"),
    "KT_NUM_GPU_EXPERTS": ("--kt-num-gpu-experts", "L323"),
    "KT_THREADPOOL_COUNT": ("--kt-threadpool-count", "L131"),
    "KT_CPUINFER": ("--kt-cpuinfer", "L126"),
    "CHUNKED_PREFILL_SIZE": ("--chunked-prefill-size", "L118"),
    "PORT": ("--port", "L132"),
}
# The recipe field behind each flag, to tell `--set serve.X=` from the recipe's own value.
_FLAG_FIELDS: dict[str, str] = {
    "--device": "device_type", "--page-size": "page_size",
    "--attention-backend": "attention_backend", "--quantization": "quantization",
    "--dtype": "dtype", "--mem-fraction-static": "mem_fraction_static",
    "--max-prefill-tokens": "max_prefill_tokens", "--context-length": "context_length",
    "--watchdog-timeout": "watchdog_timeout", "--kt-method": "kt_method",
    "--kt-num-gpu-experts": "kt_num_gpu_experts", "--kt-threadpool-count": "threads_per_numa",
    "--kt-cpuinfer": "threads_per_numa", "--max-running-requests": "max_running_requests",
    "--chunked-prefill-size": "chunked_prefill_size", "--host": "host", "--port": "port",
}
# The operator sglang/0003 imports when KT_MXFP4_DEPOOL=1 (kt_stream_prefill.py, patch
# L233-249): `mxfp4_fused_op` from $KT_MXFP4_OP_DIR, else <ktransformers root>/tools/ascendc_mxfp4;
# the wrapper loads libmxfp4fused.so beside itself (scripts/tools/ascendc_mxfp4/
# mxfp4_fused_op.py L40-42).
OP_DIR_ENV = "KT_MXFP4_OP_DIR"
OP_FILES = ("libmxfp4fused.so", "mxfp4_fused_op.py")
OP_STEP = "ascendc-op"
# `--api-key` goes into argv only when the server starts (supervisor.ServerProcess reads the
# file): plans, specs, records and logs carry this placeholder instead.
API_KEY_PLACEHOLDER = "<api-key from file>"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")

# origins shown by `serve --print`
RECIPE, SET, ENVIRONMENT, HOST, WORKSPACE, OPTION, SCRIPTS, RULE = (
    "recipe", "--set", "environment", "host", "workspace", "option", "CANN set_env", "rule")
# bash adds or rewrites these itself; they are not part of what the scripts export
_SHELL_NOISE = frozenset({"SHLVL", "_", "PWD", "OLDPWD"})


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


# --- derivation rules (pure) ----------------------------------------------------------------


def cpu_threads(serve: Serve, numa_nodes: Sequence[int], cores: int,
                pools: int | None = None) -> tuple[int, int]:
    """(threadpool count, CPU-infer threads) for this host.

    One subpool per NUMA node: kt-kernel binds subpool i to node i, so more than the nodes
    fails with "NUMA node N not found" (L127-131). Threads: the launcher's 32 (L126, sized for
    the single-NUMA A3), raised to 16 per node on multi-NUMA hosts (L123-124; guide appendix
    E: 8 pools / 128 threads on the 8-NUMA Kunpeng-920), and never every core (L124-125).
    """
    pools = pools or max(1, len(numa_nodes))
    cap = cores - serve.reserved_cores
    threads = min(max(serve.cpuinfer_default, serve.threads_per_numa * pools), cap)
    threads -= threads % pools  # equal threads per subpool
    if threads < pools:
        raise InputError(
            f"host has {cores} cores and {pools} NUMA nodes: too few for one CPU-infer thread per "
            f"node after serve.reserved_cores={serve.reserved_cores}; lower serve.reserved_cores"
        )
    return pools, threads


def chunked_prefill(serve: Serve, longest_prompt: int | None) -> int:
    """The recipe's chunk, raised to a page multiple covering the longest declared prompt."""
    longest = longest_prompt or serve.longest_prompt_tokens
    if longest <= 0:
        raise InputError(f"--longest-prompt {longest}: must be a positive token count")
    if longest > serve.context_length:
        raise InputError(
            f"--longest-prompt {longest} exceeds serve.context_length {serve.context_length}; "
            "raise serve.context_length or declare a shorter prompt"
        )
    size = max(serve.chunked_prefill_size, longest)
    page = serve.page_size
    size = -(-size // page) * page  # round up: the NSA compressor needs one chunk per prompt
    return min(size, -(-serve.max_prefill_tokens // page) * page)


def nsa_compressor_mode(setting: str, cann_version: str | None) -> tuple[str, str]:
    """(mode, reason): CANN >= 9 has the public single-state op, 8.5 the private split one."""
    if setting != "auto":
        return setting, "set by the recipe"
    if not cann_version:
        return "split", "CANN version unknown: the code default"
    try:
        major = int(cann_version.split(".")[0])
    except ValueError:
        return "split", f"CANN version {cann_version!r} unparsable: the code default"
    return ("single" if major >= 9 else "split"), f"from CANN {cann_version}"


def pick_device(npus: Sequence[NpuInfo], requested: int | None, inherited: str | None, *,
                models: Sequence[str] = (), mem_fraction: float = 0.81
                ) -> tuple[str | None, str]:
    """(ASCEND_RT_VISIBLE_DEVICES value, reason): --device, the env, else the idlest card.

    The idlest card is the one doctor checks (host.choose_npu), so both name the same card.
    """
    healthy = [n for n in npus if n.healthy]
    if requested is not None:
        known = {n.device_id: n for n in npus}
        if npus and requested not in known:
            raise InputError(
                f"--device {requested}: npu-smi lists devices {sorted(known)}; pick one of them"
            )
        if npus and known[requested] not in healthy:
            raise InputError(
                f"--device {requested}: npu-smi reports health {known[requested].health!r}; "
                "pick a card whose health is OK"
            )
        return str(requested), "from --device"
    if inherited:
        return inherited, "kept from the environment"
    if not healthy:
        return None, "no healthy NPU reported by npu-smi"
    # prefer the recipe's NPU model; any healthy card when none matches (doctor says so)
    idlest = (choose_npu(healthy, models, mem_fraction=mem_fraction)
              or choose_npu(healthy, ("",), mem_fraction=mem_fraction))
    assert idlest is not None  # healthy is not empty
    return str(idlest.device_id), (f"idlest healthy card, {idlest.label} (HBM used "
                                   f"{idlest.hbm_used_mb} MB, AI core {idlest.aicore_pct}%)")


def weight_template(workspace: Workspace, recipe: Recipe) -> str:
    """The --kt-weight-path value: the GGUF dir and the file template, {layer} made literal."""
    name = recipe.conversion.file_template.replace("{layer}", LAYER_PLACEHOLDER)
    return str(workspace.gguf_dir(recipe) / name)


def missing_layer_files(workspace: Workspace, recipe: Recipe) -> list[Path]:
    """Layer files the template resolves to that do not exist (kt-kernel would read nothing)."""
    template = weight_template(workspace, recipe)
    paths = [Path(template.replace(LAYER_PLACEHOLDER, str(layer)))
             for layer in range(recipe.conversion.layers)]
    return [p for p in paths if not p.is_file()]


def ascend_root(toolkit: str) -> Path:
    """.../Ascend/cann-9.0.0 and .../Ascend/ascend-toolkit/latest give .../Ascend (L228-229)."""
    root = Path(toolkit).parent
    if root.name == "ascend-toolkit":
        root = root.parent
    return root


def toolkit_home(env: Mapping[str, str]) -> tuple[str | None, str]:
    """(ASCEND_TOOLKIT_HOME, how it was found), searched as the launcher does (L137-148).

    The environment's ASCEND_TOOLKIT_HOME, else ASCEND_HOME_PATH, else the first of four
    layouts holding a set_env.sh; (None, why) when none does.
    """
    for name in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        if env.get(name):
            return env[name], f"{name} from the environment"
    import glob

    home = env.get("HOME") or str(Path.home())
    patterns = ("/usr/local/Ascend/ascend-toolkit/latest", f"{home}/Ascend/ascend-toolkit/latest",
                f"{home}/Ascend/cann-*", "/home/*/Ascend/cann-*")
    for pattern in patterns:
        for cand in sorted(glob.glob(pattern)) if "*" in pattern else [pattern]:
            if Path(cand, "set_env.sh").is_file():
                return cand, f"found {cand}/set_env.sh"
    return None, ("no CANN toolkit: ASCEND_TOOLKIT_HOME and ASCEND_HOME_PATH unset and no "
                  "set_env.sh under " + ", ".join(patterns))


def atb_set_env(toolkit: str | None, env: Mapping[str, str]) -> tuple[Path | None, str]:
    """(ATB's set_env.sh, how): ATB_SET_ENV, else nnal/atb beside the toolkit (L226-235)."""
    if env.get("ATB_SET_ENV"):
        return Path(env["ATB_SET_ENV"]), "ATB_SET_ENV from the environment"
    cands = [ascend_root(toolkit) / "nnal/atb/set_env.sh"] if toolkit else []
    cands.append(Path("/usr/local/Ascend/nnal/atb/set_env.sh"))
    for cand in cands:
        if cand.is_file():
            return cand, f"found {cand}"
    # the launcher's own warning text (L235)
    return None, ("ATB set_env not found (ATB ops may be unavailable); set ATB_SET_ENV=<path> "
                  "if needed")


def cann_scripts(serve: Serve, toolkit: str | None,
                 env: Mapping[str, str] | None = None) -> list[Path]:
    """The recipe's set_env scripts with {toolkit}, {ascend_root} and {atb_set_env} filled in.

    An {atb_set_env} entry that finds nothing is left out (the launcher warns and goes on).
    """
    if not toolkit:
        return []
    root = ascend_root(toolkit)
    out = []
    for item in serve.cann_set_env:
        if "{atb_set_env}" in item:
            atb, _ = atb_set_env(toolkit, env or {})
            if atb is not None:
                out.append(atb)
            continue
        out.append(Path(item.replace("{toolkit}", toolkit).replace("{ascend_root}", str(root))))
    return out


def op_dir(workspace: Workspace, recipe: Recipe, env: Mapping[str, str]) -> tuple[Path, str]:
    """(where sglang will import the AscendC operator from, origin of that directory).

    $KT_MXFP4_OP_DIR wins (sglang/0003 reads it first). Otherwise the tool points it at the
    recipe's ascendc-op build directory instead of copying scripts/tools/* under
    <ktransformers root>/tools as the guide does (§3, §6): a copy goes stale when the op is
    rebuilt (the guide's own warning), and the patched tree stays free of untracked files.
    """
    if env.get(OP_DIR_ENV):
        return Path(env[OP_DIR_ENV]), ENVIRONMENT
    step = next((s for s in recipe.build.steps if s.name == OP_STEP), None)
    if step is not None:
        return bringup.step_workdir(workspace, step), WORKSPACE
    return workspace.tree_dir(recipe) / "tools" / "ascendc_mxfp4", "sglang's default"


def missing_op_files(directory: Path) -> list[str]:
    return [name for name in OP_FILES if not (directory / name).is_file()]


def read_api_key(path: Path) -> str:
    """The key in ``path`` (one line, no blanks); InputError naming the file and the fix."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot read the API key file ({exc.strerror}); write the key "
                         "on one line in a file only you can read (chmod 600)") from None
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    if len(lines) != 1 or any(c.isspace() for c in lines[0]):
        raise InputError(f"{path}: the API key file must hold exactly one key on one line "
                         f"(found {len(lines)} non-empty lines); write just the key")
    return lines[0]


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def _env_number(env: Mapping[str, str], name: str, kind: type[int] | type[float]
                ) -> int | float | None:
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        return kind(raw)
    except ValueError:
        line = FLAG_KNOBS[name][1] if name in FLAG_KNOBS else ""
        raise InputError(
            f"{name}={raw!r} in the environment is not a{'n integer' if kind is int else ' number'}"
            f" (the launcher reads it at {line}); fix or unset it"
        ) from None


def connect_url(host: str, port: int) -> str:
    """The URL a local client uses: a wildcard bind address is reached on loopback."""
    if host in ("0.0.0.0", "", "::", "[::]"):
        host = "127.0.0.1"
    return f"http://{host}:{port}"



def sglang_flags(recipe: Recipe, *, model_path: str, weight_path: str, gpu_experts: int,
                 pools: int, threads: int, chunk: int, mem_fraction: float | None = None,
                 port: int | None = None, quantization: str | None = None,
                 skip_warmup: bool | None = None, api_key: bool = False,
                 extra: Sequence[str] | None = None) -> list[str]:
    """The launch flags, in the launcher's order (L306-331)."""
    s = recipe.serve
    mem_fraction = s.mem_fraction_static if mem_fraction is None else mem_fraction
    if skip_warmup is None:
        # streaming prefill never runs the CPU MoE, so the launcher keeps sglang's warm-up on
        # to warm kt-kernel; without streaming it skips the warm-up (L288-296)
        skip_warmup = s.env.get("KT_PREFILL_STREAM") != "1"
    flags = [
        "--model-path", model_path,
        "--device", s.device_type,
        "--tensor-parallel-size", "1",
        "--page-size", str(s.page_size),
        "--attention-backend", s.attention_backend,
        "--quantization", quantization or s.quantization,
        "--disable-shared-experts-fusion",
        "--dtype", s.dtype,
        "--trust-remote-code",
        "--mem-fraction-static", f"{mem_fraction:g}",
        "--disable-radix-cache",
        "--max-prefill-tokens", str(s.max_prefill_tokens),
        "--context-length", str(s.context_length),
        "--watchdog-timeout", str(s.watchdog_timeout),
    ]
    if skip_warmup:
        flags.append("--skip-server-warmup")
    flags += [
        "--kt-method", s.kt_method,
        "--kt-num-gpu-experts", str(gpu_experts),
        "--kt-weight-path", weight_path,
        "--kt-threadpool-count", str(pools),
        "--kt-cpuinfer", str(threads),
        "--max-running-requests", str(s.max_running_requests),
        "--chunked-prefill-size", str(chunk),
        "--host", s.host,
        "--port", str(s.port if port is None else port),
    ]
    if api_key:
        # sglang's --api-key; the real key replaces the placeholder only at exec time
        flags += ["--api-key", API_KEY_PLACEHOLDER]
    return flags + list(s.extra_args if extra is None else extra)


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
    own_command = s.command is not None
    notes: list[str] = []
    warnings: list[str] = []
    origins: dict[str, str] = {}
    sets = set(set_keys)

    def recipe_origin(field_name: str) -> str:
        return SET if f"serve.{field_name}" in sets else RECIPE

    for flag, field_name in _FLAG_FIELDS.items():
        origins[flag] = recipe_origin(field_name)

    def from_env(name: str) -> str:
        return f"{ENVIRONMENT} ({name}, launcher {FLAG_KNOBS[name][1]})"

    def launcher_number(name: str, kind: type[int] | type[float], recipe_value: float,
                        flag: str) -> float:
        """The launcher's ``${NAME:-default}``: an exported value wins over the recipe's."""
        value = _env_number(base_env, name, kind)
        if value is None:
            return recipe_value
        origins[flag] = from_env(name)
        return value

    # --- CPU pools and threads: the environment's, else derived from the host
    env_pools = _env_number(base_env, "KT_THREADPOOL_COUNT", int)
    env_threads = _env_number(base_env, "KT_CPUINFER", int)
    nodes = max(1, len(host.numa_nodes))
    if env_pools is not None and not 1 <= env_pools <= nodes:
        raise InputError(
            f"KT_THREADPOOL_COUNT={env_pools} in the environment: this host has {nodes} NUMA "
            f"node(s) and kt-kernel binds subpool i to node i (\"NUMA node N not found\" "
            f"otherwise, launcher L127-129); export a value from 1 to {nodes} or unset it"
        )
    pools, threads = cpu_threads(s, host.numa_nodes, host.cores, int(env_pools or 0) or None)
    origins["--kt-threadpool-count"] = (from_env("KT_THREADPOOL_COUNT") if env_pools else
                                        f"{HOST} ({nodes} NUMA node(s))")
    origins["--kt-cpuinfer"] = f"{HOST} ({pools} pool(s), {host.cores} cores)"
    if env_threads is not None:
        if env_threads < pools:
            raise InputError(f"KT_CPUINFER={env_threads} in the environment: fewer threads than "
                             f"the {pools} subpool(s); export at least {pools} or unset it")
        threads = int(env_threads)
        origins["--kt-cpuinfer"] = from_env("KT_CPUINFER")
        if threads >= host.cores:
            warnings.append(f"KT_CPUINFER={threads} takes every core of this {host.cores}-core "
                            "host: the pool thrashes (launcher L124-125); leave headroom")

    # --- chunked prefill: the environment's, else the recipe's raised for --longest-prompt
    env_chunk = _env_number(base_env, "CHUNKED_PREFILL_SIZE", int)
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
        chunk = int(env_chunk)
        origins["--chunked-prefill-size"] = from_env("CHUNKED_PREFILL_SIZE")
    else:
        chunk = chunked_prefill(s, longest_prompt)
        if chunk > s.chunked_prefill_size:  # only --longest-prompt can exceed the recipe's
            notes.append(f"chunked prefill raised from {s.chunked_prefill_size} to {chunk} to "
                         f"cover a {longest_prompt}-token prompt")
            origins["--chunked-prefill-size"] = f"{OPTION} (--longest-prompt)"
        elif chunk < s.chunked_prefill_size:
            notes.append(f"chunked prefill lowered from {s.chunked_prefill_size} to {chunk}: "
                         f"serve.max_prefill_tokens is {s.max_prefill_tokens}")

    # --- resident experts and the static memory fraction
    base_experts = int(launcher_number("KT_NUM_GPU_EXPERTS", int, s.kt_num_gpu_experts,
                                       "--kt-num-gpu-experts"))
    experts = base_experts if gpu_experts is None else gpu_experts
    if experts != base_experts:
        origins["--kt-num-gpu-experts"] = f"{RULE} (retry after a KV/HBM failure)"
    if not 0 <= experts <= s.kt_num_gpu_experts_max:
        raise InputError(
            f"KT_NUM_GPU_EXPERTS={experts}: above the measured ceiling of "
            f"{s.kt_num_gpu_experts_max} resident experts at context 65536 (launcher L299-300; "
            "each costs ~1 GB of HBM); use at most that, or lower serve.context_length and raise "
            "serve.kt_num_gpu_experts_max")
    base_fraction = float(launcher_number("MEM_FRACTION", float, s.mem_fraction_static,
                                          "--mem-fraction-static"))
    fraction = base_fraction if mem_fraction is None else mem_fraction
    if fraction != base_fraction:
        origins["--mem-fraction-static"] = f"{RULE} (retry after an HBM failure)"
    if not 0 < fraction < 1:
        raise InputError(f"MEM_FRACTION={fraction:g}: must be between 0 and 1 (default 0.81, "
                         "guide appendix G.1); fix or unset it")
    if fraction < s.mem_fraction_floor:
        warnings.append(
            f"--mem-fraction-static {fraction:g} is below the floor {s.mem_fraction_floor:g}: "
            "the KV pool drops below the context length (guide appendix G.1); use "
            f"{s.mem_fraction_floor:g}")

    port = int(launcher_number("PORT", int, s.port, "--port"))
    quantization = base_env.get("QUANTIZATION") or s.quantization
    if base_env.get("QUANTIZATION"):
        origins["--quantization"] = from_env("QUANTIZATION")

    # --- every launcher env knob: the environment's value, else the recipe's
    knob_env: dict[str, str] = {}
    for key, value in s.env.items():
        if key in ENV_KNOBS and base_env.get(key):
            origins[key] = f"{ENVIRONMENT} (launcher {ENV_KNOBS[key]})"
        else:
            knob_env[key] = value
            origins[key] = SET if ("serve.env" in sets or f"serve.env.{key}" in sets) else RECIPE
    for key in ENV_KNOBS:
        if base_env.get(key) and key not in s.env:
            origins[key] = f"{ENVIRONMENT} (launcher {ENV_KNOBS[key]})"

    def effective(key: str) -> str | None:
        if key in ENV_KNOBS and base_env.get(key):
            return base_env[key]
        return s.env.get(key, base_env.get(key))

    stream_on = effective("KT_PREFILL_STREAM") == "1"
    if not stream_on and "KT_STREAM_WARMUP" in knob_env and not base_env.get("KT_STREAM_WARMUP"):
        # the launcher exports KT_STREAM_WARMUP only with streaming prefill on (L288-291)
        del knob_env["KT_STREAM_WARMUP"]
        origins.pop("KT_STREAM_WARMUP", None)
    skip_env = base_env.get("SKIP_WARMUP")
    skip_warmup = (skip_env != "0") if skip_env else not stream_on
    origins["--skip-server-warmup"] = (f"{ENVIRONMENT} (SKIP_WARMUP, launcher L289-296)"
                                       if skip_env else f"{RULE} (KT_PREFILL_STREAM, L288-296)")

    extra = list(s.extra_args)
    for arg in extra:
        if arg.startswith("--"):
            origins.setdefault(arg, recipe_origin("extra_args"))
    if base_env.get("EXTRA_FLAGS"):
        # split on whitespace like `read -r -a` (L278-279)
        for arg in base_env["EXTRA_FLAGS"].split():
            extra.append(arg)
            if arg.startswith("--"):
                origins.setdefault(arg, f"{ENVIRONMENT} (EXTRA_FLAGS, launcher L278)")
    if effective("SGLANG_NPU_PROFILE_ENABLE") == "1" and "--disable-cuda-graph" not in extra:
        extra.append("--disable-cuda-graph")  # L213-216
        origins["--disable-cuda-graph"] = f"{RULE} (SGLANG_NPU_PROFILE_ENABLE=1, launcher L213)"
    derived_rules: dict[str, str] = {}
    sync_submit = effective("KT_FORCE_SYNC_SUBMIT")
    if "--disable-cuda-graph" in extra and sync_submit not in (None, "1"):
        warnings.append(f"KT_FORCE_SYNC_SUBMIT={sync_submit} with --disable-cuda-graph: eager "
                        "mode garbles the output unless it is 1 (guide appendix G)")
    if "--disable-cuda-graph" in extra and sync_submit is None:
        # guide appendix G: eager mode garbles the output (CPU MoE async submits not flushed),
        # fix KT_FORCE_SYNC_SUBMIT=1; appendix F pairs it with --disable-cuda-graph
        derived_rules["KT_FORCE_SYNC_SUBMIT"] = "1"
        origins["KT_FORCE_SYNC_SUBMIT"] = f"{RULE} (--disable-cuda-graph: guide appendix G)"
        notes.append("--disable-cuda-graph (eager mode): KT_FORCE_SYNC_SUBMIT=1 set, else the "
                     "output is garbled (guide appendix G)")

    mode, mode_reason = nsa_compressor_mode(s.nsa_compressor_mode, host.cann_version)
    mode_origin = RECIPE if s.nsa_compressor_mode != "auto" else f"{HOST} ({mode_reason})"
    # the launcher keeps ASCEND_RT_VISIBLE_DEVICES, else takes NPU_DEVICE_ID (L251-255)
    dev, dev_reason = pick_device(host.npus, device,
                                  base_env.get("ASCEND_RT_VISIBLE_DEVICES")
                                  or base_env.get("NPU_DEVICE_ID"),
                                  models=recipe.host.npu_models, mem_fraction=fraction)
    if dev is None and not own_command:
        raise Dsv4Error(
            f"serve: {dev_reason}; check `npu-smi info` (run `dsv4-offload doctor`) or pass "
            "--device N"
        )
    if dev is None:
        notes.append(f"{dev_reason}; ASCEND_RT_VISIBLE_DEVICES left unset (serve.command set)")

    model_path = str(workspace.weights_dir(recipe, "w8a8"))
    weight_path = weight_template(workspace, recipe)
    origins["--model-path"] = origins["--kt-weight-path"] = WORKSPACE
    missing = missing_layer_files(workspace, recipe)
    if missing and not require_layers:
        notes.append(f"{len(missing)} of {recipe.conversion.layers} GGUF layer files missing "
                     f"(first: {missing[0]}); run `dsv4-offload convert`")
    elif missing:
        raise InputError(
            f"{missing[0]}: GGUF layer file missing ({len(missing)} of "
            f"{recipe.conversion.layers} absent; --kt-weight-path {weight_path} must resolve "
            "for every layer); run `dsv4-offload convert` then `dsv4-offload verify-gguf`"
        )
    if base_env.get("KT_GGUF_TEMPLATE") and base_env["KT_GGUF_TEMPLATE"] != weight_path:
        notes.append(f"KT_GGUF_TEMPLATE={base_env['KT_GGUF_TEMPLATE']} from the environment "
                     "is not used: the workspace's GGUF set is served")

    # --- the AscendC operator, where sglang imports it from
    ops, ops_origin = op_dir(workspace, recipe, base_env)
    depool = effective("KT_MXFP4_DEPOOL") == "1"
    absent = missing_op_files(ops) if depool else []
    if absent:
        message = (f"{ops / absent[0]}: the AscendC MXFP4 operator is missing and "
                   "KT_MXFP4_DEPOOL=1 (sglang imports it from $KT_MXFP4_OP_DIR; every prefill "
                   "of 512+ tokens would fall back to hybrid)")
        fix = ("build it: `dsv4-offload build ascendc-op`, or serve without depool: --set "
               "serve.env.KT_MXFP4_DEPOOL=0")
        if require_layers and not own_command:
            raise InputError(f"{message}; {fix}")
        notes.append(f"{message}; {fix}")

    api_key = api_key_file is not None
    if api_key_file is not None:
        read_api_key(api_key_file)  # validated now; only the starting process keeps the key
        origins["--api-key"] = f"{OPTION} (--api-key-file {api_key_file})"
    elif not is_loopback(s.host):
        warnings.append(f"the server binds {s.host} with no API key: anyone who reaches port "
                        f"{port} can use it; pass --api-key-file FILE or --set "
                        "serve.host=127.0.0.1")

    flags = sglang_flags(recipe, model_path=model_path, weight_path=weight_path,
                         gpu_experts=experts, pools=pools, threads=threads, chunk=chunk,
                         mem_fraction=fraction, port=port, quantization=quantization,
                         skip_warmup=skip_warmup, api_key=api_key, extra=extra)
    python = python or s.python
    argv = _command(s, flags, model_path, python)

    env = {k: v for k, v in base_env.items() if k not in set(s.unset_env)}
    env_unset = sorted(k for k in s.unset_env if k in base_env)
    # the GGUF dedup path reads the template from the environment too (L113-116)
    derived_env: dict[str, str] = {"KT_GGUF_TEMPLATE": weight_path}
    origins["KT_GGUF_TEMPLATE"] = WORKSPACE
    # streaming prefill reads config and index from both checkpoints; the launcher derives
    # them from MODEL_PATH unless exported (L78-79)
    for key, value in (("KT_PREFILL_STREAM_CKPT", model_path),
                       ("KT_MXFP4_CKPT", str(workspace.weights_dir(recipe, "mxfp4")))):
        if not base_env.get(key):
            derived_env[key] = value
            origins[key] = WORKSPACE
    if base_env.get("KT_NSA_COMPRESSOR_MODE"):
        mode, mode_reason = base_env["KT_NSA_COMPRESSOR_MODE"], "explicitly set (L172-173)"
    else:
        derived_env["KT_NSA_COMPRESSOR_MODE"] = mode
        origins["KT_NSA_COMPRESSOR_MODE"] = mode_origin
    if depool and ops_origin == WORKSPACE:
        derived_env[OP_DIR_ENV] = str(ops)
        origins[OP_DIR_ENV] = f"{WORKSPACE} (the ascendc-op build directory)"
    elif depool and ops_origin == ENVIRONMENT:
        origins[OP_DIR_ENV] = ENVIRONMENT

    derived_env["PYTHONPATH"] = server_pythonpath(workspace.tree_dir(recipe),
                                                  base_env.get("PYTHONPATH"))
    origins["PYTHONPATH"] = f"{WORKSPACE} (launcher order, L24 + L46)"
    if not own_command:
        derived_env["PYTHON_BIN"] = python  # the launcher exports its choice (L56)
        origins["PYTHON_BIN"] = python_origin
    toolkit = toolkit or host.cann_toolkit
    if toolkit:
        derived_env["ASCEND_TOOLKIT_HOME"] = toolkit
        origins["ASCEND_TOOLKIT_HOME"] = (
            ENVIRONMENT if base_env.get("ASCEND_TOOLKIT_HOME") == toolkit else toolkit_origin)
    if dev is not None:
        derived_env["ASCEND_RT_VISIBLE_DEVICES"] = dev
        origins["ASCEND_RT_VISIBLE_DEVICES"] = (
            f"{OPTION} (--device)" if device is not None else
            ENVIRONMENT if dev_reason == "kept from the environment" else f"{HOST} ({dev_reason})")
    derived_env.update(derived_rules)
    for key in (script_env or {}):
        origins.setdefault(key, SCRIPTS)
    for layer in (dict(script_env or {}), knob_env, derived_env):
        env.update(layer)
    env_set = {k: v for k, v in env.items() if base_env.get(k) != v}

    derived = {
        "threadpool_count": pools, "cpuinfer": threads, "numa_nodes": len(host.numa_nodes),
        "cores": host.cores, "chunked_prefill_size": chunk, "kt_num_gpu_experts": experts,
        "mem_fraction_static": fraction,
        "nsa_compressor_mode": mode, "nsa_compressor_mode_reason": mode_reason,
        "device": dev, "device_reason": dev_reason, "weight_path": weight_path,
        "cann_version": host.cann_version, "op_dir": str(ops) if depool else None,
        "python": python,
    }
    return ServePlan(argv=argv, env=env, env_set=env_set, env_unset=env_unset,
                     url=connect_url(s.host, port), derived=derived, notes=notes,
                     warnings=warnings, origins=origins,
                     api_key_file=str(api_key_file) if api_key_file else None)


def _command(serve: Serve, flags: list[str], model_path: str, python: str) -> list[str]:
    if serve.command is None:
        return [python, "-m", SGLANG_MODULE, *flags]
    values = {"{python}": python, "{host}": serve.host, "{port}": str(serve.port),
              "{model_path}": model_path}
    argv: list[str] = []
    placed = False
    for part in serve.command:
        if part == "{flags}":
            placed = True
            if serve.pass_flags:
                argv += flags
            continue
        for key, value in values.items():
            part = part.replace(key, value)
        argv.append(part)
    if serve.pass_flags and not placed:
        argv += flags
    return argv


# --- the CANN scripts' environment (edge: runs bash once, caches the result) ---------------


def capture_script_env(scripts: Sequence[Path], base_env: Mapping[str, str], *,
                       cache_dir: Path | None = None, timeout: float = 60) -> dict[str, str]:
    """What sourcing ``scripts`` in bash adds or changes, relative to ``base_env``.

    Sourced in a child bash (with -e/-u relaxed: vendor scripts are not `set -u` clean) and
    read back with `env -0`, rather than sourced by hand; cached by the scripts' stats.
    """
    present = [p for p in scripts if p.is_file()]
    if not present:
        return {}
    key = _scripts_key(present, base_env)
    cache = cache_dir / f"cann-env-{key}.json" if cache_dir else None
    if cache and cache.is_file():
        try:
            cached = json.loads(cache.read_text(encoding="utf-8"))
            if isinstance(cached, dict):
                return {str(k): str(v) for k, v in cached.items()}
        except (OSError, ValueError):
            pass  # a damaged cache is recaptured below
    before = _bash_env("", [], base_env, timeout)
    body = 'set +eu; for f in "$@"; do source "$f" || exit 97; done; '
    after = _bash_env(body, [str(p) for p in present], base_env, timeout)
    diff = {k: v for k, v in after.items() if k not in _SHELL_NOISE and before.get(k) != v}
    if cache:
        from dsv4_offload.workspace.store import atomic_write_json

        atomic_write_json(cache, diff)
    return diff


def _bash_env(body: str, args: list[str], base_env: Mapping[str, str],
              timeout: float) -> dict[str, str]:
    script = body + "env -0"
    try:
        proc = subprocess.run(["bash", "-c", script, "bash", *args], env=dict(base_env),
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                              check=False)
    except FileNotFoundError:
        raise Dsv4Error("bash not found: it is needed to read the CANN set_env scripts; "
                        "install bash") from None
    except subprocess.TimeoutExpired:
        raise Dsv4Error(f"sourcing {' '.join(args)} took over {timeout:.0f}s; check those "
                        "scripts (serve.cann_set_env)") from None
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        raise Dsv4Error(f"sourcing the CANN scripts {' '.join(args)} failed "
                        f"({err[-1] if err else f'exit {proc.returncode}'}); fix the script or "
                        "remove it from serve.cann_set_env")
    env: dict[str, str] = {}
    for item in proc.stdout.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _scripts_key(scripts: Sequence[Path], base_env: Mapping[str, str]) -> str:
    h = hashlib.sha256()
    for p in scripts:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for k in sorted(base_env):
        h.update(f"{k}={base_env[k]}\0".encode())
    return h.hexdigest()[:16]


def inherited_env() -> dict[str, str]:
    """The environment the server would inherit from this process."""
    return dict(os.environ)
