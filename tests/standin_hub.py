"""A stand-in model hub on 127.0.0.1 for the real `huggingface_hub` and `modelscope` clients.

It speaks the few endpoints a snapshot download uses:

Hugging Face
- ``GET /api/models/{repo}/revision/{rev}``          repo info with the resolved commit sha
- ``GET /api/models/{repo}/commits/{rev}``           the commit history, newest first
  (huggingface_hub 2.4.0 hf_api.py:4252-4267 reads ``id``, ``authors[].user``, ``date``,
  ``title``, ``message`` of each item)
- ``GET /api/models/{repo}/tree/{rev}[/{dir}]``       file listing (size, git oid, LFS sha256)
- ``HEAD|GET /{repo}/resolve/{rev}/{file}``           file metadata headers / bytes (Range);
  LFS files answer 302 to ``/cdn/{repo}/{sha256}`` with X-Linked-Size / X-Linked-Etag,
  the way the Hub sends large files to its CDN

ModelScope
- ``GET /api/v1/models/{repo}/repo/files?Revision=``  file listing (Path, Size, Sha256)
- ``GET /api/v1/models/{repo}/repo?FilePath=...``     file bytes (Range), at ``Revision``
- ``GET /api/v1/models/{repo}/commits?Ref=&PageNumber=&PageSize=``  the commit history,
  newest first, as modelscope 1.40.2 reads it (utils/repo_utils.py:298-357:
  ``Data.Commit[]`` with ``Id``, ``ShortId``, ``Title``, ``CommittedDate``..., and
  ``TotalCount``; hub/utils/utils.py:562 reads an integer date as UNIX seconds)

Every request is recorded, with the body bytes sent for it, so tests can count data
requests and bytes (``sent_by_file``). ``throttle`` (bytes/s) paces file bodies, so a small
synthetic checkpoint takes seconds to download: time to watch or kill it. Files listed in
``corrupt_served`` are served with one flipped byte (same size) to play a hub or proxy
that hands out bad data; ``phantom`` adds listing entries that are never served (a hostile
hub's absolute or ``..`` paths); ``listing_body`` replaces the listings' JSON with raw bytes.
``move_to`` pushes a new commit (dated a day after the head, or as given): the branches
follow it, and both hubs still serve the earlier commits by their sha, as the hubs do.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

# Files at or above this size are "LFS" files on the HF side (listing carries a sha256).
LFS_THRESHOLD = 1024
# the first commit of every stand-in repo: before the bundled recipes' not_after (2026-08-06)
FIRST_COMMIT_DATE = dt.datetime(2026, 7, 1, 8, 0, tzinfo=dt.timezone.utc)


def git_blob_oid(data: bytes) -> str:
    """The git blob id of ``data`` (what the Hub lists as ``oid`` for non-LFS files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
    repo_id: str
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    revisions: tuple[str, ...] = ("main", "master")
    corrupt_served: set[str] = field(default_factory=set)
    phantom: dict[str, int] = field(default_factory=dict)  # path -> claimed size, never served
    # a hostile hub: the listing endpoints answer these bytes instead (an HTML page, junk)
    listing_body: bytes | None = None
    # earlier commits, still served by their sha: commit -> its files (oldest first)
    history: dict[str, dict[str, bytes]] = field(default_factory=dict)
    # commit -> when it was committed (UTC); a commit not named here is FIRST_COMMIT_DATE
    dates: dict[str, dt.datetime] = field(default_factory=dict)

    def move_to(self, commit: str, files: dict[str, bytes],
                date: dt.datetime | None = None) -> None:
        """Push a new commit: the branches point at it, the old one stays fetchable by sha."""
        when = date or self.date_of(self.commit) + dt.timedelta(days=1)
        self.history[self.commit] = self.files
        self.commit, self.files = commit, files
        self.dates[commit] = when

    def date_of(self, commit: str) -> dt.datetime:
        return self.dates.get(commit, FIRST_COMMIT_DATE)

    def log(self, rev: str) -> list[str] | None:
        """The commits reachable from ``rev``, newest first; None when there is no such rev."""
        chain = [self.commit, *reversed(list(self.history))]
        if rev in self.revisions or rev == self.commit:
            return chain
        if rev in self.history:
            return chain[chain.index(rev):]
        return None

    def at(self, rev: str) -> tuple[str, dict[str, bytes]] | None:
        """(commit, files) a branch or commit sha names, None when the hub has no such one."""
        if rev in self.revisions or rev == self.commit:
            return self.commit, self.files
        if rev in self.history:
            return rev, self.history[rev]
        return None

    def sha256(self, path: str, files: dict[str, bytes] | None = None) -> str:
        return hashlib.sha256((self.files if files is None else files)[path]).hexdigest()

    def served_bytes(self, path: str, files: dict[str, bytes] | None = None) -> bytes:
        data = (self.files if files is None else files)[path]
        if path in self.corrupt_served and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    sent: int = 0  # body bytes written for it (a dropped connection stops the count)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        # clients drop connections mid-body when they reject data: not a server fault
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class StandinHub:
    """Start with ``with StandinHub(repos) as hub:``; ``hub.url`` is the endpoint."""

    def __init__(self, repos: list[HubRepo]) -> None:
        self.repos = {r.repo_id: r for r in repos}
        self.requests: list[Request] = []
        self.throttle: float | None = None  # bytes per second for file bodies, to interrupt
        self._lock = threading.Lock()
        self._server = _QuietServer(("127.0.0.1", 0), self._handler_class())
        # a second port plays the CDN: another origin, so the client does not follow the
        # redirect on HEAD and reads the file's metadata from the 302 itself, as on the Hub
        self._cdn = _QuietServer(("127.0.0.1", 0), self._handler_class())
        # a short poll, so stopping the hub takes milliseconds, not half a second
        self._threads = [threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
                         for srv in (self._server, self._cdn)]

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def cdn_url(self) -> str:
        host, port = self._cdn.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> StandinHub:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for srv in (self._server, self._cdn):
            srv.shutdown()
            srv.server_close()

    def data_requests(self) -> list[Request]:
        """Requests that fetch or probe file contents (not listings)."""
        return [r for r in self.requests
                if "/resolve/" in r.path or "/repo?" in r.path or r.path.startswith("/cdn/")]

    def record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def file_of(self, req: Request) -> tuple[str, str] | None:
        """(repo id, file path) a data request reads, or None for listings and probes."""
        path = unquote(urlsplit(req.path).path)
        query = {k: v[0] for k, v in parse_qs(urlsplit(req.path).query).items()}
        if m := re.fullmatch(r"/cdn/([^/]+/[^/]+)/([0-9a-f]{64})", path):
            repo = self.repos.get(m[1])
            name = next((p for p in (repo.files if repo else {}) if repo
                         and repo.sha256(p) == m[2]), None)
            return (m[1], name) if name else None
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return m[1], m[3]
        if m := re.fullmatch(r"/api/v1/models/([^/]+/[^/]+)/repo", path):
            return (m[1], query["FilePath"]) if "FilePath" in query else None
        return None

    def sent_by_file(self) -> dict[tuple[str, str], int]:
        """Body bytes served per (repo id, file), over every request so far."""
        out: dict[tuple[str, str], int] = {}
        for req in list(self.requests):
            key = self.file_of(req)
            if key is not None and req.sent:
                out[key] = out.get(key, 0) + req.sent
        return out

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

            def do_HEAD(self) -> None:
                self._dispatch(head=True)

            def do_GET(self) -> None:
                self._dispatch(head=False)

            # --- plumbing ---
            def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool,
                      throttle: bool = False) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if head:
                    return
                req = getattr(self, "_request", None)
                rate = hub.throttle if throttle else None
                if not rate:
                    self.wfile.write(body)
                    if req is not None:
                        req.sent += len(body)
                    return
                step = max(1, int(rate / 10))
                t0 = time.monotonic()
                for i in range(0, len(body), step):
                    chunk = body[i:i + step]
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    if req is not None:
                        req.sent += len(chunk)
                    # paced by the clock: `rate` bytes a second over the whole body (a last
                    # short chunk waits only for its own bytes, writes take no extra time)
                    time.sleep(max(0.0, t0 + (i + len(chunk)) / rate - time.monotonic()))

            def _json(self, value: object, head: bool = False, status: int = 200,
                      extra: dict[str, str] | None = None) -> None:
                body = json.dumps(value).encode()
                self._send(status, body, {"Content-Type": "application/json", **(extra or {})},
                           head)

            def _not_found(self, head: bool, what: str,
                           extra: dict[str, str] | None = None) -> None:
                headers = {"X-Error-Code": "EntryNotFound", "X-Error-Message": what,
                           **(extra or {})}
                self._json({"error": what}, head, 404, headers)

            def _repo(self, repo_id: str) -> HubRepo | None:
                return hub.repos.get(repo_id)

            def _dispatch(self, head: bool) -> None:
                split = urlsplit(self.path)
                path = unquote(split.path)
                self._request = Request(self.command, self.path, self.headers.get("Range"))
                hub.record(self._request)
                query = {k: v[0] for k, v in parse_qs(split.query).items()}
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path):
                    return self._hf_revision(m[1], m[2], head)
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/commits/([^/]+)", path):
                    return self._hf_commits(m[1], m[2], head)
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path):
                    return self._hf_tree(m[1], m[2], (m[3] or "").strip("/"), head)
                if m := re.fullmatch(r"/cdn/([^/]+/[^/]+)/([0-9a-f]{64})", path):
                    return self._cdn(m[1], m[2], head)
                if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                    return self._hf_resolve(m[1], m[2], m[3], head)
                if m := re.fullmatch(r"/api/v1/models/([^/]+/[^/]+)/commits", path):
                    return self._ms_commits(m[1], query, head)
                if m := re.fullmatch(r"/api/v1/models/([^/]+/[^/]+)/repo/files", path):
                    return self._ms_files(m[1], query, head)
                if m := re.fullmatch(r"/api/v1/models/([^/]+/[^/]+)/repo", path):
                    return self._ms_file(m[1], query, head)
                if m := re.fullmatch(r"/api/v1/models/([^/]+/[^/]+)", path):
                    repo = self._repo(m[1])
                    if repo is None:
                        return self._json({"Code": 10010205001, "Message": "not found"}, head, 404)
                    return self._json({"Code": 200, "Data": {"Path": repo.repo_id.split("/")[0],
                                                            "Name": repo.repo_id.split("/")[1]}},
                                      head)
                self._not_found(head, f"no route for {path}")

            # --- Hugging Face ---
            def _hf_revision(self, repo_id: str, rev: str, head: bool) -> None:
                repo = self._repo(repo_id)
                if repo is None:
                    return self._json({"error": "Repository not found"}, head, 404,
                                      {"X-Error-Code": "RepoNotFound"})
                snap = repo.at(rev)
                if snap is None:
                    return self._json({"error": "Revision not found"}, head, 404,
                                      {"X-Error-Code": "RevisionNotFound"})
                siblings = [{"rfilename": p} for p in sorted(snap[1])]
                self._json({"id": repo_id, "modelId": repo_id, "sha": snap[0],
                            "lastModified": _hf_date(repo.date_of(snap[0])),
                            "private": False, "siblings": siblings}, head)

            def _hf_commits(self, repo_id: str, rev: str, head: bool) -> None:
                repo = self._repo(repo_id)
                if repo is None:
                    return self._json({"error": "Repository not found"}, head, 404,
                                      {"X-Error-Code": "RepoNotFound"})
                log = repo.log(rev)
                if log is None:
                    return self._json({"error": "Revision not found"}, head, 404,
                                      {"X-Error-Code": "RevisionNotFound"})
                self._json([{"id": c, "authors": [{"user": "standin"}],
                             "date": _hf_date(repo.date_of(c)), "title": f"commit {c[:7]}",
                             "message": ""} for c in log], head)

            def _hf_tree(self, repo_id: str, rev: str, sub: str, head: bool) -> None:
                repo = self._repo(repo_id)
                if repo is None:
                    return self._json({"error": "Repository not found"}, head, 404,
                                      {"X-Error-Code": "RepoNotFound"})
                if repo.listing_body is not None:
                    return self._send(200, repo.listing_body, {"Content-Type": "text/html"},
                                      head)
                snap = repo.at(rev)
                if snap is None:
                    return self._json({"error": "Revision not found"}, head, 404,
                                      {"X-Error-Code": "RevisionNotFound"})
                entries = []
                for p, data in sorted(snap[1].items()):
                    if sub and not p.startswith(sub + "/"):
                        continue
                    entry: dict[str, object] = {"type": "file", "path": p, "size": len(data),
                                                "oid": git_blob_oid(data)}
                    if len(data) >= LFS_THRESHOLD:
                        entry["lfs"] = {"oid": repo.sha256(p, snap[1]), "size": len(data),
                                        "pointerSize": 134}
                    entries.append(entry)
                for p, size in sorted(repo.phantom.items()):
                    entries.append({"type": "file", "path": p, "size": size, "oid": "0" * 40,
                                    "lfs": {"oid": "0" * 64, "size": size, "pointerSize": 134}})
                self._json(entries, head)

            def _hf_resolve(self, repo_id: str, rev: str, fname: str, head: bool) -> None:
                repo = self._repo(repo_id)
                snap = repo.at(rev) if repo else None
                if repo is None or snap is None or fname not in snap[1]:
                    return self._not_found(head, f"{fname} not found",
                                           {"X-Repo-Commit": repo.commit} if repo else None)
                commit, files = snap
                true = files[fname]
                if len(true) >= LFS_THRESHOLD:
                    sha = repo.sha256(fname, files)
                    return self._send(302, b"", {
                        "Location": f"{hub.cdn_url}/cdn/{repo_id}/{sha}",
                        "X-Repo-Commit": commit, "X-Linked-Etag": f'"{sha}"',
                        "X-Linked-Size": str(len(true)), "ETag": '"pointer-oid"'}, head)
                headers = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_oid(true)}"',
                           "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
                self._ranged(repo.served_bytes(fname, files), headers, head)

            def _cdn(self, repo_id: str, sha: str, head: bool) -> None:
                repo = self._repo(repo_id)
                found = next(((p, files) for files in ([repo.files, *repo.history.values()]
                                                       if repo else [])
                              for p in files if repo and repo.sha256(p, files) == sha), None)
                if repo is None or found is None:
                    return self._not_found(head, "no such blob")
                self._ranged(repo.served_bytes(*found), {
                    "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                    "ETag": f'"{sha}"'}, head)

            # --- ModelScope ---
            def _ms_commits(self, repo_id: str, query: dict[str, str], head: bool) -> None:
                repo = self._repo(repo_id)
                log = repo.log(query.get("Ref", "master")) if repo else None
                if repo is None or log is None:
                    return self._json({"Code": 10010205001, "Message": "model not found",
                                       "Success": False}, head, 404)
                size = int(query.get("PageSize", "50"))
                start = (int(query.get("PageNumber", "1")) - 1) * size
                page = [{"Id": c, "ShortId": c[:8], "Title": f"commit {c[:7]}", "Message": "",
                         "AuthorName": "standin", "AuthorEmail": "",
                         "AuthoredDate": int(repo.date_of(c).timestamp()),
                         "CommittedDate": int(repo.date_of(c).timestamp()),
                         "CommitterName": "standin", "CommitterEmail": "",
                         "CreatedAt": int(repo.date_of(c).timestamp())}
                        for c in log[start:start + size]]
                self._json({"Code": 200, "Success": True, "Message": "success",
                            "Data": {"Commit": page}, "TotalCount": len(log)}, head)

            def _ms_files(self, repo_id: str, query: dict[str, str], head: bool) -> None:
                repo = self._repo(repo_id)
                snap = repo.at(query.get("Revision", "master")) if repo else None
                if repo is None or snap is None:
                    return self._json({"Code": 10010205001, "Message": "model not found",
                                       "Success": False}, head, 404)
                if repo.listing_body is not None:
                    return self._send(200, repo.listing_body, {"Content-Type": "text/html"},
                                      head)
                files = []
                for p, data in sorted(snap[1].items()):
                    files.append({"Path": p, "Name": p.rsplit("/", 1)[-1], "Type": "blob",
                                  "Size": len(data), "Sha256": repo.sha256(p, snap[1]),
                                  "Revision": snap[0]})
                for p, size in sorted(repo.phantom.items()):
                    files.append({"Path": p, "Name": p, "Type": "blob", "Size": size,
                                  "Sha256": "0" * 64, "Revision": repo.commit})
                self._json({"Code": 200, "Success": True, "Data": {"Files": files}}, head)

            def _ms_file(self, repo_id: str, query: dict[str, str], head: bool) -> None:
                repo = self._repo(repo_id)
                fname = query.get("FilePath", "")
                snap = repo.at(query.get("Revision", "master")) if repo else None
                if repo is None or snap is None or fname not in snap[1]:
                    return self._json({"Code": 10010205001, "Message": "file not found"}, head, 404)
                self._ranged(repo.served_bytes(fname, snap[1]),
                             {"Content-Type": "application/octet-stream",
                              "Accept-Ranges": "bytes"}, head)

            def _ranged(self, data: bytes, headers: dict[str, str], head: bool) -> None:
                rng = self.headers.get("Range")
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
                if m:
                    start = int(m[1])
                    end = int(m[2]) if m[2] else len(data) - 1
                    if start >= len(data):
                        return self._send(416, b"", {**headers,
                                                     "Content-Range": f"bytes */{len(data)}"},
                                          head)
                    end = min(end, len(data) - 1)
                    part = data[start:end + 1]
                    return self._send(206, part, {
                        **headers, "Content-Range": f"bytes {start}-{end}/{len(data)}"}, head,
                        throttle=True)
                self._send(200, data, headers, head, throttle=True)

        return Handler


def _hf_date(when: dt.datetime) -> str:
    """A date as the Hub writes it (``2022-08-19T07:19:38.123Z``, what huggingface_hub's
    parse_datetime reads: utils/_datetime.py:19)."""
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def tiny_model_repo(repo_id: str, *, commit: str | None = None) -> HubRepo:
    """A small repo shaped like a model: config, a safetensors shard and a tokenizer."""
    import struct

    header = {"w": {"dtype": "I8", "shape": [64, 32], "data_offsets": [0, 2048]}}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    tensor = bytes(range(256)) * 8
    safetensors = struct.pack("<Q", len(blob)) + blob + tensor
    files = {
        "config.json": json.dumps({"model_type": "deepseek_v4", "num_hidden_layers": 2}).encode(),
        "model-00001-of-00001.safetensors": safetensors,
        "model.safetensors.index.json": json.dumps(
            {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"vocab": {"a": 0}}}).encode()
        * 40,
    }
    repo = HubRepo(repo_id, files)
    if commit:
        repo.commit = commit
    return repo


def isolate_clients(tmp_path: Path, monkeypatch: Any) -> None:
    """The real hub clients keep tokens and caches under HF_HOME and MODELSCOPE_CACHE: those
    go inside the test's tmp dir, and no endpoint or offline switch of the caller leaks in."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-cache"))
    for var in ("HF_ENDPOINT", "MODELSCOPE_ENDPOINT", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
