"""The one timestamp format of logs, records and the state file (UTC, to the second)."""

from __future__ import annotations

import datetime as dt


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
