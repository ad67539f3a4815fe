"""The build stage: the recipe's build steps (kt-kernel, gguf-py, sglang, the AscendC op).

1. Preflight: the build python exists and is the recipe's ``host.python`` (the extension
   binds to the interpreter that builds it); steps that compile natively (``build_ext``)
   need cmake, a C compiler and the hwloc/numa headers.
   Then `patch audit` of the steps' markers: a required marker that no file of its tree
   can print (:mod:`dsv4_offload.sources.audit`) refuses the build before anything compiles.
   A step an enabled serve setting requires (``required_when_env``: the AscendC op with
   KT_MXFP4_DEPOOL=1) has its compiler and CANN headers checked here, before anything runs.
2. Each step runs in ``<workspace>/<workdir>`` with the argv and environment
   :func:`bringup.step_command` makes (its context, e.g. ``cann``: CANN's set_env.sh sourced;
   its env; ``CC``/``CXX`` from ``recipe.platform`` for kt-kernel), ``{python}`` replaced by
   the build python (``{tool_python}``, ``{workspace}`` and more: see
   ``bringup.Placeholders``), its output in ``logs/build/<step>.log``; the recipe's
   ``build.umask`` holds for the whole run.
3. Its log (this run's part) must match no ``forbid_markers`` entry (checked first: it
   names the cause) and every ``expect_markers`` entry. Markers are Python
   regular expressions searched line by line (``re.search``); plain text without
   metacharacters matches itself, the same rule as the acceptance log markers.
4. ``check_import`` runs ``<python> -c "import X"`` with the PYTHONPATH the server gets
   (``server_pythonpath``); for kt-kernel that needs a ``kt_kernel -> python`` link. After
   kt-kernel, :mod:`dsv4_offload.build.kernelcheck` checks the extension the server will load.
5. An optional step that fails is a warning; one whose compiler is missing is skipped.
6. Configuring kt-kernel's CMake inside a git work tree installs commit hooks into that
   repo: hooks that appear during the build are reported.
7. CMake caches options (CPUINFER_ARM_SVE...): when a step's command, env or python
   changed since its last good build, its ``build/`` dir is removed first (``--clean``
   forces it). A failing step's log is matched against known pitfalls for the fix.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv4_offload.build import bringup, kernelcheck
from dsv4_offload.build.bringup import KT_KERNEL_STEP
from dsv4_offload.build.interpreter import build_python, server_pythonpath
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.options import PathText, StageOptions
from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.core.runner import capture, failure_excerpt, run_command
from dsv4_offload.recipe import BuildStep, Recipe
from dsv4_offload.serving.plan import ENV_KNOBS
from dsv4_offload.sources import git as gitsrc
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace, read_json


class BuildOptions(StageOptions):
    steps: tuple[str, ...] = ()  # the steps to build (none: every one)
    python: PathText | None = None  # the build python (default: the workspace's choice)
    clean: bool = False  # a fresh configure: each step's build dir removed first
    jobs: int | None = None  # compile jobs (a pipelined run's share of the cores)


Options = BuildOptions

# the packages each header comes from: Debian/Ubuntu first, then openEuler/EulerOS (Kunpeng)
NATIVE_HEADERS = {"hwloc.h": ("libhwloc-dev", "hwloc-devel"),
                  "numa.h": ("libnuma-dev", "numactl-devel")}
# compilers a step may call by name that do not come from apt (bisheng ships with CANN)
TOOLS_BY_NAME = ("bisheng", "cmake", "ninja", "make")
PRODUCT_GLOBS = ("*kt_kernel_ext*.so", "libmxfp4fused.so")
RUNTIME_STEPS = ("kt-kernel", "sglang")  # their workdirs go on the server's PYTHONPATH
_QUICK_TIMEOUT_S = 60.0
# a word of an expected marker that did not show -> the usual reason
MARKER_HINTS: tuple[tuple[str, str], ...] = (
    ("Ascend", "CANN was not found by the configure: source {set_env} (and "
               "nnal/atb/set_env.sh) first"),
    ("DOTPROD", "dotprod was not enabled: build on the aarch64 host whose CPU has asimddp "
                "(`dsv4-offload doctor`), not in an emulator or on x86"),
    # kt-kernel/CMakeLists.txt lines 217-234 print the -march it targets
    ("ARM target", "the configure targets other CPU features than the marker wants (a +sve, "
                   "+bf16 or +i8mm is one a Kunpeng-920 lacks): keep CPUINFER_ARM_SVE, "
                   "CPUINFER_ARM_BF16 and CPUINFER_ARM_I8MM OFF in the kt-kernel step's env"),
)
# log pattern -> the fix; first match wins, so the most specific come first; {set_env} is the
# recipe's CANN set_env.sh (bringup.set_env_hint)
KNOWN_FAILURES: tuple[tuple[str, str], ...] = (
    # kt-kernel is C++20 (CMakeLists.txt:124) and cpu_backend/worker_pool.h:17 includes
    # <barrier> (ktransformers @ d7b5b49a), which libstdc++ ships from GCC 11
    (r"barrier: No such file or directory",
     "the compiler's C++ library has no <barrier> (kt-kernel's cpu_backend/worker_pool.h:17): "
     "kt-kernel needs GCC 11 or newer; install g++-11 or later (g++-13 on A3) and give it in "
     "the step's env (CC=gcc-13 CXX=g++-13), then `dsv4-offload build kt-kernel --clean`"),
    # kt-kernel/CMakeLists.txt:225-234 (patched) append +sve/+bf16/+i8mm to the ARM target
    (r"ARM target: -march=\S*\+(sve|bf16|i8mm)",
     "kt-kernel was configured with SVE, BF16 or I8MM, which the Kunpeng-920 lacks (SIGILL, "
     "or 'llamafile not supported' in the MXFP4 MoE): keep CPUINFER_ARM_SVE=OFF, "
     "CPUINFER_ARM_BF16=OFF and CPUINFER_ARM_I8MM=OFF in the kt-kernel step's env, then "
     "`dsv4-offload build kt-kernel --clean`"),
    (r"llamafile not supported",
     "kt-kernel was built with ARM SVE: keep CPUINFER_ARM_SVE=OFF, CPUINFER_ARM_BF16=OFF and "
     "CPUINFER_ARM_I8MM=OFF in the kt-kernel step's env, then `dsv4-offload build kt-kernel "
     "--clean`"),
    (r"hwloc\.h: No such file|Could NOT find (HWLOC|hwloc)|cannot find -lhwloc",
     "apt-get install libhwloc-dev (yum install hwloc-devel)"),
    (r"numa\.h: No such file|cannot find -lnuma|Could NOT find (NUMA|numa)",
     "apt-get install libnuma-dev (yum install numactl-devel)"),
    (r"Python\.h: No such file",
     "install the build python's headers (apt-get install python3.11-dev)"),
    (r"Could NOT find OpenMP",
     "build with gcc (OpenMP comes with it), e.g. CC=gcc CXX=g++ or the platform's gcc-13"),
    (r"pybind11.*(does not contain a CMakeLists|not found)|Could not find a package "
     r"configuration file provided by \"pybind11\"",
     "the pybind11 submodule is missing: run `dsv4-offload fetch` (it takes pybind11 at the "
     "pinned commit)"),
    (r"`project\.license` must be valid exactly by one definition",
     "the build python's setuptools is too old for kt-kernel's pyproject.toml (its SPDX "
     "`license = \"Apache-2.0\"` needs setuptools >= 77): <build python> -m pip install -U "
     "'setuptools>=77', or build with a venv's python (--set build.python=...)"),
    (r"externally-managed-environment",
     "this python refuses pip installs (PEP 668): build with a venv's or the image's python "
     "(--python PATH)"),
    (r"No module named 'sentencepiece'",
     "gguf-py of llama.cpp b3173 imports sentencepiece without declaring it: "
     "<build python> -m pip install sentencepiece"),
    (r"No module named '(torch|torch_npu)(\.[\w.]+)?'",
     "torch and torch_npu come with the CANN image: build and serve with the image's python "
     "(--python PATH)"),
    (r"(libascendcl\.so|ascendcl).*(not found|No such file)|Could NOT find (Ascend|ACL)",
     "CANN is not in the environment: source {set_env} before building (the recipe's step: "
     "context: cann)"),
    # the A3 bring-up (setup_dsv4_env_from_clean_cann.sh, "S"; guide appendix A, "G")
    (r"RT_LIMIT_TYPE_SIMT_WARP_STACK_SIZE",
     "triton-ascend 3.2.0 does not build against CANN 9.0.0 (S150-152): install "
     "triton-ascend==3.2.1.dev20260530 from the Huawei Cloud nightly index"),
    (r"undefined reference to `?(dlopen|dlsym|dlclose)",
     "sgl_kernel_npu's PTAExtensionOPS lacks -ldl (S248-249): the step's edit adds "
     "${CMAKE_DL_LIBS}; rerun `dsv4-offload build sgl-kernel-npu`"),
    # the run-time libraries kt_kernel_ext links (guide G78, G105, G620: the 910B image has
    # no hwloc, and a recreated container loses it)
    (r"libhwloc\.so\.\d+: cannot open shared object file",
     "kt-kernel links libhwloc at run time: apt-get install libhwloc15 (yum install hwloc-libs);"
     " inside the 910B container again after it is recreated"),
    (r"libnuma\.so\.\d+: cannot open shared object file",
     "kt-kernel links libnuma at run time: apt-get install libnuma1 (yum install numactl-libs)"),
    (r"libc10\.so: cannot open shared object file",
     "custom_ops links libc10.so: import torch and torch_npu before custom_ops (S203-205)"),
    (r"partially initialized module 'custom_ops'|circular import",
     "a custom_ops source directory shadows the installed wheel: import it from a neutral "
     "directory (S199-201)"),
    (r"aclnn\w+ not in libopapi\.so|has no attribute '(compressor|npu_\w+)'",
     "a vendor is missing (customize, custom_transformer or the custom_ops binding, G474-476): "
     "rebuild the vendor-customize, custom-ops and vendor-transformer steps"),
    (r"security check|group.writable|others have write",
     "msopgen refuses group/world-writable files: umask 0022 and chmod -R go-w (S96-97, S182)"),
    (r"gcc-13: (not found|No such file)|No CMAKE_C_COMPILER could be found",
     "install the platform's compiler (A3: apt-get install gcc-13 g++-13) or fix "
     "platform.cc/cxx"),
)


@dataclass
class StepReport:
    name: str
    status: str = "pending"  # ok | warn | failed | skipped
    seconds: float = 0.0
    log: str = ""
    message: str = ""
    products: list[str] = field(default_factory=list)
    hooks_added: list[str] = field(default_factory=list)
    hint: str = ""  # the known cause of a failure, when the log shows one
    fix: str = ""  # set when the failure is not in a log (missing checkout, missing tool)
    settings: str = ""  # digest of what configures the build (command, env, python)
    cleaned: str = ""  # why the build dir was removed first, if it was
    kernel: dict[str, Any] = field(default_factory=dict)  # kernelcheck's facts (kt-kernel)

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "seconds": round(self.seconds, 1), "log": self.log,
                "message": self.message, "products": self.products,
                "hooks_added": self.hooks_added, "hint": self.hint, "cleaned": self.cleaned,
                **({"kernel": self.kernel} if self.kernel else {})}


# --- facts shared with other stages ---------------------------------------------------------


def runtime_pythonpath(workspace: Workspace, recipe: Recipe) -> list[Path]:
    """Directories the server's python needs on PYTHONPATH: sglang's and kt-kernel's."""
    return [bringup.step_workdir(workspace, s) for s in recipe.build.steps
            if s.name in RUNTIME_STEPS]


