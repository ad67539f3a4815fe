"""The pure acceptance checks: degeneration detector, determinism, log markers, probes file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsv4_offload.acceptance.probes import (
    Reply,
    check_determinism,
    check_log_markers,
    check_probe,
    degeneration,
    find_loops,
    markers_that_apply,
    sentence_cycle,
)
from dsv4_offload.acceptance.throughput import (
    CYCLE,
    Bucket,
    Calibration,
    Plan,
    check_throughput,
    natural_prompt,
    write_chart,
)
from dsv4_offload.core.errors import InputError
from dsv4_offload.recipe import Degeneration, LogMarker, Probe, load_recipe
from dsv4_offload.stages.accept import load_probes

CFG = Degeneration()
PEER = json.loads((Path(__file__).parent / "fixtures" / "peer-greedy-outputs.json")
                  .read_text(encoding="utf-8"))


@pytest.mark.parametrize("text", [
    "北京。北京是中华人民共和国的首都，也是全国的政治和文化中心。",
    " Paris. Paris is the capital and the largest city of France.",
    "The capital of France is Paris.",
    "Numbers like 1000000 and 2024-01-01 are fine, and so is a short ... ellipsis.",
    "北京 (Beijing) 是中国的首都。",  # two writing systems are ordinary in a Chinese answer
    "俄罗斯的首都是莫斯科 (Moscow, Москва)。",  # three, when it quotes a name
    "def f(x):\n    return {x: [i * 2 for i in range(x)]}  # code is full of symbols",
])
def test_coherent_texts_pass(text):
    assert degeneration(text, CFG) == []


@pytest.mark.parametrize("name", sorted(PEER["good"]))
def test_real_greedy_answers_of_the_small_model_pass(name):
    """SmolLM2-135M's own greedy answers (captured, see the fixture's _how): wrong facts
    sometimes, but never degenerate in the guide's sense."""
    text = PEER["good"][name]
    assert degeneration(text, CFG) == [], (name, text)


@pytest.mark.parametrize("name", ["paris-chat-long", "story-chat-long"])
def test_a_real_answer_cycling_through_a_sentence_passes_with_a_note(name):
    text = PEER["good"][name]
    note = sentence_cycle(text, CFG)
    assert note and "-token sentence" in note, text
    period = int(note.split("through a ")[1].split("-token")[0])
    assert period >= CFG.min_sentence_period
    probe = Probe(name="p", prompt="Paris is", expect_any=["Paris" if "paris" in name else "E"])
    check = check_probe(probe, Reply(text, 200, 1.0), CFG)
    assert check.ok and "note: cycles through" in check.observed and check.data["note"] == note


def test_the_real_scrambled_model_answers_empty_and_fails():
    for name, text in PEER["scrambled"].items():
        assert degeneration(text, CFG) == [
            "empty text with HTTP 200 (usually a weight path that resolved to nothing)"], name


@pytest.mark.parametrize(("text", "finding"), [
    ("", "empty text with HTTP 200"),
    ("   \n", "empty text with HTTP 200"),
    ("Paris!!!!!!!!!!!!!!!!!!!!!!!!!!!", "one character repeated"),
    ("the the the the the the the the", "one token repeated 8 times"),
    ("Paris is" + " very" * 9 + " big.", "one token repeated 9 times"),
    ("北京北京北京北京北京北京北京北京北京北京", "a 2-token loop repeated 10.0 times"),
    ("The answer is yes, yes, yes, yes, yes, yes, yes.", "a 2-token loop"),
    ("it is a city it is a city it is a city it is a city it is a city", "a 4-token loop"),
    ("Paris. I am a bot. I am a bot. I am a bot. I am a bot. I am a bot.", "a 5-token loop"),
    ("value nan nan", "'nan' in the output"),
    ("Par\ufffd\ufffdis", "U+FFFD"),
    (" ilesatur Добро ⸮ظبط 기억 ŧrans ▒▒ Ψηφ ктив ‡ 역사 ملك ∰ tionsен ◊ δεί",
     "garbled text: 5 writing systems mixed"),
    ("Paris ▒▒▒ ⌘⌘ ☃ ▒ ⍟⍟ ⌬ ▒ ☍ ⍜ ▒▒ ⌘ ⍟ ☃☃ ▒ ⌬⌬ ☍ ▒", "unusual symbols"),
])
def test_degenerate_texts_are_named(text, finding):
    assert any(finding in f for f in degeneration(text, CFG)), degeneration(text, CFG)


