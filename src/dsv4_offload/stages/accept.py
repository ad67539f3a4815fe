"""Stage `accept`: health, coherent greedy probes, determinism, the same probes after a prompt
that streams (dynamic residency), decode tok/s, the probes again, the server log.

Options: ``url`` (default: the supervised server, else serve.host:port), ``api``
(native | openai), ``model`` (the name an OpenAI server wants), ``probes`` (a YAML file
with a list of probes, or a mapping with ``probes`` and ``determinism_probe``), ``log``
(a server log to check, for a server started elsewhere; default: the supervised server's),
``require_lines``/``forbid_lines`` (regexes replacing the recipe's markers), ``quick``,
``no_throughput_gate``, ``gpqa`` (rounds), ``api_key_file``.
The log is read after all of accept's own traffic. Writes ``reports/accept-<time>.json`` and
a PNG chart beside it; the summary goes to provenance through the stage outputs.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from dsv4_offload.acceptance import ceilings as cl
from dsv4_offload.acceptance import gpqa
from dsv4_offload.acceptance import probes as pr
from dsv4_offload.acceptance import residency as rs
from dsv4_offload.acceptance import throughput as tp
from dsv4_offload.core.clock import now_iso
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.options import PathText, StageOptions
from dsv4_offload.core.results import Check, Problem, StageResult, Status, Task
from dsv4_offload.recipe import Acceptance, LogMarker, Probe
from dsv4_offload.serving import supervisor as sv
from dsv4_offload.serving.rules import connect_url
from dsv4_offload.workspace.context import StageContext
from dsv4_offload.workspace.store import atomic_write_json

OPENAI_HEALTH = ["/v1/models"]  # OpenAI-compatible servers need not have sglang's /health


class AcceptOptions(StageOptions):
    url: str | None = None  # the server (default: the one `serve` started, else the recipe's)
    api: str | None = None  # native | openai (default: acceptance.api)
    model: str | None = None  # the model name to ask for (default: the server's)
    probes: PathText | None = None  # a YAML file of probes instead of the recipe's
    log: PathText | None = None  # the server's log (default: the supervised one)
    require_lines: tuple[str, ...] = ()  # the log lines the server must print (another server)
    forbid_lines: tuple[str, ...] = ()  # the log lines it must not print
    quick: bool = False  # a short throughput run
    no_throughput_gate: bool = False  # report tok/s without failing on them
    gpqa: int = 0  # rounds of GPQA-diamond through evalscope
    api_key_file: PathText | None = None  # the key to send (default: serve's)

    def needs_image(self) -> bool:
        """A given URL is an HTTP check from here; GPQA's evalscope lives in the image."""
        return self.url is None or self.gpqa > 0


Options = AcceptOptions


def load_probes(path: Path, acceptance: Acceptance) -> tuple[list[Probe], str]:
    """(probes, determinism probe name) from a user's YAML file, validated like the recipe."""
    from pydantic import ValidationError

    from dsv4_offload.recipe.yamldoc import read_yaml_any

    if not path.exists():
        raise InputError(f"{path}: probes file not found; give an existing YAML file")
    doc = read_yaml_any(path)
    items = doc.get("probes") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items:
        raise InputError(f"{path}: expected a non-empty list of probes (name, prompt, "
                         "expect_any), or a mapping with 'probes:'")
    parsed = []
    for i, item in enumerate(items):
        try:
            parsed.append(Probe.model_validate(item))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(item)"
            raise InputError(f"{path}: probes[{i}].{where}: {err['msg']}; see the recipe's "
                             "acceptance.probes for the fields") from None
    names = [p.name for p in parsed]
    chosen = doc.get("determinism_probe") if isinstance(doc, dict) else None
    chosen = chosen or (acceptance.determinism_probe if acceptance.determinism_probe in names
                        else names[0])
    if chosen not in names:
        raise InputError(f"{path}: determinism_probe {chosen!r} is not one of {names}")
    return parsed, str(chosen)


