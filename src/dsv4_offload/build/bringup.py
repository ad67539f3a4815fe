"""What build steps of an environment bring-up need beyond a command (the A3 recipe).

The delivery's ``scripts/tools/setup_dsv4_env_from_clean_cann.sh`` (cann-recipes-infer @
1a7fbd3, "S" below) brings a clean CANN 9.0.0 image up in phases, each with a workaround
for a known pitfall. Here those workarounds are step fields the build runner applies and then
checks, each failure naming it:

- ``umask`` (S96-97: umask 0002 makes msopgen's security check abort): the command runs
  with it, and no file it created may be group- or world-writable afterwards;
- ``chmod_go_w`` (S182, S227, S247): ``chmod -R go-w`` of the workdir first, then checked;
- ``context: cann`` (S48, S83, S116): the step runs in the shell the script keeps after its
  prereq phase: ``$CANN_HOME/set_env.sh`` sourced, ASCEND_HOME_PATH (and ASCEND_TOOLKIT_HOME)
  the CANN home, ``CANN_HOME`` from the environment honoured, ``build.vars.cann_home`` the
  default (:func:`cann_home`, :func:`step_command`);
- ``source_env`` (S87-91: the CANN/vendor set_env scripts read unset variables): sourced
  with nounset off, the resulting environment used by the command and the checks;
- build ``umask`` (S96-97: the prereq phase sets it once for the whole run): set by the build
  stage before the first step, restored after the last;
- ``edits`` (S248-258: -ldl for sgl_kernel_npu): a line extended unless already there,
  checked by the text it must then contain;
- ``install_run`` (S184-187, S231-233): the ``.run`` package the build produced, installed;
- ``require_installed`` (S125-137): installed versions against the constraints file;
- build ``constraints`` (S79-80, dsv4_torch_lock.txt): ``-c FILE`` on every pip install
  and ``PIP_CONSTRAINT`` for the pip calls inside build scripts.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import Dsv4Error
from dsv4_offload.core.runner import capture
from dsv4_offload.workspace.store import atomic_write_bytes

if TYPE_CHECKING:
    from dsv4_offload.recipe import BuildStep, FileEdit, Recipe, RunPackage
    from dsv4_offload.workspace.store import Workspace

_QUICK_TIMEOUT_S = 300.0
_PLACEHOLDER = re.compile(r"\{(python|workspace|(?:source|file|glob):[^{}]+|[A-Za-z0-9_.-]+)\}")
_PIP_CONSTRAINT = "PIP_CONSTRAINT"

KT_KERNEL_STEP = "kt-kernel"  # the build step that compiles kt-kernel
CANN_HOME_VAR = "cann_home"  # the build var naming the CANN home (S48's default)
CANN_HOME_ENV = "CANN_HOME"  # S48: `: "${CANN_HOME:=$HOME/Ascend/cann-9.0.0}"`
SET_ENV = "set_env.sh"  # S116: `source_env "$CANN_HOME/set_env.sh"`
# guide line 545 (appendix, method B): the AscendC header bisheng compiles the op against
KERNEL_OPERATOR_H = "aarch64-linux/tikcpp/tikcfw/kernel_operator.h"
# CANN 8.5 (the 910B image): the toolkit the delivery's launcher finds first and sources
# (launch_ds4flash_npu.sh L141, L145 and L237); the 910B recipe's serve.cann_set_env
# "{toolkit}/set_env.sh"
CANN8_SET_ENV = "/usr/local/Ascend/ascend-toolkit/latest/set_env.sh"


class StepFailed(Dsv4Error):
    """A workaround or check of a build step failed; ``fix`` says what to do."""

    def __init__(self, message: str, fix: str, log: Path | None = None) -> None:
        super().__init__(message, log=str(log) if log else None)
        self.fix = fix


def note(log: Path, text: str) -> None:
    """A line in the step's log saying what was done, so every workaround is visible."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"=== {now_iso()} {text}\n")


# --- placeholders ---------------------------------------------------------------------------


