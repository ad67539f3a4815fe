"""patch audit: the recipe's log markers searched in checkouts the tests make (real git repos)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_build import KT_BUILD  # prints the patched kt-kernel's configure lines, real formats

from dsv4_offload.recipe import load_recipe_and_series
from dsv4_offload.sources import audit
from dsv4_offload.workspace.store import Workspace

KT = "src/ktransformers"
DELIVERY_DIR = "integration/sglang/dsv4-flash-single-npu-moe-offload"


def commit_repo(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "tree"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """ktransformers (with the stand-in setup.py), llama.cpp, pybind11 and the delivery;
    sglang and custom_flashinfer are not laid out."""
    root = tmp_path / "ws"
    commit_repo(root / KT / "third_party/llama.cpp", {"ggml.h": "    GGML_TYPE_MXFP4 = 39,\n"})
    commit_repo(root / KT / "third_party/pybind11", {"CMakeLists.txt": "project(pybind11)\n"})
    commit_repo(root / KT, {"kt-kernel/fake_setup.py": KT_BUILD,
                            # an archived copy, as ktransformers has one: cited after kt-kernel/
                            "archive/csrc/setup.py": KT_BUILD,
                            ".gitignore": "third_party/llama.cpp/\nthird_party/pybind11/\n"})
    commit_repo(root / "src/cann-recipes-infer", {
        f"{DELIVERY_DIR}/README.md": "Look for 'SWAC4C128KVPool mem usage: 3.41 GB' in the log.\n",
        f"{DELIVERY_DIR}/sglang/0003-x.patch": "+    logger.info('Capture npu graph end')\n",
        f"{DELIVERY_DIR}/scripts/tools/check.sh": 'echo "NPU OUT OF MEMORY: lower experts"\n',
    })
    return root


def run_audit(root: Path, *overrides: str, recipe: str = "dsv4-flash-910b") -> audit.AuditReport:
    r, s = load_recipe_and_series(recipe, list(overrides))
    return audit.audit(r, s, audit.workspace_dirs(r, Workspace(root)))


def by_marker(report: audit.AuditReport, variant: str) -> audit.MarkerAudit:
    (item,) = [i for i in report.items if i.variant == variant]
    return item


def test_literal_runs_split_on_metacharacters_and_groups() -> None:
    (only,) = audit.variants(r"-- Forward (CPUINFER_ARM_SVE) -> -D(LLAMA_ARM_SVE)=(OFF)$")
    assert only[1] == ["-- Forward ", "CPUINFER_ARM_SVE", " -> -D", "LLAMA_ARM_SVE", "=", "OFF"]
    assert audit.searchable(only[1]) == ["-- Forward ", "CPUINFER_ARM_SVE", " -> -D",
                                         "LLAMA_ARM_SVE"]
    assert audit.variants(r"Ascend NPU \(CANN\) backend selected")[0][1] == [
        "Ascend NPU (CANN) backend selected"]  # escapes are the character itself
    assert audit.variants("Capture .*graph end")[0][1] == ["Capture ", "graph end"]
    assert [v for v, _ in audit.variants("NPU out of memory|EL0004|x(a|b)")] == [
        "NPU out of memory", "EL0004", "x(a|b)"]
    assert audit.variants("NPU out of memory|NPU out of HBM")[1] == (
        "NPU out of HBM", ["NPU out of HBM"])  # not the shared prefix alone
    assert audit.searchable(audit.variants(r"\d+\s+(ok)?")[0][1]) == []


@pytest.mark.parametrize("recipe", ["dsv4-flash-910b", "dsv4-flash-a3"])
def test_every_kt_kernel_marker_of_the_bundled_recipes_is_found(ws: Path, recipe: str) -> None:
    report = run_audit(ws, recipe=recipe)
    build_items = [i for i in report.items if i.owner.startswith("build.steps[kt-kernel]")]
    assert len(build_items) == 8
    for item in build_items:
        assert item.verdict == audit.FOUND, item
        assert item.where.startswith("ktransformers/kt-kernel/fake_setup.py:"), item
    arm = by_marker(report, r"ARM target: -march=(armv8\.2-a)(\+fp16)(\+dotprod)$")
    assert arm.runs == ["ARM target: -march=", "armv8.2-a", "+fp16", "+dotprod"]
    assert report.ok  # nothing required is missing; sglang's are unchecked


def test_a_required_marker_no_file_prints_is_an_error(ws: Path) -> None:
    report = run_audit(ws, "build.steps.0.expect_markers.6=Found Ascend CL library")
    item = by_marker(report, "Found Ascend CL library")
    assert (item.verdict, item.severity) == (audit.MISSING, "error")
    assert item.detail == ("no file of ktransformers, llama.cpp, pybind11 contains "
                           "'Found Ascend CL library'")
    assert not report.ok and report.status == "failed"
    assert report.errors() == [item]
    assert "patch apply" in audit.refusal_fix(item)


def test_parts_of_a_marker_in_different_files_do_not_count(ws: Path) -> None:
    report = run_audit(ws, "build.steps.0.expect_markers=['(ARM target: )(GGML_TYPE_MXFP4)']")
    (item,) = [i for i in report.items if i.kind == "expect"]
    assert item.verdict == audit.MISSING
    assert "different files" in item.detail and "llama.cpp/ggml.h" in item.detail


def test_an_absent_tree_leaves_markers_unchecked_never_passed(ws: Path) -> None:
    report = run_audit(ws)
    kv = by_marker(report, "SWAC4C128KVPool mem usage:")  # only in a README: prose isn't searched
    capture = by_marker(report, "Capture npu graph end")  # only in a patch file: not searched
    for item in (kv, capture):
        assert item.verdict == audit.UNCHECKED and item.severity == "warning"
        assert "absent: sglang, custom_flashinfer" in item.detail
    assert report.sources["sglang"] == "absent: " + (
        f"{ws / KT / 'third_party/sglang'} is not a git checkout (run `dsv4-offload fetch`)")
    # sglang laid out: what it prints is found, what nothing prints is an error
    commit_repo(ws / KT / "third_party/sglang",
                {"python/sglang/srt/pool.py":
                 'logger.info(f"SWAC4C128KVPool mem usage: {gb:.2f} GB")\n'})
    commit_repo(ws / KT / "third_party/custom_flashinfer", {"setup.py": "pass\n"})
    report = run_audit(ws)
    kv = by_marker(report, "SWAC4C128KVPool mem usage:")
    assert kv.where == "sglang/python/sglang/srt/pool.py:1"
    capture = by_marker(report, "Capture npu graph end")
    assert (capture.verdict, capture.severity) == (audit.MISSING, "error")


def test_fatal_patterns_case_folded_and_unprintable_ones_warn(ws: Path) -> None:
    commit_repo(ws / KT / "third_party/sglang", {"a.py": "pass\n"})
    commit_repo(ws / KT / "third_party/custom_flashinfer", {"b.py": "pass\n"})
    report = run_audit(ws)
    oom = by_marker(report, "NPU out of memory")  # the pattern is compiled with re.I
    assert oom.verdict == audit.FOUND
    assert oom.where == ("cann-recipes-infer/integration/sglang/dsv4-flash-single-npu-moe-"
                         "offload/scripts/tools/check.sh:1")
    el = by_marker(report, "EL0004")
    assert (el.verdict, el.severity) == (audit.MISSING, "warning")
    assert not report.ok  # the acceptance markers are missing here, not the fatal ones
    assert {i.kind for i in report.errors()} == {"required"}


def test_markers_the_command_prints_are_not_searched(ws: Path) -> None:
    report = run_audit(ws, "build.steps.2.expect_markers=['Successfully installed']",
                       "build.steps.2.log_sources=[]")
    item = by_marker(report, "Successfully installed")
    assert item.verdict == audit.UNCHECKED and "the command itself" in item.detail


def test_patch_audit_command_json_and_exit_codes(ws: Path) -> None:
    from conftest import run_cli_inproc as run_cli  # the answer is the point

    ok = run_cli("--workspace", str(ws), "--json", "patch", "audit")
    assert ok.code == 0, ok
    doc = ok.json()
    assert doc["command"] == "patch audit" and doc["status"] == "warn"  # unchecked ones
    verdicts = {m["marker"]: m["verdict"] for m in doc["data"]["markers"]}
    assert verdicts[r"Ascend NPU \(CANN\) backend selected"] == "found"
    assert verdicts["SWAC4C128KVPool mem usage:"] == "unchecked"
    bad = run_cli("--workspace", str(ws), "--set",
                  "build.steps.0.expect_markers.6=Found Ascend CL library", "patch", "audit")
    assert bad.code == 1
    assert ("error: build.steps[kt-kernel].expect_markers: 'Found Ascend CL library': no file "
            "of ktransformers, llama.cpp, pybind11 contains") in bad.out


def test_cmake_status_prefix_need_not_stand_in_the_source(tmp_path: Path) -> None:
    # kt-kernel/CMakeLists.txt:239 `message(STATUS "x86 detected")` prints '-- x86 detected'
    assert audit.source_forms("-- x86 detected") == ["-- x86 detected", "x86 detected"]
    assert audit.source_forms("-- ON") == ["-- ON"]  # too short once the prefix is gone
    root = tmp_path / "ws"
    commit_repo(root / KT, {"kt-kernel/CMakeLists.txt": 'message(STATUS "x86 detected")\n'})
    report = run_audit(root, "build.steps.0.expect_markers=['^-- x86 detected$']",
                       "build.steps.0.forbid_markers=[]",
                       "build.steps.0.log_sources=[ktransformers]")
    (item,) = [i for i in report.items if i.kind == "expect"]
    assert (item.verdict, item.where) == (audit.FOUND, "ktransformers/kt-kernel/CMakeLists.txt:1")


def test_a_tree_git_cannot_search_is_unchecked_not_passed(ws: Path) -> None:
    (ws / KT / ".git" / "index").write_bytes(b"not an index")
    report = run_audit(ws)
    assert report.sources["ktransformers"].startswith("absent: git grep failed: ")
    item = by_marker(report, r"Ascend NPU \(CANN\) backend selected")
    assert item.verdict == audit.UNCHECKED and "absent: ktransformers" in item.detail


def test_our_resident_write_lines_are_found_in_the_patched_sglang_only_when_applied(
        ws: Path, tmp_path: Path) -> None:
    from test_patch_zero_context import (
        RESIDENT_FIX,
        STREAM_FILE,
        resident_fix,
        stand_in_stream_file,
    )

    from dsv4_offload.recipe import Source
    from dsv4_offload.sources import series as series_mod

    sglang = ws / KT / "third_party/sglang"
    commit_repo(sglang, {STREAM_FILE: stand_in_stream_file()})
    head = subprocess.run(["git", "-C", str(sglang), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    entry, data = resident_fix()
    outcome = series_mod.apply_target(
        sglang, Source(name="sglang", url="file:///nowhere", commit=head, path="sglang"),
        [series_mod.LoadedPatch(entry, data, f"{RESIDENT_FIX}.patch")], tmp_path / "log")
    assert outcome.status == "applied", outcome
    report = run_audit(ws)
    ours = [i for i in report.items if "resident write" in i.marker]
    assert sorted(i.kind for i in ours) == ["forbidden", "required"]
    for item in ours:
        assert item.verdict == audit.FOUND, item
        assert item.where.startswith(f"sglang/{STREAM_FILE}:"), item
    # a recipe that serves the delivery's series unmodified expects neither line
    skipped = run_audit(ws, f"series_skip=[{RESIDENT_FIX}]")
    assert not [i for i in skipped.items if "resident write" in i.marker]