@pytest.mark.parametrize(("text", "period"), [
    # hand-made: a 9-token sentence cycling passes (greedy decoding does this)
    (" Paris is the capital city of France." * 5, 8),
    ("北京是中国的首都。" * 4, 9),
])
def test_hand_made_sentence_cycles_pass_with_a_note(text, period):
    assert degeneration(text, CFG) == []
    note = sentence_cycle(text, CFG)
    assert note and f"a {period}-token sentence" in note


def test_loops_are_found_with_their_period():
    loops = {lp.period: lp for lp in find_loops(list("abcabcabcx"))}
    assert loops[3].repeats == 3 and loops[3].unit == ["a", "b", "c"]
    assert 6 not in loops  # the same loop, judged at its smallest period
    assert find_loops(["one", "two", "three", "four"]) == []


def test_thresholds_come_from_the_recipe():
    loose = Degeneration(max_char_run=40, max_token_run=10, max_loop_repeats=9)
    text = "Paris is very" + " very" * 7 + " big"
    assert degeneration(text, CFG) and degeneration(text, loose) == []


def test_probe_verdicts():
    probe = Probe(name="fr", prompt="The capital of France is", expect_any=["Paris"])
    assert check_probe(probe, Reply(" Paris.", 200, 0.1), CFG).ok
    wrong = check_probe(probe, Reply(" zorp quib flandle", 200, 0.1), CFG)
    assert not wrong.ok and "does not mention Paris" in wrong.observed
    empty = check_probe(probe, Reply("", 200, 0.1), CFG)
    assert not empty.ok and "weight path" in empty.observed
    http = check_probe(probe, Reply("HTTP 500: boom", 500, 0.1), CFG)
    assert not http.ok and http.observed.startswith("HTTP 500")


def _run(rates: list[float]) -> list[dict]:
    return [{"tok_s": r, "ttft_s": 0.5} for r in rates]


# the lines as the delivery's guide quotes them for this server (G639, G642, G643, with its
# ellipses), the depool slot as sglang/0003's print formats it (patch lines 711-714: Python
# tuples), and 0003's warm-up message (patch line 1104)
GOOD_LOG = (
    "Load weight end … mem usage=48.32 GB\n"
    "[KT_STREAM][depool] reserved ND streaming slot (256, 4096, 4096)+(256, 2048, 4096) "
    "(6.44GB) at model-load time\n"
    "SWAC4C128KVPool mem usage: 3.41 GB\n"
    "Capture npu graph end … mem usage=0.27 GB\n"
    "[KT_STREAM] warmup prefill 1/1 -> hybrid (prime CPU MoE)\n"
)
FALLBACK = ("[KT_STREAM] streaming failed (RuntimeError('NPU out of memory. Tried to allocate "
            "1.00 GiB')) -> hybrid fallback\n")
DEDUP = "[KT_STREAM][dedup] KT_MXFP4_GGUF_DEDUP=1 but KT_GGUF_TEMPLATE empty\n"


def _markers(env: dict[str, str] | None = None):
    acc = load_recipe().acceptance
    env = env if env is not None else dict(load_recipe().serve.env)
    return (markers_that_apply(acc.log_markers_required, env),
            markers_that_apply(acc.log_markers_forbidden, env))


def test_determinism():
    assert check_determinism("fr", "a", "a").ok
    assert not check_determinism("fr", "a", "b").ok


def test_the_recipe_markers_pass_the_guides_log_and_catch_the_patches_messages():
    required, forbidden = _markers()
    assert [m.name for m in required] == ["weights loaded", "depool slot reserved",
                                          "KV pool sized", "NPU graph captured"]
    assert all(c.ok for c in check_log_markers(GOOD_LOG, required, forbidden, "log"))
    # the launcher's deliberate warm-up pass through the hybrid path is not a fallback
    bad = GOOD_LOG + FALLBACK + FALLBACK + DEDUP
    failed = {c.name: c for c in check_log_markers(bad, required, forbidden, "log")
              if c.ok is False}
    assert sorted(failed) == ["log without 'GGUF dedup without a template'",
                              "log without 'streaming prefill fell back'"]
    fallback = failed["log without 'streaming prefill fell back'"]
    assert fallback.observed.startswith("2x, first: \"[KT_STREAM] streaming failed")
    assert "MEM_FRACTION 0.81" in fallback.fix


