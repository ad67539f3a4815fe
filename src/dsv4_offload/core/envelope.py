"""The one JSON document a command prints with ``--json``: ``schema``, ``command``,
``status`` and ``data``. Every command builds it here and every reader parses it here (the
scheduler and the container path reading a stage child's output)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SCHEMA = 1
KEYS = ("schema", "command", "status", "data")
ERROR = "error"  # the status of a document that reports a one-line error
INTERRUPTED = "interrupted"


class MalformedDocument(ValueError):
    """Text that is not such a document; its message is one line."""


@dataclass(frozen=True)
class Envelope:
    """One command's outcome: its words, its status word and its data."""

    command: str
    status: str
    data: Any
    schema: int = SCHEMA

    @classmethod
    def error(cls, command: str, message: str, exit_code: int, **more: Any) -> Envelope:
        """The document of a command that ended with a one-line error."""
        return cls(command, ERROR, {"error": message, "exit_code": int(exit_code), **more})

    def to_json(self) -> str:
        """The document as printed: indented, UTF-8 as is, anything else as its str()."""
        doc = {"schema": self.schema, "command": self.command, "status": self.status,
               "data": self.data}
        return json.dumps(doc, indent=2, ensure_ascii=False, default=str) + "\n"

    @classmethod
    def parse(cls, text: str) -> Envelope:
        """The document back from its text; :class:`MalformedDocument` when it is not one."""
        try:
            doc = json.loads(text)
        except ValueError:
            raise MalformedDocument(f"not a JSON document: {_head(text)}") from None
        if not isinstance(doc, dict) or any(key not in doc for key in KEYS):
            raise MalformedDocument(f"not a dsv4-offload document (it needs {', '.join(KEYS)}):"
                                    f" {_head(text)}")
        if doc["schema"] != SCHEMA:
            raise MalformedDocument(f"document schema {doc['schema']!r}; this dsv4-offload "
                                    f"reads schema {SCHEMA}")
        if not isinstance(doc["command"], str) or not isinstance(doc["status"], str):
            raise MalformedDocument(f"its command and status are not text: {_head(text)}")
        return cls(doc["command"], doc["status"], doc["data"], doc["schema"])

    @property
    def error_message(self) -> str:
        """The one-line error of an error document; empty for any other."""
        if self.status != ERROR or not isinstance(self.data, dict):
            return ""
        return str(self.data.get("error") or "")


def _head(text: str) -> str:
    """The start of ``text`` on one line, for an error message."""
    flat = " ".join(text.split())
    return repr(flat[:80] + ("..." if len(flat) > 80 else "")) if flat else "(empty)"