def selected_steps(ctx: StageContext) -> list[BuildStep]:
    names = list(ctx.options_as(BuildOptions).steps)
    known = [s.name for s in ctx.recipe.build.steps]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InputError(f"build: unknown step '{unknown[0]}'; the recipe's build.steps are: "
                         f"{', '.join(known)}")
    return [s for s in ctx.recipe.build.steps if not names or s.name in names]


# --- fingerprint ----------------------------------------------------------------------------


def fingerprint_inputs(ctx: StageContext) -> dict[str, str]:
    """Interpreter and compiler versions, and the HEAD of every patched source."""
    python = ctx.options_as(BuildOptions).python
    if python is None:
        # `status` has no --python: take the interpreter the last build used, so a build
        # made with --python does not look stale afterwards
        python = ctx.workspace.state().outputs("build").get("python") or \
            ctx.recipe.build.interpreter
    cc = ctx.recipe.platform.cc or "gcc"
    out = {
        "python": python_version(python) or "missing",
        "cc": _first_line([cc, "--version"]) or "missing",
        "cmake": _first_line(["cmake", "--version"]) or "missing",
    }
    for source in ctx.recipe.sources:
        if source.patched:
            head = gitsrc.head_commit(ctx.workspace.source_dir(ctx.recipe, source.name))
            out[f"head.{source.name}"] = head or "missing"
    return out


