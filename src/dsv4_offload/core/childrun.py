"""The protocol between this tool's own processes: one stage run by a child of this tool.

A pipelined `run` (pipeline/schedule.py) starts each stage as ``run --serial --from S --to S
--force S`` in a child process, and a stage the recipe puts in its container goes there the
same way through ``docker exec`` (serving/container.py). The parent lends the child its
workspace lock and hands it its options; the child runs the one stage, records it, and
prints one ``--json`` document (core/envelope) holding the stage's result. Every variable of
that protocol is named here; the settings a user exports (``DSV4_WORKSPACE``,
``DSV4_RUNTIME``, ``DSV4_CACHE`` ...) stay with the code that reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv4_offload.core.envelope import Envelope, MalformedDocument
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import StageResult

# set by our `docker exec` to the container's name: this process is inside it
IN_CONTAINER_ENV = "DSV4_IN_CONTAINER"
# the options handed to the child's one stage, as a JSON object (read once, then removed)
STAGE_OPTIONS_ENV = "DSV4_STAGE_OPTIONS"
# a lock holder that runs a stage in another process lends it its lock: the token it wrote
# into the lock file (workspace/store.py), passed to that process in this variable
HANDOFF_ENV = "DSV4_LOCK_HANDOFF"
# set for a borrower whose stdin is the lender's pipe: EOF there means the lender is gone
LENDER_PIPE_ENV = "DSV4_LENDER_PIPE"
# a pipelined run names itself to the stage processes it starts: one whose parent is no
# longer that run (killed outright: its children got the parent-death signal) says so
SCHEDULER_PID_ENV = "DSV4_SCHEDULER_PID"
# the pipelined run's event stream (core/events), appended to by every stage process
EVENTS_ENV = "DSV4_EVENTS_FILE"
# every child the tool starts carries its starter's identity (core/runner, core/procs): once
# the leader of a group is gone, only members carrying it are proven ours and signalled
GROUP_MARK_ENV = "DSV4_GROUP_MARK"
INTERNAL_ENV = (IN_CONTAINER_ENV, STAGE_OPTIONS_ENV, HANDOFF_ENV, LENDER_PIPE_ENV,
                SCHEDULER_PID_ENV, EVENTS_ENV, GROUP_MARK_ENV)
# what crosses into a container by name when set (`docker exec -e NAME`): the container's
# name and the lender's pipe go as values on its argv, the scheduler's pid stays on the host
PASSED_BY_NAME = (HANDOFF_ENV, STAGE_OPTIONS_ENV, EVENTS_ENV)


# --- the parent's side -----------------------------------------------------------------------


def tool_argv(python: str, workspace: Path | str, recipe: list[str], overrides: list[str],
              verbose: bool = False) -> list[str]:
    """This tool run by ``python`` on the same workspace, recipe (``--recipe X`` or nothing)
    and ``--set`` items: the words before its command."""
    argv = [python, "-m", "dsv4_offload", "--workspace", str(workspace), *recipe]
    for item in overrides:
        argv += ["--set", item]
    if verbose:
        argv.append("--verbose")
    return argv


def stage_argv(stage: str, device: Any = None) -> list[str]:
    """The command that runs ``stage`` alone (the serial run of that one stage, forced) and
    prints its result as the one JSON document."""
    argv = ["--json", "run", "--serial", "--from", stage, "--to", stage, "--force", stage]
    if device is not None:
        argv += ["--device", str(device)]
    return argv


def encode_options(options: Mapping[str, Any]) -> str:
    """The options as they cross: a JSON object (anything else as its str())."""
    return json.dumps(dict(options), default=str)


def stage_env(base: Mapping[str, str], token: str, options: Mapping[str, Any] | None = None,
              events_file: Path | None = None, scheduler_pid: int | None = None
              ) -> dict[str, str]:
    """``base`` with the lent lock's ``token``, the handed ``options``, the run's
    ``events_file`` and the ``scheduler_pid`` (each only when given)."""
    env = dict(base)
    env.pop(LENDER_PIPE_ENV, None)  # its lender is the process starting it, not ours
    env[HANDOFF_ENV] = token
    if options is not None:
        env[STAGE_OPTIONS_ENV] = encode_options(options)
    if events_file is not None:
        env[EVENTS_ENV] = str(events_file)
    if scheduler_pid is not None:
        env[SCHEDULER_PID_ENV] = str(scheduler_pid)
    return env


def passed_names(env: Mapping[str, str]) -> list[str]:
    """The protocol's variables set in ``env`` that cross into a container by name."""
    return [name for name in PASSED_BY_NAME if name in env]


@dataclass(frozen=True)
class ChildReport:
    """What a stage child printed: its stage's result, and the one-line error it ended with
    when it printed an error document."""

    result: StageResult | None = None
    error: str = ""


def read_report(text: str, stage: str) -> ChildReport:
    """The result of ``stage`` in a child's ``run --json`` document (``data.stages``); an
    empty report when the child printed no such document (it died, or was killed)."""
    try:
        doc = Envelope.parse(text)
    except MalformedDocument:
        return ChildReport()
    stages = doc.data.get("stages") if isinstance(doc.data, dict) else None
    got = stages.get(stage) if isinstance(stages, dict) else None
    result = None
    # a status word this version does not know, or a field of another shape, reads as no
    # result: as from a child that printed nothing
    with contextlib.suppress(ValueError, TypeError):
        result = StageResult.from_dict(got) if isinstance(got, dict) else None
    return ChildReport(result, doc.error_message)


# --- the child's side ------------------------------------------------------------------------


def handed_options(environ: MutableMapping[str, str] = os.environ) -> dict[str, Any]:
    """The options handed to this process's one stage: read once and taken out of the
    environment, so the processes the stage starts do not take them for their own."""
    raw = environ.pop(STAGE_OPTIONS_ENV, None)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        raise InputError(f"{STAGE_OPTIONS_ENV} is not JSON: {raw[:80]!r}; it is set by "
                         "dsv4-offload for its own stage processes: unset it") from None
    if not isinstance(value, dict):
        raise InputError(f"{STAGE_OPTIONS_ENV} is not a JSON object: {raw[:80]!r}; it is set "
                         "by dsv4-offload for its own stage processes: unset it")
    return value


def container_name() -> str:
    """The container our `docker exec` put this process in; empty outside one."""
    return os.environ.get(IN_CONTAINER_ENV, "")


def lent_token() -> str:
    """The token of the workspace lock lent to this process; empty when none was."""
    return os.environ.get(HANDOFF_ENV, "")


def on_lender_pipe() -> bool:
    """Whether this process's stdin is its lender's pipe (EOF: the lender is gone)."""
    return bool(os.environ.get(LENDER_PIPE_ENV))


def scheduler_pid() -> int | None:
    """The pid of the pipelined run that started this process; None outside one."""
    raw = os.environ.get(SCHEDULER_PID_ENV, "")
    return int(raw) if raw.isdigit() else None
