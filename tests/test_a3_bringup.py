"""The A3 bring-up from a clean CANN 9.0.0 image, as the bundled dsv4-flash-a3 build steps.

The steps come from the delivery's scripts/tools/setup_dsv4_env_from_clean_cann.sh ("S"):
they run here against small trees this test makes (a fake CANN with set_env.sh, fake
build.sh / build_and_install.sh that behave like the real ones where it matters, and an
interpreter whose pip records its argv and environment). Every pip step must get the
constraints; every workaround must show in the log; every failure must be named.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path

import pytest
from kernel_standin import EXT_NAME, compile_extension, write_loader

DELIVERY_TOOLS = "src/cann-recipes-infer/integration/sglang/dsv4-flash-single-npu-moe-offload/" \
                 "scripts/tools"
BRINGUP = ["prereq", "torch", "triton", "sglang-deps", "kt-kernel-deps", "vendor-customize",
           "custom-ops", "vendor-transformer", "sgl-kernel-npu", "sgl-kernel-npu-wheels",
           "verify"]
# our own constraints file for the test (the real one is fetched from the pinned delivery)
TORCH_LOCK = "# test constraints\ntorch==2.8.0+cpu\ntorch_npu==2.8.0.post4\n"
BASE_REQS = "# test requirements\nfastapi\n"


def _exe(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


# what the recorders (pip, cmake, gcc-13, bisheng) write of their environment
RECORDED_ENV = ("FAKE_CANN_MARKER", "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "CC", "CXX")
# a recorder: its argv, cwd, umask and RECORDED_ENV as a JSON line in $FAKE_RECORD
RECORDER = f"""#!{sys.executable}
import json, os, sys
mask = os.umask(0); os.umask(mask)
with open(os.environ["FAKE_RECORD"], "a") as fh:
    fh.write(json.dumps({{"tool": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                         "cwd": os.getcwd(), "umask": "%04o" % mask,
                         **{{k: os.environ.get(k) for k in {RECORDED_ENV!r}}}}}) + "\\n")
if "--version" in sys.argv:
    print(os.path.basename(sys.argv[0]) + " (recorder) 13.1.0")
"""

# the interpreter: `-m pip` records argv + PIP_CONSTRAINT (and RECORDED_ENV, the umask) and
# "installs" into a site dir of stand-in packages; anything else runs the real python with
# that site dir on its path
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, sys

# the commands in this process (conftest.run_cli_inproc): what they answer is the point
CLI_IN_PROCESS = True
SITE = os.environ["FAKE_SITE"]

def dist(name, version):
    d = os.path.join(SITE, name.replace("-", "_") + "-" + version + ".dist-info")
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, "METADATA"), "w").write(f"Metadata-Version: 2.1\\nName: {{name}}\\n"
                                                 f"Version: {{version}}\\n")

def module(name, text):
    os.makedirs(os.path.join(SITE, name), exist_ok=True)
    open(os.path.join(SITE, name, "__init__.py"), "w").write(text)

if sys.argv[1:3] == ["-m", "pip"]:
    args = sys.argv[3:]
    with open(os.environ["FAKE_PIP_LOG"], "a") as fh:
        mask = os.umask(0); os.umask(mask)
        fh.write(json.dumps({{"argv": args, "PIP_CONSTRAINT": os.environ.get("PIP_CONSTRAINT"),
                             "cwd": os.getcwd(), "umask": "%04o" % mask,
                             **{{k: os.environ.get(k) for k in {RECORDED_ENV!r}}}}}) + "\\n")
    if "-e" in args and os.path.basename(os.getcwd()) == "gguf-py":  # editable gguf-py
        module("gguf", "")
    for a in args:
        if a.startswith("triton-ascend=="):
            version = os.environ.get("FAKE_TRITON_VERSION") or a.split("==")[1]
            dist("triton-ascend", version)
            module("triton", "")
        base = os.path.basename(a)
        if base.startswith("sgl_kernel_npu") and base.endswith(".whl"):
            module("sgl_kernel_npu", "")
        if base.startswith("custom_ops") and base.endswith(".whl"):
            # registers torch.ops.custom.*; it links libc10.so, loaded by importing torch first
            module("custom_ops", "import sys\\n"
                   "if 'torch' not in sys.modules:\\n"
                   "    raise ImportError('libc10.so: cannot open shared object file')\\n"
                   "for op in ('compressor', 'npu_sparse_attn_sharedkv', "
                   "'npu_quant_lightning_indexer', 'npu_moe_gating_top_k'):\\n"
                   "    setattr(sys.modules['torch'].ops.custom, op, object())\\n")
    sys.exit(0)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [SITE] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])
"""