def run(ctx: StageContext) -> StageResult:
    acc = ctx.recipe.acceptance
    options = ctx.options_as(AcceptOptions)
    api = options.api if options.api is not None else acc.api
    if api not in ("native", "openai"):
        raise InputError(f"--api {api}: must be 'native' (sglang /generate) or 'openai'")
    gpqa_rounds = options.gpqa
    if gpqa_rounds < 0:
        raise InputError(f"--gpqa {gpqa_rounds}: give a number of rounds (the delivery runs 10)")
    evalscope = gpqa.find_evalscope() if gpqa_rounds else None  # before any traffic
    record = sv.read_record(ctx.workspace.serve_record)
    url = options.url or (record.url if sv.record_alive(record) else
                                connect_url(ctx.recipe.serve.host, ctx.recipe.serve.port))
    # nothing started here and no --url: the next step is to start the server, not its logs
    # a --url server this workspace did not start: its logs are its starter's, not ours
    ours = sv.record_alive(record) and record is not None and record.url == url
    dead_fix = ("the server hung or died: `dsv4-offload serve logs`" if ours else
                f"the server at {url} did not answer: check it is up and its own log"
                if options.url else
                "no server was started in this workspace: start one with `dsv4-offload serve "
                "--detach`, then run accept again (or point --url at a running server)")
    probe_list, det_name = (load_probes(Path(options.probes), acc) if options.probes
                            else (acc.probes, acc.determinism_probe))
    log_path = _server_log(ctx, record, url)
    required, forbidden = _markers(ctx)
    switches = _switches(ctx, record, url)
    client = pr.ServerClient(url, api, options.model, acc.request_timeout_s,
                             headers=auth_headers(ctx, record, url))
    quick = options.quick
    gate = not options.no_throughput_gate
    checks: list[Check] = []
    buckets: list[tp.Bucket] = []
    streamed = 0  # the longest prompt accept sent, as the server counted it
    texts: dict[str, str] = {}
    notes: list[str] = []
    started = time.monotonic()

    with ctx.task(f"accepting {url}", total=2 * len(probe_list) + 5) as task:
        current = "health check"  # what a failure names
        try:
            for path in (OPENAI_HEALTH if api == "openai" else ctx.recipe.serve.health_paths):
                code, secs = client.get(path)
                checks.append(Check.verdict(
                    f"GET {path}", code == 200, f"HTTP {code} ({secs:.1f}s)",
                    "" if code == 200 else "the server is not ready: "
                    "`dsv4-offload serve status` / `serve logs`", required="HTTP 200"))
            task.advance()
            if all(c.ok for c in checks):
                for probe in probe_list:
                    current = f"probe '{probe.name}'"
                    reply = client.generate(probe.prompt, probe.max_new_tokens, probe.chat)
                    texts[probe.name] = reply.text
                    checks.append(pr.check_probe(probe, reply, acc.degeneration))
                    task.advance()
                det = next(p for p in probe_list if p.name == det_name)
                current = f"determinism probe '{det_name}'"
                again = client.generate(det.prompt, det.max_new_tokens, det.chat)
                checks.append(pr.check_determinism(det_name, texts[det_name], again.text))
                task.advance()
        except pr.ServerUnreachable as exc:
            checks.append(Check.verdict("server answers", False, f"{current}: {exc}",
                                        dead_fix))
        except ValueError as exc:
            checks.append(Check.verdict("server answers", False, f"{current}: {exc}",
                                        "is --api right for this server (native or openai)?"))
        if all(c.ok is not False for c in checks):
            buckets, tp_check = _throughput(ctx, client, record, log_path, quick, gate,
                                            chat=any(p.chat for p in probe_list), task=task)
            checks.append(tp_check)
            notes += [f"bucket {b.target} skipped: {b.skipped}" for b in buckets if b.skipped]
            if tp_check.ok is not False:  # the probes again, after prompts that streamed
                after_checks, streamed = _after_long_prompts(
                    ctx, client, probe_list, texts, buckets, switches,
                    int(tp_check.data["chunk"]), task)
                checks += after_checks
        else:
            checks.append(Check.verdict("decode throughput", None,
                                        "skipped: earlier checks failed"))
        task.advance()
        if gpqa_rounds and evalscope:
            if any(c.ok is False and c.gate for c in checks):
                checks.append(Check.verdict("GPQA-diamond", None, "skipped: earlier checks failed"))
            else:
                try:
                    checks.append(_gpqa(ctx, client, evalscope, gpqa_rounds, task))
                except (InputError, pr.ServerUnreachable) as exc:
                    checks.append(Check.verdict("GPQA-diamond", False, str(exc),
                                                "give --model, or check the server"))
        # after all of accept's own traffic: a server that died under it, and the log lines
        # only long prompts can cause (streaming prefill fallback), are caught here
        if all(c.name != "server answers" for c in checks):
            checks.append(_still_answering(ctx, client, api, record))
        log_text = log_path.read_text(encoding="utf-8", errors="replace") if log_path else None
        longest = max([b.prompt_tokens or 0 for b in buckets] + [streamed])
        required = [m for m in required if longest >= m.after_prompt_tokens]
        checks += pr.check_log_markers(log_text, required, forbidden, str(log_path))
        task.advance()

    return _result(ctx, url, api, checks, buckets, log_path, notes, time.monotonic() - started,
                   switches)


