"""Each hub's commit history: the one commit a weight set's revision names, on any host.

A branch moves; a commit does not. A set that names a branch with a date rule
(``not_after``) resolves, on every host and on any later day, to the newest commit of that
branch's history at or before the end of that day (UTC): pushes after the date change
nothing. A set that names a full commit resolves to it. A branch with no date rule resolves
to its head today, which is what a fleet must avoid (the download stage warns).

The history comes from the hub clients, read at their installed versions:

- Hugging Face: ``HfApi.model_info`` (huggingface_hub 2.4.0, hf_api.py:3145; ``sha`` and
  ``lastModified``, :916-918) names the head and its date; when the head is after the date,
  ``HfApi.list_repo_commits(repo_id, revision=<head>)`` (hf_api.py:4184-4269):
  ``GET /api/models/{repo}/commits/{revision}``, newest first, paged by the ``Link`` header
  (utils/_pagination.py:56), each item ``{"id", "authors": [{"user"}], "date", "title",
  "message"}`` read into ``GitCommitInfo`` (hf_api.py:1489).
- ModelScope: modelscope 1.40.2 keeps the commit-history shapes, ``CommitHistoryResponse``
  (modelscope/utils/repo_utils.py:332-357: ``Data.Commit[]`` of ``DetailedCommitInfo``,
  :283-312, ``Id``, ``CommittedDate``...; ``TotalCount``), and ``ModelInfo.sha`` reads the
  first of them (modelscope/hub/info.py:226-231), but its ``HubApi`` became a shim over
  modelscope_hub 0.5.1 and lost the call that fetched them (``list_repo_commits``:
  ``GET /api/v1/models/{repo}/commits`` with ``Ref``, ``PageNumber``, ``PageSize``, as
  modelscope's hub/api.py had it before the shim). So the request goes through the client's
  own session (``HubApi.session``, modelscope/hub/api.py:93-101, its cookies and proxies)
  and the answer is read by the client's own ``CommitHistoryResponse.from_api_response``.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.runner import redact
from dsv4_offload.recipe.fields import HEX40
from dsv4_offload.weights import hubs

MS_PAGE_SIZE = 50
MS_MAX_PAGES = 200  # 10,000 commits: past that a repository is not a model's history
HTTP_TIMEOUT_S = 60


@dataclass(frozen=True)
class Commit:
    """One commit of a hub repository: its full sha, its date (UTC, ISO 8601) and title."""

    sha: str
    date: str | None = None
    title: str = ""


def cutoff(not_after: dt.date) -> dt.datetime:
    """The first instant after ``not_after`` (UTC): commits before it qualify."""
    return dt.datetime.combine(not_after + dt.timedelta(days=1), dt.time(),
                               tzinfo=dt.timezone.utc)


def iso(when: dt.datetime | None) -> str | None:
    """``when`` in UTC as ``YYYY-MM-DDTHH:MM:SSZ`` (None stays None)."""
    if when is None:
        return None
    if when.tzinfo is None:  # a hub that names no zone means UTC
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def newest_before(commits: Iterable[tuple[str, dt.datetime | None, str]],
                  not_after: dt.date | None) -> Commit | None:
    """The first of ``commits`` (newest first, as both hubs list them) dated at or before
    ``not_after``; the first of all without a date rule."""
    limit = cutoff(not_after) if not_after is not None else None
    for sha, when, title in commits:
        if limit is None:
            return Commit(sha, iso(when), title)
        if when is None:
            continue  # an undated commit cannot be placed before the date
        aware = when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)
        if aware < limit:
            return Commit(sha, iso(when), title)
    return None


def resolve(hub: str, repo_id: str, revision: str, not_after: dt.date | None,
            endpoint: str, timeout: float = HTTP_TIMEOUT_S) -> tuple[Commit, Commit | None]:
    """The commit ``revision`` names under the date rule, through the hub's history, and
    the branch's head today (None for a full commit, which has no head to move). A
    ``timeout`` under HTTP_TIMEOUT_S asks once, without the clients' retries."""
    if HEX40.match(revision):
        if hub == "modelscope":
            # ModelScope's history is asked by branch; a full commit is its own answer
            # (the listing at it proves it exists)
            return Commit(revision), None
        not_after = None
    rows = iter(_history(hub, repo_id, revision, not_after, endpoint, timeout))
    first = next(rows, None)
    found = newest_before(itertools.chain([first], rows), not_after) if first else None
    if first is None or found is None:
        rule = f"at or before {not_after.isoformat()} (weights.*.not_after)" if not_after \
            else "at all"
        raise InputError(
            f"{hub} {repo_id}@{revision} has no commit {rule}; fix weights.*.revision or "
            "weights.*.not_after in the recipe")
    head = None if HEX40.match(revision) else Commit(first[0], iso(first[1]), first[2])
    return found, head


