"""Stand-ins of what the kt-kernel build leaves for the server to load, for the kernel check.

``compile_extension`` makes a real ELF shared object with gcc, so its symbol tables are the
linker's, not ours: with ``ascend`` it calls ``aclrtProcessReport`` (left undefined, as the
real extension imports it from libascendcl; the Ascend worker's loop,
cpu_backend/ascend_callback_worker.cpp:43 of the patched kt-kernel) and carries the binding's
name ``init_ascend_callback_worker`` (ext_bindings.cpp:485); with ``mxfp4`` it defines ggml's
``ggml_vec_dot_mxfp4_q8_0`` (llama.cpp ggml-quants.c:11330 after the delivery's
llama_cpp/0002) beside an older ggml kernel. Nothing here is upstream output: the names are
the patched sources' and the code is ours.

``write_loader`` writes a ``utils/loader.py`` with the one enum the check reads (the patched
``python/utils/loader.py:19`` and ``:51``: ``GGMLQuantizationType.MXFP4 = 39``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

EXT_NAME = "kt_kernel_ext.cpython-311-aarch64-linux-gnu.so"


def compile_extension(out: Path, *, ascend: bool = True, mxfp4: bool = True,
                      ggml: bool = True, strip: bool = False) -> Path:
    """A shared object at ``out`` (gcc -shared); without ``ggml`` no ggml symbol is visible
    (as with hidden symbols); ``strip`` drops ``.symtab`` as a release build's pybind11_strip
    does (``.dynsym`` stays)."""
    lines = ["void *PyInit_kt_kernel_ext(void);"]
    if ggml:
        lines.append("void ggml_vec_dot_q8_0_q8_0(void) {}")
    body = ""
    if ascend:
        lines += ["extern int aclrtProcessReport(int);",
                  'const char *kt_binding_name = "init_ascend_callback_worker";']
        body = "aclrtProcessReport(1000); return (void *)kt_binding_name;"
    if ggml and mxfp4:
        lines.append("void ggml_vec_dot_mxfp4_q8_0(void) {}")
    lines.append("void *PyInit_kt_kernel_ext(void) { " + (body or "return 0;") + " }")
    out.parent.mkdir(parents=True, exist_ok=True)
    source = out.with_name(out.name + ".c")
    source.write_text("\n".join(lines) + "\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(out), str(source)],
                   check=True, capture_output=True, timeout=120)
    source.unlink()
    if strip:
        subprocess.run(["strip", str(out)], check=True, capture_output=True, timeout=60)
    return out


def write_loader(python_dir: Path, mxfp4: int | None = 39) -> Path:
    """``python_dir/utils/loader.py`` with GGMLQuantizationType (MXFP4 left out when None)."""
    path = python_dir / "utils" / "loader.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "__init__.py").touch()
    members = "    F32 = 0\n    Q8_0 = 8\n"
    if mxfp4 is not None:
        members += f"    MXFP4 = {mxfp4}\n"
    path.write_text("from enum import IntEnum\n\n\nclass GGMLQuantizationType(IntEnum):\n"
                    + members)
    return path
