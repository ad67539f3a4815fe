"""Stage `accept`: health, coherent greedy probes, determinism, log markers, decode tok/s.

Options: ``url`` (default: the supervised server, else serve.host:port), ``api``
(native | openai), ``model`` (the name an OpenAI server wants), ``probes`` (a YAML file
with a list of probes, or a mapping with ``probes`` and ``determinism_probe``), ``log``
(a server log to check for markers; default: the supervised server's).
Writes ``reports/accept-<time>.json`` and a PNG chart beside it; the summary goes to
provenance through the stage outputs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dsv4_offload import probes as pr
from dsv4_offload import supervisor as sv
from dsv4_offload.errors import InputError
from dsv4_offload.recipe import Acceptance, Probe
from dsv4_offload.serveplan import connect_url
from dsv4_offload.stage import Problem, StageContext, StageResult, Status
from dsv4_offload.workspace import atomic_write_json, now_iso

OPENAI_HEALTH = ["/v1/models"]  # OpenAI-compatible servers need not have sglang's /health


def load_probes(path: Path, acceptance: Acceptance) -> tuple[list[Probe], str]:
    """(probes, determinism probe name) from a user's YAML file, validated like the recipe."""
    import yaml
    from pydantic import ValidationError

    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: probes file not found; give an existing YAML file") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise InputError(f"{path}: unreadable probes file ({str(exc).splitlines()[0]}); "
                         "write a YAML list of probes") from None
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
    api = ctx.option("api", acc.api)
    if api not in ("native", "openai"):
        raise InputError(f"--api {api}: must be 'native' (sglang /generate) or 'openai'")
    record = sv.read_record(ctx.workspace.serve_record)
    url = ctx.option("url") or (record.url if sv.record_alive(record) and record else
                                connect_url(ctx.recipe.serve.host, ctx.recipe.serve.port))
    probe_list, det_name = (load_probes(Path(ctx.option("probes")), acc) if ctx.option("probes")
                            else (acc.probes, acc.determinism_probe))
    log_path = _server_log(ctx, record, url)
    client = pr.ServerClient(url, api, ctx.option("model"), acc.request_timeout_s)
    checks: list[pr.Check] = []
    buckets: list[pr.Bucket] = []
    texts: dict[str, str] = {}
    started = time.monotonic()

    with ctx.task(f"accepting {url}", total=len(probe_list) + 3) as task:
        try:
            for path in (OPENAI_HEALTH if api == "openai" else ctx.recipe.serve.health_paths):
                code, secs = client.get(path)
                checks.append(pr.Check(f"GET {path}", code == 200, f"HTTP {code} ({secs:.1f}s)",
                                       "" if code == 200 else "the server is not ready: "
                                       "`dsv4-offload serve status` / `serve logs`",
                                       required="HTTP 200"))
            task.advance()
            if all(c.ok for c in checks):
                for probe in probe_list:
                    reply = client.generate(probe.prompt, probe.max_new_tokens, probe.chat)
                    texts[probe.name] = reply.text
                    checks.append(pr.check_probe(probe, reply, acc.degeneration))
                    task.advance()
                det = next(p for p in probe_list if p.name == det_name)
                again = client.generate(det.prompt, det.max_new_tokens, det.chat)
                checks.append(pr.check_determinism(det_name, texts[det_name], again.text))
                task.advance()
        except pr.ServerUnreachable as exc:
            checks.append(pr.Check("server answers", False, str(exc),
                                   "the server hung or died: `dsv4-offload serve logs`"))
        except ValueError as exc:
            checks.append(pr.Check("server answers", False, str(exc),
                                   "is --api right for this server (native or openai)?"))
        log_text = log_path.read_text(encoding="utf-8", errors="replace") if log_path else None
        checks += pr.check_log_markers(log_text, acc.log_markers_required,
                                       acc.log_markers_forbidden, str(log_path))
        coherent = all(c.ok is not False for c in checks)
        if coherent:
            try:
                buckets = pr.measure_throughput(client, acc.throughput,
                                                chat=any(p.chat for p in probe_list))
                checks.append(pr.check_throughput(buckets, acc.throughput))
            except pr.ServerUnreachable as exc:
                checks.append(pr.Check("decode throughput", False, str(exc),
                                       "the server hung or died under load: `serve logs`"))
        else:
            checks.append(pr.Check("decode throughput", None, "skipped: earlier checks failed"))
        task.advance()

    return _result(ctx, url, api, checks, buckets, log_path, time.monotonic() - started)


