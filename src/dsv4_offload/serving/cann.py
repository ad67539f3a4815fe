"""The CANN toolkit's environment: found as the delivery's launcher finds it, read from its scripts.

The search (``toolkit_home``, ``atb_set_env``) follows cann-recipes-infer @ 1a7fbd34,
integration/sglang/dsv4-flash-single-npu-moe-offload/scripts/tools/launch_ds4flash_npu.sh
(L137-148, L226-235). What the recipe's ``set_env`` scripts export is read at the edge, in
one function (``capture_script_env``): run once in bash and cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4_offload.core.errors import Dsv4Error
from dsv4_offload.core.runner import capture

if TYPE_CHECKING:
    from dsv4_offload.recipe import Serve

# bash adds or rewrites these itself; they are not part of what the scripts export
_SHELL_NOISE = frozenset({"SHLVL", "_", "PWD", "OLDPWD"})


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
        proc = capture(["bash", "-c", script, "bash", *args], env=base_env, timeout=timeout)
    except FileNotFoundError:
        raise Dsv4Error("bash not found: it is needed to read the CANN set_env scripts; "
                        "install bash") from None
    except subprocess.TimeoutExpired:
        raise Dsv4Error(f"sourcing {' '.join(args)} took over {timeout:.0f}s; check those "
                        "scripts (serve.cann_set_env)") from None
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise Dsv4Error(f"sourcing the CANN scripts {' '.join(args)} failed "
                        f"({err[-1] if err else f'exit {proc.returncode}'}); fix the script or "
                        "remove it from serve.cann_set_env")
    env: dict[str, str] = {}
    for item in proc.stdout.split("\0"):
        if "=" in item:
            k, v = item.split("=", 1)
            env[k] = v
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