def _switches(ctx: StageContext, record: sv.ServeRecord | None, url: str) -> rs.Switches:
    """The residency switches of the server under test: its own environment where readable;
    for this workspace's server, else the environment serve launches it with."""
    mine = record is not None and record.url == url
    pid = record.server_pid if mine and sv.record_alive(record) else None
    return rs.server_switches(pid, _launch_env(ctx, rs.SWITCHES) if mine else None)


def _launch_env(ctx: StageContext, keys: Any) -> dict[str, str]:
    """The server's environment as the launcher builds it: the recipe's values, a knob the
    user exported winning (launch_ds4flash_npu.sh's ${X:-default})."""
    return {**ctx.recipe.serve.env, **{k: os.environ[k] for k in keys if k in os.environ}}


def _after_long_prompts(ctx: StageContext, client: pr.ServerClient, probes: list[Probe],
                        before: dict[str, str], buckets: list[tp.Bucket],
                        switches: rs.Switches, chunk: int, task: Task
                        ) -> tuple[list[Check], int]:
    """The coherence probes again after the long prompts, and their answers against the
    first ones: a prompt that streamed moved the resident experts (acceptance/residency.py),
    which must not change a greedy answer. Without a bucket over the streaming threshold,
    one prompt a little over it is sent first. Returns the checks and the longest prompt."""
    acc = ctx.recipe.acceptance
    threshold = switches.threshold
    streamed = max([b.prompt_tokens or 0 for b in buckets] + [0])
    skipped = None
    try:
        if streamed < threshold:
            task.update(description="residency: a prompt that streams")
            streamed_or_none = rs.stream_once(client, threshold, chunk,
                                              any(p.chat for p in probes))
            if streamed_or_none is None:
                skipped = (f"skipped: the server's chunked prefill ({chunk} tokens) cannot "
                           f"take a prompt over the streaming threshold {threshold}")
            streamed = streamed_or_none or 0
    except (rs.StreamFailed, tp.BucketFailed, pr.ServerUnreachable) as exc:
        return [Check.verdict("answers survive a streamed prompt", False, str(exc),
                              "the server failed under a prompt that streams: "
                              "`dsv4-offload serve logs`")], streamed
    checks, after = [], {}
    for probe in probes:
        task.update(description=f"the probe '{probe.name}' again")
        try:
            reply = client.generate(probe.prompt, probe.max_new_tokens, probe.chat)
        except pr.ServerUnreachable as exc:
            reply = pr.Reply(str(exc), 0, 0.0, error=str(exc))
        after[probe.name] = reply.text
        check = pr.check_probe(probe, reply, acc.degeneration)
        check.name += " after the long prompts"
        checks.append(check)
        task.advance()
    if skipped:
        return [*checks, Check.verdict("answers survive a streamed prompt", None, skipped)
                ], streamed
    drift = rs.Drift(before, after, streamed or None)
    return checks + rs.check_drift(drift, acc.residency.min_similarity, threshold, switches,
                                   ctx.series.holds(rs.FIX_PATCH)), streamed


