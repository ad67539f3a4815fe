"""`serve` against the delivery's own launcher: its line with its defaults, flag for flag and
variable for variable, on the 8-NUMA Kunpeng-920 + 910B and the single-NUMA A3; the launcher's
knob precedence, toolkit and ATB search, the AscendC operator, the interpreter choice."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest
from conftest import HOST_RECIPE, run_cli, run_cli_inproc
from serve_helpers import make_op, make_workspace

from dsv4_offload.build.interpreter import chosen_python, resolve_python
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.host import probe_host
from dsv4_offload.recipe import load_recipe, load_recipe_and_series
from dsv4_offload.serving.cann import atb_set_env, toolkit_home
from dsv4_offload.serving.flags import API_KEY_PLACEHOLDER
from dsv4_offload.serving.plan import build_plan
from dsv4_offload.serving.rules import op_dir
from dsv4_offload.stages.serve import next_attempt
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

HOSTS = Path(__file__).parent / "fixtures" / "hosts"
TOOLKIT = "/usr/local/Ascend/ascend-toolkit/latest"
PYTHON = "/usr/local/python3.11.14/bin/python3.11"  # python_env.sh L50's third candidate

# --- the delivery's launcher, written as data --------------------------------------------------
# cann-recipes-infer @ 1a7fbd348f4d8be4aecdb369d4b0fe89d433f5a5,
# integration/sglang/dsv4-flash-single-npu-moe-offload/scripts/tools/launch_ds4flash_npu.sh,
# run as the guide's §7 runs it (NPU_DEVICE_ID, MODEL_PATH, KT_GGUF_TEMPLATE set; every other
# `${X:-default}` at its default; EXTRA_FLAGS empty).


def launcher_argv(model: str, template: str, pools: str, threads: str) -> list[str]:
    """The exec line, L306-331."""
    return [
        "-m", "sglang.launch_server",
        "--model-path", model,                      # L307
        "--device", "npu",                          # L308
        "--tensor-parallel-size", "1",              # L309
        "--page-size", "128",                       # L310
        "--attention-backend", "ascend",            # L311
        "--quantization", "compressed-tensors",     # L312, QUANTIZATION default L119
        "--disable-shared-experts-fusion",          # L313
        "--dtype", "bfloat16",                      # L314
        "--trust-remote-code",                      # L315
        "--mem-fraction-static", "0.81",            # L316, MEM_FRACTION default
        "--disable-radix-cache",                    # L317
        "--max-prefill-tokens", "65535",            # L318
        "--context-length", "65536",                # L319
        "--watchdog-timeout", "18000",              # L320
        # L321 WARMUP_ARGS is empty: KT_PREFILL_STREAM=1 (L90) makes SKIP_WARMUP=0 (L288-296)
        "--kt-method", "LLAMAFILE",                 # L322
        "--kt-num-gpu-experts", "32",               # L323, KT_NUM_GPU_EXPERTS default
        "--kt-weight-path", template,               # L324, KT_GGUF_TEMPLATE
        "--kt-threadpool-count", pools,             # L325, KT_THREADPOOL_COUNT (L131: 1)
        "--kt-cpuinfer", threads,                   # L326, KT_CPUINFER (L126: 32)
        "--max-running-requests", "1",              # L327
        "--chunked-prefill-size", "8192",           # L328, CHUNKED_PREFILL_SIZE default L118
        "--host", "0.0.0.0",                        # L329
        "--port", "8020",                           # L330, PORT default L132
    ]


def launcher_env(repo: str, model: str, template: str, nsa: str, device: str) -> dict[str, str]:
    """Every variable the launcher exports, with its defaults."""
    return {
        # ensure_kt_kernel.sh L24 then L46 (nothing inherited)
        "PYTHONPATH": f"{repo}/third_party/sglang/python:{repo}/kt-kernel/python:"
                      f"{repo}/third_party/sglang/python:{repo}/kt-kernel",
        "PYTHON_BIN": PYTHON,                                # L55-56
        "KT_PREFILL_STREAM_CKPT": model,                     # L78
        "KT_MXFP4_CKPT": model.removesuffix("-W8A8"),        # L79
        "KT_MXFP4_DEPOOL": "1",                              # L86
        "KT_MXFP4_GGUF_DEDUP": "1",                          # L88
        "KT_DYNAMIC_RESIDENT": "1",                          # L89
        "KT_PREFILL_STREAM": "1",                            # L90
        "KT_SIDE_STREAM": "1",                               # L91
        "KT_PREFILL_STREAM_THRESHOLD": "512",                # L98
        "KT_GGUF_TEMPLATE": template,                        # L116
        "ASCEND_TOOLKIT_HOME": TOOLKIT,                      # L141, L155
        "KT_NSA_COMPRESSOR_MODE": nsa,                       # L162-169
        "SGLANG_SET_CPU_AFFINITY": "1",                      # L190
        "TASK_QUEUE_ENABLE": "1",                            # L191
        "STREAMS_PER_DEVICE": "32",                          # L192
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",  # L193
        "IS_DEEPSEEK_V4": "1",                               # L194
        "USE_FUSED_COMPRESSOR": "1",                         # L195
        "LI_KV_DTYPE_INT8": "1",                             # L196
        "USE_PA_DECODE": "1",                                # L197
        "USE_PA_PREFILL": "1",                               # L198
        "USE_FUSED_HC_POST_ASCENDC": "1",                    # L199
        "USE_FUSED_HC_PRE_ASCENDC": "1",                     # L200
        "USE_NPU_MOE_GATING_TOP_K": "1",                     # L201
        "USE_FUSED_TRANSPOSE_BATCHMATMUL": "1",              # L202
        "USE_ROPE_PARTIAL_IN_PLACE_ASCENDC": "1",            # L203
        "ASCEND_USE_FIA": "1",                               # L204
        "SGLANG_NPU_PROFILE_ENABLE": "0",                    # L206
        "SGLANG_NPU_PROFILE_DECODE_TOKEN": "2",              # L207
        "SGLANG_NPU_PROFILE_DIR": "./npu_results_dbg",       # L208
        "SGLANG_NPU_PROFILE_LEVEL": "0",                     # L209
        "SGLANG_NPU_PROFILE_ANALYSE": "0",                   # L210
        "SGLANG_NPU_PROFILE_DISABLE_GRAPH": "1",             # L211
        "SGLANG_NPU_PROFILE_KEEP_EAGER_AFTER": "1",          # L212
        "ASCEND_RT_VISIBLE_DEVICES": device,                 # L253-254, from NPU_DEVICE_ID
        "KT_STREAM_WARMUP": "1",                             # L290
    }


# (fixture, recipe, the delivery's pools and threads there, NSA mode from that CANN)
PLATFORMS = [
    # 8-NUMA Kunpeng-920 + 910B (CANN 8.5.0 in the fixture): the guide's appendix E line
    # `KT_THREADPOOL_COUNT=8 KT_CPUINFER=128` on top of the launcher
    ("kunpeng920-910b", "dsv4-flash-910b", "8", "128", "split"),
    # single-NUMA A3 on CANN 9: the launcher's own defaults, 1 pool / 32 threads (L126, L131)
    ("a3-1numa", "dsv4-flash-a3", "1", "32", "single"),
]


def fixture_facts(name: str):
    root = HOSTS / name
    return probe_host(root=root, npu_smi=["cat", str(root / "npu-smi-info.txt")], env={})


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    workspace = make_workspace(tmp_path / "ws")
    make_op(workspace)
    return workspace


@pytest.mark.parametrize(("fixture", "recipe_name", "pools", "threads", "nsa"), PLATFORMS)
def test_plan_equals_the_delivery_launcher_flag_for_flag_and_variable_for_variable(
        ws: Workspace, fixture, recipe_name, pools, threads, nsa):
    recipe = load_recipe(recipe_name)
    facts = fixture_facts(fixture)
    assert len(facts.numa_nodes) == int(pools)
    plan = build_plan(recipe, facts, ws, base_env={"NPU_DEVICE_ID": "3"}, python=PYTHON,
                      toolkit=TOOLKIT)
    model = str(ws.weights_dir(recipe, "w8a8"))
    template = str(ws.gguf_dir(recipe) / "dsv4_layer{layer_idx}_mxfp4.gguf")
    assert plan.argv[0] == PYTHON
    assert plan.argv[1:] == launcher_argv(model, template, pools, threads)
    expected = launcher_env(str(ws.tree_dir(recipe)), model, template, nsa, "3")
    # the one variable the tool adds: where the AscendC op was built (see op_dir's docstring)
    extra = {k: v for k, v in plan.env_set.items() if k not in expected}
    assert extra == {"KT_MXFP4_OP_DIR": str(op_dir(ws, recipe, {})[0])}
    assert {k: v for k, v in plan.env_set.items() if k in expected} == expected
    assert plan.origins["--kt-threadpool-count"].startswith("host")
    assert plan.origins["--kt-cpuinfer"].startswith("host")


def host_env(name: str, **extra: str) -> dict[str, str]:
    root = HOSTS / name
    smi = f"cat {shlex.quote(str(root / 'npu-smi-info.txt'))}"
    return {"DSV4_HOST_ROOT": str(root), "DSV4_NPU_SMI": smi, "PYTHON_BIN": PYTHON, **extra}


@pytest.mark.parametrize(("fixture", "recipe_name", "pools", "threads", "nsa"), PLATFORMS)
def test_serve_print_shows_the_launcher_line_and_an_exported_knob_with_its_origin(
        ws: Workspace, fixture, recipe_name, pools, threads, nsa):
    base = ["--workspace", str(ws.root), "--recipe", recipe_name]
    # the printed plan: no process of its own to see (run_cli_inproc)
    res = run_cli_inproc(*base, "--json", "serve", "--print",
                         env=host_env(fixture, NPU_DEVICE_ID="3"))
    assert res.code == 0, res
    data = res.json()["data"]
    recipe = load_recipe(recipe_name)
    model = str(ws.weights_dir(recipe, "w8a8"))
    template = str(ws.gguf_dir(recipe) / "dsv4_layer{layer_idx}_mxfp4.gguf")
    assert data["argv"][1:] == launcher_argv(model, template, pools, threads)
    assert data["env_set"]["ASCEND_RT_VISIBLE_DEVICES"] == "3"
    exported = run_cli_inproc(*base, "serve", "--print",
                              env=host_env(fixture, KT_CPUINFER="48", NPU_DEVICE_ID="3"))
    assert exported.code == 0, exported
    assert "--kt-cpuinfer 48  [environment (KT_CPUINFER, launcher L126)]" in exported.out
    assert f"--kt-threadpool-count {pools}  [host" in exported.out
    assert "KT_MXFP4_DEPOOL=1  [recipe]" in exported.out
    assert "# warning: the server binds 0.0.0.0 with no API key" in exported.out
    assert "--kt-cpuinfer 48 \\" in exported.out  # the command itself


def test_exported_knobs_win_over_the_recipe_and_set_is_told_apart(ws: Workspace):
    recipe = load_recipe(None, ["serve.env.KT_SIDE_STREAM=0"])
    env = {"KT_PREFILL_STREAM": "0", "MEM_FRACTION": "0.83", "CHUNKED_PREFILL_SIZE": "32768",
           "KT_NUM_GPU_EXPERTS": "24", "QUANTIZATION": "w8a8_int8", "PORT": "8031",
           "EXTRA_FLAGS": "--cuda-graph-bs 2"}
    plan = build_plan(recipe, fixture_facts("kunpeng920-910b"), ws, base_env=env,
                      toolkit=TOOLKIT, set_keys=["serve.env.KT_SIDE_STREAM"])
    flags = dict(plan.flag_values())
    assert flags["--mem-fraction-static"] == "0.83"
    assert flags["--chunked-prefill-size"] == "32768"
    assert flags["--kt-num-gpu-experts"] == "24"
    assert flags["--quantization"] == "w8a8_int8"
    assert flags["--port"] == "8031" and plan.url.endswith(":8031")
    assert plan.argv[-2:] == ["--cuda-graph-bs", "2"]
    # streaming off: the launcher skips sglang's warm-up and exports no KT_STREAM_WARMUP
    assert "--skip-server-warmup" in plan.argv and "KT_STREAM_WARMUP" not in plan.env
    assert plan.env["KT_PREFILL_STREAM"] == "0"
    assert plan.origins["KT_PREFILL_STREAM"] == "environment (launcher L90)"
    assert plan.origins["--chunked-prefill-size"].startswith("environment (CHUNKED_PREFILL_SIZE")
    assert plan.env["KT_SIDE_STREAM"] == "0" and plan.origins["KT_SIDE_STREAM"] == "--set"
    assert plan.origins["--cuda-graph-bs"].startswith("environment (EXTRA_FLAGS")


@pytest.mark.parametrize(("env", "match"), [
    ({"KT_NUM_GPU_EXPERTS": "41"}, "ceiling of 40"),
    ({"KT_THREADPOOL_COUNT": "9"}, "8 NUMA node"),
    ({"CHUNKED_PREFILL_SIZE": "-1"}, "positive multiple of the page size 128"),
    ({"CHUNKED_PREFILL_SIZE": "1000"}, "positive multiple"),
    ({"KT_CPUINFER": "many"}, "KT_CPUINFER='many' in the environment is not an integer"),
])
def test_bad_exported_knobs_are_one_line_errors(ws: Workspace, env, match):
    with pytest.raises(InputError, match=match):
        build_plan(load_recipe(), fixture_facts("kunpeng920-910b"), ws, base_env=env,
                   toolkit=TOOLKIT)


def test_recipe_experts_above_the_ceiling_are_refused():
    with pytest.raises(InputError, match="measured ceiling"):
        load_recipe(None, ["serve.kt_num_gpu_experts=48"])


def test_eager_mode_gets_sync_submit_and_profiling_adds_eager(ws: Workspace):
    facts = fixture_facts("kunpeng920-910b")
    eager = build_plan(load_recipe(), facts, ws, toolkit=TOOLKIT,
                       base_env={"EXTRA_FLAGS": "--disable-cuda-graph"})
    assert eager.env["KT_FORCE_SYNC_SUBMIT"] == "1"
    assert any("KT_FORCE_SYNC_SUBMIT=1" in n for n in eager.notes)
    kept = build_plan(load_recipe(), facts, ws, toolkit=TOOLKIT,
                      base_env={"EXTRA_FLAGS": "--disable-cuda-graph",
                                "KT_FORCE_SYNC_SUBMIT": "0"})
    assert kept.env["KT_FORCE_SYNC_SUBMIT"] == "0"  # exported: left alone, with a warning
    assert any("KT_FORCE_SYNC_SUBMIT=0 with --disable-cuda-graph" in w for w in kept.warnings)
    profiled = build_plan(load_recipe(), facts, ws, toolkit=TOOLKIT,
                          base_env={"SGLANG_NPU_PROFILE_ENABLE": "1"})
    assert profiled.argv[-1] == "--disable-cuda-graph"  # launcher L213-216


def test_depool_refuses_to_start_without_the_operator_and_names_both_fixes(tmp_path: Path):
    ws = make_workspace(tmp_path / "ws")
    facts = fixture_facts("kunpeng920-910b")
    with pytest.raises(InputError) as err:
        build_plan(load_recipe(), facts, ws, base_env={}, toolkit=TOOLKIT)
    message = err.value.one_line()
    assert "libmxfp4fused.so: the AscendC MXFP4 operator is missing" in message
    assert "dsv4-offload build ascendc-op" in message
    assert "--set serve.env.KT_MXFP4_DEPOOL=0" in message
    # half an operator is no operator
    directory = make_op(ws)
    (directory / "mxfp4_fused_op.py").unlink()
    with pytest.raises(InputError, match=r"mxfp4_fused_op\.py: the AscendC"):
        build_plan(load_recipe(), facts, ws, base_env={}, toolkit=TOOLKIT)
    # depool off (recipe or environment): no operator needed, no KT_MXFP4_OP_DIR
    off = build_plan(load_recipe(None, ["serve.env.KT_MXFP4_DEPOOL=0"]), facts, ws,
                     base_env={}, toolkit=TOOLKIT)
    assert "KT_MXFP4_OP_DIR" not in off.env
    build_plan(load_recipe(), facts, ws, base_env={"KT_MXFP4_DEPOOL": "0"}, toolkit=TOOLKIT)
    # an exported KT_MXFP4_OP_DIR is where sglang looks: checked there, not overridden
    elsewhere = tmp_path / "op"
    elsewhere.mkdir()
    for name in ("libmxfp4fused.so", "mxfp4_fused_op.py"):
        (elsewhere / name).touch()
    plan = build_plan(load_recipe(), facts, ws, base_env={"KT_MXFP4_OP_DIR": str(elsewhere)},
                      toolkit=TOOLKIT)
    assert plan.env["KT_MXFP4_OP_DIR"] == str(elsewhere)
    assert "KT_MXFP4_OP_DIR" not in plan.env_set


def test_toolkit_search_follows_the_launcher(tmp_path: Path):
    assert toolkit_home({"ASCEND_TOOLKIT_HOME": "/a", "ASCEND_HOME_PATH": "/b"})[0] == "/a"
    assert toolkit_home({"ASCEND_HOME_PATH": "/b"})[0] == "/b"
    home = tmp_path / "home"
    cann = home / "Ascend" / "cann-9.0.0"
    cann.mkdir(parents=True)
    assert toolkit_home({"HOME": str(home)})[0] != str(cann)  # no set_env.sh there yet
    (cann / "set_env.sh").write_text("# our own stand-in\n")
    found, how = toolkit_home({"HOME": str(home)})
    if Path("/usr/local/Ascend/ascend-toolkit/latest/set_env.sh").is_file():
        pytest.skip("a real CANN toolkit on this machine comes first in the launcher's order")
    assert found == str(cann) and "set_env.sh" in how


def test_atb_set_env_search_and_the_launchers_warning(tmp_path: Path):
    root = tmp_path / "Ascend"
    toolkit = root / "cann-9.0.0"
    toolkit.mkdir(parents=True)
    assert atb_set_env(str(toolkit), {"ATB_SET_ENV": "/x/set_env.sh"})[0] == Path("/x/set_env.sh")
    if not Path("/usr/local/Ascend/nnal/atb/set_env.sh").is_file():
        none, warning = atb_set_env(str(toolkit), {})
        assert none is None
        assert warning.startswith("ATB set_env not found (ATB ops may be unavailable)")
    atb = root / "nnal" / "atb" / "set_env.sh"
    atb.parent.mkdir(parents=True)
    atb.write_text("# our own stand-in\n")
    assert atb_set_env(str(toolkit), {})[0] == atb
    # .../Ascend/ascend-toolkit/latest resolves to the same Ascend root (L228-229)
    assert atb_set_env(str(root / "ascend-toolkit" / "latest"), {})[0] == atb


@pytest.mark.parametrize(("fraction", "experts", "key", "expected"), [
    (0.85, 32, "hbm-oom", (0.83, 32)),   # the fraction first, down the guide's values
    (0.82, 32, "hbm-oom", (0.81, 32)),
    (0.81, 32, "hbm-oom", (0.81, 24)),   # at the floor: fewer resident experts
    (0.81, 24, "kv-cache", (0.81, 16)),
    (0.80, 32, "kv-cache", (0.81, 32)),  # below the floor the pool is short: back to it
    (0.81, 16, "hbm-oom", None),
])
def test_hbm_retry_lowers_the_fraction_to_its_floor_before_the_experts(fraction, experts, key,
                                                                        expected):
    step = next_attempt(load_recipe().serve, fraction, experts, key)
    assert (step[:2] if step else None) == expected


def test_hbm_failures_walk_the_fraction_then_the_experts(tmp_path: Path, no_leftovers):
    from serve_helpers import context, free_port, standin_overrides

    from dsv4_offload.stages import serve

    ws = make_workspace(tmp_path / "ws")
    overrides = standin_overrides(no_leftovers, free_port(), "--mode", "fatal", "--fatal",
                                  "hbm-oom", "--exit-after-fatal")
    ctx = context(ws, [*overrides, "serve.mem_fraction_static=0.83"], "serve")
    result = serve.run(ctx)
    tried = [(a["mem_fraction_static"], a["kt_num_gpu_experts"]) for a in result.data["attempts"]]
    assert tried == [(0.83, 32), (0.82, 32), (0.81, 32), (0.81, 24), (0.81, 16)]
    assert "--mem-fraction-static 0.83, 0.82, 0.81" in result.problems[0].message


# --- the interpreter -----------------------------------------------------------------------


def fake_pythons(tmp_path: Path) -> Path:
    """python3 (the real one, without torch) and python3.11 (the real one with stub modules
    numpy, torch, torch_npu, sglang on its path), like a clean image's system python and
    the image's torch python."""
    stubs = tmp_path / "stubs"
    for name in ("numpy", "torch", "torch_npu", "sglang"):
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = sys.executable
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec {shlex.quote(real)} -I \"$@\"\n")
    (bin_dir / "python3.11").write_text(
        f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(stubs))}${{PYTHONPATH:+:$PYTHONPATH}} "
        f"exec {shlex.quote(real)} \"$@\"\n")
    for p in bin_dir.iterdir():
        p.chmod(0o755)
    return bin_dir