def test_sglangs_generic_kv_line_does_not_stand_in_for_the_dsv4_pool():
    required, forbidden = _markers()
    log = GOOD_LOG.replace("SWAC4C128KVPool mem usage: 3.41 GB",
                           "KV Cache is allocated. #tokens: 131072, KV size: 3.41 GB")
    failed = [c for c in check_log_markers(log, required, forbidden, "x.log") if c.ok is False]
    assert [c.name for c in failed] == ["log has 'KV pool sized'"]
    assert failed[0].observed == "missing from x.log"


def test_the_depool_slot_is_required_only_with_depool_on():
    env = dict(load_recipe().serve.env, KT_MXFP4_DEPOOL="0")
    required, forbidden = _markers(env)
    assert "depool slot reserved" not in [m.name for m in required]
    no_slot = "\n".join(line for line in GOOD_LOG.splitlines() if "depool" not in line)
    assert all(c.ok for c in check_log_markers(no_slot, required, forbidden, "log"))
    required, forbidden = _markers()
    failed = [c.name for c in check_log_markers(no_slot, required, forbidden, "log")
              if c.ok is False]
    assert failed == ["log has 'depool slot reserved'"]
    assert check_log_markers(None, required, [], "log")[0].ok is None


def test_a_marker_is_a_string_or_a_mapping_and_must_compile():
    assert LogMarker.model_validate("Capture npu graph end").pattern == "Capture npu graph end"
    with pytest.raises(ValueError, match="not a regular expression"):
        LogMarker.model_validate("[KT_STREAM")


def test_throughput_statistics_are_the_delivery_scripts():
    bucket = Bucket(1000, 998, _run([20.0, 22.0, 19.0, 21.0]))
    # decode_throughput_test.sh L246: mean, sorted[n // 2], min, max
    assert bucket.stats() == {"mean": 20.5, "median": 21.0, "min": 19.0, "max": 22.0,
                              "prefill_s": 0.5}


