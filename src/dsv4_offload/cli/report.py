"""``report``: one redacted tar.gz to attach to a bug report.

What it holds: the resolved recipe (YAML) and the sources lock, the stage records (state,
provenance, the serve and container records), the doctor's JSON (run here, in this process;
its failure is recorded, not fatal), the versions of the tool, Python, every source (recipe
pin, lock, checkout HEAD) and every installed Python package, and the last lines of every
log of the workspace. Before anything is written, every text goes through :func:`scrub`:
URL credentials, the values of secret-looking environment variables (``*TOKEN*``,
``*SECRET*``, ``*PASSWORD*``, ``*API_KEY*``...), the contents of API key files the recipe
or a record names, and well-known token shapes (``hf_...``, ``sk-...``, ``ghp_...``,
``Bearer ...``, ``--api-key X``) become ``***``.
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import typer

from dsv4_offload.cli import kit

TAIL = 200  # last lines kept of each log
MASK = "***"
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_KEY|CREDENTIAL|AUTH", re.I)
# any scheme's user[:password]@ part (git+https, ftp, ssh://user@ too: a name can be a token)
_URL_USERINFO = re.compile(r"\b([a-z][a-z0-9+.-]*://)[^/@\s\"']+@", re.I)
_TOKEN_SHAPES = [
    re.compile(r"\bhf_[A-Za-z0-9]{16,}"),            # Hugging Face
    re.compile(r"\bsk-[A-Za-z0-9_-]{16,}"),          # OpenAI-style API keys
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"),     # GitHub
    re.compile(r"\bglpat-[A-Za-z0-9_-]{16,}"),       # GitLab
]
_KEY_VALUE = [
    re.compile(r"(\bBearer\s+)[^\s\"']+", re.I),
    re.compile(r"(--api-key[= ]\s*)[^\s\"']+"),
    re.compile(r"((?:api[_-]?key|token|secret|password)[\"']?\s*[:=]\s*[\"']?)[^\s\"'&,}]+",
               re.I),
]


def secret_values(env: dict[str, str], key_files: Iterable[str | Path]) -> list[str]:
    """The values to remove wherever they appear: secret-named variables' values and the
    contents (and each line) of the API key files."""
    values = [v for k, v in env.items() if _SECRET_NAME.search(k) and len(v) >= 6]
    for path in key_files:
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        values += [line.strip() for line in text.splitlines() if len(line.strip()) >= 6]
        if len(text.strip()) >= 6:
            values.append(text.strip())
    return sorted(set(values), key=len, reverse=True)  # longest first: no partial leftovers


def scrub(text: str, secrets: Iterable[str]) -> str:
    from dsv4_offload.core.runner import redact

    text = redact(text, secrets=list(secrets))
    for value in secrets:
        text = text.replace(value, MASK)
    text = _URL_USERINFO.sub(rf"\1{MASK}@", text)
    for pattern in _TOKEN_SHAPES:
        text = pattern.sub(MASK, text)
    for pattern in _KEY_VALUE:
        text = pattern.sub(rf"\g<1>{MASK}", text)
    return text


def _string_values(docs: tuple[Any, ...], wanted: Callable[[str, str], bool]) -> list[str]:
    """Every string value, anywhere in these JSON-like documents, whose key and value
    ``wanted`` accepts."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if isinstance(value, str) and value and wanted(str(key), value):
                    found.append(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for doc in docs:
        walk(doc)
    return found


def _key_files(*docs: Any) -> list[str]:
    """Every value of a key naming an API key file."""
    return _string_values(docs, lambda key, _value: "key_file" in key)


def _named_logs(*docs: Any) -> list[str]:
    """Log paths the records name (the server's log lives where serve put it)."""
    return _string_values(docs, lambda key, value: key.endswith("log") and value.startswith("/"))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _git_head(repo: Path) -> str | None:
    """A checkout's HEAD commit, read from its files (no git process)."""
    git = repo / ".git"
    if git.is_file():  # a worktree or submodule: "gitdir: PATH"
        text = git.read_text(errors="replace").strip()
        if text.startswith("gitdir:"):
            git = (repo / text.split(":", 1)[1].strip()).resolve()
    try:
        head = (git / "HEAD").read_text().strip()
    except OSError:
        return None
    if not head.startswith("ref:"):
        return head
    ref = head.split(":", 1)[1].strip()
    try:
        return (git / ref).read_text().strip()
    except OSError:
        pass
    try:
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return f"({ref}, unresolved)"


def _packages() -> dict[str, str]:
    from importlib import metadata

    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = getattr(dist, "name", None)
        if name:
            out[str(name)] = str(dist.version)
    return dict(sorted(out.items(), key=lambda kv: kv[0].lower()))


def _tail(path: Path, lines: int = TAIL) -> str:
    from collections import deque

    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines))
    except OSError as exc:
        return f"(unreadable: {exc.strerror})\n"


def _doctor(typer_ctx: typer.Context) -> Any:
    """The doctor stage's result document, evaluated through the pipeline without a record;
    an exception is recorded instead."""
    try:
        from dsv4_offload import pipeline

        return pipeline.evaluate(kit.load_context(typer_ctx, "doctor"), "doctor").as_dict()
    except Exception as exc:  # the report is for when things are broken: never fail on it
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"}