@pytest.fixture
def a3(tmp_path: Path) -> dict:
    """A workspace with the bring-up's trees, a fake CANN 9.0.0 and the tools on PATH."""
    ws = tmp_path / "ws"
    site = tmp_path / "site"
    bin_dir = tmp_path / "bin"
    cann = tmp_path / "Ascend" / "cann-9.0.0"
    order = tmp_path / "order.log"
    # CANN: set_env.sh reads a variable nobody set, as the vendors' do (S87-89)
    _exe(cann / "set_env.sh", 'export ASCEND_CUSTOM_OPP_PATH="${ASCEND_CUSTOM_OPP_PATH}:x"\n'
         f'export ASCEND_OPP_PATH="{cann}/opp"\n')
    # the packages a clean image has: torch and torch_npu at the locked versions
    torch_init = "import types\n__version__ = '2.8.0+cpu'\n" \
                 "ops = types.SimpleNamespace(custom=types.SimpleNamespace())\n"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(torch_init)
    (site / "torch_npu").mkdir()
    (site / "torch_npu" / "__init__.py").write_text("__version__ = '2.8.0.post4'\n")
    for name, version in (("torch", "2.8.0+cpu"), ("torch_npu", "2.8.0.post4")):
        d = site / f"{name}-{version}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    _exe(bin_dir / "fake-python", FAKE_PYTHON)
    _exe(bin_dir / "gcc-13", "#!/bin/sh\necho 'gcc-13 (Ubuntu 13.1.0) 13.1.0'\n")
    _exe(bin_dir / "pkg-config", "#!/bin/sh\n[ -z \"$FAKE_NO_HWLOC\" ]\n")
    _exe(bin_dir / "ldconfig", "#!/bin/sh\necho '\tlibhwloc.so.15 (libc6,AArch64) => "
                               "/lib/aarch64-linux-gnu/libhwloc.so.15'\n")
    # the pinned delivery's two files (our own test contents; their digests set below)
    tools = ws / DELIVERY_TOOLS
    tools.mkdir(parents=True)
    (tools / "dsv4_torch_lock.txt").write_text(TORCH_LOCK)
    (tools / "dsv4_sglang_base_reqs.txt").write_text(BASE_REQS)
    # a build that refuses group-writable files, as msopgen's security check does (S96, S182)
    msopgen = ('if [ -n "$(find . -path ./.git -prune -o -perm /022 -print)" ]; then '
               'echo "msopgen: security check failed: group-writable files"; exit 1; fi\n')
    ascendc = ws / "src/cann-recipes-ops/ops/ascendc"
    _exe(ascendc / "build.sh", "#!/bin/bash\nset -e\n"
         f'echo "vendor-customize $*" >> {order}\necho "umask $(umask)"\n' + msopgen +
         "mkdir -p output\n"
         "printf '#!/bin/sh\\nfor a; do case $a in --install-path=*) p=${a#*=};; esac; done\\n"
         "mkdir -p $p/vendors/customize/bin\\n"
         "echo \"export ASCEND_CUSTOM_OPP_PATH=$p/vendors/customize:$ASCEND_CUSTOM_OPP_PATH\" "
         "> $p/vendors/customize/bin/set_env.bash\\n' "
         "> output/CANN-custom_ops-1.0-linux.aarch64.run\n")
    (ascendc / "op_host.cpp").write_text("// an operator\n")
    # group-writable, as a checkout made under umask 0002 leaves it: msopgen would refuse it
    (ascendc / "op_host.cpp").chmod(0o664)
    ext = ascendc / "torch_ops_extension"
    _exe(ext / "build_and_install.sh", "#!/bin/bash\nset -e\n"
         f'echo custom-ops >> {order}\nmkdir -p dist && touch dist/custom_ops-1.0-cp311.whl\n'
         f'"$FAKE_PY" -m pip install -I dist/custom_ops-1.0-cp311.whl\n')
    # the source package beside it shadows the wheel when imported from here (S199-201)
    (ext / "custom_ops").mkdir()
    (ext / "custom_ops" / "__init__.py").write_text(
        "raise ImportError(\"cannot import name 'custom_ops_lib' from partially initialized "
        "module 'custom_ops' (most likely due to a circular import)\")\n")
    _exe(ws / "src/ops-transformer/build.sh", "#!/bin/bash\nset -e\n"
         f'echo "vendor-transformer $*" >> {order}\necho "umask $(umask)"\n' + msopgen +
         "mkdir -p build\n"
         "printf '#!/bin/sh\\nfor a; do case $a in --install-path=*) p=${a#*=};; esac; done\\n"
         "mkdir -p $p/vendors/custom_transformer/bin\\n"
         "echo \"export X=\\\\${UNSET_BY_ANYONE}\" "
         "> $p/vendors/custom_transformer/bin/set_env.bash\\n' "
         "> build/cann-ops-transformer-custom_linux-aarch64.run\n")
    (ws / "src/ops-transformer/third_party").mkdir()
    sgl = ws / "src/sgl-kernel-npu"
    (sgl / "csrc/attentions/csrc").mkdir(parents=True)
    (sgl / "csrc/attentions/csrc/CMakeLists.txt").write_text(
        "add_library(PTAExtensionOPS SHARED ops.cpp)\n"
        "target_link_libraries(PTAExtensionOPS PUBLIC\n  c10\n  torch\n  )\n")
    _exe(sgl / "build.sh", "#!/bin/bash\nset -e\n"
         f"echo sgl-kernel-npu >> {order}\n"
         "grep -q CMAKE_DL_LIBS csrc/attentions/csrc/CMakeLists.txt || "
         "{ echo \"libPTAExtensionOPS.so: undefined reference to \\`dlopen'\"; exit 1; }\n"
         "mkdir -p output\nfor w in sgl_kernel_npu deep_ep attentions torch_memory_saver; do "
         "touch output/$w-1.0-py3-none-any.whl; done\n")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SITE": str(site),
           "FAKE_PIP_LOG": str(tmp_path / "pip.log"), "FAKE_PY": str(bin_dir / "fake-python")}
    sha = {name: hashlib.sha256(text.encode()).hexdigest()
           for name, text in (("torch_lock", TORCH_LOCK), ("sglang_base_reqs", BASE_REQS))}
    args = ["--workspace", str(ws), "--recipe", "dsv4-flash-a3",
            "--set", f"build.python={bin_dir / 'fake-python'}",
            "--set", f"build.vars.cann_home={cann}",
            "--set", f"build.files.torch_lock.sha256={sha['torch_lock']}",
            "--set", f"build.files.sglang_base_reqs.sha256={sha['sglang_base_reqs']}"]
    return {"ws": ws, "env": env, "args": args, "cann": cann, "site": site, "order": order,
            "pip": tmp_path / "pip.log", "tools": tools}


