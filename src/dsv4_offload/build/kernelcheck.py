"""The kt-kernel the server will load: checked after the kt-kernel build step.

kt-kernel's loader does not fail when the wrong extension is there; it loads what it finds.
Citations are the patched tree: ktransformers d7b5b49 + the delivery's main_repo/0001+0002
(cann-recipes-infer @ 1a7fbd3), kt-kernel/ unless said otherwise.

- ``python/_cpu_detect.py:198`` takes the directory of the ``kt_kernel`` package the
  interpreter imported; ``:201-207`` glob ``_kt_kernel_ext_<variant>.*.so`` there, then
  ``kt_kernel_ext.*.so``; ``:217`` loads ``so_files[0]`` of an unsorted ``glob.glob``. With
  two extensions (another python's ABI, an older variant build) either may load.
- ``python/experts_base.py:176-179``: without ``init_ascend_callback_worker`` in the module
  (bound only with the Ascend backend, ``ext_bindings.cpp:483-498``) the ACL callback worker
  is skipped silently and the CPU MoE never overlaps the NPU.
- ``python/utils/loader.py:19, :51``: ``GGMLQuantizationType.MXFP4 = 39``, the GGUF type of
  the experts (main_repo/0002); the C++ side is llama.cpp's ``GGML_TYPE_MXFP4 = 39``
  (``ggml.h:380`` after the delivery's llama_cpp/0002) with its kernel
  ``ggml_vec_dot_mxfp4_q8_0`` (``ggml-quants.c:11330``), which ``operators/llamafile/moe.hpp:186``
  calls.

What is checked, in the interpreter and with the PYTHONPATH the server gets
(:func:`dsv4_offload.build.interpreter.server_pythonpath`):

1. ``kt_kernel`` resolves (``importlib.util.find_spec``: found, not executed, so no torch or
   CANN is needed) to the build's own package directory, not another install;
2. exactly one ``*kt_kernel_ext*.so`` is in it;
3. that file was written by this build: modified after the step started, or, when CMake had
   nothing to relink, no older than any object file of the step's ``build/`` tree;
4. with an NPU (``platform.npu``), it has the Ascend callback worker: it imports
   ``aclrtProcessReport`` (the worker's loop, ``cpu_backend/ascend_callback_worker.cpp:43``;
   nothing else calls it) and carries the binding's name;
5. it knows MXFP4 as type 39: the package's loader enum, and ggml's MXFP4 kernel among the
   extension's symbols when its symbol tables show ggml at all.

The symbols are read by :func:`elf_symbols`, a small reader of the ELF symbol tables written
here rather than a dependency (pyelftools) or ``nm``: the tool is installed into the 910B
image from a wheelhouse, binutils' ``nm`` is not promised there, and only the names of
``.dynsym``/``.symtab`` are needed.
"""

from __future__ import annotations

import ast
import json
import mmap
import os
import struct
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from dsv4_offload.build.bringup import StepFailed, note
from dsv4_offload.build.interpreter import server_pythonpath
from dsv4_offload.core.runner import capture

PACKAGE = "kt_kernel"
EXTENSION_GLOB = "*kt_kernel_ext*.so"  # covers both of _cpu_detect.py:201 and :206
# cpu_backend/ascend_callback_worker.cpp:43, :47: the worker's loop; no other caller
ASCEND_WORKER_SYMBOL = "aclrtProcessReport"
# ext_bindings.cpp:485, the name experts_base.py:178 looks for with hasattr
ASCEND_WORKER_BINDING = b"init_ascend_callback_worker"
MXFP4_TYPE = 39  # python/utils/loader.py:51; ggml.h:380 of the patched llama.cpp
MXFP4_KERNEL_SYMBOL = "ggml_vec_dot_mxfp4_q8_0"  # llama.cpp ggml-quants.c:11330 (patched)
GGML_DOT_PREFIX = "ggml_vec_dot_"  # ggml's other kernels: the symbol tables show ggml
LOADER = Path("utils") / "loader.py"  # setup.py:835 maps kt_kernel.utils to python/utils
QUANT_ENUM = "GGMLQuantizationType"  # python/utils/loader.py:19
_TIMEOUT_S = 120.0
_FIND = ("import importlib.util, json, sys\n"
         "spec = importlib.util.find_spec(sys.argv[1])\n"
         "print(json.dumps(None if spec is None else {'origin': spec.origin, 'dirs': "
         "list(spec.submodule_search_locations or [])}))\n")


