"""The pure acceptance checks: degeneration detector, determinism, log markers, probes file."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4_offload.errors import InputError
from dsv4_offload.probes import (
    Bucket,
    Reply,
    check_determinism,
    check_log_markers,
    check_probe,
    check_throughput,
    degeneration,
    filler_prompt,
    write_chart,
)
from dsv4_offload.recipe import Degeneration, Probe, load_recipe
from dsv4_offload.stages.accept import load_probes

CFG = Degeneration()


@pytest.mark.parametrize("text", [
    "北京。北京是中华人民共和国的首都，也是全国的政治和文化中心。",
    " Paris. Paris is the capital and the largest city of France.",
    "The capital of France is Paris.",
    "Numbers like 1000000 and 2024-01-01 are fine, and so is a short ... ellipsis.",
])
def test_coherent_texts_pass(text):
    assert degeneration(text, CFG) == []


@pytest.mark.parametrize(("text", "finding"), [
    ("", "empty text with HTTP 200"),
    ("   \n", "empty text with HTTP 200"),
    ("Paris!!!!!!!!!!!!!!!!!!!!!!!!!!!", "one character repeated"),
    ("the the the the the the the the", "one token repeated 8 times"),
    ("北京北京北京北京北京北京北京北京北京北京", "4-gram"),
    ("it is a city it is a city it is a city it is a city it is a city", "4-gram"),
    ("value nan nan", "'nan' in the output"),
    ("Par\ufffd\ufffdis", "U+FFFD"),
])
def test_degenerate_texts_are_named(text, finding):
    assert any(finding in f for f in degeneration(text, CFG)), degeneration(text, CFG)


def test_thresholds_come_from_the_recipe():
    loose = Degeneration(max_char_run=40, max_token_run=10, max_ngram_repeats=9, ngram=4)
    text = "Paris is very" + " very" * 7 + " big"
    assert degeneration(text, CFG) and degeneration(text, loose) == []


def test_probe_verdicts():
    probe = Probe(name="fr", prompt="The capital of France is", expect_any=["Paris"])
    assert check_probe(probe, Reply(" Paris.", 200, 0.1), CFG).ok
    wrong = check_probe(probe, Reply(" zorp quib flandle", 200, 0.1), CFG)
    assert not wrong.ok and "does not mention Paris" in wrong.detail
    empty = check_probe(probe, Reply("", 200, 0.1), CFG)
    assert not empty.ok and "weight path" in empty.detail
    http = check_probe(probe, Reply("HTTP 500: boom", 500, 0.1), CFG)
    assert not http.ok and http.detail.startswith("HTTP 500")


def test_determinism_and_log_markers():
    assert check_determinism("fr", "a", "a").ok
    assert not check_determinism("fr", "a", "b").ok
    acc = load_recipe().acceptance
    good = "KV Cache is allocated. #tokens: 1\nCapture npu graph end. Time elapsed: 1 s\n"
    assert all(c.ok for c in check_log_markers(good, acc.log_markers_required,
                                               acc.log_markers_forbidden, "log"))
    bad = "KV Cache is allocated. #tokens: 1\n[KT_STREAM] streaming failed -> hybrid fallback\n"
    checks = check_log_markers(bad, acc.log_markers_required, acc.log_markers_forbidden, "log")
    failed = [c.name for c in checks if c.ok is False]
    assert failed == ["log has 'Capture .*graph end'", "log without 'streaming failed'",
                      "log without 'hybrid fallback'"]
    assert "5x slower" in checks[1].fix
    assert check_log_markers(None, ["x"], [], "log")[0].ok is None


def test_throughput_verdict_and_chart(tmp_path: Path):
    cfg = load_recipe().acceptance.throughput
    fast = [Bucket(128, 15.2, 0.4, []), Bucket(1024, 14.0, 1.9, [])]
    assert check_throughput(fast, cfg).ok
    slow = check_throughput([Bucket(128, 4.1, 0.4, [])], cfg)
    assert not slow.ok and "below the reference 13" in slow.detail
    assert not check_throughput([Bucket(128, None, None, [])], cfg).ok
    png = write_chart(fast, tmp_path / "chart.png", 13, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_filler_prompt_grows_with_the_bucket():
    assert len(filler_prompt(1024).split()) > 4 * len(filler_prompt(128).split()) // 2


def test_probes_file_is_validated(tmp_path: Path):
    acc = load_recipe().acceptance
    good = tmp_path / "p.yaml"
    good.write_text("- {name: fr, prompt: 'What is the capital of France?', expect_any: [Paris],"
                    " chat: true}\n")
    probes, det = load_probes(good, acc)
    assert probes[0].chat and det == "fr"
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {name: fr, prompt: x}\n")
    with pytest.raises(InputError, match=r"bad.yaml: probes\[0\].expect_any"):
        load_probes(bad, acc)
    with pytest.raises(InputError, match="not found"):
        load_probes(tmp_path / "missing.yaml", acc)
