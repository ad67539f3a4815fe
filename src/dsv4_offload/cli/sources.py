"""Commands for the sources and the patch series: ``fetch`` and ``patch ...``.

Only typer and cli.kit at import time; git, the series code and rich load inside commands.
"""

from __future__ import annotations

from typing import Any, NoReturn

import typer

from dsv4_offload.cli import complete, kit
from dsv4_offload.core.errors import ExitCode

patch_app = typer.Typer(help="Apply, check, inspect, reset and refresh the patch series.")

_MIRROR_HELP = ("A mirror for source NAME, tried before the recipe's URLs (repeatable; also "
                "env DSV4_MIRRORS='NAME=URL,...').")


def _split(values: list[str]) -> list[str]:
    """Repeatable and comma-separated: --only a --only b,c."""
    return [x.strip() for v in values for x in v.split(",") if x.strip()]


def register(app: typer.Typer) -> None:
    app.command("fetch")(fetch)
    app.add_typer(patch_app, name="patch")


def fetch(
    ctx: typer.Context,
    mirror: list[str] = typer.Option([], "--mirror", metavar="NAME=URL", help=_MIRROR_HELP),
    force: bool = typer.Option(False, "--force",
                               help="Move a dirty or wrong checkout aside (never deletes)."),
) -> None:
    """Every source at its pinned commit in the workspace.

    \b
    1. Each commit into the shared cache ($DSV4_CACHE, default ~/.cache/dsv4-offload):
       depth-1 fetch by full SHA; if the host refuses, the recipe's ref, then all branches.
    2. URLs tried in order: --mirror, the recipe's URL, the recipe's mirrors (git's
       insteadOf rules apply). A second workspace copies from the cache only.
    3. Checkouts: the tree root first, nested ones (third_party/sglang, llama.cpp,
       submodules) at their own commits; a dirty or wrong checkout is left alone unless
       --force moves it aside.
    """
    from dsv4_offload.stages.fetch import FetchOptions

    kit.run_stage(ctx, "fetch", FetchOptions(mirrors=tuple(mirror), force=force))


@patch_app.callback(invoke_without_command=True)
def patch_default(ctx: typer.Context) -> None:
    """Without a subcommand: `patch apply`."""
    if ctx.invoked_subcommand is None:
        from dsv4_offload.stages.patch import PatchOptions

        kit.run_stage(ctx, "patch", PatchOptions(force=False))


@patch_app.command("apply")
def patch_apply(
    ctx: typer.Context,
    only: list[str] = typer.Option([], "--only", metavar="TARGET[,TARGET]",
                                   help="Only these targets.", autocompletion=complete.targets),
    force: bool = typer.Option(False, "--force", help="Reset a target whose applied patches "
                               "differ from the series (the old state is kept under a ref)."),
) -> None:
    """Apply the series: one commit per patch on top of the pinned commit.

    \b
    1. Load every patch and check its sha256 before any repository is touched.
    2. Per target, skip the patches already applied (commit trailers), apply the rest:
       mail-format with `git am --3way` (author kept), plain diffs with `git apply
       --index` and a fixed identity; no fuzz; commit hooks off.
    3. A failure rolls the target back and names the rejected hunks and the log.
    """
    from dsv4_offload.stages.patch import PatchOptions

    kit.run_stage(ctx, "patch", PatchOptions(only=tuple(_split(only)), force=force))


@patch_app.command("status")
def patch_status(ctx: typer.Context) -> None:
    """Per patch: applied / not-applied / changed (since applied) / missing."""
    from collections import Counter

    from dsv4_offload.sources import series as series_ops

    pctx = kit.load_context(ctx, "patch")
    rows = series_ops.series_status(pctx.recipe, pctx.series, pctx.workspace)
    all_applied = all(r.state == series_ops.APPLIED for r in rows)
    data = {"patches": [r.__dict__ for r in rows]}
    table = _table(("patch", "target", "state", "commit", "detail"),
                   [(r.name, r.target, r.state, (r.commit or "")[:12], r.detail) for r in rows])
    counts = Counter(r.state for r in rows)
    line = "patch status: " + ", ".join(f"{n} {state}" for state, n in counts.items())
    kit.emit(ctx, command="patch status", status="ok" if all_applied else "warn", data=data,
                table=_shown(ctx, table), lines=[line])
    kit.exit_with(ExitCode.OK if all_applied else ExitCode.FAILED)