def _server_log(ctx: StageContext, record: sv.ServeRecord | None, url: str) -> Path | None:
    if ctx.option("log"):
        return Path(ctx.option("log"))
    if record is not None and record.url == url and Path(record.log).is_file():
        return Path(record.log)
    return None


def _result(ctx: StageContext, url: str, api: str, checks: list[pr.Check],
            buckets: list[pr.Bucket], log_path: Path | None, seconds: float) -> StageResult:
    acc = ctx.recipe.acceptance
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = ctx.workspace.reports_dir / f"accept-{stamp}.json"
    chart = None
    problems: list[Problem] = []
    if any(b.tok_s for b in buckets):
        try:
            chart = pr.write_chart(buckets, report.with_suffix(".png"),
                                   acc.throughput.reference_tok_s,
                                   f"{ctx.recipe.name}: decode tok/s ({url})")
        except ImportError:
            problems.append(Problem("warning", "no chart: matplotlib is not installed",
                                    fix="pip install matplotlib", check="accept.chart"))
    failed = [c for c in checks if c.ok is False]
    # a slow server is a finding to read, not a broken one: throughput alone only warns
    hard = [c for c in failed if c.name != "decode throughput"]
    for c in failed:
        problems.append(Problem("error" if c in hard else "warning", f"{c.name}: {c.detail}",
                                fix=c.fix, check=f"accept.{c.name}"))
    status = Status.FAILED if hard else (Status.WARN if failed or problems else Status.OK)
    passed = sum(1 for c in checks if c.ok)
    tok_s = next((b.tok_s for b in buckets if b.tok_s), None)
    summary = (f"{'FAILED' if hard else 'passed'}: {passed}/{len(checks)} checks"
               + (f", decode {tok_s} tok/s (reference {acc.throughput.reference_tok_s:g})"
                  if tok_s else "")
               + (f"; first failure: {hard[0].name}: {hard[0].detail}" if hard else ""))
    doc = {"schema": 1, "recipe": ctx.recipe.name, "url": url, "api": api, "when": now_iso(),
           "seconds": round(seconds, 1), "status": status.value, "summary": summary,
           "checks": [c.as_dict() for c in checks],
           "throughput": [b.as_dict() for b in buckets],
           "reference_tok_s": acc.throughput.reference_tok_s,
           "log": str(log_path) if log_path else None, "chart": str(chart) if chart else None}
    atomic_write_json(report, doc)
    # provenance keeps the last verdict, passed or not: it is what a bug report needs
    ctx.workspace.update_provenance("acceptance", {
        "status": status.value, "summary": summary, "report": str(report), "when": doc["when"]})
    outputs = {"status": status.value, "url": url, "api": api, "report": str(report),
               "chart": str(chart) if chart else None, "decode_tok_s": tok_s,
               "checks_passed": passed, "checks": len(checks), "when": doc["when"]}
    return StageResult(status, summary, data={**doc, "report": str(report)}, problems=problems,
                       outputs=outputs if status is not Status.FAILED else {},
                       log=str(log_path) if log_path else None)


def fingerprint_inputs(ctx: StageContext) -> dict[str, Any]:
    # acceptance holds for the server it ran against: a restarted server needs a new one
    record = sv.read_record(ctx.workspace.serve_record)
    alive = sv.record_alive(record)
    return {"server": f"pid {record.server_pid}" if alive and record else "none"}
