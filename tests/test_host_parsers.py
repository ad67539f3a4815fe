"""Pure host parsers on captured texts: cpuinfo, meminfo, cpulists, npu-smi, CANN, versions."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from dsv4_offload.core.host import (
    NpuInfo,
    choose_npu,
    npu_is_idle,
    npu_model_matches,
    parse_cann_install_info,
    parse_cpuinfo,
    parse_cpulist,
    parse_df,
    parse_meminfo,
    parse_npu_smi_info,
    parse_npu_smi_version,
    parse_version,
    version_at_least,
    version_key,
    visible_device,
)

HOSTS = Path(__file__).parent / "fixtures" / "hosts"


def text(host: str, rel: str) -> str:
    return (HOSTS / host / rel).read_text()


# --- cpuinfo -------------------------------------------------------------------------------


def test_cpuinfo_kunpeng920_is_aarch64_with_dotprod_and_no_sve() -> None:
    arch, model, flags, cores = parse_cpuinfo(text("kunpeng920-910b", "proc/cpuinfo"))
    assert arch == "aarch64"
    assert "Kunpeng-920" in model
    assert {"asimd", "asimddp", "fphp", "asimdfhm"} <= flags
    assert not flags & {"sve", "bf16", "i8mm"}
    assert cores == 192


def test_cpuinfo_a3_host_has_sve_bf16_i8mm() -> None:
    arch, model, flags, cores = parse_cpuinfo(text("a3-host", "proc/cpuinfo"))
    assert (arch, cores) == ("aarch64", 320)
    assert "TaiShan v120" in model
    assert {"sve", "bf16", "i8mm", "asimddp"} <= flags


def test_cpuinfo_x86_reads_flags_and_model_name() -> None:
    arch, model, flags, cores = parse_cpuinfo(text("x86-no-npu", "proc/cpuinfo"))
    assert arch == "x86_64"
    assert model == "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
    assert {"avx2", "avx512f", "lm"} <= flags and "asimddp" not in flags
    assert cores == 8


def test_cpuinfo_of_this_machine_matches_the_running_kernel() -> None:
    live = Path("/proc/cpuinfo")
    if not live.exists():
        pytest.skip("no /proc/cpuinfo here")
    arch, model, flags, cores = parse_cpuinfo(live.read_text())
    if platform.machine() in ("x86_64", "aarch64"):
        assert arch == platform.machine()
    assert cores >= 1 and cores <= (os.cpu_count() or cores)
    assert flags and model


def test_cpuinfo_unknown_text_gives_no_arch() -> None:
    assert parse_cpuinfo("") == (None, "unknown CPU", frozenset(), 0)
    arch, model, _, _ = parse_cpuinfo("processor : 0\nCPU implementer : 0x41\nCPU part : 0xfff\n")
    assert arch == "aarch64" and model == "arm implementer 0x41 part 0xfff"


# --- meminfo, cpulist, df ------------------------------------------------------------------


def test_meminfo_fields_in_kib() -> None:
    info = parse_meminfo(text("kunpeng920-910b", "proc/meminfo"))
    assert info["MemTotal"] == 1585294532
    assert info["MemAvailable"] == 1421836800
    assert info["HugePages_Total"] == 0  # a count, no unit
    assert info["Active(file)"] > 0


def test_numa_node_meminfo_drops_the_node_prefix() -> None:
    info = parse_meminfo(text("kunpeng920-910b", "sys/devices/system/node/node3/meminfo"))
    assert info["MemTotal"] == 198161816
    assert info["MemFree"] < info["MemTotal"]


@pytest.mark.parametrize("cpulist, expected", [
    ("0-23\n", tuple(range(24))),
    ("0-1,48-49", (0, 1, 48, 49)),
    ("5", (5,)),
    ("", ()),
])
def test_cpulist(cpulist: str, expected: tuple[int, ...]) -> None:
    assert parse_cpulist(cpulist) == expected


def test_df_available_column() -> None:
    assert parse_df(text("kunpeng920-910b", "df.txt")) == 6048115736576
    assert parse_df("Filesystem 1-blocks Used Available Capacity Mounted on\n") is None


# --- npu-smi -------------------------------------------------------------------------------


def test_npu_smi_910b3_every_field() -> None:
    npus = parse_npu_smi_info(text("kunpeng920-910b", "npu-smi-info.txt"))
    assert [n.npu_id for n in npus] == list(range(8))
    first, last = npus[0], npus[7]
    assert first == NpuInfo(
        npu_id=0, chip=0, model="910B3", health="OK", hbm_total_mb=65536, hbm_used_mb=58921,
        aicore_pct=87, bus_id="0000:C1:00.0", phy_id=None, processes=first.processes,
    )
    assert [(p.pid, p.name, p.memory_mb) for p in first.processes] == [(402117, "python3", 55521)]
    assert (last.hbm_used_mb, last.aicore_pct, last.bus_id) == (3386, 0, "0000:42:00.0")
    assert last.processes == ()
    assert all(n.device_id == n.npu_id for n in npus)


def test_npu_smi_a3_two_dies_per_npu_with_phy_ids() -> None:
    npus = parse_npu_smi_info(text("a3-host", "npu-smi-info.txt"))
    assert len(npus) == 16
    assert [(n.npu_id, n.chip) for n in npus[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [n.phy_id for n in npus] == list(range(16))
    assert [n.device_id for n in npus] == list(range(16))
    assert {n.model for n in npus} == {"Ascend910"}
    second_die = npus[1]  # its Power column prints "-"
    assert (second_die.hbm_used_mb, second_die.hbm_total_mb, second_die.aicore_pct) == (
        57299, 65536, 72)
    assert [p.pid for p in npus[0].processes] == [77120]
    assert [p.pid for p in npus[1].processes] == [77121]
    assert npus[2].processes == ()


def test_npu_smi_bad_state_health_values() -> None:
    npus = parse_npu_smi_info(text("npu-bad-state", "npu-smi-info.txt"))
    assert [n.health for n in npus] == ["OK"] * 6 + ["Alarm", "Critical"]
    assert all(n.hbm_used_mb == 63807 for n in npus[:6])


def test_npu_smi_910b4_card_layout_and_old_910a_layout() -> None:
    # written for this test in the shapes of a 910B4-1 card and of the older 910A tool
    b4 = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 3     910B4-1             | Warning       | 91.3        33                0    / 0             |
| 0                         | 0000:82:00.0  | 4           0    / 0          3197 / 65536         |
+===========================+===============+====================================================+
"""
    a = """\
| NPU     Name                | Health          | Power(W)          Temp(C)                   |
| Chip                        | Bus-Id          | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB) |
+=============================+=================+=============================================+
| 1       910ProB             | OK              | 68.9              36                        |
| 0                           | 0000:3B:00.0    | 0                 2216 / 15603   0    / 32768 |
"""
    (b4_npu,) = parse_npu_smi_info(b4)
    assert (b4_npu.npu_id, b4_npu.model, b4_npu.health, b4_npu.hbm_used_mb) == (
        3, "910B4-1", "Warning", 3197)
    (a_npu,) = parse_npu_smi_info(a)
    assert (a_npu.model, a_npu.hbm_used_mb, a_npu.hbm_total_mb) == ("910ProB", 0, 32768)