@patch_app.command("reset")
def patch_reset(
    ctx: typer.Context,
    only: list[str] = typer.Option([], "--only", "--target", metavar="TARGET[,TARGET]",
                                   help="Only these targets (default: every patched one).",
                                   autocompletion=complete.targets),
    force: bool = typer.Option(False, "--force",
                               help="Also reset over local edits (kept under a ref)."),
    positional: str | None = typer.Argument(None, metavar="[TARGET]", hidden=True,
                                            autocompletion=complete.targets),
) -> None:
    """Back to the pinned commit; the patched state stays under refs/dsv4/patched-<time>.

    Name targets with --only like `patch apply` and `patch refresh` do (the older
    `patch reset TARGET` still works, with a note).
    """
    from dsv4_offload.cli.render import err_console
    from dsv4_offload.sources import series as series_ops

    targets = _split(only)
    if positional:
        err_console().print(f"note: `patch reset {positional}` is deprecated; use "
                            f"`patch reset --only {positional}`", soft_wrap=True)
        targets = [*(targets or []), positional]
    pctx = kit.load_context(ctx, "patch")
    log = pctx.log_dir / "reset.log"
    with pctx.workspace.lock("patch reset"):
        rows = series_ops.reset_targets(pctx.recipe, pctx.series, pctx.workspace, log,
                                        targets or None, force)
    blocked = [r for r in rows if r["result"] == "blocked"]
    table = _table(("target", "result", "kept", "detail"),
                   [(r["target"], r["result"], " ".join(r["kept"]), r.get("message", ""))
                    for r in rows], status_col=1)
    reset = [r["target"] for r in rows if r["result"] == "reset"]
    line = (f"patch reset: {len(reset)} target(s) back at the pinned commit"
            + (f", {len(blocked)} left alone (local changes; --force keeps them under a ref)"
               if blocked else ""))
    kit.emit(ctx, command="patch reset", status="failed" if blocked else "ok",
                data={"targets": rows, "log": str(log)}, table=_shown(ctx, table), lines=[line])
    kit.exit_with(ExitCode.FAILED if blocked else ExitCode.OK)


@patch_app.command("refresh")
def patch_refresh(
    ctx: typer.Context,
    only: list[str] = typer.Option([], "--only", metavar="TARGET[,TARGET]",
                                   help="Only these targets.", autocompletion=complete.targets),
) -> None:
    """Regenerate this repo's own patch files from their commits and update their sha256.

    For maintainers: edit the tree, amend the patch's commit, run refresh, commit the
    patch file and the series.
    """
    from dsv4_offload.sources import series as series_ops

    pctx = kit.load_context(ctx, "patch")
    with pctx.workspace.lock("patch refresh"):
        rows = series_ops.refresh_series(pctx.recipe, pctx.series, pctx.workspace,
                                         _split(only) or None)
    table = _table(("patch", "target", "result", "detail"),
                   [(r["name"], r["target"], r["result"], r.get("detail", "")) for r in rows])
    refreshed = sum(1 for r in rows if r["result"] == "refreshed")
    kit.emit(ctx, command="patch refresh", status="ok", data={"patches": rows},
                table=_shown(ctx, table),
                lines=[f"patch refresh: {refreshed} patch file(s) regenerated"])