def test_throughput_verdict_and_chart(tmp_path: Path):
    # the A3 recipe: the guide's own table per bucket, fail below 0.93x, warn below 1.0x
    cfg = load_recipe("dsv4-flash-a3").acceptance.throughput
    fast = [Bucket(130, 120, _run([22.2, 21.9, 21.7])), Bucket(1000, 990, _run([23.0] * 3))]
    assert check_throughput(fast, cfg).ok and check_throughput(fast, cfg).status == "pass"
    slow = check_throughput(fast + [Bucket(8000, 7900, _run([17.9, 17.1, 18.5]))], cfg)
    assert not slow.ok and slow.gate
    assert slow.observed.startswith("bucket 8000: median 17.9 tok/s, below the reference 19.8 "
                                    "x 0.93 = 18.4")
    assert "§8.1 @ 1a7fbd34" in slow.required and "0.93 x" in slow.required
    assert not check_throughput(fast[:1] + [Bucket(8000, 7900, _run([4.0]))], cfg,
                                gate=False).gate
    skipped = check_throughput([Bucket(16000, None, [], skipped="longer than the chunk")], cfg)
    assert not skipped.ok and "nothing measured: longer than the chunk" in skipped.observed
    png = write_chart(fast, tmp_path / "chart.png", 13, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_median_within_the_delivery_spread_warns_and_a_report_only_reference_never_fails():
    cfg = load_recipe("dsv4-flash-a3").acceptance.throughput
    # 19.0 at 32000: 0.99x the guide's 19.2, inside its own 0.93 spread: a pass with a warning
    near = check_throughput([Bucket(32000, 31500, _run([19.0, 18.9, 19.1]))], cfg)
    assert near.ok and near.status == "warn"
    assert "within the tolerance but below the reference 19.2" in near.fix
    assert near.data["reference_by_bucket"] == {32000: 19.2}
    # the 910B figure is from an older README than the pin: shown, never a failure
    b910 = load_recipe("dsv4-flash-910b").acceptance.throughput
    assert b910.report_only and "e00ab79" in b910.reference_source
    low = check_throughput([Bucket(1000, 990, _run([9.0] * 3))], b910)
    assert low.ok is False and not low.gate and low.status == "warn"
    assert "report only" in low.required


def test_buckets_longer_than_the_chunk_or_the_context_are_skipped_with_how_to_measure():
    plan = Plan(new_tokens=1000, repeats=3, warmup=1, chunk=8192, chunk_source="/get_server_info",
                context_length=65536)
    assert plan.skip_reason(8000) == ""
    why = plan.skip_reason(16000)
    assert "chunked prefill 8192 (/get_server_info)" in why
    assert "CHUNKED_PREFILL_SIZE=32768" in why and "--longest-prompt 16000" in why
    small = Plan(new_tokens=1000, repeats=3, warmup=1, chunk=65536, chunk_source="x",
                 context_length=32768)
    assert "exceed the context length 32768" in small.skip_reason(32000)


def test_calibrated_prompts_stay_at_or_below_the_target():
    # a server counting one token per word or punctuation mark (the stand-in's tokenizer)
    def count(text: str) -> int:
        return len(re.findall(r"\w+|[^\w\s]", text))

    short, long = natural_prompt(CYCLE), natural_prompt(2 * CYCLE)  # as calibrate() sends
    per_char = (count(long) - count(short)) / (len(long) - len(short))
    cal = Calibration(base=count(short) - per_char * len(short), per_char=per_char,
                      measured=True)
    for target in (130, 1000, 8000, 16000, 32000):
        n = cal.sentences_for(target)
        # never above the bucket, and close below it (the guide's own 32k prompt had 31.5k)
        assert 0.95 * target - 30 <= count(natural_prompt(n)) <= target, (target, n)
    assert cal.sentences_for(10) == 1


def test_prompts_are_natural_deterministic_prose_without_a_short_cycle():
    text = natural_prompt(400)
    assert text == natural_prompt(400)  # the same bytes on every run and host
    sentences = [s for s in re.split(r"(?<=\.) ", text.split("\n\nQuestion:")[0]) if s]
    assert len(set(sentences)) > 0.9 * len(sentences)  # not a filler block repeated
    assert len(natural_prompt(64).split()) > 7 * len(natural_prompt(8).split()) // 2


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


def test_the_chunk_comes_from_the_most_direct_source():
    from dsv4_offload.serving.supervisor import ServeRecord
    from dsv4_offload.stages.accept import server_chunk

    record = ServeRecord(1, 2, "http://x", "log", ["python", "-m", "sglang.launch_server",
                                                   "--chunked-prefill-size", "16384"], "now")
    # the delivery launcher's own line (launch_ds4flash_npu.sh L264)
    log = ("[launch] chunked-prefill-size=32768 (a positive value must be a multiple of "
           "page_size; see the header)\n")
    assert server_chunk({"chunked_prefill_size": 8192}, record, log, 2048) == (
        8192, "/get_server_info")
    # sglang's "no chunking" (-1 / None) says nothing about a limit: look further
    assert server_chunk({"chunked_prefill_size": -1}, record, log, 2048) == (
        16384, "the serve record's command line")
    assert server_chunk(None, None, log, 2048) == (32768, "the launcher's line in the server log")
    assert server_chunk(None, None, "no such line", 2048) == (
        2048, "the recipe (serve.chunked_prefill_size)")


def test_gpqa_reads_evalscopes_report_and_summarises_like_the_script(tmp_path: Path):
    from dsv4_offload.acceptance.gpqa import GpqaResult, read_score

    assert read_score(tmp_path) is None
    report = tmp_path / "20261203_041500" / "reports" / "W8A8" / "gpqa_diamond.json"
    report.parent.mkdir(parents=True)
    # evalscope's Report model (evalscope/report/report.py): score is a 0-1 accuracy
    report.write_text(json.dumps({"name": "r", "dataset_name": "gpqa_diamond",
                                  "model_name": "W8A8", "score": 0.6919, "metrics": []}))
    assert read_score(tmp_path) == 69.19
    report.write_text(json.dumps({"score": 69.19}))  # a percentage is not evalscope's format
    assert read_score(tmp_path) is None
    result = GpqaResult(rounds=[69.19, 72.73, None, 73.23])
    # gpqa_accuracy_repeat.sh L120-125: failed rounds out of the mean, population SD
    assert result.summary() == {"n": 3, "mean": 71.72, "min": 69.19, "max": 73.23, "sd": 1.8}
    assert result.tolerance_pp() == round(2 * 3.3 / 3 ** 0.5, 2)


def test_an_exported_depool_knob_decides_the_depool_marker(tmp_path: Path, monkeypatch):
    from serve_helpers import context, make_workspace

    from dsv4_offload.stages.accept import _markers

    ws = make_workspace(tmp_path / "ws")
    names = [m.name for m in _markers(context(ws, [], "accept"))[0]]
    assert "depool slot reserved" in names
    monkeypatch.setenv("KT_MXFP4_DEPOOL", "0")  # the launcher lets an exported value win
    names = [m.name for m in _markers(context(ws, [], "accept"))[0]]
    assert "depool slot reserved" not in names
    own = _markers(context(ws, [], "accept", require_lines=["Uvicorn running"]))
    assert [m.pattern for m in own[0]] == ["Uvicorn running"] and own[1] == []


def test_the_api_key_goes_into_every_requests_headers(tmp_path: Path):
    from serve_helpers import context, make_workspace

    from dsv4_offload.acceptance.probes import ServerClient
    from dsv4_offload.serving.supervisor import ServeRecord
    from dsv4_offload.stages.accept import auth_headers

    ws = make_workspace(tmp_path / "ws")
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    record = ServeRecord(1, 2, "http://127.0.0.1:8020", "log", [], "now",
                         extra={"api_key_file": str(key)})
    ctx = context(ws, [], "accept")
    assert auth_headers(ctx, record, "http://127.0.0.1:8020") == {
        "Authorization": "Bearer s3cret"}  # the key `serve --api-key-file` recorded
    assert auth_headers(ctx, record, "http://elsewhere:1") == {}  # not that server
    given = context(ws, [], "accept", api_key_file=str(key))
    client = ServerClient("http://elsewhere:1", headers=auth_headers(given, None, "x"))
    assert client.headers()["Authorization"] == "Bearer s3cret"
    with pytest.raises(InputError, match="cannot read the API key file"):
        auth_headers(context(ws, [], "accept", api_key_file=str(tmp_path / "no")), None, "x")


def test_a_required_line_not_confirmed_at_the_pin_warns_with_its_source_never_fails():
    required, _ = _markers()
    by_name = {m.name: m for m in required}
    # printed by the patches the tool applies: confirmed, a hard check
    assert by_name["depool slot reserved"].confirmed
    assert "0003 patch line 711" in by_name["depool slot reserved"].source
    for name in ("weights loaded", "KV pool sized", "NPU graph captured"):
        assert not by_name[name].confirmed and "not the pin" in by_name[name].source
    checks = {c.name: c for c in check_log_markers("nothing here\n", required, [], "log")}
    graph = checks["log has 'NPU graph captured'"]
    assert graph.ok is False and not graph.gate and graph.status == "warn"
    assert "not confirmed in the pinned source" in graph.fix and "7b7e357f" in graph.fix
    assert checks["log has 'depool slot reserved'"].status == "fail"
    # the fork's own text and the guide's both satisfy the graph marker
    for line in ("Capture cuda graph end. Time elapsed: 9 s", "Capture npu graph end. x"):
        assert check_log_markers(line, [by_name["NPU graph captured"]], [], "log")[0].ok


def test_the_inline_residency_line_is_required_only_after_a_long_streamed_prompt():
    env = dict(load_recipe().serve.env)
    acc = load_recipe().acceptance
    names = [m.name for m in markers_that_apply(acc.log_markers_required, env, 400)]
    assert "inline residency done" not in names  # nothing above the 512-token threshold
    (marker,) = [m for m in markers_that_apply(acc.log_markers_required, env, 31500)
                 if m.name == "inline residency done"]
    assert marker.confirmed and "0003 patch line 997" in marker.source
    off = dict(env, KT_DYNAMIC_RESIDENT="0")
    assert "inline residency done" not in [
        m.name for m in markers_that_apply(acc.log_markers_required, off, 31500)]
    line = "[KT_STREAM] inline resident: top-32 x 43 layers folded into prefill, share=0.612"
    assert check_log_markers(line, [marker], [], "log")[0].ok
    missing = check_log_markers("nothing", [marker], [], "log")[0]
    assert missing.status == "fail" and "dynamic residency never completed" in missing.fix