def test_npu_smi_error_text_lists_nothing() -> None:
    assert parse_npu_smi_info("dcmi module initialize failed. ret is -8005\n") == []


def test_npu_smi_driver_version() -> None:
    assert parse_npu_smi_version(text("kunpeng920-910b", "npu-smi-info.txt")) == "24.1.rc2"
    assert parse_npu_smi_version(text("a3-host", "npu-smi-info.txt")) == "25.2.0"
    assert parse_npu_smi_version("nothing here") is None


# --- CANN and tool versions ----------------------------------------------------------------


def test_cann_install_info_version() -> None:
    info = "usr/local/Ascend/ascend-toolkit/latest/aarch64-linux/ascend_toolkit_install.info"
    assert parse_cann_install_info(text("kunpeng920-910b", info)) == "8.5.0"
    assert parse_cann_install_info(text("a3-host", info)) == "9.0.0"
    assert parse_cann_install_info("package_name=Ascend-cann-toolkit\n") is None


@pytest.mark.parametrize("output, version", [
    ("git version 2.39.5", "2.39.5"),
    ("cmake version 3.25.1\n\nCMake suite maintained and supported by Kitware", "3.25.1"),
    ("gcc (Debian 12.2.0-14+deb12u1) 12.2.0\nCopyright (C) 2022", "12.2.0"),
    ("g++-13 (GCC) 13.2.0", "13.2.0"),
    ("Docker version 24.0.7, build afdd53b", "24.0.7"),
    ("Python 3.11.9", "3.11.9"),
    ("no digits", None),
])
def test_tool_versions(output: str, version: str | None) -> None:
    assert parse_version(output) == version


