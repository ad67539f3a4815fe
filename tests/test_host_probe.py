"""probe_host over captured sysroots (real files, real commands) and over this machine."""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path

import pytest

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.host import probe_host

HOSTS = Path(__file__).parent / "fixtures" / "hosts"


def smi_of(host: str) -> list[str]:
    return ["cat", str(HOSTS / host / "npu-smi-info.txt")]


def test_kunpeng_sysroot_facts(tmp_path: Path) -> None:
    facts = probe_host(tmp_path, root=HOSTS / "kunpeng920-910b", npu_smi=smi_of("kunpeng920-910b"))
    assert facts.arch == "aarch64" and facts.cores == 192
    assert facts.numa_nodes == tuple(range(8))
    assert facts.numa_cpulists[0] == "0-23" and facts.numa_cpulists[7] == "168-191"
    assert (facts.mem_total_kib, facts.mem_available_kib) == (1585294532, 1421836800)
    assert facts.npu_smi == "ok" and facts.npu_driver == "24.1.rc2" and len(facts.npus) == 8
    assert all(facts.device_nodes[p] for p in (
        "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc", "/dev/davinci0",
        "/dev/davinci7"))
    assert facts.cann_version == "8.5.0"
    assert facts.cann_toolkit == "/usr/local/Ascend/ascend-toolkit/latest"
    assert facts.python_versions == {"python3": "3.11.6", "python3.11": "3.11.6"}
    assert facts.tools == {"git": "2.34.1", "cmake": "3.22.1", "gcc": "11.4.0",
                           "g++": "11.4.0", "docker": "24.0.7"}
    assert facts.libraries == {"hwloc": True, "numa": True}
    assert facts.disk_free_bytes == 6048115736576  # from the captured df.txt


def test_without_the_toolchain_no_version_is_asked_and_the_rest_is_the_same(
        tmp_path: Path) -> None:
    """Serve's plan, the bench and tune read the CPUs, memory and NPUs alone: their probe
    asks no interpreter or tool its version (the sysroot's answer every one of them)."""
    from dataclasses import replace

    root, smi = HOSTS / "kunpeng920-910b", smi_of("kunpeng920-910b")
    full = probe_host(tmp_path, root=root, npu_smi=smi)
    bare = probe_host(tmp_path, root=root, npu_smi=smi, tools=["gcc-13"], pythons=["python3.10"],
                      toolchain=False)
    assert full.python_versions and full.tools  # the sysroot answers them
    assert bare.python_versions == {} and bare.tools == {}
    assert bare == replace(full, python_versions={}, tools={})


def test_env_selects_the_sysroot_and_npu_smi(tmp_path: Path) -> None:
    root = HOSTS / "a3-host"
    env = {"DSV4_HOST_ROOT": str(root), "DSV4_NPU_SMI": f"cat '{root / 'npu-smi-info.txt'}'",
           "PATH": "/usr/bin:/bin"}
    facts = probe_host(tmp_path, env=env, tools=["gcc-13", "g++-13"])
    assert facts.root == str(root)
    assert facts.cores == 320 and facts.numa_nodes == (0, 1, 2, 3)
    assert len(facts.npus) == 16 and facts.cann_version == "9.0.0"
    assert facts.tools["gcc-13"] == "13.2.0" and facts.tools["gcc"] == "10.3.1"
    assert facts.device_nodes["/dev/davinci15"]


def test_x86_sysroot_without_npu_or_cann(tmp_path: Path) -> None:
    facts = probe_host(tmp_path, root=HOSTS / "x86-no-npu", env={"PATH": "/usr/bin:/bin"})
    assert facts.arch == "x86_64"
    assert facts.npu_smi is None and facts.npus == ()  # no npu-smi inside the sysroot
    assert not any(facts.device_nodes.values())
    assert facts.cann_version is None and facts.cann_toolkit is None
    assert facts.tools["docker"] is None and facts.tools["git"] == "2.39.5"
    assert facts.libraries == {"hwloc": False, "numa": False}


def test_bad_state_sysroot_lacks_devmm_svm_and_hwloc(tmp_path: Path) -> None:
    facts = probe_host(tmp_path, root=HOSTS / "npu-bad-state", npu_smi=smi_of("npu-bad-state"))
    assert facts.device_nodes["/dev/devmm_svm"] is False
    assert facts.device_nodes["/dev/davinci_manager"] is True
    assert facts.libraries["hwloc"] is False


def test_npu_smi_failure_becomes_the_error_line(tmp_path: Path) -> None:
    failing = ["sh", "-c", "echo 'dcmi module initialize failed. ret is -8005' >&2; exit 255"]
    facts = probe_host(tmp_path, root=HOSTS / "kunpeng920-910b", npu_smi=failing)
    assert facts.npus == ()
    assert "exited 255" in facts.npu_smi and "dcmi module initialize failed" in facts.npu_smi
    missing = probe_host(tmp_path, root=HOSTS / "kunpeng920-910b",
                         npu_smi=[str(tmp_path / "no-such-npu-smi"), "info"])
    assert "not found" in missing.npu_smi
    garbage = probe_host(tmp_path, root=HOSTS / "kunpeng920-910b", npu_smi=["echo", "hello"])
    assert "listed no NPU" in garbage.npu_smi


def test_toolkit_home_env_is_looked_up_inside_the_sysroot(tmp_path: Path) -> None:
    root = tmp_path / "root"
    info = root / "opt/cann/9.0.0/aarch64-linux/ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text("package_name=Ascend-cann-toolkit\nversion=9.0.0\n")
    facts = probe_host(tmp_path, root=root, env={"ASCEND_TOOLKIT_HOME": "/opt/cann/9.0.0"})
    assert (facts.cann_version, facts.cann_toolkit) == ("9.0.0", "/opt/cann/9.0.0")


def test_disk_is_measured_where_the_workspace_will_be(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(HOSTS / "x86-no-npu", root)
    (root / "df.txt").unlink()  # no capture: measure this machine's filesystem
    facts = probe_host(tmp_path / "not" / "yet" / "there", root=root)
    assert facts.disk_free_bytes is not None
    assert abs(facts.disk_free_bytes - shutil.disk_usage(tmp_path).free) < 1 << 30


def test_this_machine(tmp_path: Path) -> None:
    facts = probe_host(tmp_path, env={"PATH": "/usr/local/bin:/usr/bin:/bin"})
    assert facts.root == "/"
    assert facts.arch == platform.machine()
    assert facts.cores >= 1 and (facts.mem_total_kib or 0) > 0
    assert facts.disk_free_bytes and facts.disk_free_bytes > 0
    assert json.loads(json.dumps(facts.as_dict()))["arch"] == facts.arch


@pytest.mark.parametrize("host", ["kunpeng920-910b", "a3-host", "x86-no-npu", "npu-bad-state"])
def test_facts_are_json(host: str, tmp_path: Path) -> None:
    smi = smi_of(host) if (HOSTS / host / "npu-smi-info.txt").exists() else None
    doc = probe_host(tmp_path, root=HOSTS / host, npu_smi=smi).as_dict()
    back = json.loads(json.dumps(doc))
    assert back["cpu_flags"] == sorted(back["cpu_flags"]) and back["cores"] > 0


def test_bad_environment_selections_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="DSV4_HOST_ROOT=.*not a directory"):
        probe_host(tmp_path, env={"DSV4_HOST_ROOT": str(tmp_path / "missing")})
    with pytest.raises(InputError, match="DSV4_NPU_SMI=.*shell-quoted"):
        probe_host(tmp_path, root=HOSTS / "x86-no-npu", env={"DSV4_NPU_SMI": "cat 'unclosed"})
