"""Flag and env derivation for `serve`: the brief's launch line, NUMA shapes, CANN versions."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
from serve_helpers import make_op

from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.host import HostFacts, NpuInfo, probe_host
from dsv4_offload.recipe import load_recipe
from dsv4_offload.serving.cann import cann_scripts, capture_script_env
from dsv4_offload.serving.plan import build_plan
from dsv4_offload.serving.rules import (
    chunked_prefill,
    cpu_plan,
    cpu_threads,
    nsa_compressor_mode,
    pick_device,
)
from dsv4_offload.workspace.store import Workspace

FIXTURES = Path(__file__).parent / "fixtures" / "hosts"

# The delivery's launch line as the brief gives it; <...> are filled per host below.
BRIEF_LAUNCH = (
    "python -m sglang.launch_server --model-path <W8A8> --device npu --tensor-parallel-size 1 "
    "--page-size 128 --attention-backend ascend --quantization compressed-tensors "
    "--disable-shared-experts-fusion --dtype bfloat16 --trust-remote-code "
    "--mem-fraction-static 0.81 --disable-radix-cache --max-prefill-tokens 65535 "
    "--context-length 65536 --watchdog-timeout 18000 --kt-method LLAMAFILE "
    "--kt-num-gpu-experts 32 --kt-weight-path <dir>/dsv4_layer{layer_idx}_mxfp4.gguf "
    "--kt-threadpool-count <NUMA> --kt-cpuinfer <CPUINFER> --max-running-requests 1 "
    "--chunked-prefill-size 8192 --host <host> --port 8020"
)


def npu(npu_id: int, used: int | None = 3000, core: int | None = 0, health: str = "OK",
        phy: int | None = None) -> NpuInfo:
    return NpuInfo(npu_id=npu_id, chip=0, model="910B3", health=health, hbm_total_mb=65536,
                   hbm_used_mb=used, aicore_pct=core, phy_id=phy)


def host(numa: int = 8, cores: int = 192, cann: str | None = "8.5.0",
         npus: tuple[NpuInfo, ...] = (npu(0),), toolkit: str | None = None) -> HostFacts:
    return HostFacts(
        arch="aarch64", cpu_model="Kunpeng-920", cpu_flags=frozenset({"asimd", "asimddp"}),
        cores=cores, numa_nodes=tuple(range(numa)), mem_total_kib=None, mem_available_kib=None,
        npus=npus, npu_smi="ok", device_nodes={}, cann_version=cann, cann_toolkit=toolkit,
        python_versions={}, tools={}, libraries={}, disk_free_bytes=None,
    )


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    """A workspace whose 43 GGUF layer files exist (empty: only their presence is checked)."""
    workspace = Workspace(tmp_path / "ws")
    recipe = load_recipe()
    gguf = workspace.gguf_dir(recipe)
    gguf.mkdir(parents=True)
    for layer in range(recipe.conversion.layers):
        (gguf / recipe.conversion.file_name(layer)).touch()
    make_op(workspace)
    return workspace


def test_default_recipe_on_kunpeng920_8numa_matches_the_brief_flag_for_flag(ws: Workspace):
    recipe = load_recipe()
    plan = build_plan(recipe, host(numa=8, cores=192), ws, base_env={})
    expected = shlex.split(
        BRIEF_LAUNCH.replace("<W8A8>", str(ws.weights_dir(recipe, "w8a8")))
        .replace("<dir>", str(ws.gguf_dir(recipe)))
        .replace("<NUMA>", "8").replace("<CPUINFER>", "128").replace("<host>", "0.0.0.0")
    )
    assert plan.argv[0] == recipe.serve.python
    assert plan.argv[1:] == expected[1:]
    assert plan.derived["threadpool_count"] == 8 and plan.derived["cpuinfer"] == 128


def test_captured_kunpeng_fixture_host_gives_the_same_line(ws: Workspace):
    root = FIXTURES / "kunpeng920-910b"
    facts = probe_host(root=root, npu_smi=["cat", str(root / "npu-smi-info.txt")], env={})
    plan = build_plan(load_recipe(), facts, ws, base_env={})
    argv = plan.argv
    assert argv[argv.index("--kt-threadpool-count") + 1] == "8"
    assert argv[argv.index("--kt-cpuinfer") + 1] == "128"
    assert plan.env["KT_NSA_COMPRESSOR_MODE"] == "split"
    # the card with the least HBM in use, whatever its number
    idlest = min((n for n in facts.npus if n.health == "OK"), key=lambda n: n.hbm_used_mb)
    assert plan.env["ASCEND_RT_VISIBLE_DEVICES"] == str(idlest.device_id)


@pytest.mark.parametrize(("numa", "cores", "pools", "threads"), [
    (8, 192, 8, 128),   # Kunpeng-920 910B host: 16 per node, never all cores
    (4, 96, 4, 64),
    (4, 40, 4, 36),     # capped below the core count (4 reserved), equal per pool
    (1, 40, 1, 32),     # A3-style single node: the launcher's 32 (L126)
    (1, 16, 1, 12),
    (2, 64, 2, 32),     # 16 per node would be fewer than the launcher's 32
])
def test_threadpool_is_numa_nodes_and_cpuinfer_is_capped(numa, cores, pools, threads):
    serve = load_recipe().serve
    assert cpu_threads(serve, tuple(range(numa)), cores) == (pools, threads)


def test_a_host_too_small_for_the_reserve_is_a_warning_with_its_consequence():
    """issue 21: a host fact never exits 2; 8 CPUs on 8 nodes leave nothing after the reserve,
    so one thread per pool, said with its cost and the --set that accepts it."""
    serve = load_recipe().serve
    cpus = cpu_plan(serve, tuple(range(8)), 8)
    assert (cpus.pools, cpus.threads) == (8, 8)
    assert cpus.warning is not None and "keeps 0 core(s) free" in cpus.warning
    assert "slower decode" in cpus.warning and "--set serve.reserved_cores=0" in cpus.warning
    accepted = serve.model_copy(update={"reserved_cores": 0})
    assert cpu_plan(accepted, tuple(range(8)), 8).warning is None


def test_fewer_cpus_than_pools_fails_with_exit_1_not_a_usage_error():
    with pytest.raises(Dsv4Error, match="KT_THREADPOOL_COUNT=4") as err:
        cpu_plan(load_recipe().serve, tuple(range(8)), 4)
    assert not isinstance(err.value, InputError) and err.value.exit_code == 1
    assert cpu_plan(load_recipe().serve, tuple(range(8)), 4, pools=4).threads == 4


def _fixture_host(name: str) -> HostFacts:
    root = FIXTURES / name
    return probe_host(root=root, npu_smi=["cat", str(root / "npu-smi-info.txt")], env={})


def test_host_facts_of_a_fixture_become_plan_warnings(ws: Workspace):
    """The 8-NUMA Kunpeng-920 fixture, squeezed: the plan is made, and says what it costs."""
    import dataclasses

    facts = _fixture_host("kunpeng920-910b")
    assert len(facts.numa_nodes) == 8
    small = build_plan(load_recipe(), dataclasses.replace(facts, cores=10), ws, base_env={})
    assert small.derived["threadpool_count"] == 8 and small.derived["cpuinfer"] == 8
    (said,) = [w for w in small.warnings if "CPU-infer thread per node" in w]
    assert said.startswith("host has 10 CPUs and 8 NUMA node(s)")
    holes = build_plan(load_recipe(), dataclasses.replace(facts, numa_nodes=(0, 2, 4, 6)), ws,
                       base_env={})
    assert any("NUMA node ids [0, 2, 4, 6] are not 0..3" in w for w in holes.warnings)
    hidden = build_plan(load_recipe(), dataclasses.replace(facts, numa_nodes=()), ws,
                        base_env={})
    assert hidden.derived["threadpool_count"] == 1
    assert any(w.startswith("NUMA is not visible") for w in hidden.warnings)
    with pytest.raises(Dsv4Error) as err:
        build_plan(load_recipe(), dataclasses.replace(facts, cores=4), ws, base_env={})
    assert err.value.exit_code == 1
    # the A3's single node: nothing to say
    a3 = build_plan(load_recipe(), _fixture_host("a3-1numa"), ws, base_env={})
    assert not any("NUMA" in w or "CPU-infer" in w for w in a3.warnings)


@pytest.mark.parametrize(("numa", "cores"), [(8, 192), (4, 96), (1, 40)])
def test_plan_flags_follow_the_host(ws: Workspace, numa, cores):
    plan = build_plan(load_recipe(), host(numa=numa, cores=cores), ws, base_env={})
    argv = plan.argv
    assert int(argv[argv.index("--kt-threadpool-count") + 1]) == numa
    assert int(argv[argv.index("--kt-cpuinfer") + 1]) < cores


@pytest.mark.parametrize(("cann", "mode"), [("8.5.0", "split"), ("9.0.0", "single"),
                                            ("10.1.RC1", "single"), (None, "split")])
def test_nsa_compressor_mode_from_cann(ws: Workspace, cann, mode):
    plan = build_plan(load_recipe(), host(cann=cann), ws, base_env={})
    assert plan.env["KT_NSA_COMPRESSOR_MODE"] == mode
    assert nsa_compressor_mode("auto", cann)[0] == mode


def test_recipe_mode_wins_over_cann():
    assert nsa_compressor_mode("single", "8.5.0") == ("single", "set by the recipe")


def test_a3_recipe_on_cann9_single_numa(ws: Workspace):
    recipe = load_recipe("dsv4-flash-a3")
    plan = build_plan(recipe, host(numa=1, cores=40, cann="9.0.0"), ws, base_env={})
    assert plan.env["KT_NSA_COMPRESSOR_MODE"] == "single"
    assert plan.argv[plan.argv.index("--kt-threadpool-count") + 1] == "1"


def test_chunked_prefill_covers_the_longest_prompt_in_page_multiples():
    serve = load_recipe().serve
    assert chunked_prefill(serve, None) == 8192
    assert chunked_prefill(serve, 8193) == 8320
    assert chunked_prefill(serve, 30000) % 128 == 0 and chunked_prefill(serve, 30000) >= 30000
    with pytest.raises(InputError, match="context_length"):
        chunked_prefill(serve, 70000)


def test_longest_prompt_option_reaches_the_argv_with_a_note(ws: Workspace):
    plan = build_plan(load_recipe(), host(), ws, base_env={}, longest_prompt=10000)
    assert plan.argv[plan.argv.index("--chunked-prefill-size") + 1] == "10112"
    assert any("10000" in n for n in plan.notes)


def test_a_chunk_capped_by_max_prefill_tokens_says_so(ws: Workspace):
    recipe = load_recipe(None, ["serve.max_prefill_tokens=4096"])
    plan = build_plan(recipe, host(), ws, base_env={})
    assert plan.argv[plan.argv.index("--chunked-prefill-size") + 1] == "4096"
    assert plan.notes == ["chunked prefill lowered from 8192 to 4096: "
                          "serve.max_prefill_tokens is 4096"]


def test_weight_path_keeps_layer_idx_literal_and_every_layer_must_exist(ws: Workspace):
    recipe = load_recipe()
    plan = build_plan(recipe, host(), ws, base_env={})
    path = plan.argv[plan.argv.index("--kt-weight-path") + 1]
    assert path.endswith("/dsv4_layer{layer_idx}_mxfp4.gguf")
    assert plan.env["KT_GGUF_TEMPLATE"] == path
    (ws.gguf_dir(recipe) / recipe.conversion.file_name(17)).unlink()
    with pytest.raises(InputError, match=r"dsv4_layer17_mxfp4\.gguf: GGUF layer file missing"):
        build_plan(recipe, host(), ws, base_env={})


def test_fixed_exports_checkpoints_and_proxies(ws: Workspace):
    recipe = load_recipe()
    base = {"http_proxy": "http://127.0.0.1:7890", "HTTPS_PROXY": "x", "PATH": "/usr/bin",
            "TASK_QUEUE_ENABLE": "0"}
    plan = build_plan(recipe, host(), ws, base_env=base)
    assert "http_proxy" not in plan.env and "HTTPS_PROXY" not in plan.env
    assert plan.env_unset == ["HTTPS_PROXY", "http_proxy"]
    assert plan.env["PATH"] == "/usr/bin"
    for key in ("STREAMS_PER_DEVICE", "PYTORCH_NPU_ALLOC_CONF", "IS_DEEPSEEK_V4"):
        assert plan.env[key] == recipe.serve.env[key]
    # an exported launcher knob wins over the recipe, as `${X:-default}` does (L191)
    assert plan.env["TASK_QUEUE_ENABLE"] == "0"
    assert plan.origins["TASK_QUEUE_ENABLE"].startswith("environment")
    assert plan.env["KT_PREFILL_STREAM_CKPT"] == str(ws.weights_dir(recipe, "w8a8"))
    # the launcher derives the MXFP4 checkpoint by dropping "-W8A8"
    assert plan.env["KT_MXFP4_CKPT"] == str(ws.weights_dir(recipe, "w8a8")).removesuffix("-W8A8")
    assert "--skip-server-warmup" not in plan.argv  # streaming prefill keeps the warm-up


def test_device_choice_option_env_and_idlest():
    cards = (npu(0, used=60000, core=90), npu(1, used=3000, core=0),
             npu(2, used=2000, core=0, health="Alarm"), npu(3, used=3000, core=5))
    assert pick_device(cards, None, None)[0] == "1"
    assert pick_device(cards, 3, None) == ("3", "from --device")
    assert pick_device(cards, None, "5")[0] == "5"
    with pytest.raises(Dsv4Error, match="health 'Alarm'") as err:  # a host fact: exit 1
        pick_device(cards, 2, None)
    assert not isinstance(err.value, InputError)
    with pytest.raises(InputError, match="lists devices"):
        pick_device(cards, 9, None)
    # A3: ASCEND_RT_VISIBLE_DEVICES takes the die's physical id
    a3 = (npu(0, used=50000, phy=0), npu(0, used=100, phy=1))
    assert pick_device(a3, None, None)[0] == "1"


def test_no_healthy_npu_fails_with_a_fix(ws: Workspace):
    with pytest.raises(Dsv4Error, match="--device N"):
        build_plan(load_recipe(), host(npus=()), ws, base_env={})


def test_own_command_with_flags_placeholder_and_no_npu(ws: Workspace):
    recipe = load_recipe(None, ["serve.command=[run-me, '{flags}', --extra, '{port}']",
                                "serve.port=9999"])
    plan = build_plan(recipe, host(npus=()), ws, base_env={})
    assert plan.argv[0] == "run-me" and plan.argv[-2:] == ["--extra", "9999"]
    assert "--kt-cpuinfer" in plan.argv
    assert "ASCEND_RT_VISIBLE_DEVICES" not in plan.env
    recipe = load_recipe(None, ["serve.command=[srv, --port, '{port}']", "serve.pass_flags=false"])
    assert build_plan(recipe, host(), ws, base_env={}).argv == ["srv", "--port", "8020"]


def test_cann_set_env_scripts_captured_once_in_bash(tmp_path: Path):
    toolkit = tmp_path / "Ascend" / "ascend-toolkit" / "latest"
    atb = tmp_path / "Ascend" / "nnal" / "atb"
    toolkit.mkdir(parents=True)
    atb.mkdir(parents=True)
    (toolkit / "set_env.sh").write_text(
        f"export ASCEND_TOOLKIT_HOME={toolkit}\n"
        "export LD_LIBRARY_PATH=/opt/cann/lib64:$LD_LIBRARY_PATH\n"
        "echo $UNSET_VARIABLE_IS_FINE >/dev/null\n")
    (atb / "set_env.sh").write_text("export ATB_HOME_PATH=/opt/atb\n")
    serve = load_recipe().serve
    scripts = cann_scripts(serve, str(toolkit))
    assert scripts[0] == toolkit / "set_env.sh" and scripts[1] == atb / "set_env.sh"
    base = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": "/usr/lib"}
    cache = tmp_path / "cache"
    env = capture_script_env(scripts, base, cache_dir=cache)
    assert env == {"ASCEND_TOOLKIT_HOME": str(toolkit), "ATB_HOME_PATH": "/opt/atb",
                   "LD_LIBRARY_PATH": "/opt/cann/lib64:/usr/lib"}
    assert len(list(cache.glob("cann-env-*.json"))) == 1
    # a failing script is a one-line error naming it
    (atb / "set_env.sh").write_text("return 3\n")
    with pytest.raises(Dsv4Error, match="serve.cann_set_env"):
        capture_script_env(scripts, base)


def test_plan_env_layers_script_env_under_the_recipe(ws: Workspace):
    plan = build_plan(load_recipe(), host(toolkit="/opt/tk"), ws, base_env={},
                      script_env={"ASCEND_OPP_PATH": "/opt/opp", "TASK_QUEUE_ENABLE": "2"})
    assert plan.env["ASCEND_OPP_PATH"] == "/opt/opp"
    assert plan.env["TASK_QUEUE_ENABLE"] == "1"  # the recipe's fixed export wins
    assert plan.env["ASCEND_TOOLKIT_HOME"] == "/opt/tk"
    assert "KT_NSA_COMPRESSOR_MODE=split" in plan.shell()


def test_script_form_round_trips_to_the_same_argv(ws: Workspace):
    plan = build_plan(load_recipe(), host(), ws, base_env={"http_proxy": "x"})
    lines = plan.script()
    assert lines[0] == "unset http_proxy"
    assert "export KT_NSA_COMPRESSOR_MODE=split" in lines
    command = lines[-1]
    assert command.splitlines()[0] == "python3.11 -m sglang.launch_server \\"
    assert shlex.split(command.replace("\\\n", " ")) == plan.argv


def test_server_pythonpath_is_the_launchers_order_then_the_inherited_one(ws: Workspace):
    recipe = load_recipe()
    plan = build_plan(recipe, host(), ws, base_env={"PYTHONPATH": "/site/extra"})
    parts = plan.env["PYTHONPATH"].split(os.pathsep)
    # ensure_kt_kernel.sh L24 prepends sglang/python:kt-kernel, then launch_ds4flash_npu.sh
    # L46 prepends sglang/python:kt-kernel/python (REPO = the ktransformers tree)
    repo = ws.root / "src/ktransformers"
    assert parts == [str(repo / "third_party/sglang/python"), str(repo / "kt-kernel/python"),
                     str(repo / "third_party/sglang/python"), str(repo / "kt-kernel"),
                     "/site/extra"]
    assert plan.origins["PYTHONPATH"].startswith("workspace")


def test_serve_and_doctor_pick_the_same_card():
    from dsv4_offload.core.host import choose_npu

    recipe = load_recipe()
    cards = (npu(0, used=9000), npu(1, used=2500, core=40), npu(2, used=2600, core=0))
    chosen = choose_npu(cards, recipe.host.npu_models,
                        mem_fraction=recipe.serve.mem_fraction_static)
    assert chosen is not None
    assert pick_device(cards, None, None, models=recipe.host.npu_models)[0] == str(
        chosen.device_id)


# --- serve.extra_args / EXTRA_FLAGS against sglang's server_args table --------------------


@pytest.mark.parametrize(("extra", "env", "match"), [
    (["--chunked-prefill-size", "-1"], "", r"^--chunked-prefill-size -1 \(serve.extra_args\): "
     r"must be a positive multiple of the page size 128 \(the launcher refuses -1"),
    ([], "--chunked-prefill-size 4096", r"--chunked-prefill-size 4096 \(EXTRA_FLAGS, launcher "
     r"L278\) is below the plan's 32768 .*a prompt longer than the chunk fails"),
    (["--port", "8030"], "", r"--port 8030 \(serve.extra_args\) clashes with the plan's --port "
     "8020"),
    (["--nccl-port=8020"], "", r"--nccl-port 8020 .* is the server's own HTTP port"),
    (["--cuda-graph-max-bs", "two"], "", r"--cuda-graph-max-bs two \(serve.extra_args\): not "
     "an integer"),
    (["--swa-full-tokens-ratio"], "", r"--swa-full-tokens-ratio \(serve.extra_args\) needs a "
     "value"),
    (["--disable-cuda-graph", "yes"], "", r"--disable-cuda-graph .* takes no value"),
    (["8192"], "", r"'8192' in serve.extra_args follows no flag"),
])
def test_extra_args_with_a_bad_value_are_refused_in_one_line_naming_the_flag(
        ws: Workspace, extra, env, match):
    recipe = load_recipe(None, [f"serve.extra_args={extra!r}".replace("'", '"')])
    with pytest.raises(InputError, match=match) as err:
        build_plan(recipe, host(), ws, base_env={"EXTRA_FLAGS": env} if env else {},
                   longest_prompt=32768)
    assert "\n" not in str(err.value)


def test_an_unknown_flag_is_a_warning_naming_the_nearest_and_the_table_source(ws: Workspace):
    recipe = load_recipe(None, ['serve.extra_args=["--chunked-prefil-size", "8192", '
                                '"--swa-full-tokens-ratio", "0.5", "--mem-fraction-static", '
                                '"0.8"]'])
    plan = build_plan(recipe, host(), ws, base_env={})
    typo = next(w for w in plan.warnings if w.startswith("--chunked-prefil-size"))
    assert "did you mean --chunked-prefill-size?" in typo
    assert "iforgetmyname/sglang @ 7b7e357f" in typo and "not the pin" in typo
    # a known flag of the right kind passes; one the plan already sets is told
    assert not any(w.startswith("--swa-full-tokens-ratio") for w in plan.warnings)
    assert any(w.startswith("--mem-fraction-static (serve.extra_args) repeats a flag")
               for w in plan.warnings)
    assert plan.argv[-6:] == ["--chunked-prefil-size", "8192", "--swa-full-tokens-ratio",
                              "0.5", "--mem-fraction-static", "0.8"]


def test_a_fraction_above_the_floor_with_streaming_prefill_warns_citing_the_guide(
        ws: Workspace):
    plan = build_plan(load_recipe(), host(), ws, base_env={"MEM_FRACTION": "0.85"})
    (warning,) = [w for w in plan.warnings if "with streaming prefill on" in w]
    assert warning.startswith("--mem-fraction-static 0.85 is above 0.81 with streaming "
                              "prefill on (KT_PREFILL_STREAM=1)")
    assert "appendix G.1" in warning and "125 s" in warning
    assert not [w for w in build_plan(load_recipe(), host(), ws, base_env={}).warnings
                if "streaming prefill" in w]
    off = build_plan(load_recipe(), host(), ws,
                     base_env={"MEM_FRACTION": "0.85", "KT_PREFILL_STREAM": "0"})
    assert not [w for w in off.warnings if "streaming prefill" in w]


def test_set_env_entries_of_pythonpath_are_kept_behind_the_launchers(ws: Workspace):
    """Issue 17: CANN's set_env.sh puts its python packages on PYTHONPATH before the launcher's
    L46 runs; the server keeps them, after the launcher's entries (it used to start again
    from the shell's PYTHONPATH and lose them)."""
    recipe = load_recipe()
    cann = os.pathsep.join(["/usr/local/Ascend/ascend-toolkit/latest/python/site-packages",
                            "/site/extra"])
    plan = build_plan(recipe, host(), ws, base_env={"PYTHONPATH": "/site/extra"},
                      script_env={"PYTHONPATH": cann})
    parts = plan.env["PYTHONPATH"].split(os.pathsep)
    repo = ws.root / "src/ktransformers"
    assert parts == [str(repo / "third_party/sglang/python"), str(repo / "kt-kernel/python"),
                     str(repo / "third_party/sglang/python"), str(repo / "kt-kernel"),
                     "/usr/local/Ascend/ascend-toolkit/latest/python/site-packages",
                     "/site/extra"]