def _history(hub: str, repo_id: str, revision: str, not_after: dt.date | None,
             endpoint: str, timeout: float) -> Iterable[tuple[str, dt.datetime | None, str]]:
    """Commits of ``revision``, newest first; on the Hub, only as far as the rule needs."""
    if hub == "huggingface":
        return _huggingface(repo_id, revision, not_after, endpoint, timeout)
    if hub == "modelscope":
        return _modelscope(repo_id, revision, endpoint, timeout)
    raise InputError(f"unknown hub '{hub}'; use one of {list(hubs.HUBS)}")


def _huggingface(repo_id: str, revision: str, not_after: dt.date | None, endpoint: str,
                 timeout: float) -> list[tuple[str, dt.datetime | None, str]]:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint)
    with hubs.huggingface_errors(repo_id, revision, endpoint):
        # one plain request first: the head and its date often answer alone, and a hub that
        # cannot be reached fails here at once (the history's pager retries for ~20 s)
        info = api.model_info(repo_id, revision=revision, timeout=timeout)
        if not info.sha:
            raise ValueError(f"model info of {repo_id}@{revision} has no commit sha")
        if not_after is None or (info.last_modified is not None
                                 and info.last_modified < cutoff(not_after)):
            return [(info.sha, info.last_modified, "")]
        commits = api.list_repo_commits(repo_id, revision=info.sha)
    return [(c.commit_id, c.created_at, c.title) for c in commits]


def _modelscope(repo_id: str, revision: str, endpoint: str,
                timeout: float) -> Iterable[tuple[str, dt.datetime | None, str]]:
    """Pages of ``/api/v1/models/{repo}/commits``, newest first, read as they are needed."""
    import requests
    from modelscope.hub.api import HubApi
    from modelscope.utils.repo_utils import CommitHistoryResponse

    session = HubApi(endpoint=endpoint).session
    if timeout < HTTP_TIMEOUT_S:
        # a quick question (`status`): the client's session retries a refused connection
        # for ~15 s; a plain one with its headers and cookies asks once
        quick = requests.Session()
        quick.headers.update(session.headers)
        quick.cookies.update(session.cookies)
        session = quick
    url = f"{endpoint}/api/v1/models/{repo_id}/commits"
    seen = 0
    for page in range(1, MS_MAX_PAGES + 1):
        try:
            answer = session.get(url, params={"Ref": revision, "PageNumber": page,
                                              "PageSize": MS_PAGE_SIZE},
                                 timeout=timeout)
            if answer.status_code == 404:
                raise InputError(f"{repo_id}@{revision} not found on modelscope at "
                                 f"{redact(endpoint)}; fix weights.*.repo_id / revision in "
                                 "the recipe")
            answer.raise_for_status()
            body: Any = answer.json()
            if not isinstance(body, dict) or body.get("Code") != 200:
                raise ValueError(f"answer without Code 200: {str(body)[:120]}")
            history = CommitHistoryResponse.from_api_response(body)
            rows = [(c.id, c.committed_date, c.title or "") for c in history.commits or []]
            if any(not isinstance(sha, str) or not HEX40.match(sha) for sha, _, _ in rows):
                raise ValueError("a commit without a full 40-hex Id")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # before requests':
            # its JSONDecodeError is a RequestException too
            raise hubs.not_a_listing("modelscope", repo_id, endpoint, exc) from None
        except (requests.RequestException, OSError) as exc:
            raise hubs.unreachable("modelscope", repo_id, endpoint, exc) from None
        yield from rows
        seen += len(rows)
        if not rows or seen >= (history.total_count or 0):
            return