def auth_headers(ctx: StageContext, record: sv.ServeRecord | None, url: str) -> dict[str, str]:
    """The API key a server started with `serve --api-key-file` wants, as a header."""
    path = ctx.options_as(AcceptOptions).api_key_file
    if not path and record is not None and record.url == url:
        path = record.extra.get("api_key_file")
    return pr.api_key_headers(path)


def _markers(ctx: StageContext) -> tuple[list[LogMarker], list[LogMarker]]:
    """The recipe's log markers that apply to this server, or the user's own lines."""
    acc = ctx.recipe.acceptance
    options = ctx.options_as(AcceptOptions)
    own_required, own_forbidden = list(options.require_lines), list(options.forbid_lines)
    if own_required or own_forbidden:
        # another server (llama.cpp, a container build): its own lines replace the recipe's
        try:
            return ([LogMarker(pattern=p) for p in own_required],
                    [LogMarker(pattern=p) for p in own_forbidden])
        except ValueError as exc:
            raise InputError(f"--require-line/--forbid-line: {str(exc).splitlines()[-1]}"
                             ) from None
    keys = {k for m in [*acc.log_markers_required, *acc.log_markers_forbidden]
            for k in m.when_env}
    env = _launch_env(ctx, keys)
    applied = {p.name for p in ctx.series.patches}  # a line only our own patch prints
    # the prompt lengths are known after the traffic: run() drops what they do not reach
    return (pr.markers_that_apply(acc.log_markers_required, env, None, applied),
            pr.markers_that_apply(acc.log_markers_forbidden, env, None, applied))


def server_chunk(info: dict[str, Any] | None, record: sv.ServeRecord | None,
                 log_text: str | None, recipe_chunk: int) -> tuple[int, str]:
    """The server's chunked prefill and where it was read, most direct source first."""
    value = (info or {}).get("chunked_prefill_size")  # sglang ServerArgs field
    if isinstance(value, int) and value > 0:
        return value, "/get_server_info"
    if record is not None and "--chunked-prefill-size" in record.argv:
        i = record.argv.index("--chunked-prefill-size")
        if i + 1 < len(record.argv) and record.argv[i + 1].lstrip("-").isdigit():
            size = int(record.argv[i + 1])
            if size > 0:
                return size, "the serve record's command line"
    if log_text:
        # launch_ds4flash_npu.sh L264: "[launch] chunked-prefill-size=${CHUNKED_PREFILL_SIZE}"
        found = re.findall(r"\[launch\] chunked-prefill-size=(\d+)", log_text)
        if found:
            return int(found[-1]), "the launcher's line in the server log"
    return recipe_chunk, "the recipe (serve.chunked_prefill_size)"


