"""Doctor verdicts on the captured hosts, through the stage entry point and its pure checks."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from dsv4_offload.core.host import HostFacts, probe_host
from dsv4_offload.core.results import Status
from dsv4_offload.recipe import Recipe, load_recipe_and_series
from dsv4_offload.stages import doctor
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import Workspace

HOSTS = Path(__file__).parent / "fixtures" / "hosts"
RECIPE_910B = "dsv4-flash-910b"
RECIPE_A3 = "dsv4-flash-a3"


def use_host(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """Point the probes at a captured sysroot the way the CLI does: by environment."""
    monkeypatch.setenv("DSV4_HOST_ROOT", str(root))
    smi = root / "npu-smi-info.txt"
    if smi.exists():
        monkeypatch.setenv("DSV4_NPU_SMI", f"cat '{smi}'")
    else:
        monkeypatch.delenv("DSV4_NPU_SMI", raising=False)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)


def as_in_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """Doctor as `container exec -- doctor` runs it: inside the 910B image, where the build's
    toolchain rows are judged (the captured hosts carry a toolchain). Outside, the 910B
    recipe shows those rows as the image's (test_a_bare_910b_host_is_not_judged_…)."""
    monkeypatch.setenv("DSV4_IN_CONTAINER", "dsv4_singlecard")


# the host verdicts below bind loopback; the default 0.0.0.0 bind warning has its own test
LOOPBACK = ["serve.host=127.0.0.1"]


def context(tmp_path: Path, recipe_name: str = RECIPE_910B, **options: object) -> StageContext:
    recipe, series = load_recipe_and_series(recipe_name, LOOPBACK)
    return StageContext(recipe=recipe, series=series, workspace=Workspace(tmp_path / "ws"),
                        options=dict(options), stage="doctor")


def run_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, host: str,
           recipe_name: str = RECIPE_910B, **options: object):  # type: ignore[no-untyped-def]
    use_host(monkeypatch, HOSTS / host)
    result = doctor.run(context(tmp_path, recipe_name, **options))
    by_name = {c["name"]: c for c in result.data["checks"]}
    return result, by_name


def facts_of(host: str, recipe: Recipe) -> HostFacts:
    root = HOSTS / host
    smi = root / "npu-smi-info.txt"
    tools = [t for t in (recipe.platform.cc, recipe.platform.cxx) if t]
    return probe_host(Path("/nonexistent-ws"), root=root,
                      npu_smi=["cat", str(smi)] if smi.exists() else None, tools=tools)


def statuses(checks: dict[str, dict[str, str]]) -> dict[str, str]:
    return {name: c["status"] for name, c in checks.items()}


# --- verdicts per captured host ------------------------------------------------------------