@dataclass
class KernelFacts:
    """What the server will load; recorded in the build's step data."""

    package: str = ""
    extension: str = ""
    written: str = ""  # how the extension is known to be this build's
    ascend_worker: str = "not required"
    mxfp4: str = ""
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"package": self.package, "extension": self.extension, "written": self.written,
                "ascend_worker": self.ascend_worker, "mxfp4": self.mxfp4, "notes": self.notes}


def check_kernel(python: str, tree: Path, workdir: Path, env: Mapping[str, str],
                 started: float, *, need_ascend: bool, log: Path) -> KernelFacts:
    """The checks above, in order; the first that fails raises :class:`StepFailed` with its fix.

    ``tree`` is the ktransformers checkout (the server's PYTHONPATH is made from it),
    ``workdir`` the kt-kernel step's, ``env`` the step's environment (its PYTHONPATH is what
    the server's follows), ``started`` the step's start (epoch seconds).
    """
    facts = KernelFacts()
    package = resolve_package(python, tree, workdir, env)
    facts.package = str(package)
    ext = only_extension(package)
    facts.extension = str(ext)
    facts.written = written_by_this_build(ext, workdir, started)
    symbols = elf_symbols(ext)
    if need_ascend:
        facts.ascend_worker = ascend_worker(ext, symbols)
    facts.mxfp4 = loader_mxfp4(package)
    kernel = mxfp4_kernel(ext, symbols)
    if kernel:
        facts.notes.append(kernel)
    note(log, f"kernel check: the server imports {PACKAGE} from {package}; it loads {ext} "
              f"({facts.written}); Ascend callback worker: {facts.ascend_worker}; "
              f"MXFP4: {facts.mxfp4}" + "".join(f"; {n}" for n in facts.notes))
    return facts