@patch_app.command("audit")
def patch_audit(ctx: typer.Context) -> None:
    """Can the patched trees print every log text the tool waits for or fears?

    \b
    1. The texts: the build steps' expect/forbid markers, the acceptance log markers and
       the serve supervisor's fatal patterns.
    2. Their trees: a build step's log_sources (default: the source holding its workdir and
       those nested in it); acceptance and serve: every source but the delivery, plus the
       delivery's scripts.
    3. Each literal run (4+ characters, between regex metacharacters and groups) is
       searched with `git grep -F` in the workspace's checkouts; one file must hold them all.
    4. A required marker nothing prints is an error (exit 1); a forbidden or fatal one a
       warning; a marker whose tree is not fetched is 'unchecked', never passed.
    """
    from dsv4_offload.sources import git as gitsrc

    pctx = kit.load_context(ctx, "patch")
    gitsrc.require_git()
    report = _audit(pctx)
    kit.emit(ctx, command="patch audit", status=report.status, data=report.as_dict(),
             table=_shown(ctx, _audit_table(report)),
             lines=[f"patch audit: {report.summary()}", *_audit_errors(report)])
    kit.exit_with(ExitCode.OK if report.ok else ExitCode.FAILED)


def _audit(pctx: Any) -> Any:
    from dsv4_offload.sources import audit

    return audit.audit(pctx.recipe, pctx.series,
                       audit.workspace_dirs(pctx.recipe, pctx.workspace))


def _audit_table(report: Any) -> Any:
    rows = [(i.kind, i.owner, i.variant, i.verdict, i.where or i.detail) for i in report.items]
    return _table(("kind", "owner", "marker", "verdict", "where / why"), rows, status_col=3)


def _audit_errors(report: Any) -> list[str]:
    from dsv4_offload.sources import audit

    return [f"error: {i.owner}: '{i.marker}': {i.detail}; fix: {audit.refusal_fix(i)}"
            for i in report.errors()]


@patch_app.command("check")
def patch_check(
    ctx: typer.Context,
    rev: list[str] = typer.Option([], "--rev", metavar="TARGET=REF",
                                  help="Check against another upstream branch/tag/SHA."),
    only: list[str] = typer.Option([], "--only", metavar="TARGET[,TARGET]",
                                   help="Only these targets.", autocompletion=complete.targets),
    junit: str | None = typer.Option(None, "--junit", metavar="FILE", help="JUnit XML report."),
    markdown: str | None = typer.Option(None, "--markdown", metavar="FILE",
                                        help="Markdown summary (e.g. $GITHUB_STEP_SUMMARY)."),
    mirror: list[str] = typer.Option([], "--mirror", metavar="NAME=URL", help=_MIRROR_HELP),
    bisect: list[str] = typer.Option(
        [], "--bisect", metavar="TARGET=REF",
        help="Walk TARGET's first-parent history from the pinned commit to REF: per patch the "
             "last clean commit and the first that needs offset, fuzz, fails or has it "
             "upstream."),
) -> None:
    """CI: does the series still apply? Never touches the workspace.

    \b
    1. Fetch the targets and the patch origins into the cache; check every sha256.
    2. Per target, the pinned commit's tree (or --rev TARGET=REF) in a temporary index:
       no checkout; only the touched files' blobs are read.
    3. Per patch, in order, `git apply --cached --check`: clean / offset / fuzz (GNU patch
       on the touched files) / fails (rejected hunks; what a 3-way merge makes of it) /
       already-upstream; then apply it so the next patch sees the tree it expects.
    4. `patch audit` of the log markers against the workspace's patched trees
       (unchecked where none is laid out).
    5. Exit 0 only when every checked patch is clean and no required marker is missing.
    --bisect TARGET=REF: the same check along TARGET's first-parent history from the
    pinned commit to REF (fetched blob-less); per patch the commits where it stops being
    clean, needs fuzz, fails or is taken upstream; exit 0 only when all are clean at REF.
    """
    from pathlib import Path

    from dsv4_offload.core.errors import InputError
    from dsv4_offload.sources import check as series_check
    from dsv4_offload.sources import git as gitsrc
    from dsv4_offload.sources import series as series_ops

    pctx = kit.load_context(ctx, "patch")
    gitsrc.require_git()
    if bisect:
        if rev or only:
            raise InputError("--bisect TARGET=REF names its own target and REF; drop --rev "
                             "and --only")
        _bisect(ctx, pctx, bisect, junit, markdown, gitsrc.mirrors_from(mirror, pctx.recipe))
    revs: dict[str, str] = {}
    for item in rev:
        name, sep, ref = item.partition("=")
        if not sep or not name or not ref:
            raise InputError(f"--rev {item!r}: expected TARGET=REF, e.g. --rev sglang=main")
        revs[name] = ref
    mirrors = gitsrc.mirrors_from(mirror, pctx.recipe)
    log = pctx.log_dir / "check.log"
    report = series_check.check_series(pctx.recipe, pctx.series, log, mirrors=mirrors,
                                     revs=revs, only=_split(only) or None)
    if junit:
        series_ops.write_report(Path(junit), series_check.junit_xml(report))
    if markdown:
        series_ops.write_report(Path(markdown),
                                series_check.markdown_summary(report).encode("utf-8"))
    data: dict[str, Any] = report.as_dict()
    data["log"] = str(log)
    # the markers against the workspace's patched trees (unchecked where none is laid out)
    audited = _audit(pctx)
    data["audit"] = audited.as_dict()
    table = _table(("patch", "target", "base", "result", "detail"),
                   [(r.name, r.target, r.base[:12], r.status, r.detail) for r in report.rows],
                   status_col=3)
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items())
    ok = report.ok and audited.ok
    verdict = "ok" if ok else "failed"
    kit.emit(ctx, command="patch check", status=verdict, data=data, table=_shown(ctx, table),
                lines=[f"patch check: {verdict} — {counts}; log: {log}",
                       f"patch audit: {audited.summary()}", *_audit_errors(audited)])
    kit.exit_with(ExitCode.OK if ok else ExitCode.FAILED)