def _throughput(ctx: StageContext, client: pr.ServerClient, record: sv.ServeRecord | None,
                log_path: Path | None, quick: bool, gate: bool, chat: bool,
                task: Task) -> tuple[list[tp.Bucket], Check]:
    cfg = ctx.recipe.acceptance.throughput
    log_text = log_path.read_text(encoding="utf-8", errors="replace") if log_path else None
    chunk, source = ctx.recipe.serve.chunked_prefill_size, "the recipe"

    marks = [_log_size(log_path)]  # the log's size when each request of the phase was sent

    def step(what: str) -> None:
        marks.append(_log_size(log_path))
        task.update(description=f"throughput: {what}")

    try:
        # sglang's /get_server_info holds its ServerArgs; an OpenAI-only server has none
        info = client.get_json("/get_server_info") if client.api == "native" else None
        chunk, source = server_chunk(info, record, log_text, chunk)
        context = (info or {}).get("context_length")
        plan = tp.Plan(new_tokens=cfg.quick_new_tokens if quick else cfg.new_tokens,
                       repeats=1 if quick else cfg.repeats,
                       warmup=min(cfg.warmup, 1) if quick else cfg.warmup,
                       chunk=chunk, chunk_source=source,
                       context_length=context if isinstance(context, int) and context > 0
                       else ctx.recipe.serve.context_length)
        step("calibrating the prompt in the server's tokens")
        calibration = tp.calibrate(client, chunk, chat)
        buckets = tp.measure_throughput(client, plan, cfg.prompt_buckets, calibration, chat,
                                        on_step=step)
    except (tp.BucketFailed, pr.ServerUnreachable) as exc:
        what = str(exc) if isinstance(exc, tp.BucketFailed) else f"before the buckets: {exc}"
        why = "the server failed under load"
        if "after 0 tokens" in what or "no answer within" in what:
            why = no_token_cause(log_path, marks[-1], _startup_facts(record))
        return [], Check.verdict("decode throughput", False, what, _with_tail(why, log_path),
                                 data={"chunk": chunk, "chunk_source": source})
    check = tp.check_throughput(buckets, cfg, gate)
    check.data.update({"chunk": chunk, "chunk_source": source, "quick": quick,
                       "new_tokens": plan.new_tokens, "repeats": plan.repeats,
                       "warmup": plan.warmup, "calibrated": calibration.measured})
    if not calibration.measured:
        check.observed += ("; prompt sizes estimated: the server reported no prompt token "
                           "counts")
    return buckets, check


def _log_size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path else 0
    except OSError:
        return 0


def _startup_facts(record: sv.ServeRecord | None) -> dict[str, Any]:
    facts = record.extra.get("startup") if record is not None else None
    return facts if isinstance(facts, dict) else {}


# sglang's scheduler logs each prefill it starts: "Prefill batch, #new-seq: 1, #new-token: N,
# ..." (fork main @ 7b7e357f scheduler_metrics_mixin.py:174-181, not the pin)
_PREFILL = re.compile(r"Prefill batch\b.*#new-token: (\d+)")


def no_token_cause(log_path: Path | None, since: int, startup: dict[str, Any]) -> str:
    """Why a request ended with no token: never admitted, or a prefill over the timeout, told
    apart by the scheduler's prefill lines written since the request was sent."""
    swa = startup.get("swa_pool_tokens")
    pool = f" (the SWA pool holds {swa} tokens)" if swa else ""
    both = ("no token came back. Either the prompt was never admitted: it does not fit the "
            f"SWA KV pool{pool} and waits (give the pool more: serve.extra_args "
            "--swa-full-tokens-ratio, or fewer resident experts); or its prefill ran longer "
            "than acceptance.request_timeout_s (raise it; check the page cache and "
            "`[KT_STREAM] streaming failed` in the log)")
    if log_path is None:
        return both + "; no server log to tell which"
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
        with open(log_path, "rb") as fh:
            fh.seek(since)
            tail = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return both + "; the server log is unreadable"
    started = [int(n) for n in _PREFILL.findall(tail)]
    if started:
        return (f"no token came back, but the prefill started (#new-token: {max(started)} in "
                "the log since the request): it ran longer than "
                "acceptance.request_timeout_s; raise it, and check the page cache and "
                "`[KT_STREAM] streaming failed` (the slow hybrid fallback) in the log")
    if _PREFILL.search(text):
        return ("no token came back and no prefill started since the request (earlier "
                "requests logged theirs): the prompt was never admitted, most likely larger "
                f"than the SWA KV pool{pool}; give the pool more (serve.extra_args "
                "--swa-full-tokens-ratio) or keep fewer resident experts")
    return both + " (the log has no scheduler prefill lines to tell which)"