def _build(cli, a3: dict, *steps: str, env: dict | None = None):  # type: ignore[no-untyped-def]
    r = cli(*a3["args"], "--json", "build", *steps, env={**a3["env"], **(env or {})},
            timeout=300)
    assert r.out.strip(), r
    return r, r.json()


def _log(a3: dict, step: str) -> str:
    return (a3["ws"] / "logs" / "build" / f"{step}.log").read_text()


def _error(doc: dict) -> dict:
    return next(p for p in doc["data"]["problems"] if p["severity"] == "error")


def test_the_bring_up_runs_in_order_with_constraints_and_workarounds(cli, a3: dict) -> None:
    r, doc = _build(cli, a3, *BRINGUP)
    assert r.code == 0, r
    assert list(doc["data"]["data"]["steps"]) == BRINGUP
    assert all(s["status"] == "ok" for s in doc["data"]["data"]["steps"].values())
    # the fake trees ran in the recipe's order, with the script's arguments (S183, S228-230)
    ws = a3["ws"]
    assert a3["order"].read_text().splitlines() == [
        "vendor-customize -c ascend910_93", "custom-ops",
        "vendor-transformer --pkg --experimental --soc=ascend910_93 --vendor_name=custom "
        "--ops=sparse_attn_sharedkv,sparse_attn_sharedkv_metadata,compressor,"
        "quant_lightning_indexer,quant_lightning_indexer_metadata "
        f"--cann_3rd_lib_path={ws}/src/ops-transformer/third_party -j16", "sgl-kernel-npu"]
    # every pip call had the torch lock: `-c` on ours, PIP_CONSTRAINT for build scripts' own
    lock = str(a3["tools"] / "dsv4_torch_lock.txt")
    calls = [json.loads(x) for x in a3["pip"].read_text().splitlines()]
    assert [c["argv"][:2] for c in calls] == [
        ["install", "triton-ascend==3.2.1.dev20260530"],
        ["install", "-r"], ["install", "safetensors"],
        ["install", "-I"],  # build_and_install.sh's own pip (S198)
        ["install", f"{ws}/src/sgl-kernel-npu/output/sgl_kernel_npu-1.0-py3-none-any.whl"]]
    assert all(c["PIP_CONSTRAINT"] == lock for c in calls)
    assert all(c["argv"][-2:] == ["-c", lock] for c in calls if c["argv"][1] != "-I")
    assert calls[1]["argv"][2] == str(a3["tools"] / "dsv4_sglang_base_reqs.txt")
    assert [Path(a).name for a in calls[4]["argv"][1:5]] == [
        f"{w}-1.0-py3-none-any.whl"
        for w in ("sgl_kernel_npu", "deep_ep", "attentions", "torch_memory_saver")]
    # each workaround is in the log
    assert "workaround nounset-while-sourcing" in _log(a3, "prereq")
    assert "workaround chmod-go-w" in _log(a3, "vendor-customize")
    assert _stat_mode(ws / "src/cann-recipes-ops/ops/ascendc/op_host.cpp") == 0o644
    assert "workaround umask: the command runs with umask 0022" in _log(a3, "vendor-customize")
    assert "umask 0022" in _log(a3, "vendor-transformer")
    assert "workaround -ldl for sgl_kernel_npu: appended '${CMAKE_DL_LIBS}'" in \
        _log(a3, "sgl-kernel-npu")
    assert "target_link_libraries(PTAExtensionOPS PUBLIC ${CMAKE_DL_LIBS}" in \
        (ws / "src/sgl-kernel-npu/csrc/attentions/csrc/CMakeLists.txt").read_text()
    assert "require_installed: torch 2.8.0+cpu (constraints: 2.8.0+cpu)" in _log(a3, "torch")
    assert "check custom-ops-import (from an empty directory, no PYTHONPATH)" in \
        _log(a3, "custom-ops")
    assert "check triton-not-3.2.0" in _log(a3, "triton")
    verify = _log(a3, "verify")
    assert "vendor_transformer" not in verify and "vendors OK" in verify
    # the vendors landed in CANN's opp (S187, S233)
    assert (a3["cann"] / "opp/vendors/customize/bin/set_env.bash").is_file()
    assert (a3["cann"] / "opp/vendors/custom_transformer/bin/set_env.bash").is_file()
    # a rerun finds the -ldl edit in place, and removes the read-only vendor a first build
    # installed (S259-261)
    vendors = ws / "src/sgl-kernel-npu/python/deep_ep/deep_ep/vendors"
    (vendors / "hwcomputing").mkdir(parents=True)
    (vendors / "hwcomputing" / "uninstall.sh").write_text("#!/bin/sh\n")
    for path in (vendors / "hwcomputing" / "uninstall.sh", vendors / "hwcomputing", vendors):
        path.chmod(0o555)
    r, doc = _build(cli, a3, "sgl-kernel-npu")
    assert r.code == 0, r
    assert "already has CMAKE_DL_LIBS" in _log(a3, "sgl-kernel-npu")
    assert "workaround read-only leftovers: removed python/deep_ep/deep_ep/vendors/hwcomputing" \
        in _log(a3, "sgl-kernel-npu")
    assert vendors.is_dir() and not (vendors / "hwcomputing").exists()


