"""The launch plan's rules: the launcher's variables, and pure derivations from the recipe and host.

ENV_KNOBS and FLAG_KNOBS list the variables the delivery's launcher reads; each function is
one rule of that launcher (cann-recipes-infer @ 1a7fbd34,
integration/sglang/dsv4-flash-single-npu-moe-offload/scripts/tools/launch_ds4flash_npu.sh;
line numbers below are that file's) or of its guide. The only reads are at the edge, each in
its own function: the existence of the GGUF layer files (``missing_layer_files``) and of the
AscendC operator (``missing_op_files``), and the API key file (``read_api_key``).
build_plan (serving.plan) applies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.build import bringup
from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.host import choose_npu
from dsv4_offload.core.inputs import read_user_text

if TYPE_CHECKING:
    from dsv4_offload.core.host import NpuInfo
    from dsv4_offload.recipe import Recipe, Serve
    from dsv4_offload.workspace.store import Workspace

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


# kt-kernel substitutes this itself, once per layer: it must reach the server unexpanded.
LAYER_PLACEHOLDER = "{layer_idx}"
# The operator sglang/0003 imports when KT_MXFP4_DEPOOL=1 (kt_stream_prefill.py, patch
# L233-249): `mxfp4_fused_op` from $KT_MXFP4_OP_DIR, else <ktransformers root>/tools/ascendc_mxfp4;
# the wrapper loads libmxfp4fused.so beside itself (scripts/tools/ascendc_mxfp4/
# mxfp4_fused_op.py L40-42).
OP_DIR_ENV = "KT_MXFP4_OP_DIR"
OP_FILES = ("libmxfp4fused.so", "mxfp4_fused_op.py")
OP_STEP = "ascendc-op"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")

# origins shown by `serve --print`
RECIPE, SET, ENVIRONMENT, HOST, WORKSPACE, OPTION, SCRIPTS, RULE, TUNED = (
    "recipe", "--set", "environment", "host", "workspace", "option", "CANN set_env", "rule",
    "tune overlay")


@dataclass(frozen=True)
class CpuPlan:
    """kt-kernel's CPU pools for this host, and what a host fact costs (a warning)."""

    pools: int
    threads: int
    warning: str | None = None


def cpu_plan(serve: Serve, numa_nodes: Sequence[int], cores: int,
             pools: int | None = None) -> CpuPlan:
    """The threadpool count and CPU-infer threads for this host: doctor's NUMA row and the
    serve plan both take them from here.

    One subpool per NUMA node: kt-kernel binds subpool i to node i, so more than the nodes
    fails with "NUMA node N not found" (L127-131). Threads: the launcher's 32 (L126, sized for
    the single-NUMA A3), raised to 16 per node on multi-NUMA hosts (L123-124; guide appendix
    E: 8 pools / 128 threads on the 8-NUMA Kunpeng-920), and never every core (L124-125).
    A host too small for the recipe's reserve gets one thread per pool and a warning; a host
    with fewer CPUs than pools cannot run them (Dsv4Error, exit 1: not a usage error).
    """
    pools = pools or max(1, len(numa_nodes))
    if cores < pools:
        raise Dsv4Error(
            f"host has {cores} CPU(s) for {pools} kt-kernel subpool(s) (one per NUMA node): not "
            "one CPU-infer thread each, so kt-kernel cannot run them; export "
            f"KT_THREADPOOL_COUNT={max(1, cores)} (fewer pools, each node's memory bandwidth "
            "unused) or serve on a host with more CPUs")
    cap = cores - serve.reserved_cores
    threads = min(max(serve.cpuinfer_default, serve.threads_per_numa * pools), cap)
    threads -= threads % pools  # equal threads per subpool
    if threads >= pools:
        return CpuPlan(pools, threads)
    return CpuPlan(pools, pools, (
        f"host has {cores} CPUs and {pools} NUMA node(s): serve.reserved_cores="
        f"{serve.reserved_cores} leaves fewer than one CPU-infer thread per node, so serve "
        f"runs one per node ({pools}) and keeps {cores - pools} core(s) free instead: the "
        "server's own threads compete with kt-kernel's (slower decode, stalls possible); "
        f"to accept that, `--set serve.reserved_cores={cores - pools}`; or serve on a host "
        "with more CPUs"))


def cpu_threads(serve: Serve, numa_nodes: Sequence[int], cores: int,
                pools: int | None = None) -> tuple[int, int]:
    """(threadpool count, CPU-infer threads) of :func:`cpu_plan`."""
    plan = cpu_plan(serve, numa_nodes, cores, pools)
    return plan.pools, plan.threads


