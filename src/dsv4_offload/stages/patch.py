"""patch: the series applied to the fetched sources, one commit per patch.

1. every patch loaded from its origin and its sha256 checked (before any repo is touched);
2. per target, in series order: recover an apply that was killed half-way, skip the
   patches already applied (known by their commit trailers), apply the rest;
3. a failure rolls that target back to where it was, with the rejected hunks and the log.
"""

from __future__ import annotations

from dsv4_offload.core.options import StageOptions
from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.sources import git as gitsrc
from dsv4_offload.sources import series as series_ops
from dsv4_offload.workspace.context import StageContext


def fingerprint_inputs(ctx: StageContext) -> dict[str, str]:
    """The series, patch by patch, and each target's HEAD: a changed digest, order or target,
    or a tree no longer at its patched commit (`patch reset`, `fetch --force`), makes the
    stage stale.

    Not the git version: the commits are deterministic, and a git upgrade must not make
    the (expensive) build downstream stale."""
    out = {f"patch:{i:02d}:{p.name}": f"{p.target}:{p.method}:{p.strip}:{p.sha256[:16]}"
           for i, p in enumerate(ctx.series.patches)}
    for target in series_ops.series_targets(ctx.series):
        head = gitsrc.head_commit(ctx.workspace.source_dir(ctx.recipe, target))
        out[f"head:{target}"] = head or "missing"
    return out


class PatchOptions(StageOptions):
    only: tuple[str, ...] = ()  # the targets to apply (none: every one)
    force: bool = False


Options = PatchOptions


def run(ctx: StageContext) -> StageResult:
    gitsrc.require_git()
    log = ctx.log_dir / "apply.log"
    options = ctx.options_as(PatchOptions)
    outcomes = series_ops.apply_series(ctx.recipe, ctx.series, ctx.workspace, log,
                                       only=list(options.only) or None, force=options.force)
    problems: list[Problem] = []
    for o in outcomes:
        if o.recovered:
            problems.append(Problem("info", f"{o.target}: recovered an interrupted apply",
                                    check=o.target))
        if o.status == "failed":
            hunks = ", ".join(o.rejected[:6]) or "see the log"
            problems.append(Problem("error", f"{o.message}; rejected: {hunks}", check=o.target,
                                    fix=f"update the patch for this {o.target} commit; see "
                                        f"the log: {log}"))
        elif o.status == "blocked":
            problems.append(Problem("error", f"{o.target}: {o.message}", check=o.target))
    applied = sum(len(o.applied) for o in outcomes)
    skipped = sum(len(o.skipped) for o in outcomes)
    failed = any(o.status in ("failed", "blocked") for o in outcomes)
    if failed:
        status = Status.FAILED
    elif applied:
        status = Status.OK
    else:
        status = Status.SKIPPED
    summary = (f"{applied} patch(es) applied, {skipped} already applied, "
               f"{len(outcomes)} target(s)")
    data = {"targets": [o.__dict__ for o in outcomes]}
    outputs = {} if failed else {o.target: o.head for o in outcomes}
    return StageResult(status, summary, data=data, problems=problems, outputs=outputs,
                       log=str(log))