class Placeholders:
    """``{python}`` (the build python), ``{tool_python}`` (the interpreter running
    dsv4-offload, for its own cross-build helpers), ``{workspace}``, ``{source:NAME}``,
    ``{file:NAME}``, build ``vars`` and, as a whole argument, ``{glob:PATTERN}`` (the sorted
    matches in the workdir)."""

    def __init__(self, recipe: Recipe, workspace: Workspace, python: str,
                 environ: Mapping[str, str] | None = None) -> None:
        self.recipe, self.workspace = recipe, workspace
        self.values = {"python": python, "tool_python": sys.executable,
                       "workspace": str(workspace.root)}
        for key, value in recipe.build.vars.items():
            self.values[key] = os.path.expandvars(os.path.expanduser(value))
        home = cann_home(recipe, os.environ if environ is None else environ)
        if home is not None:  # {cann_home} is the CANN home the cann context sources
            self.values[CANN_HOME_VAR] = home[0]

    def text(self, value: str) -> str:
        def sub(m: re.Match[str]) -> str:
            key = m.group(1)
            if key.startswith("source:"):
                return str(self.workspace.source_dir(self.recipe, key[7:]))
            if key.startswith("file:"):
                return str(self.file_path(key[5:]))
            return self.values.get(key, m.group(0))

        return _PLACEHOLDER.sub(sub, value)

    def argv(self, args: list[str], workdir: Path) -> list[str]:
        out: list[str] = []
        for arg in args:
            if arg.startswith("{glob:") and arg.endswith("}"):
                pattern = self.text(arg[6:-1])
                found = sorted(str(p) for p in workdir.glob(pattern))
                if not found:
                    raise StepFailed(f"nothing in {workdir} matches {pattern}",
                                     "the command before produced nothing; read its log")
                out += found
            else:
                out.append(self.text(arg))
        return out

    def file_path(self, name: str) -> Path:
        remote = self.recipe.build.files[name]
        return self.workspace.source_dir(self.recipe, remote.source) / remote.path


def check_files(recipe: Recipe, workspace: Workspace, python: str) -> list[str]:
    """Every build.files entry present with its pinned sha256; the errors, one line each."""
    places = Placeholders(recipe, workspace, python)
    errors = []
    for name, remote in recipe.build.files.items():
        path = places.file_path(name)
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            errors.append(f"build.files.{name}: {path} is missing; run `dsv4-offload fetch` "
                          f"({remote.source} at its pinned commit holds it)")
            continue
        if digest != remote.sha256:
            errors.append(f"build.files.{name}: {path} has sha256 {digest[:16]}…, the recipe "
                          f"pins {remote.sha256[:16]}…; refetch {remote.source} "
                          "(`dsv4-offload fetch --force`) or fix the recipe")
    return errors


def with_constraints(argv: list[str], constraints: Path | None) -> list[str]:
    """``-c FILE`` appended to a pip install (S165, S167, S264 pass the torch lock so)."""
    if constraints is None or "install" not in argv:
        return argv
    if not any(Path(a).name in ("pip", "pip3") or a == "pip" for a in argv):
        return argv
    return [*argv, "-c", str(constraints)]


def constraints_env(env: dict[str, str], constraints: Path | None) -> dict[str, str]:
    """pip calls inside build scripts (build_and_install.sh) see the constraints too."""
    if constraints is not None:
        env = dict(env)
        env[_PIP_CONSTRAINT] = str(constraints)
    return env


# --- source_env: set_env scripts with nounset off ------------------------------------------


def sourced_env(scripts: list[str], env: dict[str, str], log: Path) -> dict[str, str]:
    """The environment after sourcing ``scripts`` in bash with nounset off (S87-91)."""
    for script in scripts:
        if not Path(script).is_file():
            raise StepFailed(f"source_env: {script} not found",
                             "install CANN there (or the vendor this step needs: an earlier "
                             "step installs it), or export CANN_HOME=DIR (or --set "
                             "build.vars.cann_home=DIR) naming it")
    body = "set -e; set +u; " + "".join(f'. "${i + 1}"; ' for i in range(len(scripts))) + \
        "set -u; env -0"
    proc = capture(["bash", "-c", body, "dsv4-source-env", *scripts], env=env,
                   timeout=_QUICK_TIMEOUT_S)
    note(log, f"workaround nounset-while-sourcing: sourced {' '.join(scripts)} with set +u "
              "(setup_dsv4_env_from_clean_cann.sh lines 87-91)")
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise StepFailed(f"workaround nounset-while-sourcing: sourcing {' '.join(scripts)} "
                         f"failed (exit {proc.returncode}): {tail[0]}",
                         "run the script by hand in bash to see why; the CANN home is "
                         "$CANN_HOME, else build.vars.cann_home")
    out: dict[str, str] = {}
    for item in proc.stdout.split("\0"):
        key, sep, value = item.partition("=")
        if sep and key:
            out[key] = value
    return out