def threadpool_problem(pools: int, nodes: int) -> str | None:
    """Why ``pools`` kt-kernel subpools cannot run on a host of ``nodes`` NUMA nodes, or None:
    kt-kernel binds subpool i to node i ("NUMA node N not found" otherwise, L127-131)."""
    if 1 <= pools <= nodes:
        return None
    return (f"this host has {nodes} NUMA node(s) and kt-kernel binds subpool i to node i "
            "(\"NUMA node N not found\" otherwise, launcher L127-129); use 1 to "
            f"{nodes}")


def cpuinfer_problem(threads: int, pools: int, cores: int, reserved: int) -> str | None:
    """Why ``threads`` CPU-infer threads over ``pools`` subpools do not fit the host, or None:
    at least one per subpool, and the recipe's reserved cores left free (L124-125)."""
    if threads < pools:
        return f"fewer threads than the {pools} subpool(s); give at least {pools}"
    if threads > cores - reserved:
        return (f"more than the {cores} cores less serve.reserved_cores={reserved} (the NPU "
                "callback, python and the OS need them; the pool thrashes, launcher "
                f"L124-125); give at most {max(pools, cores - reserved)}")
    return None


def experts_problem(serve: Serve, experts: int) -> str | None:
    """Why ``experts`` resident experts do not fit the NPU's HBM, or None: the measured
    ceiling (launcher L299-300; each costs ~1 GB of HBM)."""
    if 0 <= experts <= serve.kt_num_gpu_experts_max:
        return None
    return (f"above the measured ceiling of {serve.kt_num_gpu_experts_max} resident experts "
            "at context 65536 (launcher L299-300; each costs ~1 GB of HBM); use at most that, "
            "or lower serve.context_length and raise serve.kt_num_gpu_experts_max")


def mem_fraction_problem(serve: Serve, fraction: float, streaming: bool) -> str | None:
    """The MEM_FRACTION rule (guide appendix G.1): what ``fraction`` costs, or None.

    Below the floor the KV pool holds less than the context; above it with streaming prefill
    on, the streaming temporaries lose the headroom they use (G.1 L663-669: 0.85 OOMs a 32k
    streamed prefill into the hybrid fallback, 0.83 takes 125 s).
    """
    floor = serve.mem_fraction_floor
    if fraction > floor + 1e-9 and streaming:
        return (f"--mem-fraction-static {fraction:g} is above {floor:g} with streaming prefill "
                "on (KT_PREFILL_STREAM=1): the guide's A3 table (appendix G.1) shows 0.85 "
                "failing a 32k prefill into the slow hybrid fallback and 0.83 taking 125 s; "
                f"use {floor:g} unless you measured otherwise")
    if fraction < floor - 1e-9:
        return (f"--mem-fraction-static {fraction:g} is below the floor {floor:g}: the KV pool "
                f"drops below the context length (guide appendix G.1); use {floor:g}")
    return None


def numa_warning(numa_nodes: Sequence[int]) -> str | None:
    """What the host's NUMA layout costs the plan, if anything (doctor's row says the same)."""
    if not numa_nodes:
        return ("NUMA is not visible (no /sys/devices/system/node/node*: a container without "
                "/sys?): serve runs one threadpool, one node's memory bandwidth for the CPU "
                "MoE; bind-mount /sys or run on the host to use every node")
    if list(numa_nodes) != list(range(len(numa_nodes))):
        return (f"NUMA node ids {list(numa_nodes)} are not 0..{len(numa_nodes) - 1}: kt-kernel "
                "numbers its threadpools 0..N-1 and stops with `NUMA node N not found` at "
                "start; check `numactl -H` and the BIOS NUMA settings, or export "
                "KT_THREADPOOL_COUNT=1")
    return None


def dram_need(recipe: Recipe, pools: int) -> tuple[float, str]:
    """(GiB of DRAM the plan needs, how it adds up) for ``pools`` threadpools.

    With one pool kt-kernel points the experts at the mmapped GGUF; with several it copies
    each node's slice into anonymous memory (delivery main_repo/0002, moe.hpp), while
    streaming prefill still reads the GGUF set through the page cache: twice the set.
    """
    conv = recipe.conversion
    gguf = conv.layers * conv.expected_file_bytes / 2**30
    copies = 1 if pools == 1 else 2
    margin = recipe.host.memory_margin_gib
    need = gguf * copies + margin
    terms = (f"GGUF set {gguf:,.0f} GiB x {copies} "
             + ("(one pool: the experts read the mmapped set)" if copies == 1 else
                f"({pools} pools: each node's slice copied into anonymous memory, plus the set "
                "in the page cache for streaming prefill)")
             + f" + {margin:g} GiB margin = {need:,.0f} GiB; the GGUF term dominates")
    return need, terms