@pytest.mark.parametrize("older, newer", [
    ("8.5.RC1", "8.5.0"), ("8.3.RC1", "8.5.0"), ("8.5.0", "8.5.1"), ("8.5.1", "9.0.0"),
    ("9.0.0-beta.1", "9.0.0"), ("2.9", "2.20"), ("9.0", "11.4.0"),
])
def test_version_order(older: str, newer: str) -> None:
    assert version_key(older) < version_key(newer)
    assert version_at_least(newer, older) and not version_at_least(older, newer)


def test_version_at_least_none_is_false() -> None:
    assert not version_at_least(None, "1.0")
    assert version_at_least("8.5.0", "8.5.0")


# --- NPU matching and choice ---------------------------------------------------------------


def _npu(model: str, phy: int | None = None, health: str = "OK", used: int = 3000,
         npu_id: int = 0) -> NpuInfo:
    return NpuInfo(npu_id=npu_id, chip=0, model=model, health=health, hbm_total_mb=65536,
                   hbm_used_mb=used, aicore_pct=0, phy_id=phy)


@pytest.mark.parametrize("model, phy, wanted, matches", [
    ("910B3", None, "910B", True),
    ("910B4-1", None, "910B", True),
    ("Ascend910B3", None, "910B", True),
    ("910ProB", None, "910B", False),
    ("Ascend910_9382", None, "A3", True),
    ("Ascend910_9392", None, "910_93", True),
    ("Ascend910", 5, "A3", True),
    ("910C", None, "A3", True),
    ("Ascend910", None, "A3", False),
    ("Ascend910", 5, "910B", False),
    ("910B3", None, "A3", False),
])
def test_npu_model_matches_loosely(model: str, phy: int | None, wanted: str,
                                   matches: bool) -> None:
    assert npu_model_matches(_npu(model, phy), wanted) is matches


def test_idle_means_the_server_can_still_claim_its_fraction() -> None:
    assert npu_is_idle(_npu("910B3", used=12000), 0.81)
    assert not npu_is_idle(_npu("910B3", used=13000), 0.81)


def test_choose_npu_on_the_fixtures() -> None:
    kp = parse_npu_smi_info(text("kunpeng920-910b", "npu-smi-info.txt"))
    assert choose_npu(kp, ["910B"], mem_fraction=0.81).npu_id == 7  # the idle one
    assert choose_npu(kp, ["910B"], mem_fraction=0.81, device=3).npu_id == 3
    assert choose_npu(kp, ["910B"], mem_fraction=0.81, device=42) is None
    assert choose_npu(kp, ["A3"], mem_fraction=0.81) is None
    bad = parse_npu_smi_info(text("npu-bad-state", "npu-smi-info.txt"))
    assert choose_npu(bad, ["910B"], mem_fraction=0.81).health == "Alarm"  # idle beats busy
    a3 = parse_npu_smi_info(text("a3-host", "npu-smi-info.txt"))
    assert choose_npu(a3, ["A3"], mem_fraction=0.81).device_id == 3  # least HBM in use


def test_visible_device_reads_the_first_id() -> None:
    assert visible_device({"ASCEND_RT_VISIBLE_DEVICES": "4,5"}) == 4
    assert visible_device({"ASCEND_RT_VISIBLE_DEVICES": ""}) is None
    assert visible_device({}) is None