def test_healthy_kunpeng_910b_passes_on_the_idle_npu(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    as_in_the_image(monkeypatch)
    result, checks = run_on(monkeypatch, tmp_path, "kunpeng920-910b")
    assert result.status is Status.OK, result.problems
    assert checks.pop("python")["status"] == "skip"  # only the live host's pythons are probed
    assert set(statuses(checks).values()) == {"ok"}
    assert result.problems == []
    assert result.data["device"] == 7
    assert "NPU 7" in checks["npu-hbm-free"]["observed"]
    assert "8 nodes (0-7), 24 CPUs each" in checks["numa"]["observed"]
    assert result.outputs["host"]["arch"] == "aarch64"
    assert result.outputs["device"] == 7


def test_report_file_holds_the_same_checks(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    result, _ = run_on(monkeypatch, tmp_path, "kunpeng920-910b")
    report = tmp_path / "ws" / "reports" / "doctor.json"
    assert result.data["report"] == str(report)
    doc = json.loads(report.read_text())
    assert doc["status"] == "ok" and doc["recipe"] == RECIPE_910B
    assert doc["checks"] == result.data["checks"]
    assert doc["host"]["cann_version"] == "8.5.0"
    assert not list(report.parent.glob(".*.tmp"))  # nothing half-written left behind


def test_a3_host_warns_about_sve_and_passes_the_rest(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    result, checks = run_on(monkeypatch, tmp_path, "a3-host", RECIPE_A3)
    assert result.status is Status.WARN
    assert checks["cpu-build-off"]["status"] == "warn"
    assert "sve" in checks["cpu-build-off"]["observed"]
    assert "CPUINFER_ARM_SVE" in checks["cpu-build-off"]["fix"]
    assert "llamafile not supported" in checks["cpu-build-off"]["fix"]
    others = {n: s for n, s in statuses(checks).items() if n not in ("cpu-build-off", "python")}
    assert set(others.values()) == {"ok"}, others
    assert checks["gcc-13"]["observed"] == "13.2.0"  # the A3 recipe's compiler, not gcc 10
    assert result.data["device"] == 3  # an idle die, by its device id
    assert [p.severity for p in result.problems] == ["warning"]


def test_a_cpu_without_fp16_arithmetic_fails(tmp_path: Path) -> None:
    # pitfall 7: the build targets -march=armv8.2-a+fp16+dotprod, so asimdhp is needed too
    recipe, _ = load_recipe_and_series(RECIPE_910B)
    facts = facts_of("kunpeng920-910b", recipe)
    assert "asimdhp" in facts.cpu_flags  # the captured Kunpeng-920 has it
    no_fp16 = dataclasses.replace(facts, cpu_flags=facts.cpu_flags - {"asimdhp"})
    (flags,) = [c for c in doctor.check_cpu(recipe, no_fp16) if c.name == "cpu-flags"]
    assert flags.status == "fail" and flags.observed == "missing asimdhp"
    assert "asimdhp" in flags.fix


def test_x86_without_npu_fails_on_arch_and_npu(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    as_in_the_image(monkeypatch)
    result, checks = run_on(monkeypatch, tmp_path, "x86-no-npu")
    assert result.status is Status.FAILED
    assert checks["arch"]["status"] == "fail" and checks["arch"]["observed"].startswith("x86_64")
    assert checks["cpu-flags"]["status"] == "fail" and "asimddp" in checks["cpu-flags"]["observed"]
    assert checks["npu-smi"]["status"] == "fail" and checks["npu-smi"]["observed"] == "not found"
    assert checks["npu-model"]["status"] == "skip"
    assert checks["device-nodes"]["status"] == "fail"
    assert checks["cann"]["status"] == "fail"
    assert "lmsysorg/sglang:deepseek-v4-npu-910b" in checks["cann"]["fix"]
    assert checks["libhwloc"]["status"] == "fail" and "libhwloc-dev" in checks["libhwloc"]["fix"]
    assert checks["memory"]["status"] == "fail" and checks["disk"]["status"] == "fail"
    assert checks["docker"]["status"] == "warn"  # recommended, absent
    assert checks["page-cache"]["status"] == "warn"  # the GGUF set cannot be cached
    assert result.summary.startswith(f"{len(result.problems) - 2} check(s) failed: arch")
    assert checks["git"]["status"] == "ok"


def test_bad_npu_fails_with_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    as_in_the_image(monkeypatch)
    result, checks = run_on(monkeypatch, tmp_path, "npu-bad-state")
    assert result.status is Status.FAILED
    health = checks["npu-health"]
    assert health["status"] == "fail" and "Alarm" in health["observed"]
    assert "npu-smi info -t health -i 6" in health["fix"]
    assert "npu-smi set -t reset -i 6 -c 0" in health["fix"]
    nodes = checks["device-nodes"]
    assert nodes["status"] == "fail" and nodes["observed"] == "missing /dev/devmm_svm"
    assert "--device" in nodes["fix"]
    assert checks["libhwloc"]["status"] == "fail"
    failed = {p.check for p in result.problems if p.severity == "error"}
    assert failed == {"npu-health", "device-nodes", "libhwloc"}
    assert all(p.fix for p in result.problems)


def test_bad_npu_chosen_by_device_option(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _, critical = run_on(monkeypatch, tmp_path, "npu-bad-state", device=7)
    assert "Critical" in critical["npu-health"]["observed"]
    _, busy = run_on(monkeypatch, tmp_path, "npu-bad-state", device=0)
    assert busy["npu-health"]["status"] == "ok"
    assert busy["npu-hbm-free"]["status"] == "fail"
    assert "63807 MB used by pid 918233 python3" in busy["npu-hbm-free"]["observed"]
    _, unknown = run_on(monkeypatch, tmp_path, "npu-bad-state", device=42)
    assert unknown["npu-health"]["status"] == "fail"
    assert "device 42 is not listed" in unknown["npu-health"]["observed"]


def test_visible_devices_env_chooses_a_busy_card(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    use_host(monkeypatch, HOSTS / "kunpeng920-910b")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2")
    result = doctor.run(context(tmp_path))
    checks = {c["name"]: c for c in result.data["checks"]}
    assert result.status is Status.FAILED
    assert checks["npu-hbm-free"]["status"] == "fail"
    assert "pid 402119" in checks["npu-hbm-free"]["observed"]
    assert "healthy idle alternatives: 7" in checks["npu-hbm-free"]["fix"]


@pytest.mark.parametrize("host", ["kunpeng920-910b", "a3-host", "x86-no-npu", "npu-bad-state"])
def test_every_failure_and_warning_says_how_to_fix_it(host: str) -> None:
    for name in (RECIPE_910B, RECIPE_A3):
        recipe, _ = load_recipe_and_series(name)
        checks, _ = doctor.evaluate(recipe, facts_of(host, recipe))
        for c in checks:
            assert c.status in ("ok", "warn", "fail", "skip")
            if c.status in ("warn", "fail"):
                assert c.fix, (host, name, c)


# --- recipe against the wrong host ---------------------------------------------------------


def test_a3_recipe_on_the_910b_host(tmp_path: Path) -> None:
    recipe, _ = load_recipe_and_series(RECIPE_A3)
    checks = {c.name: c for c in doctor.evaluate(recipe, facts_of("kunpeng920-910b", recipe))[0]}
    assert checks["npu-model"].status == "fail" and checks["npu-model"].observed == "910B3"
    assert "--recipe" in checks["npu-model"].fix
    assert checks["cann"].status == "fail" and checks["cann"].observed.startswith("8.5.0")
    assert checks["gcc-13"].status == "fail" and checks["gcc-13"].observed == "not found"
    assert "apt-get install gcc-13 g++-13" in checks["gcc-13"].fix


def test_910b_recipe_on_the_a3_host() -> None:
    recipe, _ = load_recipe_and_series(RECIPE_910B)
    checks = {c.name: c for c in doctor.evaluate(recipe, facts_of("a3-host", recipe))[0]}
    assert checks["npu-model"].status == "fail" and checks["npu-model"].observed == "Ascend910"


def test_sve_host_with_a_build_that_leaves_sve_on_fails() -> None:
    recipe, _ = load_recipe_and_series(RECIPE_A3)
    steps = [s.model_copy(update={"env": {k: v for k, v in s.env.items()
                                          if k != "CPUINFER_ARM_SVE"}})
             for s in recipe.build.steps]
    leaky = recipe.model_copy(update={"build": recipe.build.model_copy(update={"steps": steps})})
    checks = {c.name: c for c in doctor.evaluate(leaky, facts_of("a3-host", leaky))[0]}
    off = checks["cpu-build-off"]
    assert off.status == "fail" and "CPUINFER_ARM_SVE" in off.observed
    assert 'build.steps[kt-kernel].env.CPUINFER_ARM_SVE: "OFF"' in off.fix


# --- thresholds on edited copies of the healthy host ---------------------------------------


def edited_host(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    shutil.copytree(HOSTS / "kunpeng920-910b", root)
    return root


def set_mem_available(root: Path, gib: int) -> None:
    path = root / "proc" / "meminfo"
    lines = [f"MemAvailable:   {gib * 1024 * 1024} kB" if line.startswith("MemAvailable:")
             else line for line in path.read_text().splitlines()]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("gib, status", [(300, "ok"), (200, "warn"), (100, "fail")])
def test_memory_thresholds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gib: int,
                           status: str) -> None:
    root = edited_host(tmp_path)
    set_mem_available(root, gib)
    use_host(monkeypatch, root)
    result = doctor.run(context(tmp_path))
    checks = {c["name"]: c for c in result.data["checks"]}
    assert checks["memory"]["status"] == status
    assert checks["memory"]["observed"].startswith(f"{gib} GiB available")
    assert result.status is {"ok": Status.OK, "warn": Status.WARN, "fail": Status.FAILED}[status]


# the figure is the plan `run` refuses on (weights/diskplan): 275 + 150 + 137.1 = 562.1 GiB;
# 500 GiB passed doctor's old 415 GiB minimum and was then refused by `run` (issue 28)
@pytest.mark.parametrize("gib, status", [(700, "ok"), (500, "fail"), (100, "fail")])
def test_disk_is_judged_on_the_plan_run_refuses_on(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path, gib: int,
                                                     status: str) -> None:
    root = edited_host(tmp_path)
    free = gib * 1024**3
    (root / "df.txt").write_text("Filesystem 1-blocks Used Available Capacity Mounted on\n"
                                 f"/dev/sda1 {free * 2} {free} {free} 50% /data\n")
    use_host(monkeypatch, root)
    checks = {c["name"]: c for c in doctor.run(context(tmp_path)).data["checks"]}
    disk = checks["disk"]
    assert disk["status"] == status
    assert disk["observed"].startswith(f"{gib}.0 GiB free")
    assert "this run still writes 562.1 GiB" in disk["required"]
    assert "would peak at 412.1 GiB" in disk["required"]  # the delivery's serial way
    if status == "fail":
        assert disk["observed"].endswith(", 562.1 GiB to write")
        assert f"the run needs {562.1 - gib:.1f} GiB more free space" in disk["fix"]
        # 500 GiB: only the serial way fits, and the fix says so
        assert ("only the delivery's serial way fits" in disk["fix"]) is (gib == 500)


def test_numa_node_ids_with_a_hole_warn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = edited_host(tmp_path)
    shutil.rmtree(root / "sys/devices/system/node/node3")
    use_host(monkeypatch, root)
    checks = {c["name"]: c for c in doctor.run(context(tmp_path)).data["checks"]}
    assert checks["numa"]["status"] == "warn"
    assert "NUMA node N not found" in checks["numa"]["fix"]


def test_libnuma_needs_its_header_as_the_build_does(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    """issue 21: the .so alone passed, and the kt-kernel build then stopped on numa.h."""
    as_in_the_image(monkeypatch)
    root = edited_host(tmp_path)
    (root / "usr/include/numa.h").unlink()
    assert any((root / "usr/lib/aarch64-linux-gnu").glob("libnuma.so*"))
    use_host(monkeypatch, root)
    checks = {c["name"]: c for c in doctor.run(context(tmp_path)).data["checks"]}
    assert checks["libnuma"]["status"] == "fail", checks["libnuma"]
    assert "libnuma-dev" in checks["libnuma"]["fix"]


def test_numa_row_says_what_the_serve_plan_will_use(tmp_path: Path) -> None:
    """issue 21: the row and the serve plan are one function (serving.rules.cpu_threads).
    32 threads per node on 8 nodes is more than 192 CPUs: the plan caps it and serves, so the
    row passes with the plan's figures (it used to fail, with a fix that changed nothing)."""
    from dsv4_offload.serving.rules import cpu_threads

    recipe, _ = load_recipe_and_series(RECIPE_910B)
    hungry = recipe.model_copy(update={"serve": recipe.serve.model_copy(
        update={"threads_per_numa": 32})})
    facts = facts_of("kunpeng920-910b", hungry)
    checks = {c.name: c for c in doctor.evaluate(hungry, facts)[0]}
    pools, threads = cpu_threads(hungry.serve, facts.numa_nodes, facts.cores)
    assert checks["numa"].status == "ok", checks["numa"]
    assert f"serve: {pools} pool(s) x {threads // pools} threads ({threads} of 192 CPUs)" \
        in checks["numa"].observed


def test_a_host_too_small_for_the_pools_is_a_warning_with_a_fix_that_works(
    tmp_path: Path
) -> None:
    recipe, _ = load_recipe_and_series(RECIPE_910B)
    # 8 nodes, 8 CPUs: nothing left for one thread per pool after the reserve
    facts = dataclasses.replace(facts_of("kunpeng920-910b", recipe), cores=8)
    checks = {c.name: c for c in doctor.evaluate(recipe, facts)[0]}
    row = checks["numa"]
    assert row.status == "warn", row  # a host fact: a warning with its consequence
    assert "slower decode" in row.fix  # the serve plan's own words (serving.rules.cpu_plan)
    fix = re.search(r"--set (serve\.reserved_cores=\d+)", row.fix)
    assert fix, row.fix
    fixed, _ = load_recipe_and_series(RECIPE_910B, [fix.group(1)])
    assert {c.name: c for c in doctor.evaluate(fixed, facts)[0]}["numa"].status == "ok"


def test_fewer_cpus_than_numa_nodes_fails_the_row_as_serve_would(tmp_path: Path) -> None:
    recipe, _ = load_recipe_and_series(RECIPE_910B)
    facts = dataclasses.replace(facts_of("kunpeng920-910b", recipe), cores=4)
    row = {c.name: c for c in doctor.evaluate(recipe, facts)[0]}["numa"]
    assert row.status == "fail" and "export KT_THREADPOOL_COUNT=4" in row.fix, row


# --- fingerprint ---------------------------------------------------------------------------


def test_fingerprint_follows_the_host_and_names_the_area(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    use_host(monkeypatch, HOSTS / "kunpeng920-910b")
    first = doctor.fingerprint_inputs(context(tmp_path))
    assert doctor.fingerprint_inputs(context(tmp_path)) == first
    use_host(monkeypatch, HOSTS / "npu-bad-state")
    bad = doctor.fingerprint_inputs(context(tmp_path))
    changed = {k for k in first if first[k] != bad[k]}
    # issue 19: the verdicts doctor reached are part of it too ("checks")
    assert changed == {"host.npu", "host.devices", "host.toolchain", "checks"}
    assert all(isinstance(v, str) and len(v) == 16 for v in bad.values())


def test_fingerprint_follows_what_doctor_reads_beyond_the_host(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 19: the interpreter doctor reports (recorded choice, PYTHON_BIN) and the
    verdicts it reaches make doctor stale, so `run` runs it again."""
    from dsv4_offload.workspace.store import Workspace

    use_host(monkeypatch, HOSTS / "kunpeng920-910b")
    monkeypatch.delenv("PYTHON_BIN", raising=False)
    first = doctor.fingerprint_inputs(context(tmp_path))
    monkeypatch.setenv("PYTHON_BIN", "/opt/other/python3.11")
    assert {k for k, v in doctor.fingerprint_inputs(context(tmp_path)).items()
            if first[k] != v} == {"python"}
    monkeypatch.delenv("PYTHON_BIN")
    Workspace(tmp_path / "ws").update_provenance("python", {"path": "/usr/bin/python3",
                                                             "source": "probe"})
    assert doctor.fingerprint_inputs(context(tmp_path))["python"] != first["python"]


def test_a_doctor_run_probes_the_host_once(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    from dsv4_offload import pipeline

    host = HOSTS / "kunpeng920-910b"
    use_host(monkeypatch, host)
    calls = tmp_path / "npu-smi-calls"
    monkeypatch.setenv("DSV4_NPU_SMI", f"sh -c 'echo x >> {calls}; cat {host}/npu-smi-info.txt'")
    ctx = context(tmp_path)
    result = pipeline.run_stage(ctx, "doctor", {})
    assert result.status is Status.OK, result.problems
    assert calls.read_text().splitlines() == ["x"]  # the recorded fingerprint reused the facts
    record = ctx.workspace.read_state()["stages"]["doctor"]
    assert record["status"] == "done"
    assert record["fingerprint"]["input.host.npu"] == doctor.fingerprint_inputs(
        context(tmp_path))["host.npu"]


def test_x86_dev_recipe_checks_the_build_needs_and_nothing_of_the_npu(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result, checks = run_on(monkeypatch, tmp_path, "x86-no-npu", "dsv4-flash-x86-dev")
    names = set(checks)
    assert not names & {"npu-smi", "npu-model", "npu-health", "npu-hbm", "npu-hbm-free",
                        "device-nodes", "cann", "docker"}
    assert checks["arch"]["status"] == "ok" and checks["numa"]["status"] == "skip"
    assert {"cmake", "g++", "libhwloc", "libnuma", "pkg-config", "hwloc.pc", "py-numpy",
            "py-setuptools"} <= names
    assert checks["g++"]["required"] == ">= 11.0"  # C++20 and <barrier> (worker_pool.h:17)
    # a captured sysroot cannot import modules: reported as failing, with the install line
    assert checks["py-setuptools"]["status"] == "fail"
    assert "-m pip install 'setuptools>=77'" in checks["py-setuptools"]["fix"]
    assert checks["hwloc.pc"]["fix"].startswith("apt-get install libhwloc-dev")


def test_open_bind_without_a_key_and_a_small_page_cache_are_warnings(tmp_path: Path) -> None:
    recipe, _ = load_recipe_and_series(RECIPE_910B)
    facts = facts_of("kunpeng920-910b", recipe)
    checks = {c.name: c for c in doctor.evaluate(recipe, facts)[0]}
    assert checks["serve-bind"].status == "warn"  # the delivery's 0.0.0.0, no key
    assert "--api-key-file" in checks["serve-bind"].fix
    assert checks["page-cache"].status == "ok"
    keyed, _ = load_recipe_and_series(RECIPE_910B, ["serve.api_key_file=/etc/dsv4/key"])
    assert {c.name: c for c in doctor.evaluate(keyed, facts)[0]}["serve-bind"].status == "ok"
    from dataclasses import replace

    small = replace(facts, mem_available_kib=100 * 1024**2)  # 100 GiB < the 137 GiB set
    page = {c.name: c for c in doctor.evaluate(recipe, small)[0]}["page-cache"]
    assert page.status == "warn" and "137 GiB" in page.required and "page cache" in page.fix


def test_doctor_says_which_python_and_why(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    monkeypatch.setenv("PYTHON_BIN", sys.executable)
    monkeypatch.delenv("DSV4_HOST_ROOT", raising=False)
    as_in_the_image(monkeypatch)  # the launcher's python is the image's to choose
    result = doctor.run(context(tmp_path))
    check = {c["name"]: c for c in result.data["checks"]}["python"]
    assert check["status"] == "ok"
    assert check["observed"].startswith(f"{sys.executable} (PYTHON_BIN:")


def test_a_bare_910b_host_is_not_judged_on_what_only_the_image_needs() -> None:
    """The 910B recipe builds in its image: a host with Python 3.9, no cmake, no compiler
    and no CANN toolkit passes, and those rows say where they are checked (issue 17)."""
    recipe, _ = load_recipe_and_series(RECIPE_910B, LOOPBACK)
    facts = facts_of("kunpeng920-910b", recipe)
    bare = dataclasses.replace(
        facts, python_versions={"python3": "3.9.2"}, libraries={}, cann_version=None,
        cann_toolkit=None, tools={k: v for k, v in facts.tools.items()
                                  if k not in ("cmake", "gcc", "g++", "pkg-config")})
    outside = doctor.RuntimeFacts(inside=False, probe="not probed: a captured host")
    checks, _ = doctor.evaluate(recipe, bare, runtime=outside)
    rows = {c.name: c for c in checks}
    assert not [c for c in checks if c.status == doctor.FAIL], [
        (c.name, c.observed) for c in checks if c.status == doctor.FAIL]
    for name in ("python", "cmake", "gcc", "cann"):
        assert rows[name].status == doctor.SKIP, rows[name]
        assert "checked in the image lmsysorg/sglang:deepseek-v4-npu-910b" in rows[name].observed
        assert "container exec -- doctor" in rows[name].fix
    # inside the image (or with the build on the host) the same facts fail those rows
    inside = doctor.RuntimeFacts(inside=True)
    failed = {c.name for c in doctor.evaluate(recipe, bare, runtime=inside)[0]
              if c.status == doctor.FAIL}
    assert {"python", "cmake", "gcc", "cann"} <= failed
    on_host, _ = load_recipe_and_series(RECIPE_910B, [*LOOPBACK, "runtime.kind=host"])
    failed = {c.name for c in doctor.evaluate(on_host, bare, runtime=outside)[0]
              if c.status == doctor.FAIL}
    assert {"python", "cmake", "gcc", "cann"} <= failed


def test_a_gcc_10_compiler_fails_doctor_as_kt_kernel_needs_11(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    as_in_the_image(monkeypatch)
    # the 910B host as captured, with a compiler stand-in reporting gcc 10
    host = tmp_path / "host"
    shutil.copytree(HOSTS / "kunpeng920-910b", host, symlinks=True)
    for tool in ("gcc", "g++"):
        stand_in = host / "usr/bin" / tool
        stand_in.write_text("#!/bin/sh\ncat <<'CAPTURED'\n"
                            f"{tool} (Ubuntu 10.5.0-1ubuntu1~20.04) 10.5.0\nCAPTURED\n")
        stand_in.chmod(0o755)
    use_host(monkeypatch, host)
    result = doctor.run(context(tmp_path))
    checks = {c["name"]: c for c in result.data["checks"]}
    assert checks["gcc"]["status"] == "fail" and checks["gcc"]["observed"] == "10.5.0"
    assert checks["gcc"]["required"] == ">= 11.0"
    assert checks["g++"]["status"] == "fail"


# --- DRAM from the plan: GGUF x 1 with one threadpool, x 2 with several ---------------------


def _short_host(tmp_path: Path, fixture: str, gib: int) -> Path:
    root = tmp_path / fixture
    shutil.copytree(HOSTS / fixture, root)
    set_mem_available(root, gib)
    return root


def test_an_8_numa_host_short_of_the_copy_warns_and_offers_one_threadpool(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # 270 GiB: above doctor's 256 recommended, below 2 x 137 GiB + margin for 8 pools
    use_host(monkeypatch, _short_host(tmp_path, "kunpeng920-910b", 270))
    monkeypatch.delenv("KT_THREADPOOL_COUNT", raising=False)
    result = doctor.run(context(tmp_path))
    checks = {c["name"]: c for c in result.data["checks"]}
    assert checks["memory"]["status"] == "ok"
    plan = checks["memory-plan"]
    assert plan["status"] == "warn" and plan["observed"].startswith("8 threadpool(s)")
    assert "GGUF set 137 GiB x 2 (8 pools" in plan["fix"]  # 43 x 3,422,552,640 B
    assert "KT_THREADPOOL_COUNT=1 needs 153 GiB" in plan["fix"]
    assert "memory bandwidth" in plan["fix"]  # the trade-off, the user's choice
    # the same host with one pool exported: the plan needs the set once
    monkeypatch.setenv("KT_THREADPOOL_COUNT", "1")
    checks = {c["name"]: c for c in doctor.run(context(tmp_path)).data["checks"]}
    assert checks["memory-plan"]["status"] == "ok"
    assert "x 1 (one pool" in checks["memory-plan"]["observed"]


def test_a_1_numa_host_needs_the_gguf_set_once(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    use_host(monkeypatch, _short_host(tmp_path, "a3-1numa", 170))
    monkeypatch.delenv("KT_THREADPOOL_COUNT", raising=False)
    result = doctor.run(context(tmp_path, RECIPE_A3))
    plan = {c["name"]: c for c in result.data["checks"]}["memory-plan"]
    assert plan["status"] == "ok" and plan["observed"].startswith("1 threadpool(s): GGUF set")


def test_doctor_and_the_serve_plan_agree_on_the_dram_shortfall(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    from dsv4_offload.core.host import probe_host as probe
    from dsv4_offload.serving.plan import build_plan

    root = _short_host(tmp_path, "kunpeng920-910b", 270)
    use_host(monkeypatch, root)
    monkeypatch.delenv("KT_THREADPOOL_COUNT", raising=False)
    doctor_fix = {c["name"]: c for c in doctor.run(context(tmp_path)).data["checks"]
                  }["memory-plan"]["fix"]
    ctx = context(tmp_path)
    facts = probe(Path("/nonexistent-ws"), root=root)
    plan = build_plan(ctx.recipe, facts, ctx.workspace, base_env={}, require_layers=False)
    assert f"DRAM: {doctor_fix}" in plan.warnings


def test_a_compiler_without_its_assembler_fails_doctor_not_cmake(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """gcc answers --version without binutils, and the kt-kernel build then dies in cmake's
    first test: doctor compiles a one-line file to find that out first."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc on this machine")
    monkeypatch.delenv("DSV4_HOST_ROOT", raising=False)
    ok = doctor.run(context(tmp_path, "dsv4-flash-x86-dev"))
    assert {c["name"]: c for c in ok.data["checks"]}["cc-compiles"]["status"] == "ok"
    lonely = tmp_path / "bin"  # gcc alone on PATH: no `as`, no `ld`
    lonely.mkdir()
    (lonely / "gcc").symlink_to(gcc)
    monkeypatch.setenv("PATH", str(lonely))
    result = doctor.run(context(tmp_path, "dsv4-flash-x86-dev"))
    row = {c["name"]: c for c in result.data["checks"]}["cc-compiles"]
    assert row["status"] == "fail" and "binutils" in row["fix"], row
    assert result.status is Status.FAILED