@patch_app.command("rebase")
def patch_rebase(
    ctx: typer.Context,
    spec: str | None = typer.Argument(None, metavar="TARGET=REF",
                                      help="The target and the upstream branch/tag/SHA to "
                                           "carry its patches onto."),
    out: str | None = typer.Option(None, "--out", metavar="DIR",
                                   help="Where <series>@<REF>/ is written (default: "
                                        "<workspace>/rebased; e.g. patches/ to commit it)."),
    cont: bool = typer.Option(False, "--continue", help="Go on after fixing a conflict."),
    abort: bool = typer.Option(False, "--abort", help="Drop the rebase under way."),
    mirror: list[str] = typer.Option([], "--mirror", metavar="NAME=URL", help=_MIRROR_HELP),
) -> None:
    """Carry TARGET's patches onto a newer upstream REF as a new series (maintainers).

    \b
    1. REF's history into the blob-less history cache; the patches applied as commits on
       the pinned commit in a work tree <workspace>/rebase/TARGET.
    2. Each commit cherry-picked (3-way) onto REF in branch dsv4-rebase/TARGET-REF; one
       already upstream is dropped. At a conflict it stops: fix the files there, `git add`
       them, `patch rebase --continue`; or `patch rebase --abort`.
    3. Done: DIR/<series>@<REF>/ holds the regenerated patches, a series file (new sha256,
       origin file, upstream status kept, a note per patch) and recipe.yaml, an overlay
       (`extends:` the recipe) pinning REF: use it with --recipe for check, apply or run.
    The workspace's checkouts are never touched.
    """
    from pathlib import Path

    from dsv4_offload.core.errors import InputError
    from dsv4_offload.sources import carry
    from dsv4_offload.sources import git as gitsrc

    pctx = kit.load_context(ctx, "patch")
    if cont + abort + (spec is not None) != 1:
        raise InputError("patch rebase: give TARGET=REF to start, or --continue, or --abort")
    gitsrc.require_git()
    log = pctx.log_dir / "rebase.log"
    ws = pctx.workspace
    with ws.lock("patch rebase"):
        if abort:
            outcome = carry.rebase_abort(ws, log)
        elif cont:
            outcome = carry.rebase_continue(pctx.recipe, pctx.series, ws, log)
        else:
            assert spec is not None
            target, ref = carry.parse_target_ref(spec, "patch rebase")
            outcome = carry.rebase_start(pctx.recipe, pctx.series, ws, target, ref, log,
                                         out=Path(out) if out else None,
                                         mirrors=gitsrc.mirrors_from(mirror, pctx.recipe))
    s = outcome.state
    table = _table(("patch", "state", "note"),
                   [(p.name, p.state, p.note or ", ".join(p.files)) for p in s.picks])
    lines = [f"patch rebase {s.target} {s.pinned[:12]} -> {s.ref} ({s.ref_commit[:12]}): "
             f"{outcome.status}; {outcome.message}"]
    if outcome.status == "stopped":
        lines += [f"fix {', '.join(outcome.conflicts)} in {s.worktree}, then "
                  f"`git -C {s.worktree} add <files>` and `dsv4-offload patch rebase "
                  "--continue`; or `dsv4-offload patch rebase --abort` (the pinned state is "
                  "untouched)"]
    elif outcome.status == "done":
        lines += [f"series: {outcome.series_file}", f"recipe overlay: {outcome.recipe_file} "
                  f"(dsv4-offload --recipe {outcome.recipe_file} patch check)"]
    lines.append(f"log: {log}")
    data = outcome.as_dict()
    data["log"] = str(log)
    stopped = outcome.status == "stopped"
    kit.emit(ctx, command="patch rebase", status="failed" if stopped else "ok", data=data,
             table=_shown(ctx, table), lines=lines)
    kit.exit_with(ExitCode.FAILED if stopped else ExitCode.OK)