def resolve_package(python: str, tree: Path, workdir: Path, env: Mapping[str, str]) -> Path:
    """The directory of the ``kt_kernel`` package ``python`` imports with the server's
    PYTHONPATH; it must be this build's (``workdir``/python, through the build's link)."""
    env = dict(env)
    env["PYTHONPATH"] = server_pythonpath(tree, env.get("PYTHONPATH"))
    try:
        # cwd /: the server's working directory is the user's; nothing there may count here
        proc = capture([python, "-c", _FIND, PACKAGE], env=env, timeout=_TIMEOUT_S, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StepFailed(f"kernel check: cannot run {python} to find {PACKAGE} ({exc})",
                         "check the build python (--python PATH)") from None
    lines = proc.stdout.strip().splitlines()
    found: dict[str, Any] | None = None
    try:
        answered = proc.returncode == 0 and bool(lines)
        found = json.loads(lines[-1]) if answered else None
    except ValueError:
        answered = False
    if not answered:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise StepFailed(f"kernel check: {python} could not look {PACKAGE} up: {last}",
                         "run the same python by hand to see why")
    own = (workdir / "python").resolve()
    if found is None or not found.get("dirs"):
        raise StepFailed(
            f"kernel check: {PACKAGE} is not importable with the server's PYTHONPATH "
            f"({env['PYTHONPATH']})",
            f"the build links {workdir / PACKAGE} -> python; rerun `dsv4-offload build "
            "kt-kernel` and read its log")
    package = Path(found["dirs"][0]).resolve()  # the build's kt_kernel link followed
    if package != own:
        raise StepFailed(
            f"kernel check: with the server's PYTHONPATH {python} imports {PACKAGE} from "
            f"{package}, not from this build's {own}",
            f"remove that copy ({python} -m pip uninstall kt-kernel, or take its directory "
            "off PYTHONPATH), then `dsv4-offload build kt-kernel`")
    return package


def only_extension(package: Path) -> Path:
    """The one extension the loader can find in ``package`` (_cpu_detect.py:198-217)."""
    found = sorted(package.glob(EXTENSION_GLOB))
    if not found:
        raise StepFailed(
            f"kernel check: no {EXTENSION_GLOB} in {package}, where kt-kernel's loader looks "
            "(_cpu_detect.py:198-214)",
            "the build wrote its extension elsewhere: read the step's log, then "
            "`dsv4-offload build kt-kernel --clean`")
    if len(found) > 1:
        newest = max(found, key=lambda p: p.stat().st_mtime)
        others = " ".join(str(p) for p in found if p != newest)
        raise StepFailed(
            f"kernel check: {len(found)} extensions in {package}: "
            f"{', '.join(str(p) for p in found)}; kt-kernel's loader loads the first of an "
            "unsorted glob (_cpu_detect.py:201-217), so any of them may be the one served",
            f"keep the one this build wrote ({newest.name}, the newest): rm {others}; then "
            "`dsv4-offload build kt-kernel`")
    return found[0]


def written_by_this_build(ext: Path, workdir: Path, started: float) -> str:
    """How ``ext`` is known to come from this build, else StepFailed naming its age."""
    mtime = ext.stat().st_mtime
    if mtime >= started:
        return "written by this build"
    objects = [p.stat().st_mtime for p in (workdir / "build").rglob("*.o")] \
        if (workdir / "build").is_dir() else []
    if objects and mtime >= max(objects):
        return (f"up to date: CMake relinked nothing, it is newer than all {len(objects)} "
                f"object files of {workdir / 'build'}")
    when = datetime.fromtimestamp(mtime).isoformat(timespec="seconds")
    began = datetime.fromtimestamp(started).isoformat(timespec="seconds")
    raise StepFailed(
        f"kernel check: {ext} was not written by this build (modified {when}, the step began "
        f"{began}" + (", and it is older than the build tree's object files)" if objects
                     else "; no build tree beside it)"),
        "a stale extension from an earlier build: `dsv4-offload build kt-kernel --clean`")


def ascend_worker(ext: Path, symbols: dict[str, bool] | None) -> str:
    """The extension has the Ascend callback worker (the symbol and its binding's name)."""
    fix = ("build with the Ascend backend: CPUINFER_USE_ASCEND_NPU=1 in the kt-kernel step's env "
           "and CANN's set_env.sh sourced, so the configure prints 'Ascend NPU (CANN) backend "
           "selected' (CMakeLists.txt:486); then `dsv4-offload build kt-kernel --clean`")
    if symbols is None:
        raise StepFailed(f"kernel check: {ext} is not an ELF shared object", fix)
    if ASCEND_WORKER_SYMBOL not in symbols or not _contains(ext, ASCEND_WORKER_BINDING):
        raise StepFailed(
            f"kernel check: {ext} was built without the Ascend backend (no "
            f"{ASCEND_WORKER_SYMBOL}, the ACL callback worker of "
            "cpu_backend/ascend_callback_worker.cpp:43): kt-kernel would skip the worker "
            "silently (experts_base.py:176-179) and run the CPU MoE without overlapping the NPU",
            fix)
    return f"present ({ASCEND_WORKER_SYMBOL}, {ASCEND_WORKER_BINDING.decode()})"


def loader_mxfp4(package: Path) -> str:
    """``GGMLQuantizationType.MXFP4`` of the package's loader, read without importing it."""
    path = package / LOADER
    fix = ("the kt-kernel tree lacks the delivery's main_repo/0002: `dsv4-offload patch apply`, "
           "then `dsv4-offload build kt-kernel`")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, ValueError) as exc:
        raise StepFailed(f"kernel check: cannot read {path} ({exc})", fix) from None
    value = _enum_member(tree, QUANT_ENUM, "MXFP4")
    if value is None:
        raise StepFailed(f"kernel check: {path} has no {QUANT_ENUM}.MXFP4 (loader.py:51 of the "
                         f"patched tree: MXFP4 = {MXFP4_TYPE})", fix)
    if value != MXFP4_TYPE:
        raise StepFailed(f"kernel check: {path} gives {QUANT_ENUM}.MXFP4 = {value}; the GGUF "
                         f"files carry type {MXFP4_TYPE} (ggml.h:380 of the patched llama.cpp)",
                         fix)
    return f"{QUANT_ENUM}.MXFP4 = {MXFP4_TYPE} in {path}"