def _still_answering(ctx: StageContext, client: pr.ServerClient, api: str,
                     record: sv.ServeRecord | None) -> Check:
    path = OPENAI_HEALTH[0] if api == "openai" else ctx.recipe.serve.health_paths[0]
    try:
        code, _ = client.get(path)
    except pr.ServerUnreachable as exc:
        return Check.verdict("server alive after the run", False, str(exc),
                             "the server died during acceptance: `dsv4-offload serve logs`")
    ok = code == 200
    return Check.verdict("server alive after the run", ok, f"GET {path}: HTTP {code}",
                         "" if ok else "the server stopped answering: `dsv4-offload serve logs`",
                         required="HTTP 200")


def _gpqa(ctx: StageContext, client: pr.ServerClient, evalscope: str, rounds: int,
          task: Task) -> Check:
    reference = ctx.recipe.acceptance.gpqa_reference_pct
    model = ctx.options_as(AcceptOptions).model or _served_model(client)
    key = client.headers().get("Authorization", "Bearer EMPTY").split(" ", 1)[1]
    out = ctx.workspace.reports_dir / f"gpqa-{time.strftime('%Y%m%d-%H%M%S')}"

    def on_round(i: int) -> None:
        task.update(description=f"GPQA-diamond round {i}/{rounds} (evalscope)")

    # gpqa_accuracy_repeat.sh L57: the chat endpoint itself is the --api-url
    result = gpqa.run_rounds(rounds, evalscope, model, client.url + "/v1/chat/completions",
                             key, out, on_round)
    stats = result.summary()
    failed = [i + 1 for i, s in enumerate(result.rounds) if s is None]
    shown = (f"{stats['n']} of {rounds} rounds: mean {stats['mean']}% (min {stats['min']}, "
             f"max {stats['max']}, SD {stats['sd']} pp); rounds "
             + ", ".join("?" if s is None else f"{s:g}" for s in result.rounds))
    data = {"rounds": result.rounds, **stats, "reference": reference, "logs": result.logs,
            "dir": str(out)}
    if failed or stats["mean"] is None:
        return Check.verdict("GPQA-diamond", False, f"round(s) {failed} failed; {shown}",
                             f"see {out}/R{failed[0] if failed else 1}.log", data)
    if reference is None:
        return Check.verdict("GPQA-diamond", True, f"{shown}; no reference in the recipe",
                             data=data)
    tolerance = result.tolerance_pp()
    data["tolerance_pp"] = tolerance
    ok = float(stats["mean"] or 0) >= reference - tolerance
    note = "" if rounds >= 3 else "; one round is noise (±3.3 pp): run 3 to 10"
    return Check.verdict("GPQA-diamond", ok, f"{shown}{note}",
                         "" if ok else "accuracy below the reference: check the GGUF and W8A8 "
                         "(verify-gguf) and that sglang is at its pinned commit", data,
                         required=f"mean >= {reference:g}% - {tolerance:g} pp (2 SE of the mean)")


def _served_model(client: pr.ServerClient) -> str:
    """The model name evalscope must send: the server's first /v1/models id."""
    doc = client.get_json("/v1/models") or {}
    items = doc.get("data") or []
    if items and isinstance(items[0], dict) and items[0].get("id"):
        return str(items[0]["id"])
    raise InputError("accept --gpqa: the server lists no model on /v1/models; give --model "
                     "(the W8A8 path the server was started with)")


def _with_tail(fix: str, log_path: Path | None) -> str:
    tail = pr.log_tail(log_path)
    if not tail:
        return fix + ": `dsv4-offload serve logs`"
    return fix + f"; the last lines of {log_path}:\n  " + "\n  ".join(tail)


def _server_log(ctx: StageContext, record: sv.ServeRecord | None, url: str) -> Path | None:
    given = ctx.options_as(AcceptOptions).log
    if given:
        path = Path(given)
        if not path.is_file():
            raise InputError(f"--server-log {path}: no such file; give the log the server "
                             "writes (e.g. `... 2>&1 | tee /tmp/kt_serve.log`)")
        return path
    if record is not None and record.url == url and Path(record.log).is_file():
        return Path(record.log)
    return None


