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

from dsv4_offload.errors import Dsv4Error, InputError
from dsv4_offload.host import choose_npu

if TYPE_CHECKING:
    from dsv4_offload.host import HostFacts, NpuInfo
    from dsv4_offload.recipe import Recipe, Serve
    from dsv4_offload.workspace import Workspace

# kt-kernel substitutes this itself, once per layer: it must reach the server unexpanded.
LAYER_PLACEHOLDER = "{layer_idx}"
SGLANG_MODULE = "sglang.launch_server"
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

    def as_dict(self) -> dict[str, Any]:
        return {"argv": self.argv, "env_set": dict(sorted(self.env_set.items())),
                "env_unset": self.env_unset, "url": self.url, "derived": self.derived,
                "notes": self.notes, "shell": self.shell()}


# --- derivation rules (pure) ----------------------------------------------------------------


def cpu_threads(serve: Serve, numa_nodes: Sequence[int], cores: int) -> tuple[int, int]:
    """(threadpool count, CPU-infer threads) for this host.

    kt-kernel binds subpool i to NUMA node i, so more subpools than nodes fails with
    "NUMA node N not found"; taking every core makes the spinning pool thrash.
    """
    pools = max(1, len(numa_nodes))
    cap = cores - serve.reserved_cores
    threads = min(serve.threads_per_numa * pools, cap)
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


def cann_scripts(serve: Serve, toolkit: str | None) -> list[Path]:
    """The recipe's set_env scripts with {toolkit} and {ascend_root} filled in."""
    if not toolkit:
        return []
    root = Path(toolkit).parent
    if root.name == "ascend-toolkit":  # .../Ascend/ascend-toolkit/latest -> .../Ascend
        root = root.parent
    return [Path(s.replace("{toolkit}", toolkit).replace("{ascend_root}", str(root)))
            for s in serve.cann_set_env]


def connect_url(host: str, port: int) -> str:
    """The URL a local client uses: a wildcard bind address is reached on loopback."""
    if host in ("0.0.0.0", "", "::", "[::]"):
        host = "127.0.0.1"
    return f"http://{host}:{port}"


def sglang_flags(recipe: Recipe, *, model_path: str, weight_path: str, gpu_experts: int,
                 pools: int, threads: int, chunk: int) -> list[str]:
    """The launch flags, in the order of the brief's launch line."""
    s = recipe.serve
    flags = [
        "--model-path", model_path,
        "--device", s.device_type,
        "--tensor-parallel-size", "1",
        "--page-size", str(s.page_size),
        "--attention-backend", s.attention_backend,
        "--quantization", s.quantization,
        "--disable-shared-experts-fusion",
        "--dtype", s.dtype,
        "--trust-remote-code",
        "--mem-fraction-static", f"{s.mem_fraction_static:g}",
        "--disable-radix-cache",
        "--max-prefill-tokens", str(s.max_prefill_tokens),
        "--context-length", str(s.context_length),
        "--watchdog-timeout", str(s.watchdog_timeout),
    ]
    # streaming prefill never runs the CPU MoE, so the launcher keeps sglang's warm-up on to
    # warm kt-kernel; without streaming it skips the warm-up (the baseline)
    if s.env.get("KT_PREFILL_STREAM") != "1":
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
        "--port", str(s.port),
    ]
    return flags + list(s.extra_args)


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
    require_layers: bool = True,
) -> ServePlan:
    """Derive argv and env. ``script_env`` is what the CANN scripts set (capture_script_env).

    Missing GGUF layer files are an error, or with ``require_layers=False`` a note.
    """
    s = recipe.serve
    own_command = s.command is not None
    notes: list[str] = []
    pools, threads = cpu_threads(s, host.numa_nodes, host.cores)
    chunk = chunked_prefill(s, longest_prompt)
    if chunk > s.chunked_prefill_size:  # only --longest-prompt can exceed the recipe's chunk
        notes.append(f"chunked prefill raised from {s.chunked_prefill_size} to {chunk} to cover "
                     f"a {longest_prompt}-token prompt")
    elif chunk < s.chunked_prefill_size:
        notes.append(f"chunked prefill lowered from {s.chunked_prefill_size} to {chunk}: "
                     f"serve.max_prefill_tokens is {s.max_prefill_tokens}")
    experts = s.kt_num_gpu_experts if gpu_experts is None else gpu_experts
    mode, mode_reason = nsa_compressor_mode(s.nsa_compressor_mode, host.cann_version)
    dev, dev_reason = pick_device(host.npus, device, base_env.get("ASCEND_RT_VISIBLE_DEVICES"),
                                  models=recipe.host.npu_models,
                                  mem_fraction=s.mem_fraction_static)
    if dev is None and not own_command:
        raise Dsv4Error(
            f"serve: {dev_reason}; check `npu-smi info` (run `dsv4-offload doctor`) or pass "
            "--device N"
        )
    if dev is None:
        notes.append(f"{dev_reason}; ASCEND_RT_VISIBLE_DEVICES left unset (serve.command set)")

    model_path = str(workspace.weights_dir(recipe, "w8a8"))
    weight_path = weight_template(workspace, recipe)
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

    flags = sglang_flags(recipe, model_path=model_path, weight_path=weight_path,
                         gpu_experts=experts, pools=pools, threads=threads, chunk=chunk)
    argv = _command(s, flags, model_path)

    env = {k: v for k, v in base_env.items() if k not in set(s.unset_env)}
    env_unset = sorted(k for k in s.unset_env if k in base_env)
    derived_env: dict[str, str] = {
        # the GGUF dedup path reads the template from the environment too
        "KT_GGUF_TEMPLATE": weight_path,
        # streaming prefill reads config and index from both checkpoints
        "KT_PREFILL_STREAM_CKPT": model_path,
        "KT_MXFP4_CKPT": str(workspace.weights_dir(recipe, "mxfp4")),
        "KT_NSA_COMPRESSOR_MODE": mode,
    }
    # sglang and kt_kernel import from their checkouts, as the build's import check did
    from dsv4_offload.stages.build import runtime_pythonpath

    pythonpath = [str(p) for p in runtime_pythonpath(workspace, recipe)]
    if base_env.get("PYTHONPATH"):
        pythonpath.append(base_env["PYTHONPATH"])
    derived_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    if host.cann_toolkit:
        derived_env["ASCEND_TOOLKIT_HOME"] = host.cann_toolkit
    if dev is not None:
        derived_env["ASCEND_RT_VISIBLE_DEVICES"] = dev
    for layer in (dict(script_env or {}), dict(s.env), derived_env):
        env.update(layer)
    env_set = {k: v for k, v in env.items() if base_env.get(k) != v}

    derived = {
        "threadpool_count": pools, "cpuinfer": threads, "numa_nodes": len(host.numa_nodes),
        "cores": host.cores, "chunked_prefill_size": chunk, "kt_num_gpu_experts": experts,
        "nsa_compressor_mode": mode, "nsa_compressor_mode_reason": mode_reason,
        "device": dev, "device_reason": dev_reason, "weight_path": weight_path,
        "cann_version": host.cann_version,
    }
    return ServePlan(argv=argv, env=env, env_set=env_set, env_unset=env_unset,
                     url=connect_url(s.host, s.port), derived=derived, notes=notes)


def _command(serve: Serve, flags: list[str], model_path: str) -> list[str]:
    if serve.command is None:
        return [serve.python, "-m", SGLANG_MODULE, *flags]
    values = {"{python}": serve.python, "{host}": serve.host, "{port}": str(serve.port),
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
        from dsv4_offload.workspace import atomic_write_json

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
