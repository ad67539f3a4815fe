"""`dsv4-offload tune` against the stand-in server's performance model (standin_server.py's
docstring states it), on the 8-NUMA Kunpeng fixture host, as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli, run_cli_inproc
from serve_helpers import leftovers
from standin_server import model_rate
from test_ceilings import write_caches
from test_serve_cli import host_env, standin_on_host

from dsv4_offload.workspace.store import Workspace

# the model's fast probe: two small buckets, median of 3 runs of 16 tokens each
PROBE = ["tune.buckets=[16, 64]", "tune.repeats=3", "tune.new_tokens=16"]


def _tune_words(tmp_path: Path, tag: str, *standin: str, sets: tuple[str, ...] = ()
                ) -> tuple[Path, list[str], dict[str, str]]:
    ws, _port, base, _env = standin_on_host(tmp_path, tag, "--perf-model", *standin)
    words = [*base, *[a for s in (*PROBE, *sets) for a in ("--set", s)]]
    return ws.root, words, host_env("kunpeng920-910b")


def _events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _started(events: list[dict]) -> list[dict]:
    return [e["setting"] for e in events if e["event"] == "trial.started"]


@pytest.mark.slow
def test_tune_finds_the_models_optimum_and_apply_makes_it_the_serve_default(
        tmp_path, no_leftovers):
    """The search finds the model's optimum within its budget; show, apply and the overlay's
    origin in `serve --print`. The fast tier's seam (the trial loop through the real serve
    and accept stages, the study, the events):
    tests/test_tune.py::test_tune_discards_a_setting_whose_answers_degenerate; the space and
    its rules:
    tests/test_tune.py::test_the_space_holds_the_recipes_own_setting_and_the_rules_prune."""
    root, words, env = _tune_words(
        tmp_path, no_leftovers, sets=("tune.experts=[16, 24, 32]", "tune.cpuinfer=[64, 96, 128]"))
    # 16 of the 36 settings: on the stand-in's figures the seeded search meets the optimum at
    # its 11th measured setting (docs/guide.md §3.11's capture); a loaded host's noise can
    # reorder near ties, and a budget at the edge made this test fail once in CI
    res = run_cli(*words, "--json", "tune", "--budget", "16", "--knob", "experts",
                  "--knob", "cpuinfer", "--knob", "hot_tail", env=env, timeout=600)
    assert res.code == 0, res
    events = _events(res.out)
    assert events[0]["event"] == "tune.started" and events[-1]["event"] == "tune.finished"
    started = _started(events)
    # the first trial is the recipe's own setting: 32 experts, 8 pools x 16 threads, no tail
    assert started[0] == {"experts": 32, "cpuinfer": 128, "hot_tail": 0}
    assert len(started) <= 16  # of the 36 settings of the space
    # the model's optimum over the searched space (8 pools on this host)
    space = [(e, t, h) for e in (16, 24, 32) for t in (64, 96, 128) for h in (0, 32, 64, 128)]
    optimum = max(space, key=lambda s: model_rate(s[0], 8, s[1], s[2]))
    assert optimum == (32, 96, 64) and optimum != (32, 128, 0)  # not the defaults
    best = events[-1]["best"]
    assert (best["setting"]["experts"], best["setting"]["cpuinfer"],
            best["setting"]["hot_tail"]) == optimum, events
    assert not leftovers(no_leftovers)  # no server left running after tune

    shown = run_cli(*words, "tune", "show", env=env)
    assert shown.code == 0, shown
    assert "tune trials" in shown.out and f"best: trial {best['trial']}" in shown.out
    png = root / "tune" / f"{events[0]['study']}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    applied = run_cli(*words, "tune", "apply", env=env)
    assert applied.code == 0, applied
    overlay = (root / "tune" / "overlay.yaml").read_text()
    assert "kt_cpuinfer: 96" in overlay and "KT_HOT_TAIL_TOKENS: '64'" in overlay
    printed = run_cli(*words, "serve", "--print", env=env)
    assert printed.code == 0, printed
    assert "--kt-cpuinfer 96  [tune overlay (" in printed.out
    assert "KT_HOT_TAIL_TOKENS=64  [tune overlay (" in printed.out


@pytest.mark.slow
def test_tune_never_starts_a_setting_the_hbm_rule_forbids(tmp_path, no_leftovers):
    """The HBM rule through a whole tune. The fast tier's seam, the same rule function
    on the same fixture host:
    tests/test_tune.py::test_the_space_holds_the_recipes_own_setting_and_the_rules_prune."""
    # 40 resident experts are above this recipe's measured ceiling of 32
    root, words, env = _tune_words(
        tmp_path, no_leftovers,
        sets=("serve.kt_num_gpu_experts_max=32", "tune.experts=[16, 24, 32, 40]",
              "tune.hot_tail_tokens=[0]"))
    res = run_cli(*words, "--json", "tune", "--budget", "3", "--knob", "experts",
                  env=env, timeout=600)
    assert res.code == 0, res
    events = _events(res.out)
    assert events[0]["allowed"] == 3
    assert all(s["experts"] != 40 for s in _started(events))
    pruned = [e for e in events if e["event"] == "trial.pruned"]
    assert all("above the measured ceiling of 32 resident experts" in e["reason"]
               for e in pruned)
    logs = " ".join(p.read_text() for p in (root / "logs" / "serve").glob("server-*.log"))
    assert "experts=40" not in logs and "experts=32" in logs
    assert events[-1]["stopped_by"] == "every allowed setting measured"


def test_tune_discards_a_setting_whose_answers_degenerate(tmp_path, no_leftovers):
    # the model's fastest hot-tail window garbles every answer
    root, words, env = _tune_words(tmp_path, no_leftovers, "--degenerate-hot-tail", "64",
                                   sets=("tune.hot_tail_tokens=[0, 64]",))
    # the bandwidth and kernel caches: each trial's accept places its decode between the
    # ceilings
    write_caches(Workspace(root), 50.0, 20.0)
    res = run_cli(*words, "--json", "tune", "--budget", "2", "--knob", "hot_tail",
                  env=env, timeout=600)
    assert res.code == 0, res
    events = _events(res.out)
    failed = [e for e in events if e["event"] == "trial.failed"]
    assert [e["setting"]["hot_tail"] for e in failed] == [64]
    assert failed[0]["reason"].startswith("accept: probe ") and "repeated" in failed[0]["reason"]
    best = events[-1]["best"]
    assert best["setting"]["hot_tail"] == 0
    # the best trial against its ceilings: accept's own figures for it, kept by the study
    ceilings = best["ceilings"]
    assert ceilings["share"] == 0.612 and ceilings["missing"] == []  # the stand-in's line
    assert ceilings["roofline_fraction"] == pytest.approx(
        ceilings["measured_tok_s"] / ceilings["roofline_tok_s"], rel=1e-2)
    shown = run_cli(*words, "tune", "show", env=env)
    assert shown.code == 0, shown
    assert (f"trial {best['trial']} at resident share 0.612: accept measured "
            f"{ceilings['measured_tok_s']} tok/s, {ceilings['roofline_fraction']:.0%} of the "
            f"memory roofline ({ceilings['roofline_tok_s']:g} tok/s)") in shown.out, shown.out
    assert ceilings["where"] in shown.out


@pytest.mark.slow
def test_a_killed_tune_resumes_without_repeating_a_recorded_trial(tmp_path, no_leftovers):
    """SIGKILL in the third trial, then resume. The fast tier's seam (the study read back
    from its SQLite file and a setting answered from its record):
    tests/test_tune.py::test_tune_discards_a_setting_whose_answers_degenerate; the kill
    itself runs in the long tier only."""
    root, words, env = _tune_words(
        tmp_path, no_leftovers, sets=("tune.experts=[16, 24, 32]", "tune.hot_tail_tokens=[0, 64]"))
    argv = [sys.executable, "-m", "dsv4_offload", *words, "--json", "tune", "--budget", "4",
            "--knob", "experts", "--knob", "hot_tail"]
    full_env = {**os.environ, **env}
    full_env.pop("DSV4_WORKSPACE", None)
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=full_env,
                             stdin=subprocess.DEVNULL)
    assert first.stdout is not None
    seen: list[dict] = []
    deadline = time.monotonic() + 300
    # killed while its third trial's server is up: two trials recorded, one running
    while time.monotonic() < deadline:
        line = first.stdout.readline()
        if not line:
            break
        seen.append(json.loads(line))
        if len(_started(seen)) == 3:
            time.sleep(0.5)
            break
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    recorded = [e["setting"] for e in seen if e["event"] in ("trial.done", "trial.failed")]
    assert len(recorded) == 2, seen
    running = _started(seen)[2]
    running_trial = [e["trial"] for e in seen if e["event"] == "trial.started"][2]
    again = run_cli(*words, "--json", "tune", "--budget", "4", "--knob", "experts",
                    "--knob", "hot_tail", env=env, timeout=600)
    assert again.code == 0, again
    events = _events(again.out)
    assert [e["trial"] for e in events if e["event"] == "trial.requeued"] == [running_trial]
    started = _started(events)
    # the interrupted trial's setting is measured again, whole; the recorded ones never
    assert started[0] == running
    assert not [s for s in started if s in recorded]
    assert len(started) == 2 and events[-1]["measured"] == 4
    assert not leftovers(no_leftovers)


def test_tune_refuses_an_unknown_knob_a_bad_budget_and_a_bad_overlay(tmp_path, no_leftovers):
    root, words, env = _tune_words(tmp_path, no_leftovers)
    # the commands in this process: their refusals and the overlay's reading, not a process
    knob = run_cli_inproc(*words, "tune", "--knob", "cores", env=env)
    assert knob.code == 2 and knob.err.strip() == (
        "error: --knob cores: not a knob of tune; use one of experts, mem_fraction, "
        "threadpools, cpuinfer, hot_tail")
    budget = run_cli_inproc(*words, "tune", "--budget", "ten", env=env)
    assert budget.code == 2
    assert "give a number of trials (20) or a time (90s, 30m, 2h)" in budget.err
    shown = run_cli_inproc(*words, "tune", "show", env=env)
    assert shown.code == 2
    assert "no tune study in this workspace; run `dsv4-offload tune`" in shown.err
    overlay = root / "tune" / "overlay.yaml"
    overlay.parent.mkdir(parents=True)
    overlay.write_text("serve:\n  kt_cpuinfer: 96\nacceptance:\n  api: openai\n")
    printed = run_cli_inproc(*words, "serve", "--print", env=env)
    assert printed.code == 2 and "Traceback" not in printed.err
    assert f"{overlay}:3: acceptance: a tune overlay sets only `serve:`" in printed.err
    overlay.write_text("serve:\n  kt_cpuinfer: 96\n")
    printed = run_cli_inproc(*words, "serve", "--print", env=env)
    assert printed.code == 0 and f"--kt-cpuinfer 96  [tune overlay ({overlay})]" in printed.out
    cleared = run_cli_inproc(*words, "tune", "apply", "--clear", env=env)
    assert cleared.code == 0 and not overlay.exists()
    printed = run_cli_inproc(*words, "serve", "--print", env=env)
    assert "--kt-cpuinfer 128  [host (8 pool(s), 192 cores)]" in printed.out


@pytest.mark.slow
def test_tune_discards_a_setting_whose_swa_pool_cannot_take_the_longest_bucket(
        tmp_path, no_leftovers):
    """The SWA pool's bucket through a whole tune. The fast tier's seams (a trial failed by
    its acceptance and discarded; acceptance naming a prompt the SWA pool cannot admit):
    tests/test_tune.py::test_tune_discards_a_setting_whose_answers_degenerate
    tests/test_accept_stage.py::test_a_long_prompt_with_no_token_names_which_of_the_two_causes
    """
    # 40 resident experts leave the SWA pool 4096 - 8 x 510 = 16 tokens: the 64-token bucket
    # would never be admitted
    _root, words, env = _tune_words(
        tmp_path, no_leftovers, "--swa-size", "4096", "--swa-per-expert", "510",
        sets=("tune.experts=[32, 40]", "tune.hot_tail_tokens=[0]"))
    res = run_cli(*words, "--json", "tune", "--budget", "5m", "--knob", "experts", env=env,
                  timeout=600)
    assert res.code == 0, res
    events = _events(res.out)
    failed = [e for e in events if e["event"] == "trial.failed"]
    assert [e["setting"]["experts"] for e in failed] == [40]
    assert "exceeds the SWA KV pool (16 tokens" in failed[0]["reason"]
    assert events[-1]["best"]["setting"]["experts"] == 32
    assert events[-1]["stopped_by"] == "every allowed setting measured"


@pytest.mark.slow
def test_tune_never_starts_a_pool_count_the_hosts_dram_cannot_hold(tmp_path, no_leftovers):
    """The DRAM rule through a whole tune. The fast tier's seam, the same rule function on
    the same fixture host:
    tests/test_tune.py::test_the_space_holds_the_recipes_own_setting_and_the_rules_prune."""
    # 1356 GiB available: one pool needs the GGUF set once plus the margin, several twice
    _root, words, env = _tune_words(tmp_path, no_leftovers,
                                    sets=("host.memory_margin_gib=1100",))
    res = run_cli(*words, "--json", "tune", "--budget", "3", "--knob", "threadpools",
                  env=env, timeout=600)
    assert res.code == 0, res
    events = _events(res.out)
    assert events[0]["knobs"] == {"threadpools": [1, 2, 4, 8]} and events[0]["allowed"] == 1
    pruned = [e for e in events if e["event"] == "trial.pruned"]
    # the recipe's own setting, 8 pools (one per NUMA node), is the first proposal: refused
    assert pruned[0]["setting"] == {"threadpools": 8}
    assert all(e["reason"].startswith(f"threadpools {e['setting']['threadpools']}: DRAM: ")
               and "the plan needs GGUF set" in e["reason"] for e in pruned)
    assert _started(events) == [{"threadpools": 1}]
    assert events[-1]["stopped_by"] == "every allowed setting measured"


def test_the_space_holds_the_recipes_own_setting_and_the_rules_prune() -> None:
    """The knobs hold the recipe's current values, and the serve rules forbid what the
    long tier's whole tunes never start: experts above the measured HBM ceiling, pools the
    DRAM cannot hold; the reason is the rule's own words."""
    from dsv4_offload.core.host import probe_host
    from dsv4_offload.pipeline import tunespace
    from dsv4_offload.recipe import load_recipe_and_series

    root = Path(__file__).parent / "fixtures" / "hosts" / "kunpeng920-910b"
    facts = probe_host(Path("/nonexistent-ws"), root=root,
                       npu_smi=["cat", str(root / "npu-smi-info.txt")])
    recipe, _ = load_recipe_and_series("dsv4-flash-910b", [
        "serve.kt_num_gpu_experts_max=32", "tune.experts=[16, 24, 40]"])
    space = {k.name: k for k in tunespace.knobs(recipe, facts)}
    assert space["experts"].choices == (16, 24, 32, 40)  # the recipe's 32 among them
    assert space["threadpools"].current == 8  # one pool per NUMA node of the fixture
    assert tunespace.forbidden(recipe, facts, {"experts": 24}) is None
    said = tunespace.forbidden(recipe, facts, {"experts": 40})
    assert said is not None and said.startswith("experts 40: ")
    assert "above the measured ceiling of 32 resident experts" in said
    tight, _ = load_recipe_and_series("dsv4-flash-910b", ["host.memory_margin_gib=1100"])
    pools = tunespace.forbidden(tight, facts, {"threadpools": 8})
    assert pools is not None and pools.startswith("threadpools 8: DRAM: ")
    assert "the plan needs GGUF set" in pools
    assert tunespace.forbidden(tight, facts, {"threadpools": 1}) is None
