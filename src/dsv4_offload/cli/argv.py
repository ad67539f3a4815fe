"""Global options anywhere on the line: `dsv4-offload doctor --json` means `--json doctor`.

click reads a group's options only before its subcommand. The root group here moves every
global option it finds after the subcommand path (`serve status --json`) to just before the
first subcommand, so each command, present or added later, accepts them with one meaning and
nothing to declare. The walk knows every command's own options, so it never takes an option's
value for a global (`run --force --json` is left to click, which reads `--json` as the value of
`--force`, as it would anyway), stops at `--`, and stops at the first positional argument of a
command that passes the rest of its line on (`allow_interspersed_args=False`, e.g. a command
that runs another program). A command that declares an option of the same name keeps it (a
test forbids that, so the global meaning is the only one).
"""

from __future__ import annotations

import re
from typing import Any

from typer.core import TyperGroup


def _options(cmd: Any) -> dict[str, int]:
    """A command's option names, each with the number of values it takes (0 for a flag)."""
    out: dict[str, int] = {}
    for param in getattr(cmd, "params", []):
        if getattr(param, "param_type_name", "") != "option":
            continue
        flag = getattr(param, "is_flag", False) or getattr(param, "count", False)
        for name in [*param.opts, *param.secondary_opts]:
            out[name] = 0 if flag else max(int(param.nargs), 0)
    return out


def global_option_names(root: Any) -> frozenset[str]:
    """The root's options that mean the same after any subcommand (not eager ones: --help...)."""
    names: set[str] = set()
    for param in root.params:
        if getattr(param, "param_type_name", "") == "option" and not param.is_eager:
            names.update([*param.opts, *param.secondary_opts])
    return frozenset(names)


def _split_token(token: str) -> tuple[str, bool]:
    """An option token's name, and whether its value is attached (`--set=x`, `-wDIR`)."""
    if token.startswith("--"):
        name, eq, _ = token.partition("=")
        return name, bool(eq)
    return token[:2], len(token) > 2


def hoist_globals(root: Any, args: list[str], missing: list[str] | None = None
                  ) -> tuple[list[str], list[str]]:
    """`args` with global options after subcommands moved before the first subcommand.

    Returns (new args, the global option tokens found anywhere, with their values). A global
    option at the end of the line without its value (`status -w`) is named in `missing`.
    """
    global_names = global_option_names(root)
    root_opts = _options(root)
    cmd: Any = root
    opts = root_opts
    insert_at: int | None = None
    moved: list[str] = []
    found: list[str] = []
    kept: list[str] = []
    positionals = 0
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            kept.extend(args[i - 1:])
            break
        is_group = hasattr(cmd, "commands")
        if token.startswith("-") and token != "-":
            name, attached = _split_token(token)
            own = name in opts
            words = [token]
            if own and opts[name] and not attached:
                # the option's values, whatever they look like
                words += args[i:i + opts[name]]
                i += opts[name]
            if cmd is root or own:
                # an option of the command it follows (a subcommand's own keeps its meaning)
                kept.extend(words)
                if cmd is root and name in global_names:
                    found.extend(words)
                continue
            if name in global_names:
                if root_opts[name] and not attached:
                    if i + root_opts[name] > len(args) and missing is not None:
                        missing.append(name)
                    words += args[i:i + root_opts[name]]
                    i += root_opts[name]
                moved.extend(words)
                found.extend(words)
                continue
            flags = [f"-{c}" for c in token[1:]]
            if not token.startswith("--") and all(
                f in global_names and f not in opts and not root_opts[f] for f in flags
            ):
                moved.append(token)  # -vq: several global flags in one token
                found.extend(flags)
                continue
            kept.append(token)  # unknown here: click says so
            continue
        if is_group and token in cmd.commands and positionals == 0:
            if insert_at is None:
                insert_at = len(kept)
            kept.append(token)
            cmd = cmd.commands[token]
            opts = _options(cmd)
            continue
        kept.append(token)
        positionals += 1
        interspersed = getattr(cmd, "context_settings", {}).get(
            "allow_interspersed_args", getattr(cmd, "allow_interspersed_args", True)
        )
        if not is_group and not interspersed:
            kept.extend(args[i:])  # the rest belongs to the command (a program and its args)
            break
    if not moved or insert_at is None:
        return kept, found
    return kept[:insert_at] + moved + kept[insert_at:], found


GLOBALS_EPILOG = ("Global options (-w/--workspace, -r/--recipe, --set, --runtime, --json, -v, "
                  "-q) work here too; see `dsv4-offload --help`.")


_LIST_ITEM = re.compile(r"^\s*(\d+\.|-|\*|\|)\s")


def keep_lists(text: str | None) -> str | None:
    """A help text whose paragraphs holding a list or table keep their lines (click's `\\b`
    before such a paragraph), where click would reflow them into one block."""
    if not text:
        return text
    paragraphs = text.split("\n\n")
    out = []
    for para in paragraphs:
        lines = para.strip("\n").splitlines()
        if lines and lines[0].strip() != "\b" and any(_LIST_ITEM.match(x) for x in lines):
            para = "\b\n" + para.strip("\n")
        out.append(para)
    return "\n\n".join(out)


def _no_type(ctx: Any) -> None:
    return None


def _add_epilog(cmd: Any) -> None:
    """Each command's --help says that the global options apply to it, keeps its lists as
    written, and names what each option takes (never click's `<str>`)."""
    for sub in getattr(cmd, "commands", {}).values():
        if not sub.epilog:
            sub.epilog = GLOBALS_EPILOG
        sub.help = keep_lists(sub.help)
        for param in getattr(sub, "params", []):
            if param.param_type_name == "argument" and param.metavar:
                # typer prints `STEP... <list[str]>`: the metavar says it already
                param.display_type_rich = _no_type
        _add_epilog(sub)


class GlobalOptionsGroup(TyperGroup):
    """The root group: accepts its own (global) options after any subcommand too."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        _add_epilog(self)

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        missing: list[str] = []
        hoisted, _ = hoist_globals(self, list(args), missing)
        if missing:  # else click would take the command's name for its value
            ctx.fail(f"Option '{missing[0]}' requires an argument.")
        return super().parse_args(ctx, hoisted)
