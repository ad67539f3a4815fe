"""Exit codes and the one-line errors every command reports instead of a traceback."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # a check or a stage failed
    INVALID_INPUT = 2  # a recipe, series, option or input file is malformed
    LOCKED = 3  # another run holds the workspace lock
    NOT_IMPLEMENTED = 4  # a stage this version cannot run yet
    HANGUP = 129  # SIGHUP (the terminal or SSH session went away): handled like Ctrl-C
    INTERRUPTED = 130  # Ctrl-C (SIGINT)
    TERMINATED = 143  # SIGTERM (kill, a scheduler, systemd): handled like Ctrl-C


# what each code means and what to do: the table of docs/exit-codes.md is made from this
EXIT_CODE_MEANINGS: dict[ExitCode, tuple[str, str]] = {
    ExitCode.OK: ("done: every stage asked for is done, or the command did what it says", ""),
    ExitCode.FAILED: ("a check or a stage failed; its record and log say why",
                      "`dsv4-offload status` names the stage, the reason and the log; fix it "
                      "and rerun `run` (it continues from there)"),
    ExitCode.INVALID_INPUT: (
        "bad input: a recipe, series, option or input file is malformed, or the workspace "
        "cannot be read or written", "the one-line error names the file or directory, the "
        "field or owner, and the fix"),
    ExitCode.LOCKED: ("another run holds the workspace lock",
                      "wait for it (the error names its pid and command) or use another "
                      "--workspace"),
    ExitCode.NOT_IMPLEMENTED: ("a stage this version cannot run yet",
                               "stop before it with `run --to` the stage before"),
    ExitCode.HANGUP: (
        "SIGHUP (the terminal or SSH session went away): handled like Ctrl-C", "the running "
        "stage's processes were stopped and its record says `interrupted by SIGHUP`; "
        "rerun `run` (docs/guide.md, 'Over SSH', keeps a session drop from reaching it)"),
    ExitCode.INTERRUPTED: ("Ctrl-C (SIGINT)", "the running stage's processes were stopped "
                           "and its record says `interrupted by Ctrl-C`; rerun `run`"),
    ExitCode.TERMINATED: ("SIGTERM (kill, a scheduler, systemd): handled like Ctrl-C",
                          "the running stage's processes were stopped and its record says "
                          "`interrupted by SIGTERM`; rerun `run`"),
}
REGENERATE_EXIT_CODES = "python -m dsv4_offload.core.errors > docs/exit-codes.md"


def exit_codes_markdown() -> str:
    """docs/exit-codes.md: every exit code of the tool, from :class:`ExitCode`."""
    rows = [f"| {int(code)} | `{code.name}` | {meaning} | {todo} |"
            for code, (meaning, todo) in sorted(EXIT_CODE_MEANINGS.items())]
    return "\n".join([
        "# Exit codes",
        "",
        f"<!-- generated from src/dsv4_offload/core/errors.py by `{REGENERATE_EXIT_CODES}`; "
        "do not edit -->",
        "",
        "Every command of `dsv4-offload` ends with one of these codes; with `--json` an "
        "error is also a JSON document on stdout (`\"status\": \"error\"`, "
        "`data.exit_code`).",
        "",
        "| code | name | meaning | what to do |",
        "|---|---|---|---|",
        *rows,
        "",
        "A command killed outright (SIGKILL, the OOM killer) ends with the shell's 137 and "
        "runs no cleanup: its stage still reads `running` until `status` sees that the "
        "process (pid and start time) is gone and shows it `interrupted`. The children it "
        "had started die with it (a parent-death signal); whatever they had started in "
        "turn is stopped by the next `run`. A foreground `serve` takes its server with it; "
        "a detached server runs on, and `serve stop` finds it by its recorded pid, start "
        "time and command line.",
        "",
    ])


class Dsv4Error(Exception):
    """An expected failure: printed as one line, never as a traceback."""

    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, message: str, *, hint: str | None = None, log: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.log = log

    def one_line(self) -> str:
        text = self.message
        if self.hint:
            text += f" — {self.hint}"
        if self.log:
            text += f" (see the log: {self.log})"
        return text


class InputError(Dsv4Error):
    """A malformed external input: recipe, series, patch, option, weight or GGUF file."""

    exit_code = ExitCode.INVALID_INPUT


class LockedError(Dsv4Error):
    exit_code = ExitCode.LOCKED


class NotImplementedStage(Dsv4Error):
    exit_code = ExitCode.NOT_IMPLEMENTED


if __name__ == "__main__":
    print(exit_codes_markdown(), end="")