# --- the cann context: the shell the delivery's script runs its phases in -------------------


def cann_home(recipe: Recipe, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(the CANN home, where it came from), or None when the recipe names none.

    A ``--set build.vars.cann_home=DIR`` wins; then ``$CANN_HOME`` exported where the build
    runs, as the script honours it (S48); then the recipe's ``build.vars.cann_home``.
    """
    value = recipe.build.vars.get(CANN_HOME_VAR)
    if value is None:
        return None
    keys = {item.split("=", 1)[0].removeprefix("recipe.") for item in recipe.overrides}
    if f"build.vars.{CANN_HOME_VAR}" not in keys and environ.get(CANN_HOME_ENV):
        return (os.path.expanduser(environ[CANN_HOME_ENV]),
                f"${CANN_HOME_ENV} (setup_dsv4_env_from_clean_cann.sh line 48)")
    how = ("--set build.vars.cann_home" if f"build.vars.{CANN_HOME_VAR}" in keys
           else "build.vars.cann_home")
    return os.path.expandvars(os.path.expanduser(value)), how


def set_env_hint(recipe: Recipe, environ: Mapping[str, str] | None = None) -> str:
    """The set_env.sh to source for this recipe's CANN: the CANN home's (CANN 9, S116), else
    the 910B image's CANN 8.5 toolkit (the launcher's first candidate, L141 and L145)."""
    home = cann_home(recipe, os.environ if environ is None else environ)
    if home is not None:
        return str(Path(home[0]) / SET_ENV)
    return CANN8_SET_ENV


def cann_env(recipe: Recipe, environ: Mapping[str, str], log: Path) -> dict[str, str]:
    """``environ`` with the CANN home's set_env.sh sourced and ASCEND_HOME_PATH and
    ASCEND_TOOLKIT_HOME set: what every phase of the script after prereq runs in (S83, S116)."""
    found = cann_home(recipe, environ)
    if found is None:
        raise StepFailed("context cann: the recipe names no CANN home",
                         "set build.vars.cann_home (or export CANN_HOME)")
    home, how = found
    script = Path(home) / SET_ENV
    if not script.is_file():
        raise StepFailed(f"context cann: {script} not found (CANN home from {how})",
                         f"install CANN {recipe.platform.cann} in {home}, or export "
                         "CANN_HOME=DIR (or --set build.vars.cann_home=DIR) naming it")
    env = dict(environ)
    env["ASCEND_HOME_PATH"] = home  # S83 exports it before any phase sources set_env
    env = sourced_env([str(script)], env, log)
    # what set_env.sh exported stays; a value it left alone (or one of another CANN the
    # environment had) becomes this CANN home, so nothing falls back to another toolkit
    if not env.get("ASCEND_HOME_PATH"):
        env["ASCEND_HOME_PATH"] = home
    if not env.get("ASCEND_TOOLKIT_HOME") or \
            env["ASCEND_TOOLKIT_HOME"] == environ.get("ASCEND_TOOLKIT_HOME"):
        env["ASCEND_TOOLKIT_HOME"] = env["ASCEND_HOME_PATH"]
    note(log, f"context cann: sourced {script} (CANN home from {how}); ASCEND_HOME_PATH="
              f"{env['ASCEND_HOME_PATH']} ASCEND_TOOLKIT_HOME={env['ASCEND_TOOLKIT_HOME']} "
              "(setup_dsv4_env_from_clean_cann.sh lines 48, 83, 116)")
    return env


@dataclass
class StepCommand:
    """What one build step runs: its argv (placeholders filled) and its whole environment."""

    argv: list[str]
    env: dict[str, str]


# What a build's compiles read for their parallelism, set from the `jobs` a pipelined run
# hands the build (recipe `pipeline:`): kt-kernel's setup.py takes CPUINFER_PARALLEL
# (kt-kernel/setup.py:125-131, detect_parallel_jobs, else multiprocessing.cpu_count(); lines
# of ktransformers d7b5b49 with the series' main_repo/0001+0002) and passes it on as
# `cmake --build . --parallel N` (setup.py:762-764); any other `cmake --build` of a step reads
# CMAKE_BUILD_PARALLEL_LEVEL (CMake's own variable, CMake >= 3.12).
PARALLEL_VARS = ("CPUINFER_PARALLEL", "CMAKE_BUILD_PARALLEL_LEVEL")


def parallel_env(environ: Mapping[str, str], jobs: int | None) -> dict[str, str]:
    """``environ`` with the parallel-job variables at ``jobs`` (none when None); one the
    operator exported wins, and so does a step's own `env` (applied after this)."""
    env = dict(environ)
    if jobs:
        for var in PARALLEL_VARS:
            env.setdefault(var, str(int(jobs)))
    return env


