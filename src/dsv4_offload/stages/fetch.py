"""fetch: every source of the recipe at its pinned commit, laid out in the workspace.

1. each source's commit into the shared bare-repo cache (by SHA, with fallbacks, mirrors);
2. outer checkouts before nested ones: ktransformers is the tree, sglang and llama.cpp go
   to its ``third_party/`` at their own commits (never ``git submodule update``);
3. a checkout already at its commit (or at it plus series patches) is left as it is; a
   dirty one, one on another commit or a non-repo is reported, or moved aside with --force.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.core.inflight import human_bytes
from dsv4_offload.core.options import StageOptions
from dsv4_offload.core.results import Problem, StageResult, Status
from dsv4_offload.recipe.sourcelock import apply_source_locks
from dsv4_offload.sources import git as gitsrc
from dsv4_offload.workspace.context import StageContext


class FetchOptions(StageOptions):
    mirrors: tuple[str, ...] = ()  # NAME=URL items, tried before the recipe's URLs
    force: bool = False


Options = FetchOptions


def run(ctx: StageContext) -> StageResult:
    gitsrc.require_git()
    recipe, ws = ctx.recipe, ctx.workspace
    options = ctx.options_as(FetchOptions)
    mirrors = gitsrc.mirrors_from(list(options.mirrors), recipe)
    force = options.force
    log = ctx.log_dir / "git.log"
    rows: list[dict[str, Any]] = []
    problems: list[Problem] = []
    blocked_paths: list[Path] = []
    total_bytes = 0
    locked = _resolve_prefixes(ctx, mirrors, log, problems)

    with ctx.task("sources", total=len(recipe.sources)) as overall:
        for source in gitsrc.checkout_order(recipe):
            path = ws.source_dir(recipe, source.name)
            if source.commit_prefix is not None and source.name not in locked:
                rows.append({"name": source.name, "commit": None, "path": str(path),
                             "checkout": "skipped", "cache": "failed"})
                blocked_paths.append(path)
                overall.advance()
                continue
            row: dict[str, Any] = {"name": source.name, "commit": source.pinned,
                                   "path": str(path)}
            if source.commit_prefix is not None:
                row["commit_prefix"] = source.commit_prefix
                row["lock"] = locked[source.name]
            rows.append(row)
            if any(path.is_relative_to(b) for b in blocked_paths):
                row["checkout"] = "skipped"
                problems.append(Problem("error", f"{source.name}: not placed: the checkout "
                                        "it lives in is not in place (see above)",
                                        check=source.name))
                overall.advance()
                continue
            try:
                with ctx.task(f"fetch {source.name}", unit="bytes") as task:
                    outcome = gitsrc.fetch_commit(source, log=log, mirrors=mirrors, task=task)
            except Dsv4Error as exc:
                row["cache"] = "failed"
                # an InputError (the git cache, a mirror URL, a ref) is no network fault
                row["unreachable"] = not isinstance(exc, InputError)
                fix = exc.hint or ""
                problems.append(Problem("error", exc.message, check=source.name,
                                        fix=f"{fix}; see the log: {log}".lstrip("; ")))
                blocked_paths.append(path)
                overall.advance()
                continue
            row.update(cache=outcome.method, url=outcome.url, bytes=outcome.bytes_received)
            total_bytes += outcome.bytes_received
            row["checkout"] = _place(source, path, force, log, problems, blocked_paths)
            if source.submodule_of and row["checkout"] != "blocked":
                _check_gitlink(ctx, source, problems)
            overall.advance()

    outputs = {r["name"]: r["commit"] for r in rows if r.get("checkout") in
               ("created", "pinned", "patched", "recreated")}
    failed = [p for p in problems if p.severity == "error"]
    placed = sum(1 for r in rows if r["name"] in outputs)
    fetched = sum(1 for r in rows if r.get("cache") in ("sha", "ref", "heads"))
    cached = sum(1 for r in rows if r.get("cache") == "cached")
    unreachable = sum(1 for r in rows if r.get("cache") == "failed"
                      and r.get("unreachable", True))
    summary = (f"{placed}/{len(rows)} sources at their pinned commits; {fetched} fetched "
               f"({human_bytes(total_bytes)}), {cached} from the cache"
               + (f", {unreachable} unreachable" if unreachable else ""))
    warned = any(p.severity == "warning" for p in problems)
    status = Status.FAILED if failed else (Status.WARN if warned else Status.OK)
    return StageResult(status, summary, data={"sources": rows, "cache": str(gitsrc.cache_root())},
                       problems=problems, outputs=outputs if not failed else {}, log=str(log))


def _resolve_prefixes(ctx: StageContext, mirrors: dict[str, list[str]], log: Path,
                      problems: list[Problem]) -> dict[str, str]:
    """Prefix-pinned sources: the locked SHA, else resolved once on the branch and locked.

    Returns ``name -> "locked" | "resolved"`` for the sources that now have a full SHA.
    """
    lock_file = ctx.workspace.sources_lock_file
    unlocked = set(apply_source_locks(ctx.recipe, lock_file))
    out: dict[str, str] = {}
    for source in ctx.recipe.sources:
        if source.commit_prefix is None:
            continue
        if source.name not in unlocked:
            out[source.name] = "locked"
            continue
        try:
            with ctx.task(f"resolve {source.name} {source.commit_prefix}", unit="bytes") as task:
                commit = gitsrc.resolve_commit_prefix(source, log=log, mirrors=mirrors,
                                                      task=task)
        except Dsv4Error as exc:
            problems.append(Problem("error", exc.message, check=source.name,
                                    fix=f"see the log: {log}"))
            continue
        source.lock(commit)
        gitsrc.write_source_lock(lock_file, source, commit)
        out[source.name] = "resolved"
        problems.append(Problem("info", f"{source.name}: {source.commit_prefix} on "
                                f"{source.branch} is {commit}; locked in {lock_file}",
                                check=source.name))
    return out


def _place(source: Any, path: Path, force: bool, log: Path, problems: list[Problem],
           blocked_paths: list[Path]) -> str:
    state = gitsrc.inspect_checkout(path, source.pinned)
    if state.usable:
        return state.kind
    if state.kind == "absent":
        gitsrc.create_checkout(path, source, log)
        return "created"
    if not force:
        blocked_paths.append(path)
        problems.append(Problem(
            "error", f"{source.name}: {path} is {state.kind.replace('-', ' ')}: {state.detail}",
            fix="commit or move your changes, or rerun with --force (moves it aside, "
                "never deletes)", check=source.name))
        return "blocked"
    moved = gitsrc.move_aside(path)
    problems.append(Problem("warning", f"{source.name}: {state.kind} checkout moved to {moved}",
                            fix="delete it once you have kept what you need", check=source.name))
    gitsrc.create_checkout(path, source, log)
    return "recreated"


def _check_gitlink(ctx: StageContext, source: Any, problems: list[Problem]) -> None:
    """A submodule pinned at another commit than its parent records deserves a note."""
    parent = ctx.recipe.source(source.submodule_of)
    parent_dir = ctx.workspace.source_dir(ctx.recipe, parent.name)
    src_dir = ctx.workspace.source_dir(ctx.recipe, source.name)
    if not src_dir.is_relative_to(parent_dir) or not (parent_dir / ".git").exists():
        return
    rel = src_dir.relative_to(parent_dir).as_posix()
    recorded = gitsrc.gitlink_commit(parent_dir, parent.pinned, rel)
    if recorded and recorded != source.pinned:
        problems.append(Problem(
            "info", f"{source.name}: {parent.name} records {recorded[:12]} at {rel}; the recipe "
            f"pins {source.pinned[:12]}", check=source.name))