def test_missing_hwloc_fails_prereq_by_name(cli, a3: dict) -> None:
    r, doc = _build(cli, a3, "prereq", env={"FAKE_NO_HWLOC": "1"})
    assert r.code == 1
    err = _error(doc)
    assert "check hwloc-pc failed (S105-110)" in err["message"]
    assert err["fix"].startswith("apt-get install -y pkg-config libhwloc-dev libhwloc15")


def test_wrong_torch_is_named_with_the_lock(cli, a3: dict) -> None:
    meta = a3["site"] / "torch-2.8.0+cpu.dist-info" / "METADATA"
    meta.write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.10.0\n")
    r, doc = _build(cli, a3, "torch")
    assert r.code == 1
    assert "torch is 2.10.0, dsv4_torch_lock.txt pins 2.8.0+cpu" in _error(doc)["message"]


def test_triton_3_2_0_is_refused_by_name(cli, a3: dict) -> None:
    r, doc = _build(cli, a3, "triton", env={"FAKE_TRITON_VERSION": "3.2.0"})
    assert r.code == 1
    err = _error(doc)
    assert "check triton-not-3.2.0 failed (S150-152, triton 3.2.0 vs CANN 9)" in err["message"]
    assert "3.2.1.dev20260530" in err["fix"]


def test_without_the_ldl_line_the_workaround_failure_is_named(cli, a3: dict) -> None:
    cm = a3["ws"] / "src/sgl-kernel-npu/csrc/attentions/csrc/CMakeLists.txt"
    cm.write_text("add_library(PTAExtensionOPS SHARED ops.cpp)\n")
    r, doc = _build(cli, a3, "sgl-kernel-npu")
    assert r.code == 1
    assert "workaround -ldl for sgl_kernel_npu: no line of csrc/attentions/csrc/CMakeLists.txt" \
           in _error(doc)["message"]