def dram_advice(recipe: Recipe, pools: int, available_gib: float) -> tuple[str, str]:
    """('ok' | 'warn' | 'fail', what to say) for the plan's DRAM against MemAvailable."""
    need, terms = dram_need(recipe, pools)
    if available_gib >= need:
        return "ok", terms
    one, _ = dram_need(recipe, 1)
    if pools > 1 and available_gib >= one:
        return "warn", (f"{available_gib:,.0f} GiB available, the plan needs {terms}: the page "
                        "cache thrashes and prefill takes hundreds of seconds. Your choice: "
                        f"KT_THREADPOOL_COUNT=1 needs {one:,.0f} GiB (the experts stay in the "
                        "mmapped set), at the cost of one NUMA node's memory bandwidth for the "
                        "CPU MoE (slower decode); or free memory")
    return "fail", (f"{available_gib:,.0f} GiB available, the plan needs {terms}; free memory "
                    "or use a host with more DRAM")


# Between "little anonymous memory" (one pool: the experts alias the mmapped GGUF) and "about
# the GGUF set" (several pools: each node's slice copied), the boundary is half the set.
ANON_BOUNDARY = 0.5


def anon_memory_verdict(recipe: Recipe, pools: int, anon_kib: int, processes: int
                        ) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """(the figures for the serve record, (warning, fix) when the server's RssAnon after
    ready contradicts the plan's memory model, else None).

    The model (the one :func:`dram_need` counts): with one threadpool the patched kt-kernel
    aliases the GGUF mmap instead of copying the experts (delivery main_repo/0002,
    kt-kernel/operators/llamafile/moe.hpp:393-431 of the patched tree, whose comment puts
    the copy at ~138 GB RssAnon and the alias at ~0); with several it copies each node's
    slice into anonymous memory: about the GGUF set in all.
    """
    conv = recipe.conversion
    gguf = conv.layers * conv.expected_file_bytes / 2**30
    anon = anon_kib / 2**20
    one = pools == 1
    figures = {"rss_anon_gib": round(anon, 3), "processes": processes,
               "threadpool_count": pools, "gguf_set_gib": round(gguf, 3),
               "expected": "little (the experts alias the mmapped GGUF set)" if one else
               "about the GGUF set (each node's slice copied)"}
    boundary = ANON_BOUNDARY * gguf
    where = (f"the server holds {anon:,.1f} GiB of anonymous memory (RssAnon over its "
             f"{processes} processes) with {pools} CPU threadpool{'s' if pools > 1 else ''}")
    if one and anon >= boundary:
        figures["verdict"] = "contradicts the plan: the experts were copied"
        return figures, (
            f"{where}, where the plan expects the experts to stay in the mmapped GGUF set "
            f"({gguf:,.0f} GiB) and little anonymous memory: kt-kernel copied them, as a "
            "kernel built without the delivery's main_repo/0002 does (its "
            "operators/llamafile/moe.hpp:393-431 aliases the GGUF with one pool); the host "
            "needs the GGUF set twice in DRAM",
            "check the patches (`dsv4-offload patch status`) and rebuild kt-kernel from the "
            "patched tree: `dsv4-offload build kt-kernel --clean`, then serve again")
    if not one and anon < boundary:
        figures["verdict"] = "contradicts the plan: the experts were not copied"
        return figures, (
            f"{where}, where the plan expects each NUMA node's slice of the experts copied "
            f"into anonymous memory, about the GGUF set ({gguf:,.0f} GiB): this kernel does not "
            "do what the memory plan (doctor's memory-plan row) counts",
            "read the server log's kt-kernel load lines and check the extension the server "
            "loads (`dsv4-offload build kt-kernel` checks it); the DRAM figure of the plan may "
            "be too high for it")
    figures["verdict"] = "as planned"
    return figures, None


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
        if npus and known[requested] not in healthy:  # a fact of the host: exit 1, not 2
            raise Dsv4Error(
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
    text = read_user_text(path, "API key file", 4096, "write the key on one line in a file "
                          "only you can read (chmod 600)")
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    if len(lines) != 1 or any(c.isspace() for c in lines[0]):
        raise InputError(f"{path}: the API key file must hold exactly one key on one line "
                         f"(found {len(lines)} non-empty lines); write just the key")
    return lines[0]


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def env_number(env: Mapping[str, str], name: str, kind: type[int] | type[float]
                ) -> int | float | None:
    """The launcher's numeric knob ``name`` (FLAG_KNOBS) as exported; None when unset."""
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        return kind(raw)
    except ValueError:
        line = FLAG_KNOBS[name][1]
        raise InputError(
            f"{name}={raw!r} in the environment is not a{'n integer' if kind is int else ' number'}"
            f" (the launcher reads it at {line}); fix or unset it"
        ) from None


def connect_url(host: str, port: int) -> str:
    """The URL a local client uses: a wildcard bind address is reached on loopback."""
    if host in ("0.0.0.0", "", "::", "[::]"):
        host = "127.0.0.1"
    return f"http://{host}:{port}"