def mxfp4_kernel(ext: Path, symbols: dict[str, bool] | None) -> str:
    """A note on ggml's MXFP4 kernel in the extension; StepFailed when ggml shows without it."""
    if symbols is not None and MXFP4_KERNEL_SYMBOL in symbols:
        return f"ggml's MXFP4 kernel {MXFP4_KERNEL_SYMBOL} is in the extension"
    if symbols is not None and any(s.startswith(GGML_DOT_PREFIX) for s in symbols):
        raise StepFailed(
            f"kernel check: {ext} has ggml's kernels but not {MXFP4_KERNEL_SYMBOL} (type "
            f"{MXFP4_TYPE}, ggml-quants.c:11330 after the delivery's llama_cpp/0002): it was "
            "built against an unpatched llama.cpp",
            "`dsv4-offload patch apply` (the llama.cpp patches), then `dsv4-offload build "
            "kt-kernel --clean`")
    return (f"ggml's symbols are not visible in {ext.name} (stripped or hidden): its MXFP4 "
            "kernel was not checked, only the loader's type")


def _enum_member(tree: ast.Module, cls: str, member: str) -> int | None:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == member for t in item.targets) \
                        and isinstance(item.value, ast.Constant) \
                        and isinstance(item.value.value, int):
                    return item.value.value
    return None


def _contains(path: Path, needle: bytes) -> bool:
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return False
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(needle) >= 0


# --- ELF symbol tables ------------------------------------------------------------------------

_SHT_SYMTAB, _SHT_DYNSYM = 2, 11


def elf_symbols(path: Path) -> dict[str, bool] | None:
    """The names in ``path``'s ``.dynsym`` and ``.symtab`` -> defined there (False: imported,
    SHN_UNDEF); None when it is not an ELF file. ELF32/64, either byte order."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < 52 or data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        return None
    wide, end = data[4] == 2, "<" if data[5] == 1 else ">"
    try:
        if wide:
            shoff, = struct.unpack_from(end + "Q", data, 0x28)
            shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A)
        else:
            shoff, = struct.unpack_from(end + "I", data, 0x20)
            shentsize, shnum = struct.unpack_from(end + "HH", data, 0x2E)
        sections = [_section(data, shoff + i * shentsize, wide, end) for i in range(shnum)]
        out: dict[str, bool] = {}
        for sh_type, offset, size, link, entsize in sections:
            if sh_type not in (_SHT_SYMTAB, _SHT_DYNSYM) or not entsize or link >= len(sections):
                continue
            strtab = sections[link]
            for pos in range(offset, offset + size - entsize + 1, entsize):
                name_off, shndx = _symbol(data, pos, wide, end)
                start = strtab[1] + name_off
                name = data[start:data.index(b"\0", start)].decode("utf-8", "replace")
                if name:
                    out[name] = out.get(name, False) or shndx != 0
        return out
    except (struct.error, ValueError):
        return None


def _section(data: bytes, pos: int, wide: bool, end: str) -> tuple[int, int, int, int, int]:
    """(sh_type, sh_offset, sh_size, sh_link, sh_entsize) of the section header at ``pos``."""
    if wide:
        _n, sh_type, _f, _a, offset, size, link, _i, _al, entsize = struct.unpack_from(
            end + "IIQQQQIIQQ", data, pos)
    else:
        _n, sh_type, _f, _a, offset, size, link, _i, _al, entsize = struct.unpack_from(
            end + "IIIIIIIIII", data, pos)
    return sh_type, offset, size, link, entsize


def _symbol(data: bytes, pos: int, wide: bool, end: str) -> tuple[int, int]:
    """(st_name, st_shndx) of the symbol at ``pos``."""
    if wide:
        name, _info, _other, shndx = struct.unpack_from(end + "IBBH", data, pos)
    else:
        name, _value, _size, _info, _other, shndx = struct.unpack_from(end + "IIIBBH", data, pos)
    return name, shndx


def link_kt_kernel_package(kt_kernel_dir: Path) -> None:
    """Make `import kt_kernel` work from kt-kernel/: a `kt_kernel -> python` link (idempotent)."""
    name, target = "kt_kernel", "python"  # `import kt_kernel` = kt-kernel/python
    link = kt_kernel_dir / name
    if not (kt_kernel_dir / target).is_dir():
        return  # not this layout: the import check will say what is wrong
    if link.is_symlink():
        if os.readlink(link) == target:
            return
    elif link.exists():
        return  # a real directory someone made: leave it alone
    tmp = kt_kernel_dir / f".{name}.link-tmp"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)  # atomic: never a moment without a link on a rerun