def test_python_env_choice_first_candidate_that_imports_everything(tmp_path: Path):
    bin_dir = fake_pythons(tmp_path)
    env = {"PATH": str(bin_dir)}
    choice, tried = resolve_python(explicit=None, env=env)
    assert choice is not None and choice.path == str(bin_dir / "python3.11")
    assert tried[0]["candidate"] == "python3" and "No module named" in tried[0]["result"]
    # PYTHON_BIN is taken as is, even if it cannot import them (python_env.sh L46-48)
    chosen, _ = resolve_python(explicit=None, env={**env, "PYTHON_BIN": str(bin_dir / "python3")})
    assert chosen is not None and chosen.path == str(bin_dir / "python3")
    assert chosen.source == "PYTHON_BIN"
    assert resolve_python(explicit="/opt/py", env=env)[0].source == "--python"  # type: ignore[union-attr]
    (bin_dir / "python3.11").unlink()
    assert resolve_python(explicit=None, env=env)[0] is None


def test_the_import_probe_names_a_missing_module_before_importing_any(tmp_path: Path):
    """python_env.sh imports the modules in turn; the probe fails the same way on one that is
    not installed, by the same last line, without importing those before it (numpy alone is
    ~0.1 s a candidate), and imports them all, in order, where every one is there."""
    from dsv4_offload.build.interpreter import missing_imports

    log = tmp_path / "imported"
    for name in ("first", "second"):
        (tmp_path / f"{name}.py").write_text(
            f"with open({str(log)!r}, 'a') as fh:\n    fh.write({name!r} + ' ')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    why = missing_imports(sys.executable, ["first", "no_such_module_here", "second"], env)
    assert why == "ModuleNotFoundError: No module named 'no_such_module_here'"
    assert not log.exists()  # nothing imported
    assert missing_imports(sys.executable, ["second", "first"], env) is None
    assert log.read_text() == "second first "
    (tmp_path / "first.py").write_text("raise ImportError('a broken install')\n")
    assert missing_imports(sys.executable, ["first"], env) == "ImportError: a broken install"


def test_chosen_python_is_recorded_once_and_reused(tmp_path: Path, monkeypatch):
    bin_dir = fake_pythons(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("PYTHON_BIN", raising=False)
    recipe, series = load_recipe_and_series(None, [])
    ws = Workspace(tmp_path / "ws")
    ctx = StageContext(recipe=recipe, series=series, workspace=ws)
    first = chosen_python(ctx)
    assert first.path == str(bin_dir / "python3.11") and first.source == "probe"
    prov = json.loads(ws.provenance_file.read_text())
    assert prov["python"]["path"] == first.path
    # the build's interpreter is the same one
    from dsv4_offload.build.interpreter import build_python

    assert build_python(ctx) == first.path
    again = chosen_python(ctx)
    assert again.source == "recorded" and again.path == first.path
    monkeypatch.setenv("PYTHON_BIN", str(bin_dir / "python3"))
    assert chosen_python(ctx).source == "PYTHON_BIN"


def test_a_fallback_interpreter_never_passes_for_a_choice(tmp_path: Path, monkeypatch):
    """Issue 19: a build that began with no qualifying python (and failed) leaves the
    recipe's python recorded as a fallback; it is not reused as 'recorded', and doctor's
    python row is not green for it."""
    from dsv4_offload.build.interpreter import build_python
    from dsv4_offload.core.errors import InputError
    from dsv4_offload.stages import doctor

    bin_dir = fake_pythons(tmp_path)
    (bin_dir / "python3.11").unlink()  # only the python without torch
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("PYTHON_BIN", raising=False)
    recipe, series = load_recipe_and_series(None, [])
    ws = Workspace(tmp_path / "ws")
    ctx = StageContext(recipe=recipe, series=series, workspace=ws)
    assert build_python(ctx) == recipe.build.python
    assert json.loads(ws.provenance_file.read_text())["python"]["source"] == "recipe"
    with pytest.raises(InputError):
        chosen_python(ctx)  # serve and selftest: no 'recorded' choice to fall back on
    row = doctor.check_python(ctx, doctor.probe(ctx))
    assert row.status != "ok", row


# --- the API key ---------------------------------------------------------------------------


def test_api_key_reaches_sglang_only(tmp_path: Path, no_leftovers):
    import requests
    from serve_helpers import free_port, standin_overrides

    from dsv4_offload.acceptance.probes import api_key_headers
    from dsv4_offload.serving import supervisor as sv

    secret = "sk-" + os.urandom(12).hex()
    key_file = tmp_path / "key"
    key_file.write_text(secret + "\n")
    ws = make_workspace(tmp_path / "ws")
    port = free_port()
    sets = [a for o in standin_overrides(no_leftovers, port, "--mode", "good")
            for a in ("--set", o)]
    env = {"DSV4_HOST_ROOT": str(HOSTS / "x86-no-npu")}
    sets = ["-r", str(HOST_RECIPE), *sets]  # a stand-in server on this host
    started = run_cli("--workspace", str(ws.root), *sets, "serve", "--detach",
                      "--api-key-file", str(key_file), env=env)
    try:
        assert started.code == 0, started
        url = f"http://127.0.0.1:{port}"
        assert requests.get(url + "/health_generate", timeout=5).status_code == 401
        assert requests.get(url + "/health_generate", timeout=5,
                            headers=api_key_headers(key_file)).status_code == 200
        record = sv.read_record(ws.serve_record)
        assert record is not None and API_KEY_PLACEHOLDER in record.argv
        status = run_cli_inproc("--workspace", str(ws.root), *sets, "--json", "serve",
                                "status", env=env)
        assert status.code == 0 and status.json()["data"]["healthy"], status
        assert secret not in started.out + started.err
        for path in [*ws.meta_dir.rglob("*"), ws.provenance_file, *ws.root.glob("logs/**/*")]:
            if path.is_file():
                assert secret not in path.read_text(errors="replace"), path
        log = Path(record.log).read_text()
        assert "api_key='***'" in log  # the server printed it; the log masks it
        # the warm-up ran before the launch and is recorded (the stand-in's files are empty)
        state = json.loads(ws.state_file.read_text())
        assert state["stages"]["serve"]["outputs"]["page_cache"]["files"] == 43
    finally:
        run_cli("--workspace", str(ws.root), *sets, "serve", "stop", env=env)


def test_bad_api_key_file_and_open_bind_warning(ws: Workspace, tmp_path: Path):
    facts = fixture_facts("kunpeng920-910b")
    two = tmp_path / "two"
    two.write_text("a\nb\n")
    with pytest.raises(InputError, match="exactly one key"):
        build_plan(load_recipe(), facts, ws, base_env={}, toolkit=TOOLKIT, api_key_file=two)
    with pytest.raises(InputError, match="cannot read the API key file"):
        build_plan(load_recipe(), facts, ws, base_env={}, toolkit=TOOLKIT,
                   api_key_file=tmp_path / "absent")
    open_plan = build_plan(load_recipe(), facts, ws, base_env={}, toolkit=TOOLKIT)
    assert any("binds 0.0.0.0 with no API key" in w for w in open_plan.warnings)
    local = build_plan(load_recipe(None, ["serve.host=127.0.0.1"]), facts, ws, base_env={},
                       toolkit=TOOLKIT)
    assert local.warnings == []
    one = tmp_path / "one"
    one.write_text("k3y\n")
    keyed = build_plan(load_recipe(), facts, ws, base_env={}, toolkit=TOOLKIT, api_key_file=one)
    assert keyed.argv[keyed.argv.index("--api-key") + 1] == API_KEY_PLACEHOLDER
    assert "k3y" not in json.dumps(keyed.as_dict())
    # the open-bind warning is gone; what stays is that argv (and so the key) shows in `ps`
    assert len(keyed.warnings) == 1 and "`ps`" in keyed.warnings[0]


def test_host_probe_finds_cann_where_the_launcher_searches(tmp_path: Path):
    from dsv4_offload.core.host import _probe_cann

    info = tmp_path / "home/u/Ascend/cann-9.0.0/aarch64-linux/ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text("version=9.0.0\n")
    # $HOME/Ascend/cann-* and /home/*/Ascend/cann-* (launch_ds4flash_npu.sh L143-144)
    assert _probe_cann(tmp_path, {"HOME": "/home/u"}) == ("9.0.0", "/home/u/Ascend/cann-9.0.0")
    assert _probe_cann(tmp_path, {}) == ("9.0.0", "/home/u/Ascend/cann-9.0.0")


@pytest.mark.parametrize("line", [
    # kt-kernel (ktransformers d7b5b49) operators/llamafile/moe.hpp L208
    "  what():  intermediate_size * hidden_size must be a multiple of up_type blck size",
    # upstream sglang ModelConfig._verify_quantization (the W8A8 config vs --quantization)
    "ValueError: Quantization method specified in the model config (compressed-tensors) does "
    "not match the quantization method specified in the `quantization` argument (w8a8_int8).",
])
def test_quant_type_mismatch_names_the_guides_fix_first(line: str):
    from dsv4_offload.serving.supervisor import match_fatal

    fatal = match_fatal(line)
    assert fatal is not None and fatal.key == "quant-type"
    # guide appendix G: "启动报量化类型不匹配 | sglang 未固定在 298193eb3 | 重新 checkout 基线 SHA"
    assert fatal.fix.startswith("sglang is probably not at its pinned commit 298193eb3")
    assert "verify-gguf" in fatal.fix