def collect(typer_ctx: typer.Context) -> tuple[dict[str, str], list[str]]:
    """The bundle's files (name → text, not yet scrubbed) and the secrets to remove."""
    import yaml

    from dsv4_offload import __version__
    from dsv4_offload.workspace.store import Workspace

    g = kit.options_of(typer_ctx)
    files: dict[str, str] = {}
    ws = Workspace.from_option(g.workspace)
    recipe_doc: Any = None
    sources: list[dict[str, Any]] = []
    try:
        ctx = kit.load_context(typer_ctx)
        recipe_doc = ctx.recipe.model_dump(mode="json", by_alias=True)
        files["recipe.yaml"] = yaml.safe_dump(recipe_doc, sort_keys=False, allow_unicode=True)
        origin = ctx.recipe.origin
        files["recipe-origin.txt"] = (
            f"file: {ctx.recipe.file}\n"
            + "".join(f"extends: {p}\n" for p in (origin.chain[1:] if origin else ()))
            + "".join(f"--set {o}\n" for o in (origin.overrides if origin else ())))
        for src in ctx.recipe.sources:
            sources.append({"name": src.name, "url": src.url, "commit": src.commit,
                            "ref": src.ref, "checkout": _git_head(ws.root / src.path)})
    except Exception as exc:  # a broken recipe is what some reports are about
        files["recipe-error.txt"] = f"{type(exc).__name__}: {exc}\n"
    records: list[Any] = []
    if ws.meta_dir.is_dir():
        for path in sorted(ws.meta_dir.rglob("*.json")):
            rel = path.relative_to(ws.meta_dir)
            files[f"records/{rel}"] = path.read_text(encoding="utf-8", errors="replace")
            records.append(_read_json(path))
    if ws.provenance_file.is_file():
        files["records/provenance.json"] = ws.provenance_file.read_text(errors="replace")
        records.append(_read_json(ws.provenance_file))
    if ws.sources_lock_file.is_file():
        files["sources.lock.json"] = ws.sources_lock_file.read_text(errors="replace")
    files["doctor.json"] = json.dumps(_doctor(typer_ctx), indent=2, default=str) + "\n"
    files["versions.json"] = json.dumps({
        "dsv4-offload": __version__, "python": sys.version, "executable": sys.executable,
        "platform": platform.platform(), "machine": platform.machine(),
        "sources": sources, "packages": _packages(),
    }, indent=2, default=str) + "\n"
    # the tool's logs (stages, serve, records' dirs), not every *.log of the source trees
    logs = sorted({p for d in (ws.root / "logs", ws.run_dir, ws.meta_dir) if d.is_dir()
                   for p in d.rglob("*.log") if p.is_file()})
    logs += sorted({Path(p) for p in _named_logs(*records) if Path(p).is_file()} - set(logs))
    for path in logs:  # at its place under the workspace's logs/ (the others beside them)
        rel = path.relative_to(ws.root / "logs") if path.is_relative_to(ws.root / "logs") \
            else path.relative_to(ws.root) if path.is_relative_to(ws.root) \
            else Path("elsewhere", *path.parts[1:])
        files[f"logs/{rel}.tail"] = _tail(path)
    files["README.txt"] = (
        f"dsv4-offload report, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
        f"workspace: {ws.root}{'' if ws.root.is_dir() else ' (does not exist)'}\n"
        f"{len(logs)} logs (last {TAIL} lines each): logs/X.tail is the workspace's logs/X, "
        "or X when the workspace has no logs/X, or elsewhere/X for /X. Redacted: URL "
        "credentials, secret-named environment variables' values, API key files' contents, "
        "token shapes; check the files before you share them anyway.\n")
    key_files = _key_files(recipe_doc, *records)
    return files, secret_values(dict(os.environ), key_files)


def write_bundle(files: dict[str, str], secrets: list[str], out: Path) -> Path:
    """The scrubbed files as `out` (tar.gz, one top directory), written atomically."""
    top = out.name.removesuffix(".tar.gz").removesuffix(".tgz")
    import tarfile  # here: every command's start-up imports this module

    from dsv4_offload.workspace.store import atomic_write_bytes

    bundle = io.BytesIO()
    with tarfile.open(fileobj=bundle, mode="w:gz") as tar:
        for name, text in sorted(files.items()):
            data = scrub(text, secrets).encode("utf-8")
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            info.mtime = int(time.time())
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    # a temp file of its own (two reports in the same second share the default name)
    atomic_write_bytes(out, bundle.getvalue())
    out.chmod(0o666 & ~_umask())  # as open() makes a file, not the temp file's 0600
    return out


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def register(app: typer.Typer) -> None:
    app.command("report")(report)


def report(
    ctx: typer.Context,
    out: str | None = typer.Option(
        None, "--out", "-o", metavar="FILE",
        help="Where to write the bundle (default ./dsv4-report-YYYYmmdd-HHMMSS.tar.gz)."),
) -> None:
    """A redacted tar.gz for a bug report: recipe, lock, records, doctor, versions, log tails.

    \b
    Tokens (HF_TOKEN and other *TOKEN*/*SECRET*/*API_KEY* variables), URL credentials and
    API key files' contents are replaced by ***. Nothing is sent anywhere.
    """
    target = Path(out) if out else Path(f"dsv4-report-{time.strftime('%Y%m%d-%H%M%S')}.tar.gz")
    files, secrets = collect(ctx)
    path = write_bundle(files, secrets, target.expanduser().absolute())
    names = sorted(files)
    kit.emit(ctx, command="report", status="ok",
             data={"report": str(path), "files": names, "redacted_values": len(secrets)},
             lines=[f"report: {path} ({len(names)} files, redacted); attach it to the issue"])
    kit.exit_with(0)
