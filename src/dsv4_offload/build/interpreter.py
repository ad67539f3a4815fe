"""The one Python interpreter that build, selftest and serve use, chosen as the delivery does.

The delivery's ``scripts/tools/python_env.sh`` (cann-recipes-infer @ 1a7fbd34) resolves it
for the launcher and the preflight alike: ``$PYTHON_BIN`` when set, with no fallback
(L46-48); else the first of a fixed candidate list that can import the modules the
launcher asks for (L50-56; the launcher asks for numpy torch torch_npu sglang, L55). The
kt-kernel extension binds to the interpreter that built it, so the choice is recorded once
in the workspace (provenance.json, section ``python``) and every later step reuses it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.runner import capture

if TYPE_CHECKING:
    from dsv4_offload.workspace.context import StageContext

# python_env.sh L50-51, in its order
CANDIDATES: tuple[str, ...] = (
    "python3",
    "python3.11",
    "/usr/local/python3.11.14/bin/python3.11",
    "/usr/local/python3.11.14/bin/python3",
    "/opt/conda/bin/python3",
)
# launch_ds4flash_npu.sh L55: `resolve_python_bin launch numpy torch torch_npu sglang`
REQUIRED_MODULES: tuple[str, ...] = ("numpy", "torch", "torch_npu", "sglang")
PYTHON_BIN_ENV = "PYTHON_BIN"
PROVENANCE_SECTION = "python"
FALLBACK_SOURCE = "recipe"  # the recipe's python, taken for want of a qualifying one
_PROBE_TIMEOUT_S = 120  # importing torch_npu initialises CANN: slow on a cold cache
# python_env.sh L29-35 imports each module in turn; the same, as one -c program, which first
# looks each one up without importing it: a candidate that lacks torch fails as the import
# would ("No module named 'torch'") without importing numpy first (~0.1 s a candidate)
_IMPORT_PROGRAM = (
    "import importlib, importlib.util, sys\n"
    "for n in sys.argv[1:]:\n"
    "    if importlib.util.find_spec(n) is None:\n"
    "        raise ModuleNotFoundError(f'No module named {n!r}', name=n)\n"
    "for n in sys.argv[1:]:\n"
    "    importlib.import_module(n)")


@dataclass
class PythonChoice:
    """The chosen interpreter, where the choice came from, and what was tried."""

    path: str
    source: str  # "--python", "PYTHON_BIN", "recorded", "probe", "recipe"
    reason: str
    tried: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "source": self.source, "reason": self.reason,
                "tried": self.tried}


def missing_imports(python: str, modules: Sequence[str], env: Mapping[str, str]) -> str | None:
    """None when ``python`` imports every module; else a short reason (the last error line)."""
    try:
        proc = capture([python, "-c", _IMPORT_PROGRAM, *modules], env=env,
                       timeout=_PROBE_TIMEOUT_S)
    except FileNotFoundError:
        return "not found"
    except OSError as exc:
        return exc.strerror or str(exc)
    except subprocess.TimeoutExpired:
        return f"import took over {_PROBE_TIMEOUT_S}s"
    if proc.returncode == 0:
        return None
    lines = [x.strip() for x in (proc.stderr or proc.stdout).splitlines() if x.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


def resolve_python(*, explicit: str | None, env: Mapping[str, str],
                   candidates: Sequence[str] = CANDIDATES,
                   modules: Sequence[str] = REQUIRED_MODULES
                   ) -> tuple[PythonChoice | None, list[dict[str, str]]]:
    """``--python``, else ``$PYTHON_BIN`` (both without fallback), else the first candidate
    on ``env``'s PATH that imports ``modules``; (None, what was tried) when none does.

    ``env`` is the environment the probe runs in (its PATH and PYTHONPATH matter: the launcher
    sets PYTHONPATH before resolving, so sglang imports from its checkout).
    """
    if explicit:
        return PythonChoice(explicit, "--python", "given with --python"), []
    if env.get(PYTHON_BIN_ENV):
        # python_env.sh L46-48: honoured as is; a silent fallback would swap environments
        return PythonChoice(env[PYTHON_BIN_ENV], PYTHON_BIN_ENV,
                            "PYTHON_BIN is set (python_env.sh takes it without probing)"), []
    tried: list[dict[str, str]] = []
    for cand in candidates:
        found = shutil.which(cand, path=env.get("PATH", os.defpath))
        if found is None:
            tried.append({"candidate": cand, "result": "not on PATH"})
            continue
        why = missing_imports(found, modules, env)
        if why is None:
            return PythonChoice(found, "probe",
                                f"first of {', '.join(candidates)} that imports "
                                f"{' '.join(modules)}", tried), tried
        tried.append({"candidate": cand, "path": found, "result": why})
    return None, tried


def server_pythonpath(tree: Path, inherited: str | None) -> str:
    """The server's PYTHONPATH for the ktransformers tree ``tree``: the one place it is made.

    ensure_kt_kernel.sh L24 puts sglang/python and kt-kernel first, then the launcher's L46
    puts sglang/python and kt-kernel/python before those: the result repeats sglang/python.
    Whatever the environment already had (CANN's set_env.sh puts its own entries there)
    follows, as the launcher's ``${PYTHONPATH}`` does.
    """
    sglang = str(tree / "third_party" / "sglang" / "python")
    parts = [sglang, str(tree / "kt-kernel" / "python"), sglang, str(tree / "kt-kernel")]
    if inherited:
        parts.append(inherited)
    return os.pathsep.join(parts)


def _launcher_env(ctx: StageContext) -> dict[str, str]:
    """This process's environment with the launcher's PYTHONPATH in front (L24, L46)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = server_pythonpath(ctx.workspace.tree_dir(ctx.recipe),
                                          env.get("PYTHONPATH"))
    return env


def recorded_python(ctx: StageContext) -> dict[str, Any] | None:
    """The workspace's recorded choice, if any."""
    from dsv4_offload.workspace.store import read_json

    prov = read_json(ctx.workspace.provenance_file, {})
    entry = prov.get(PROVENANCE_SECTION) if isinstance(prov, dict) else None
    return entry if isinstance(entry, dict) and isinstance(entry.get("path"), str) else None


def chosen_python(ctx: StageContext, *, python: str | None = None, fallback: str | None = None,
                  record: bool = True, modules: Sequence[str] = REQUIRED_MODULES
                  ) -> PythonChoice:
    """The interpreter for this workspace: ``python`` (the stage's --python), ``$PYTHON_BIN``,
    the recorded choice, else the python_env.sh probe; recorded on first choice.

    With no qualifying candidate: ``fallback`` (the build passes its recipe python, since
    sglang may not import before it is built) is chosen and recorded, else InputError.
    """
    explicit = python
    env = _launcher_env(ctx)
    choice: PythonChoice | None
    prior = recorded_python(ctx)
    # a recorded fallback (source "recipe": nothing imported the modules when the build
    # began) is no choice: probe again, and never report it as the workspace's interpreter
    if not explicit and not env.get(PYTHON_BIN_ENV) and prior is not None \
            and prior.get("source") != FALLBACK_SOURCE and shutil.which(prior["path"]) is not None:
        return PythonChoice(prior["path"], "recorded",
                            f"recorded in {ctx.workspace.provenance_file.name} "
                            f"({prior.get('reason', 'earlier choice')})",
                            list(prior.get("tried") or []))
    choice, tried = resolve_python(explicit=explicit, env=env, modules=modules)
    if choice is None and fallback:
        choice = PythonChoice(fallback, FALLBACK_SOURCE,
                              f"no candidate imports {' '.join(modules)} yet: the recipe's "
                              "python", tried)
    if choice is None:
        first = next((f"{t['candidate']}: {t['result']}" for t in tried
                      if t["result"] != "not on PATH"), "none of them is on PATH")
        raise InputError(
            f"no python interpreter imports {' '.join(modules)} (tried {', '.join(CANDIDATES)} "
            f"with the server's PYTHONPATH; {first}); set PYTHON_BIN=/path/to/python3.11 or "
            "pass --python PATH (the one kt-kernel was built with)"
        )
    if record and (prior is None or prior.get("path") != choice.path):
        ctx.workspace.ensure()
        ctx.workspace.update_provenance(PROVENANCE_SECTION, choice.as_dict())
    return choice


def build_python(ctx: StageContext, python: str | None = None) -> str:
    """The workspace's one interpreter (:func:`chosen_python`), else the recipe's."""
    return chosen_python(ctx, python=python, fallback=ctx.recipe.build.interpreter).path