def step_command(step: BuildStep, recipe: Recipe, places: Placeholders,
                 environ: Mapping[str, str], workdir: Path, log: Path,
                 constraints: Path | None = None) -> StepCommand:
    """The one way a step's argv and environment are made, in the script's order: the
    context (``cann``: set_env.sh sourced, S116), the step's env, the compiler of kt-kernel
    (``platform.cc``/``cxx``: S281 sets CC/CXX for that phase alone), PIP_CONSTRAINT, then the
    step's own ``source_env`` scripts (S292-294)."""
    env = cann_env(recipe, environ, log) if step.context == "cann" else dict(environ)
    env.update({k: places.text(v) for k, v in step.env.items()})
    if step.name == KT_KERNEL_STEP:
        for var, value in (("CC", recipe.platform.cc), ("CXX", recipe.platform.cxx)):
            if value and var not in step.env:
                env[var] = value
    env = constraints_env(env, constraints)
    if step.source_env:
        env = sourced_env([places.text(x) for x in step.source_env], env, log)
    argv = with_constraints(places.argv(step.command, workdir), constraints)
    return StepCommand(argv, env)


# --- permissions: umask and chmod go-w ------------------------------------------------------


def parse_umask(value: str) -> int:
    return int(value, 8)


def writable_by_others(root: Path, newer_than: float | None = None) -> list[str]:
    """Files and dirs under ``root`` that group or others may write (msopgen refuses them)."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in [*dirnames, *filenames]:
            path = Path(dirpath, name)
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue
            if newer_than is not None and st.st_mtime < newer_than:
                continue
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                bad.append(str(path.relative_to(root)))
    return sorted(bad)


def chmod_go_w(root: Path, log: Path) -> None:
    """``chmod -R go-w`` (S182, S227, S247), then checked."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in [dirpath, *[os.path.join(dirpath, n) for n in filenames]]:
            path = Path(name)
            if path.is_symlink():
                continue
            mode = path.stat().st_mode
            if mode & (stat.S_IWGRP | stat.S_IWOTH):
                path.chmod(mode & ~(stat.S_IWGRP | stat.S_IWOTH))
    note(log, f"workaround chmod-go-w: chmod -R go-w {root} (msopgen's security check, "
              "setup_dsv4_env_from_clean_cann.sh lines 182, 227, 247)")
    left = writable_by_others(root)
    if left:
        raise StepFailed(f"workaround chmod-go-w: {left[0]} is still group/world-writable "
                         f"(+{len(left) - 1} more) after chmod -R go-w",
                         f"check the owner of {root} (chmod needs it) and rerun the build")


def remove_first(workdir: Path, rel: str, log: Path) -> None:
    """``chmod -R u+w`` the parent of ``rel``, then remove it (S259-261: deep_ep's vendor
    installs read-only, so a second build fails on `rm uninstall.sh`)."""
    import shutil

    target = workdir / rel
    parent = target.parent
    if parent.is_dir() and parent.resolve().is_relative_to(workdir.resolve()):
        for dirpath, _dirs, files in os.walk(parent):
            for name in [dirpath, *[os.path.join(dirpath, f) for f in files]]:
                path = Path(name)
                if not path.is_symlink():
                    path.chmod(path.stat().st_mode | stat.S_IWUSR)
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)
    else:
        return
    note(log, f"workaround read-only leftovers: removed {rel} (its parent made writable "
              "first, setup_dsv4_env_from_clean_cann.sh lines 259-261)")
    if target.exists():
        raise StepFailed(f"workaround read-only leftovers: {target} could not be removed",
                         f"remove it by hand (chmod -R u+w {parent}; rm -rf {target})")


# --- edits ----------------------------------------------------------------------------------