def test_a_build_that_resets_the_umask_is_caught(cli, a3: dict) -> None:
    build = a3["ws"] / "src/ops-transformer/build.sh"
    _exe(build, "#!/bin/bash\numask 0002\nmkdir -p build && touch build/loose.o\n"
         "printf '#!/bin/sh\\n' > build/cann-ops-transformer-custom_linux-aarch64.run\n")
    r, doc = _build(cli, a3, "vendor-transformer")
    assert r.code == 1
    assert "workaround umask 0022: the build left build" in _error(doc)["message"]


def test_a_set_env_that_fails_names_the_nounset_workaround(cli, a3: dict) -> None:
    _exe(a3["cann"] / "set_env.sh", "echo 'set_env: no toolkit here' >&2\nfalse\n")
    r, doc = _build(cli, a3, "prereq")
    assert r.code == 1
    msg = _error(doc)["message"]
    assert "workaround nounset-while-sourcing: sourcing" in msg and "set_env: no toolkit" in msg


def test_custom_ops_shadowed_or_without_torch_is_caught(cli, a3: dict) -> None:
    """The neutral directory matters: from the workdir the source package shadows it."""
    assert _build(cli, a3, "custom-ops")[0].code == 0
    import subprocess

    ext = a3["ws"] / "src/cann-recipes-ops/ops/ascendc/torch_ops_extension"
    env = {**os.environ, **a3["env"]}
    shadowed = subprocess.run([a3["env"]["FAKE_PY"], "-c", "import torch, torch_npu; "
                               "import custom_ops"], cwd=ext, env=env, capture_output=True,
                              text=True)
    assert shadowed.returncode != 0 and "circular import" in shadowed.stderr
    bare = subprocess.run([a3["env"]["FAKE_PY"], "-c", "import custom_ops"], cwd="/", env=env,
                          capture_output=True, text=True)
    assert bare.returncode != 0 and "libc10.so" in bare.stderr