def _result(ctx: StageContext, url: str, api: str, checks: list[Check],
            buckets: list[tp.Bucket], log_path: Path | None, notes: list[str],
            seconds: float, switches: rs.Switches) -> StageResult:
    acc = ctx.recipe.acceptance
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = ctx.workspace.reports_dir / f"accept-{stamp}.json"
    chart = None
    problems: list[Problem] = []
    if any(b.tok_s for b in buckets):
        try:
            chart = tp.write_chart(buckets, report.with_suffix(".png"),
                                   acc.throughput.reference_tok_s,
                                   f"{ctx.recipe.name}: decode tok/s ({url})")
        except ImportError:
            problems.append(Problem("warning", "no chart: matplotlib is not installed",
                                    fix="pip install matplotlib", check="accept.chart"))
    failed = [c for c in checks if c.ok is False]
    hard = [c for c in failed if c.gate]
    for c in failed:
        if c in hard and log_path is not None and "last lines of" not in c.fix:
            c.fix = _with_tail(c.fix or "read the server log", log_path)
        problems.append(Problem("error" if c in hard else "warning", f"{c.name}: {c.observed}",
                                fix=c.fix, check=f"accept.{c.name}"))
    problems += [Problem("warning", note, check="accept.throughput") for note in notes]
    warned = [c for c in checks if c.status == "warn"]
    status = Status.FAILED if hard else (Status.WARN if warned or problems else Status.OK)
    passed = sum(1 for c in checks if c.ok)
    tok_s = next((b.tok_s for b in buckets if b.tok_s), None)
    summary = (f"{'FAILED' if hard else 'passed'}: {passed}/{len(checks)} checks"
               + (f", decode {tok_s} tok/s (reference {acc.throughput.reference_tok_s:g})"
                  if tok_s else "")
               + (f"; first failure: {hard[0].name}: {hard[0].observed}" if hard else "")
               # figures depend on these: the delivery's and ktransformers' were taken with
               # other switches than each other
               + f"; residency switches: {switches.shown()}")
    # the measured decode between the CPU kernel's and the memory's ceilings (issue 32)
    ceilings = cl.for_accept(ctx.workspace, ctx.recipe, tok_s, log_path)
    summary += f"; {ceilings.short()}" if tok_s else ""
    doc = {"schema": 1, "recipe": ctx.recipe.name, "url": url, "api": api, "when": now_iso(),
           "seconds": round(seconds, 1), "status": status.value, "summary": summary,
           "checks": [c.as_dict() for c in checks],
           "throughput": [b.as_dict() for b in buckets], "notes": notes,
           "reference_tok_s": acc.throughput.reference_tok_s,
           "switches": {"values": switches.values, "source": switches.source},
           "log": str(log_path) if log_path else None, "chart": str(chart) if chart else None,
           "ceilings": ceilings.as_dict()}
    atomic_write_json(report, doc)
    # provenance keeps the last verdict, passed or not: it is what a bug report needs
    ctx.workspace.update_provenance("acceptance", {
        "status": status.value, "summary": summary, "report": str(report), "when": doc["when"]})
    outputs = {"status": status.value, "url": url, "api": api, "report": str(report),
               "chart": str(chart) if chart else None, "decode_tok_s": tok_s,
               "checks_passed": passed, "checks": len(checks), "when": doc["when"],
               "ceilings": doc["ceilings"]}
    return StageResult(status, summary, problems=problems,
                       data={**doc, "report": str(report), "lines": ceilings.lines()},
                       outputs=outputs if status is not Status.FAILED else {},
                       log=str(log_path) if log_path else None)


def fingerprint_inputs(ctx: StageContext) -> dict[str, Any]:
    # acceptance holds for the server it ran against: a restarted server needs a new one
    record = sv.read_record(ctx.workspace.serve_record)
    alive = sv.record_alive(record)
    return {"server": f"pid {record.server_pid}" if alive and record else "none"}
