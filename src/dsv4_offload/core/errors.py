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