def _bisect(ctx: typer.Context, pctx: Any, items: list[str], junit: str | None,
            markdown: str | None, mirrors: dict[str, list[str]]) -> NoReturn:
    from pathlib import Path

    from dsv4_offload.sources import carry
    from dsv4_offload.sources import series as series_ops

    log = pctx.log_dir / "bisect.log"
    reports = []
    for item in items:
        target, ref = carry.parse_target_ref(item, "--bisect")
        reports.append(carry.bisect_target(pctx.recipe, pctx.series, target, ref, log,
                                           mirrors=mirrors))
    if junit:
        series_ops.write_report(Path(junit), carry.bisect_junit(reports))
    if markdown:
        series_ops.write_report(Path(markdown), carry.bisect_markdown(reports).encode("utf-8"))
    ok = all(r.ok for r in reports)
    table = _table(("patch", "target", "at REF", "last clean", "first offset", "first fuzz",
                    "first fails", "first upstream"), carry.bisect_rows(reports))
    lines = [f"patch bisect {r.target}: {r.pinned[:12]}..{r.ref} ({r.ref_commit[:12]}): "
             f"{r.commits_walked} commits walked, {r.commits_checked} checked in "
             f"{r.seconds:.2f} s ({r.fetch_seconds:.2f} s fetching)"
             + (f"; note: {r.note}" if r.note else "") for r in reports]
    kit.emit(ctx, command="patch check --bisect", status="ok" if ok else "failed",
             data={"ok": ok, "targets": [r.as_dict() for r in reports], "log": str(log)},
             table=_shown(ctx, table), lines=[*lines, f"log: {log}"])
    kit.exit_with(ExitCode.OK if ok else ExitCode.FAILED)


def _shown(ctx: typer.Context, table: Any) -> Any:
    """--quiet prints only the result line."""
    return None if kit.options_of(ctx).quiet else table


def _table(columns: tuple[str, ...], rows: list[tuple[Any, ...]], status_col: int = 2) -> Any:
    from dsv4_offload.cli.render import simple_table

    return simple_table(columns, rows, status_col)