def test_a_changed_pinned_file_stops_the_build(cli, a3: dict) -> None:
    (a3["tools"] / "dsv4_torch_lock.txt").write_text(TORCH_LOCK + "torchvision==0.99\n")
    r, doc = _build(cli, a3, "torch")
    assert r.code == 1
    assert "build.files.torch_lock" in _error(doc)["message"]
    assert not (a3["ws"] / "logs/build/torch.log").exists()


def test_both_recipes_validate_and_the_a3_dry_run_lists_the_bring_up(cli, tmp_path: Path) -> None:
    for name in ("dsv4-flash-910b", "dsv4-flash-a3"):
        r = cli("--recipe", name, "recipe", "validate")
        assert r.code == 0, r
    r = cli("--workspace", str(tmp_path / "ws"), "--recipe", "dsv4-flash-a3", "--json", "run",
            "--dry-run", env={"DSV4_HOST_ROOT": str(Path(__file__).parent / "fixtures/hosts/"
                                                      "a3-host")})
    assert r.code == 0, r
    build = next(p for p in r.json()["data"]["plan"] if p["stage"] == "build")
    assert build["steps"][:len(BRINGUP) + 1] == [*BRINGUP, "kt-kernel"]
    assert "container" not in build["reason"]  # A3 runs where the tool runs
    text = cli("--workspace", str(tmp_path / "ws"), "--recipe", "dsv4-flash-a3", "run",
               "--dry-run").out
    assert text.index("prereq,") < text.index("verify,") < text.index(" kt-kernel,")


def _stat_mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- the environment of each step: the cann context, gcc-13, the umask -----------------------

KT = "src/ktransformers/kt-kernel"
GGUF = "src/ktransformers/third_party/llama.cpp/gguf-py"
SGLANG = "src/ktransformers/third_party/sglang/python"
OP = f"{DELIVERY_TOOLS}/ascendc_mxfp4"
AFTER = ["kt-kernel", "gguf-py", "sglang", "ascendc-op"]
# kt-kernel's setup.py reduced to what touches the environment: CMake, then the compiler in CC;
# the extension it leaves is a real shared object the test compiled ($KT_EXT_FROM)
KT_SETUP = """import os, shutil, subprocess, sys
subprocess.run(["cmake", "-S", ".", "-B", "build"], check=True)
subprocess.run([os.environ.get("CC", "cc"), "-c", "ext.c"], check=True)
shutil.copyfile(os.environ["KT_EXT_FROM"], "python/kt_kernel_ext.cpython-311-aarch64-linux-gnu.so")
"""