def apply_edit(workdir: Path, edit: FileEdit, log: Path) -> str:
    """Extend the first line matching ``edit.line`` unless the file has ``edit.unless``."""
    path = workdir / edit.file
    label = f"workaround {edit.why or edit.unless}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise StepFailed(f"{label}: cannot read {path} ({exc.strerror})",
                         "the source is not at its pinned commit: run `dsv4-offload fetch`"
                         ) from None
    if edit.unless in text:
        note(log, f"{label}: {edit.file} already has {edit.unless}")
        return "already"
    pattern = re.compile(f"^(.*(?:{edit.line}).*)$", re.MULTILINE)
    new, count = pattern.subn(lambda m: m.group(1) + edit.append, text, count=1)
    if count == 0 or edit.unless not in new:
        raise StepFailed(f"{label}: no line of {edit.file} matches '{edit.line}', so "
                         f"'{edit.append.strip()}' could not be added",
                         f"add {edit.append.strip()} by hand to {path} or update the recipe")
    atomic_write_bytes(path, new.encode("utf-8"))
    note(log, f"{label}: appended '{edit.append.strip()}' to the line matching "
              f"'{edit.line}' in {edit.file}")
    return "applied"


# --- versions against the constraints file --------------------------------------------------


def read_constraints(path: Path) -> dict[str, str]:
    """``name==version`` lines of a pip constraints file (comments and blanks skipped)."""
    out = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*(\S+)$", line)
        if m:
            out[_normal(m.group(1))] = m.group(2)
    return out


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(python: str, dist: str, env: dict[str, str]) -> str | None:
    code = ("import importlib.metadata as m, sys\n"
            "try:\n    print(m.version(sys.argv[1]))\nexcept m.PackageNotFoundError:\n"
            "    sys.exit(3)\n")
    try:
        proc = capture([python, "-c", code, dist], env=env, timeout=_QUICK_TIMEOUT_S, cwd="/")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def check_installed(python: str, names: list[str], constraints: Path | None,
                    env: dict[str, str], log: Path) -> None:
    """Each of ``names`` installed at its constraints version, the local tag aside
    (S127-134 compares by prefix: 2.8.0 matches the lock's 2.8.0+cpu)."""
    if constraints is None:
        raise StepFailed("require_installed needs build.constraints (the torch lock)",
                         "set build.constraints to a build.files entry")
    pins = read_constraints(constraints)
    for name in names:
        want = pins.get(_normal(name))
        if want is None:
            raise StepFailed(f"require_installed: {name} is not pinned in {constraints}",
                             "add it to the constraints or drop it from require_installed")
        got = installed_version(python, name, env)
        note(log, f"require_installed: {name} {got or 'missing'} (constraints: {want})")
        if got is None or got.split("+", 1)[0] != want.split("+", 1)[0]:
            raise StepFailed(
                f"{name} is {got or 'not installed'}, {constraints.name} pins {want}",
                f"install the versions of {constraints.name} into {python} (torch from "
                "https://download.pytorch.org/whl/cpu, torch_npu from the Ascend index), "
                "e.g. `pip install -c " + str(constraints) + f" {name}=={want}`")


# --- .run packages --------------------------------------------------------------------------


def find_run_package(workdir: Path, package: RunPackage, started: float, log: Path) -> Path:
    """The one ``.run`` package of ``package.glob`` the step's command wrote (modified after
    ``started``); older matches (a stale package left in ``output/``) are named in the log and
    never installed; none, or several fresh ones, fail naming them."""
    found = sorted(workdir.glob(package.glob))
    fresh = [p for p in found if p.stat().st_mtime >= started]
    stale = [p for p in found if p not in fresh]
    if stale:
        note(log, f"install_run: ignoring {len(stale)} .run package(s) older than this step: "
                  + ", ".join(str(p) for p in stale))
    if not fresh:
        raise StepFailed(
            f"no .run package matching {package.glob} was produced in {workdir} by this build"
            + (f" (only older ones: {', '.join(p.name for p in stale)})" if stale else ""),
            "the build did not finish its packaging: read the step's log"
            + (f"; remove the stale packages (rm {' '.join(str(p) for p in stale)})"
               if stale else ""))
    if len(fresh) > 1:
        raise StepFailed(
            f"{len(fresh)} .run packages matching {package.glob} were produced by this build: "
            f"{', '.join(str(p) for p in fresh)}; which to install is not clear",
            f"narrow build.steps[].install_run.glob ({package.glob}) to the one package")
    return fresh[0]


def make_executable(path: Path) -> None:
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def step_workdir(workspace: Workspace, step: BuildStep) -> Path:
    return workspace.root / step.workdir if step.workdir else workspace.root