def _first_line(args: list[str]) -> str | None:
    try:
        proc = capture(args, timeout=_QUICK_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (proc.stdout or proc.stderr).strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


def python_version(python: str) -> str | None:
    return _first_line([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"])


# --- preflight ------------------------------------------------------------------------------


def needs_toolchain(step: BuildStep) -> bool:
    """Steps that compile C/C++ through setup.py (kt-kernel): cmake, cc, hwloc, numa."""
    return "build_ext" in step.command


def missing_headers(cc: str, headers: list[str], env: dict[str, str]) -> list[str]:
    """Headers the compiler cannot find, asked of the compiler itself (honours CPATH etc.)."""
    missing = []
    for header in headers:
        try:
            proc = capture([cc, "-xc", "-E", "-", "-o", os.devnull],
                           input=f"#include <{header}>\n", env=env, timeout=_QUICK_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            missing.append(header)
            continue
        if proc.returncode != 0:
            missing.append(header)
    return missing


def preflight(ctx: StageContext, python: str, steps: list[BuildStep],
              env: dict[str, str]) -> list[Problem]:
    problems: list[Problem] = []
    want = ctx.recipe.host.python
    found = python_version(python)
    if found is None:
        problems.append(Problem(
            "error", f"build python '{python}' not found or not runnable",
            fix=f"install python {want} (with its -dev headers) or pass --python PATH "
            "(recipe build.python)", check="python"))
    elif not (found == want or found.startswith(want + ".")):
        problems.append(Problem(
            "error", f"build python '{python}' is {found}, the recipe wants {want} "
            "(host.python): the kt-kernel extension binds to the interpreter that builds it",
            fix=f"pass --python /path/to/python{want} or set build.python", check="python"))
    if any(needs_toolchain(s) for s in steps):
        cc = env.get("CC") or "gcc"
        installs = {"cmake": "apt-get install cmake (yum install cmake)",
                    cc: f"apt-get install build-essential (or the package of {cc}, e.g. "
                        "gcc-13 for the A3 recipe)"}
        for tool, how in installs.items():
            if shutil.which(tool, path=env.get("PATH")) is None:
                problems.append(Problem(
                    "error", f"'{tool}' not found on PATH (needed to build kt-kernel)",
                    fix=how, check=tool))
        if shutil.which(cc, path=env.get("PATH")) is not None:
            for header in missing_headers(cc, list(NATIVE_HEADERS), env):
                deb, rpm = NATIVE_HEADERS[header]
                problems.append(Problem(
                    "error", f"{header} not found by {cc} (kt-kernel links it)",
                    fix=f"apt-get install {deb} (yum install {rpm})", check=header))
    return problems


# --- the stage ------------------------------------------------------------------------------


def marker_audit(ctx: StageContext, steps: list[BuildStep], data: dict[str, Any]
                 ) -> list[Problem]:
    """`patch audit` of the steps' markers: a required one no file can print refuses the build
    before hours of compiling end in 'expected log marker not found'."""
    from dsv4_offload.sources import audit

    try:
        report = audit.audit(ctx.recipe, ctx.series, audit.workspace_dirs(
            ctx.recipe, ctx.workspace), steps=[s.name for s in steps], build_only=True)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return [Problem("warning", f"marker audit not run: {exc}", check="patch-audit",
                        fix="run `dsv4-offload patch audit` to see why")]
    data["audit"] = report.as_dict()
    problems = []
    for item in report.items:
        if item.severity == "error":
            problems.append(Problem(
                "error", f"{item.owner}: '{item.marker}' cannot be printed: {item.detail}",
                fix=audit.refusal_fix(item),
                check="patch-audit"))
    return problems  # unchecked ones (a tree not fetched) stay in data["audit"]


def toolchain_env(ctx: StageContext, steps: list[BuildStep]) -> dict[str, str]:
    """The environment the preflight checks compilers in: the kt-kernel step's CC/CXX (its
    env, else ``platform.cc``/``cxx``) over the current one, as :func:`bringup.step_command`
    gives them to that step alone."""
    env = dict(os.environ)
    for step in steps:
        if step.name == KT_KERNEL_STEP:
            for var, value in (("CC", ctx.recipe.platform.cc), ("CXX", ctx.recipe.platform.cxx)):
                value = step.env.get(var, value)
                if value:
                    env[var] = value
    return env


def required_by(recipe: Recipe, step: BuildStep, environ: Mapping[str, str]) -> str | None:
    """The serve setting that makes an optional step required ('KT_MXFP4_DEPOOL=1'), decided
    as the serve plan decides it: a launcher knob exported here wins over serve.env."""
    if not step.required_when_env:
        return None
    for key, want in step.required_when_env.items():
        value = environ[key] if key in ENV_KNOBS and environ.get(key) else \
            recipe.serve.env.get(key, environ.get(key))
        if value != want:
            return None
    return ", ".join(f"{k}={v}" for k, v in step.required_when_env.items())


def effective_steps(recipe: Recipe, steps: list[BuildStep], environ: Mapping[str, str]
                    ) -> list[BuildStep]:
    """``steps`` with ``optional`` off for those an enabled serve setting requires."""
    return [s.model_copy(update={"optional": False})
            if s.optional and required_by(recipe, s, environ) else s for s in steps]


def required_preflight(ctx: StageContext, python: str, steps: list[BuildStep]
                       ) -> list[Problem]:
    """A step serving requires (the AscendC op with KT_MXFP4_DEPOOL=1) checked before the
    first step and any download: bisheng found in its shell (CANN's set_env.sh sourced) and
    CANN's kernel_operator.h (guide line 545) under the CANN home."""
    problems: list[Problem] = []
    for step in steps:
        why = required_by(ctx.recipe, step, os.environ)
        if why is None or "bisheng" not in _tools_named(step.command):
            continue
        off = "; or serve without it: --set serve.env." + \
            next(iter(step.required_when_env)) + "=0"
        set_env = bringup.set_env_hint(ctx.recipe)
        places = bringup.Placeholders(ctx.recipe, ctx.workspace, python)
        log = ctx.log_dir / "preflight.log"
        try:
            env = bringup.step_command(step, ctx.recipe, places, os.environ,
                                       bringup.step_workdir(ctx.workspace, step), log).env
        except bringup.StepFailed as exc:
            problems.append(Problem("error", f"{step.name} (required: {why}): {exc.message}",
                                    fix=exc.fix + off, check=step.name))
            continue
        if shutil.which("bisheng", path=env.get("PATH")) is None:
            problems.append(Problem(
                "error", f"{step.name} (required: {why}): 'bisheng' not found on the PATH of "
                f"its shell", check=step.name,
                fix=f"install CANN {ctx.recipe.platform.cann}'s toolkit (bisheng ships with "
                f"it) and source {set_env}" + off))
        home = env.get("ASCEND_TOOLKIT_HOME") or env.get("ASCEND_HOME_PATH") or ""
        header = Path(home) / bringup.KERNEL_OPERATOR_H
        if not home or not header.is_file():
            problems.append(Problem(
                "error", f"{step.name} (required: {why}): {header if home else 'the CANN home'}"
                " not found (ASCEND_TOOLKIT_HOME " + (home or "unset") + ")", check=step.name,
                fix=f"install CANN {ctx.recipe.platform.cann}'s toolkit with its AscendC "
                f"headers and source {set_env}" + off))
    return problems


def run(ctx: StageContext) -> StageResult:
    steps = effective_steps(ctx.recipe, selected_steps(ctx), os.environ)
    python = build_python(ctx, ctx.options_as(BuildOptions).python)
    problems = preflight(ctx, python, steps, toolchain_env(ctx, steps))
    data: dict[str, Any] = {"python": python, "steps": {}}
    problems += [Problem("error", e, fix="the file comes from a pinned source",
                         check="build.files")
                 for e in bringup.check_files(ctx.recipe, ctx.workspace, python)]
    if not any(p.severity == "error" for p in problems):
        problems += required_preflight(ctx, python, steps)
    if any(p.severity == "error" for p in problems):
        return StageResult(Status.FAILED, "build preflight failed", data=data, problems=problems,
                           log=str(ctx.log_dir))
    audit_problems = marker_audit(ctx, steps, data)
    problems += audit_problems
    if any(p.severity == "error" for p in audit_problems):
        return StageResult(Status.FAILED, "build refused: a required log marker cannot be "
                           "printed by its tree", data=data, problems=problems)
    hooks_dir = _hooks_dir(ctx.workspace.tree_dir(ctx.recipe))
    previous = _previous_outputs(ctx)
    # S96-97: the script's prereq phase sets umask 0022 once, for every phase after it
    umask = ctx.recipe.build.umask
    old_mask = os.umask(bringup.parse_umask(umask)) if umask else None
    data["umask"] = umask
    try:
        reports = _run_steps(ctx, steps, python, hooks_dir, previous, data, problems)
    finally:
        if old_mask is not None:
            os.umask(old_mask)
    data["git_hooks"] = sorted(_hooks(hooks_dir))  # all of them, also from earlier builds
    failed = [r for r in reports if r.status == "failed"]
    outputs = _outputs(ctx, python, reports, previous)
    optional = {s.name for s in effective_steps(ctx.recipe, ctx.recipe.build.steps, os.environ)
                if s.optional}
    not_built = [s.name for s in ctx.recipe.build.steps
                 if s.name not in optional and s.name not in outputs["steps"]]
    if not failed and not_built:
        problems.append(Problem(
            "warning", f"not built yet: {', '.join(not_built)}",
            fix="run `dsv4-offload build` (all steps) before serving", check="steps"))
    durations = ", ".join(f"{r.name} {r.status} {r.seconds:.0f}s" for r in reports)
    if failed:
        before = ", ".join(f"{r.name} {r.status}" for r in reports if r is not failed[0])
        return StageResult(Status.FAILED, f"build step {failed[0].name} failed"
                           + (f" (before it: {before})" if before else ""),
                           data=data, problems=problems, log=failed[0].log)
    status = Status.WARN if any(p.severity == "warning" for p in problems) else Status.OK
    return StageResult(status, f"built: {durations}", data=data, problems=problems,
                       outputs=outputs, log=str(ctx.log_dir))


def before_container(ctx: StageContext, plan: Any, options: StageOptions
                     ) -> StageResult | None:
    """Before the build is handed to the recipe's container: its C++ compiler, asked there."""
    from dsv4_offload.serving.image_rows import compiler_in_image

    problem = compiler_in_image(ctx.recipe, plan, list(BuildOptions.of(options).steps) or None)
    return None if problem is None else StageResult(
        Status.FAILED, f"build refused: {problem.message}", problems=[problem])


def _run_steps(ctx: StageContext, steps: list[BuildStep], python: str, hooks_dir: Path | None,
               previous: dict[str, Any], data: dict[str, Any], problems: list[Problem]
               ) -> list[StepReport]:
    """The steps in order, up to the first that fails; problems and data filled in."""
    reports: list[StepReport] = []
    for step in steps:
        built_with = ((previous.get("steps") or {}).get(step.name) or {}).get("settings")
        report = run_step(ctx, step, python, hooks_dir, built_with=built_with)
        ctx.event("step.done", step=step.name, status=report.status, seconds=report.seconds)
        reports.append(report)
        data["steps"][step.name] = report.as_dict()
        if report.cleaned:
            problems.append(Problem("info", f"{step.name}: removed its build dir first "
                                            f"({report.cleaned})", check=step.name))
        if report.status == "failed":
            problems.append(Problem("error", f"{step.name}: {report.message}",
                                    fix=_fix_for(step, report), check=step.name))
            break
        if report.status in ("warn", "skipped"):
            problems.append(Problem("warning", f"{step.name}: {report.message}",
                                    fix=_fix_for(step, report), check=step.name))
        if report.hooks_added:
            problems.append(Problem(
                "warning", f"{step.name}: the build installed git hooks into "
                f"{hooks_dir}: {', '.join(report.hooks_added)}",
                fix="nothing is needed for dsv4-offload (the patch stage commits with hooks "
                f"disabled); remove them if you commit there by hand: rm {hooks_dir}/<name>",
                check="git-hooks"))
    return reports


def _previous_outputs(ctx: StageContext) -> dict[str, Any]:
    """The outputs of the last successful build (the state record is 'running' by now)."""
    value = read_json(ctx.workspace.provenance_file, {}).get("build")
    return value if isinstance(value, dict) else {}


def _outputs(ctx: StageContext, python: str, reports: list[StepReport],
             previous: dict[str, Any]) -> dict[str, Any]:
    """What serve depends on; steps not run this time keep their ``previous`` record."""
    known = {s.name for s in ctx.recipe.build.steps}
    steps: dict[str, Any] = {}
    if previous.get("python") == python:  # steps built by another interpreter do not count
        steps.update({k: v for k, v in (previous.get("steps") or {}).items() if k in known})
    for r in reports:
        if r.status in ("ok", "warn"):
            steps[r.name] = {"products": r.products, "settings": r.settings}
        else:
            steps.pop(r.name, None)
    return {"python": python, "python_version": python_version(python), "steps": steps,
            "pythonpath": [str(p) for p in runtime_pythonpath(ctx.workspace, ctx.recipe)]}


def _fix_for(step: BuildStep, report: StepReport) -> str:
    if report.fix:
        return report.fix
    if report.hint:
        return f"{report.hint}; then `dsv4-offload build {step.name}`"
    return f"read the log ({report.log}), fix the cause, then `dsv4-offload build {step.name}`"


def diagnose(text: str, set_env: str = bringup.CANN8_SET_ENV) -> str | None:
    """The fix for the first known pitfall the log shows (the delivery's troubleshooting);
    ``set_env`` is the CANN set_env.sh a fix names."""
    for pattern, fix in KNOWN_FAILURES:
        if re.search(pattern, text):
            return fix.replace("{set_env}", set_env)
    return None


def settings_digest(step: BuildStep, argv: list[str], env: dict[str, str], python: str) -> str:
    """What configures a step's build: its command, its own env, CC/CXX and the python."""
    import hashlib
    import json

    own = {k: env.get(k, "") for k in sorted({*step.env, "CC", "CXX"})}
    blob = json.dumps({"argv": argv, "env": own, "python": python}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def clean_build_dir(workdir: Path) -> bool:
    """Remove ``workdir/build`` (CMake's cache keeps old options) unless git tracks it."""
    build_dir = workdir / "build"
    if not build_dir.is_dir():
        return False
    tracked = capture(["git", "-C", str(workdir), "ls-files", "--", "build"],
                      timeout=_QUICK_TIMEOUT_S)
    if tracked.returncode == 0 and tracked.stdout.strip():
        return False  # part of the sources: not ours to delete
    shutil.rmtree(build_dir)
    return True


def run_step(ctx: StageContext, step: BuildStep, python: str, hooks_dir: Path | None, *,
             built_with: str | None = None) -> StepReport:
    """Run one step; ``built_with`` is the settings digest of its last successful build."""
    report = StepReport(step.name)
    workdir = bringup.step_workdir(ctx.workspace, step)
    log = ctx.log_dir / f"{step.name}.log"
    report.log = str(log)
    if not workdir.is_dir() and step.workdir and not _in_a_source(ctx.recipe, step.workdir):
        workdir.mkdir(parents=True)  # the workspace's own (a sysroot), not a checkout
    if not workdir.is_dir():
        report.status = "failed"
        report.log = str(ctx.log_dir)
        report.message = f"{workdir} does not exist"
        report.fix = "run `dsv4-offload fetch` and `dsv4-offload patch apply` first"
        return report
    log.parent.mkdir(parents=True, exist_ok=True)
    log.touch()  # a step of checks only still has its log
    offset = log.stat().st_size
    places = bringup.Placeholders(ctx.recipe, ctx.workspace, python)
    constraints = (places.file_path(ctx.recipe.build.constraints)
                   if ctx.recipe.build.constraints else None)
    set_env = bringup.set_env_hint(ctx.recipe)
    try:
        if step.chmod_go_w:
            bringup.chmod_go_w(workdir, log)
        for edit in step.edits:
            bringup.apply_edit(workdir, edit, log)
        for rel in step.remove_first:
            bringup.remove_first(workdir, rel, log)
        environ = bringup.parallel_env(os.environ, ctx.options_as(BuildOptions).jobs)
        made = bringup.step_command(step, ctx.recipe, places, environ, workdir, log,
                                    constraints)
        argv, env = made.argv, made.env
        _run_checks(step, "before", places, workdir, env, python, log)
    except bringup.StepFailed as exc:
        report.fix = exc.fix
        return _fail(report, step, f"{exc.message} (see the log: {log})")
    absent = [t for t in _tools_named(argv) if shutil.which(t, path=env.get("PATH")) is None]
    if absent:
        report.status = "skipped" if step.optional else "failed"
        report.log = str(ctx.log_dir)
        report.message = f"'{absent[0]}' is not on PATH" + (
            "; skipped (optional step)" if step.optional else "")
        report.fix = (f"install CANN {ctx.recipe.platform.cann}'s toolkit and source "
                      f"{set_env} to build it" if absent[0] == "bisheng"
                      else f"install {absent[0]}")
        return report
    report.settings = settings_digest(step, argv, env, python)
    # CMake caches options such as CPUINFER_ARM_SVE: a changed setting needs a fresh configure
    why = "--clean" if ctx.options_as(BuildOptions).clean else (
        "its command, env or python changed since the last build"
        if built_with and built_with != report.settings else "")
    if why and step.command and step.workdir and clean_build_dir(workdir):
        report.cleaned = why
    if step.name == KT_KERNEL_STEP:
        kernelcheck.link_kt_kernel_package(workdir)
    hooks_before = _hooks(hooks_dir)
    t0 = time.monotonic()
    started = time.time() - 1  # mtime granularity: anything the command made is newer
    if argv:
        mask = bringup.parse_umask(step.umask) if step.umask else None
        if mask is not None:
            bringup.note(log, f"workaround umask: the command runs with umask {step.umask} "
                              "(umask 0002 breaks msopgen, setup_dsv4_env_from_clean_cann.sh "
                              "lines 96-97)")
        old_mask = os.umask(mask) if mask is not None else None
        try:
            ctx.event("step.started", step=step.name)  # the live view's "build step"
            with ctx.task(f"build {step.name}") as task:
                result = run_command(argv, log=log, cwd=workdir, env=env, check=False,
                                     on_line=lambda line: task.update(
                                         description=f"build {step.name}: {line[:60]}"))
        finally:
            if old_mask is not None:
                os.umask(old_mask)
    report.seconds = time.monotonic() - t0
    report.hooks_added = sorted(_hooks(hooks_dir) - hooks_before)
    text = _read_from(log, offset)
    report.hint = diagnose(text, set_env) or ""
    if argv and result.returncode != 0:
        excerpt = failure_excerpt(result.tail)
        tail = f": {excerpt[-1]}" if excerpt else ""
        return _fail(report, step, f"exit code {result.returncode}{tail} (see the log: {log})")
    try:
        if argv and step.umask:
            loose = bringup.writable_by_others(workdir, newer_than=started)
            if loose:
                raise bringup.StepFailed(
                    f"workaround umask {step.umask}: the build left {loose[0]} group/world-"
                    f"writable (+{len(loose) - 1} more); msopgen refuses such files",
                    f"rerun with umask {step.umask} (check the build script does not reset it)")
        if step.install_run is not None:
            package = bringup.find_run_package(workdir, step.install_run, started, log)
            bringup.make_executable(package)
            run_argv = [str(package), *[places.text(a) for a in step.install_run.args]]
            installed = run_command(run_argv, log=log, cwd=workdir, env=env, check=False)
            if installed.returncode != 0:
                raise bringup.StepFailed(
                    f"installing {package.name} failed (exit {installed.returncode})",
                    "read the log; the install path must be writable (CANN's opp dir)")
    except bringup.StepFailed as exc:
        report.fix = exc.fix
        return _fail(report, step, f"{exc.message} (see the log: {log})")
    text = _read_from(log, offset)
    # a forbidden line names the cause (e.g. '+sve' on the ARM target line); check it first
    for marker in step.forbid_markers:
        hit = _compile(marker, step, "forbid_markers").search(text)
        if hit:
            line = text[text.rfind("\n", 0, hit.start()) + 1:].split("\n", 1)[0].strip()
            return _fail(report, step, f"forbidden log marker '{marker}' found: "
                                       f"'{line[:120]}' (see the log: {log})")
    for marker in step.expect_markers:
        if not _compile(marker, step, "expect_markers").search(text):
            report.hint = report.hint or next(
                (hint.replace("{set_env}", set_env) for word, hint in MARKER_HINTS
                 if word in marker), "")
            return _fail(report, step, f"expected log marker '{marker}' not found "
                                       f"(see the log: {log})")
    if step.check_import:
        error = check_import(python, step.check_import, ctx.workspace.tree_dir(ctx.recipe),
                             env, log)
        if error:
            report.hint = diagnose(_read_from(log, offset), set_env) or ""
            return _fail(report, step, f"`import {step.check_import}` fails: {error} "
                                       f"(see the log: {log})")
    try:
        if step.name == KT_KERNEL_STEP and argv:  # the extension the server will load
            report.kernel = kernelcheck.check_kernel(
                python, ctx.workspace.tree_dir(ctx.recipe), workdir, env, started, log=log,
                need_ascend=ctx.recipe.platform.npu != "none").as_dict()
        _run_checks(step, "after", places, workdir, env, python, log)
        if step.require_installed:
            bringup.check_installed(python, step.require_installed, constraints, env, log)
    except bringup.StepFailed as exc:
        report.fix = exc.fix
        report.hint = diagnose(_read_from(log, offset), set_env) or ""
        return _fail(report, step, f"{exc.message} (see the log: {log})")
    report.products = _products(workdir) if step.command else []
    report.status = "ok"
    report.message = f"{report.seconds:.0f}s"
    return report


def _in_a_source(recipe: Recipe, workdir: str) -> bool:
    """Whether a step's workdir lies in a source checkout (which fetch makes, never we)."""
    from pathlib import PurePosixPath

    path = PurePosixPath(workdir)
    return any(path == PurePosixPath(s.path) or PurePosixPath(s.path) in path.parents
               for s in recipe.sources)


def _run_checks(step: BuildStep, when: str, places: bringup.Placeholders, workdir: Path,
                env: dict[str, str], python: str, log: Path) -> None:
    """The step's checks of one phase; the first failing one raises, named with its fix."""
    import tempfile

    for check in step.checks:
        if check.when != when:
            continue
        argv = places.argv(check.run, workdir)
        check_env = dict(env)
        if check.cwd == "neutral":
            check_env.pop("PYTHONPATH", None)  # nothing of ours may shadow what is installed
            with tempfile.TemporaryDirectory(prefix="dsv4-neutral-") as neutral:
                bringup.note(log, f"check {check.name} (from an empty directory, no PYTHONPATH)")
                result = run_command(argv, log=log, cwd=Path(neutral), env=check_env,
                                     check=False, timeout=900)
        else:
            bringup.note(log, f"check {check.name}")
            result = run_command(argv, log=log, cwd=workdir, env=check_env, check=False,
                                 timeout=900)
        if result.returncode != 0:
            last = failure_excerpt(result.tail)
            why = f" ({check.why})" if check.why else ""
            cause = last[-1] if last else f"exit {result.returncode}"
            raise bringup.StepFailed(f"check {check.name} failed{why}: {cause}", check.fix)


def _fail(report: StepReport, step: BuildStep, message: str) -> StepReport:
    report.status = "warn" if step.optional else "failed"
    report.message = message + (" (optional step: continuing)" if step.optional else "")
    return report


def _compile(marker: str, step: BuildStep, field_name: str) -> re.Pattern[str]:
    try:
        return re.compile(marker, re.MULTILINE)
    except re.error as exc:
        raise InputError(f"build.steps[{step.name}].{field_name}: '{marker}' is not a valid "
                         f"regular expression ({exc}); escape metacharacters with '\\'") from None


def _tools_named(argv: list[str]) -> list[str]:
    """The program and any known compiler a shell snippet calls by name."""
    tools = [argv[0]] if argv and "/" not in argv[0] else []
    joined = " ".join(argv[1:])
    tools += [t for t in TOOLS_BY_NAME if re.search(rf"(^|[\s;&|(]){t}(\s|$)", joined)]
    return tools


def _read_from(log: Path, offset: int) -> str:
    with open(log, encoding="utf-8", errors="replace") as fh:
        fh.seek(offset)
        return fh.read()


def check_import(python: str, module: str, tree: Path, env: dict[str, str],
                 log: Path) -> str | None:
    """None when ``module`` imports with the server's PYTHONPATH (``server_pythonpath`` of
    the ktransformers ``tree``); else the error's last line."""
    env = dict(env)
    env["PYTHONPATH"] = server_pythonpath(tree, env.get("PYTHONPATH"))
    result = run_command([python, "-c", f"import {module}"], log=log, env=env, check=False,
                         timeout=300)
    if result.returncode == 0:
        return None
    lines = [x for x in result.tail if x.strip()]
    return lines[-1].strip() if lines else f"exit code {result.returncode}"


def _products(workdir: Path) -> list[str]:
    found: set[str] = set()
    for pattern in PRODUCT_GLOBS:
        for p in workdir.rglob(pattern):
            if "build" not in p.relative_to(workdir).parts[:1]:  # skip CMake's temp copies
                found.add(p.relative_to(workdir).as_posix())
    return sorted(found)


def _hooks_dir(tree: Path) -> Path | None:
    if not tree.is_dir():
        return None
    path = _first_line(["git", "-C", str(tree), "rev-parse", "--git-path", "hooks"])
    if path is None:
        return None
    hooks = Path(path)
    return hooks if hooks.is_absolute() else tree / hooks


def _hooks(hooks_dir: Path | None) -> set[str]:
    if hooks_dir is None or not hooks_dir.is_dir():
        return set()
    return {p.name for p in hooks_dir.iterdir() if p.is_file() and not p.name.endswith(".sample")}