def _fake_cann(home: Path, tag: str) -> None:
    """A CANN home whose set_env.sh marks the environment and puts its bin dir (bisheng) first,
    with the AscendC header the op compiles against (guide line 545)."""
    _exe(home / "set_env.sh", 'export ASCEND_CUSTOM_OPP_PATH="${ASCEND_CUSTOM_OPP_PATH}:x"\n'
         f'export ASCEND_OPP_PATH="{home}/opp"\nexport FAKE_CANN_MARKER={tag}\n'
         f'export PATH="{home}/bin:$PATH"\n')
    _exe(home / "bin" / "bisheng", RECORDER)
    header = home / "aarch64-linux/tikcpp/tikcfw/kernel_operator.h"
    header.parent.mkdir(parents=True, exist_ok=True)
    header.write_text("// AscendC\n")


@pytest.fixture
def a3env(a3: dict, tmp_path: Path) -> dict:
    """The A3 workspace with the four steps after the bring-up laid out, recorders for cmake,
    gcc-13 and bisheng, and a CANN home that marks the environment."""
    _fake_cann(a3["cann"], "cann-9")
    bin_dir = Path(a3["env"]["FAKE_PY"]).parent
    for tool in ("cmake", "gcc-13"):
        _exe(bin_dir / tool, RECORDER)
    ws = a3["ws"]
    (ws / KT / "python").mkdir(parents=True)
    (ws / KT / "python" / "__init__.py").write_text("")
    (ws / KT / "setup.py").write_text(KT_SETUP)
    write_loader(ws / KT / "python")
    a3["env"]["KT_EXT_FROM"] = str(compile_extension(tmp_path / "ext" / EXT_NAME))
    (ws / GGUF).mkdir(parents=True)
    (ws / SGLANG / "sglang").mkdir(parents=True)
    (ws / SGLANG / "sglang" / "__init__.py").write_text("")
    (ws / OP).mkdir(parents=True)
    (ws / OP / "mxfp4_fused_kernel.cpp").write_text("// the op\n")
    record = tmp_path / "record.log"
    a3["env"]["FAKE_RECORD"] = str(record)
    # the markers are test_build.py's business; here the configure prints none of them
    a3["args"] += ["--set", "build.steps[kt-kernel].expect_markers=[]",
                   "--set", "build.steps[kt-kernel].forbid_markers=[]"]
    return {**a3, "record": record}


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_each_step_runs_in_the_cann_shell_with_gcc_13_for_kt_kernel_alone(cli, a3env: dict
                                                                          ) -> None:
    old_mask = os.umask(0o002)  # the group-writable umask msopgen refuses (S96)
    try:
        r, doc = _build(cli, a3env, *BRINGUP, *AFTER, env={"CC": "cc-of-the-shell"})
    finally:
        os.umask(old_mask)
    assert r.code == 0, r
    steps = doc["data"]["data"]["steps"]
    assert list(steps) == [*BRINGUP, *AFTER]
    assert all(s["status"] == "ok" for s in steps.values()), steps
    cann = str(a3env["cann"])
    pip = _records(a3env["pip"])
    # the steps' calls (all in the workspace); not the fingerprint's `gcc-13 --version` nor
    # the preflight asking gcc-13 for hwloc.h and numa.h before any step
    tools = [c for c in _records(a3env["record"]) if c["argv"][:2] != ["-xc", "-E"]
             and Path(c["cwd"]).is_relative_to(a3env["ws"])]
    # every command after CANN is there ran in its shell: set_env.sh sourced (the marker, its
    # bin dir first), ASCEND_HOME_PATH and ASCEND_TOOLKIT_HOME the CANN home, umask 0022
    for call in pip + tools:
        assert call["FAKE_CANN_MARKER"] == "cann-9", call
        assert call["ASCEND_HOME_PATH"] == cann and call["ASCEND_TOOLKIT_HOME"] == cann, call
        assert call["umask"] == "0022", call
    by_cwd = {Path(c["cwd"]).relative_to(a3env["ws"]).as_posix(): c for c in pip
              if Path(c["cwd"]).is_relative_to(a3env["ws"])}
    assert {GGUF, SGLANG} <= by_cwd.keys()  # gguf-py's and sglang's pip ran, in that shell
    # gcc-13 is kt-kernel's compiler alone (S281): CMake and the compile there see it ...
    kt = [c for c in tools if c["cwd"] == str(a3env["ws"] / KT)]
    assert [c["tool"] for c in kt] == ["cmake", "gcc-13"]
    assert all(c["CC"] == "gcc-13" and c["CXX"] == "g++-13" for c in kt)
    # ... and no other step: the pip calls, the prereq check, bisheng keep the shell's CC
    others = [c for c in pip + tools if c not in kt]
    assert others and all(c["CC"] == "cc-of-the-shell" for c in others), others
    assert any(c.get("tool") == "gcc-13" and c["argv"] == ["--version"] for c in others)
    bisheng = [c for c in tools if c["tool"] == "bisheng"]
    assert len(bisheng) == 1 and bisheng[0]["cwd"] == str(a3env["ws"] / OP)
    assert f"-I{cann}/aarch64-linux/tikcpp/tikcfw" in bisheng[0]["argv"]
    assert "context cann: sourced " + cann + "/set_env.sh" in _log(a3env, "kt-kernel")


