"""serve.extra_args and EXTRA_FLAGS checked before a launch: flags sglang knows, values of the
kind each takes, and the values known to break this server.

The table of flags is serving.sglang_flags (read from sglang's server_args, cited there). A
flag missing from it is a warning with the nearest known name: the pin may be newer than the
table. A value of the wrong kind, `--chunked-prefill-size` that is not a positive multiple of
the page size (the launcher refuses -1, L33-37: it overruns kt-kernel's buffer) or below the
chunk the plan needs, and a second port that clashes with the server's, are refused with one
line naming the flag and where it came from. ``recipe_check`` applies the same rules to the
recipe alone, at recipe load, so `recipe validate`, `doctor` and `run` say it before any work.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import FAIL, OK, WARN, Check
from dsv4_offload.serving.flags import sglang_flags
from dsv4_offload.serving.rules import RECIPE, chunked_prefill
from dsv4_offload.serving.sglang_flags import FLOATS, INTS, LISTS, SOURCE, STRINGS, SWITCHES

if TYPE_CHECKING:
    from dsv4_offload.recipe import Serve

KNOWN = SWITCHES | INTS | FLOATS | STRINGS | LISTS


@dataclass(frozen=True)
class Needs:
    """What the plan derived that extra arguments must not undercut."""

    page_size: int
    chunk: int  # the plan's --chunked-prefill-size
    chunk_why: str  # what that chunk covers ("a 32000-token prompt", "the recipe's 8192")
    port: int
    planned: frozenset[str]  # the flags the plan itself writes


def split(args: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(flag, values) pairs: `--flag=value`, `--flag value`, a switch, or a list (nargs)."""
    pairs: list[tuple[str, list[str]]] = []
    for arg in args:
        if arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            pairs.append((flag, [value] if eq else []))
        elif pairs:
            pairs[-1][1].append(arg)
        else:
            pairs.append(("", [arg]))
    return pairs


def check(args: Sequence[str], origin: Callable[[str], str], needs: Needs) -> list[str]:
    """Warnings for ``args``; InputError (one line) for what would break the server."""
    warnings: list[str] = []
    for flag, values in split(args):
        where = origin(flag)
        if not flag:
            raise InputError(f"{values[0]!r} in {where} follows no flag; give it as "
                             "'--flag value' (sglang rejects a stray value)")
        if flag not in KNOWN:
            near = difflib.get_close_matches(flag, sorted(KNOWN), n=1, cutoff=0.75)
            hint = f"; did you mean {near[0]}?" if near else ""
            warnings.append(f"{flag} ({where}) is not a flag of sglang's server_args as read "
                            f"({SOURCE}){hint}: the server refuses an unknown flag at start")
            continue
        _kind(flag, values, where)
        _known_bad(flag, values, where, needs, warnings)
    return warnings


def _kind(flag: str, values: list[str], where: str) -> None:
    if flag in SWITCHES:
        if values:
            raise InputError(f"{flag} ({where}) takes no value, got {' '.join(values)!r}; "
                             f"give {flag} alone")
        return
    if not values:
        raise InputError(f"{flag} ({where}) needs a value; give '{flag} VALUE'")
    if flag in LISTS:
        return
    if len(values) > 1:
        raise InputError(f"{flag} ({where}) takes one value, got {' '.join(values)!r}")
    kind: type[int] | type[float] | None = int if flag in INTS else (
        float if flag in FLOATS else None)
    if kind is not None:
        try:
            kind(values[0])
        except ValueError:
            raise InputError(f"{flag} {values[0]} ({where}): not a"
                             f"{'n integer' if kind is int else ' number'}, as sglang's "
                             f"server_args declares it") from None


def _known_bad(flag: str, values: list[str], where: str, needs: Needs,
               warnings: list[str]) -> None:
    value = values[0] if values else ""
    if flag == "--chunked-prefill-size":
        size = int(value)
        if size <= 0 or size % needs.page_size:
            raise InputError(
                f"--chunked-prefill-size {size} ({where}): must be a positive multiple of the "
                f"page size {needs.page_size} (the launcher refuses -1, L33-37: it overruns "
                "kt-kernel's buffer); set serve.chunked_prefill_size or CHUNKED_PREFILL_SIZE")
        if size < needs.chunk:
            raise InputError(
                f"--chunked-prefill-size {size} ({where}) is below the plan's {needs.chunk} "
                f"({needs.chunk_why}): a prompt longer than the chunk fails (guide §7); drop "
                "it, or lower the longest prompt")
    elif flag == "--port" or (flag.endswith("-port") and flag in INTS):
        if flag == "--port" and int(value) != needs.port:
            raise InputError(
                f"--port {value} ({where}) clashes with the plan's --port {needs.port}: "
                "sglang takes the last one and every client looks at the other; set "
                "serve.port or PORT instead")
        if flag != "--port" and int(value) == needs.port:
            raise InputError(f"{flag} {value} ({where}) is the server's own HTTP port; pick "
                             "another port")
    elif flag in needs.planned:
        warnings.append(f"{flag} ({where}) repeats a flag the plan sets: sglang takes the "
                        "last one, yours; prefer the recipe field or launcher variable")


def recipe_check(serve: Serve) -> list[str]:
    """serve.extra_args against what the plan derives from the recipe alone (the page size,
    the recipe's chunk, the port, the flags the plan writes): the plan's own warnings, and its
    InputError for what it would refuse at serve time."""
    if not serve.pass_flags or not serve.extra_args:
        return []
    chunk = chunked_prefill(serve, None)
    planned = sglang_flags(serve, model_path="", weight_path="", gpu_experts=0, pools=1,
                           threads=1, chunk=chunk, mem_fraction=0.0, port=serve.port,
                           quantization="", skip_warmup=False, api_key=False, extra=())
    needs = Needs(page_size=serve.page_size, chunk=chunk, chunk_why=RECIPE, port=serve.port,
                  planned=frozenset(a for a in planned if a.startswith("--")))
    return check(serve.extra_args, lambda _f: "serve.extra_args", needs)


def recipe_row(serve: Serve) -> Check | None:
    """Doctor's `extra-args` row: recipe_check's verdict, the plan's own words."""
    if not serve.pass_flags or not serve.extra_args:
        return None
    required = "flags sglang knows, of their kind, that the plan does not refuse"
    try:
        warnings = recipe_check(serve)
    except InputError as exc:
        return Check("extra-args", FAIL, exc.one_line(), required, "fix serve.extra_args")
    if warnings:
        return Check("extra-args", WARN, "; ".join(warnings), required,
                     "check serve.extra_args")
    return Check("extra-args", OK, " ".join(serve.extra_args), required)