def test_cann_home_from_the_environment_is_honoured(cli, a3env: dict, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere" / "cann-9.0.0"
    _fake_cann(other, "cann-elsewhere")
    i = a3env["args"].index(f"build.vars.cann_home={a3env['cann']}")
    args = a3env["args"][:i - 1] + a3env["args"][i + 1:]  # the recipe's default, no --set
    r = cli(*args, "--json", "build", "prereq", "triton", "vendor-customize",
            env={**a3env["env"], "CANN_HOME": str(other)}, timeout=300)
    assert r.code == 0, r
    (triton,) = [c for c in _records(a3env["pip"]) if "triton" in c["argv"][1]]
    assert triton["FAKE_CANN_MARKER"] == "cann-elsewhere"
    assert triton["ASCEND_HOME_PATH"] == str(other)
    # {cann_home} is that CANN too: the vendor went into its opp (S187)
    assert (other / "opp/vendors/customize/bin/set_env.bash").is_file()
    assert not (a3env["cann"] / "opp/vendors/customize").exists()
    assert "CANN home from $CANN_HOME" in _log(a3env, "prereq")


def test_depool_requires_the_ascendc_op_and_checks_it_before_any_step(cli, a3env: dict) -> None:
    (a3env["cann"] / "aarch64-linux/tikcpp/tikcfw/kernel_operator.h").unlink()
    r, doc = _build(cli, a3env, "kt-kernel", "ascendc-op")
    assert r.code == 1
    err = _error(doc)
    assert "ascendc-op (required: KT_MXFP4_DEPOOL=1)" in err["message"]
    assert "kernel_operator.h not found" in err["message"]
    assert "\n" not in err["fix"] and "--set serve.env.KT_MXFP4_DEPOOL=0" in err["fix"]
    assert str(a3env["cann"] / "set_env.sh") in err["fix"]
    assert not (a3env["ws"] / "logs/build/kt-kernel.log").exists()  # nothing ran
    # bisheng missing from the CANN shell: named the same way
    (a3env["cann"] / "bin" / "bisheng").unlink()
    r, doc = _build(cli, a3env, "ascendc-op")
    assert r.code == 1
    assert any("'bisheng' not found on the PATH of its shell" in p["message"]
               for p in doc["data"]["problems"])
    # serving without depool (exported, as the launcher lets it win): optional again
    r, doc = _build(cli, a3env, "ascendc-op", env={"KT_MXFP4_DEPOOL": "0"})
    assert r.code == 0, r
    assert doc["data"]["data"]["steps"]["ascendc-op"]["status"] == "skipped"
