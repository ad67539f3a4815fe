"""Reading a small file a user names (an API key, a manifest): bounded, never blocking.

A FIFO or a device in its place would block the read forever or never end, a huge file would
be read whole: both are refused with one line naming the file, like a missing or
unreadable one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dsv4_offload.core.errors import InputError


def read_user_text(path: Path, what: str, limit: int, fix: str, label: str = "") -> str:
    """The UTF-8 text of ``path`` (``what`` it is, at most ``limit`` bytes); an InputError
    starting with ``label`` (the path by default), saying what is wrong and ``fix``."""
    label = label or str(path)
    try:
        # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InputError(f"{label}: {exc.strerror} (cannot read the {what}); {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{label}: the {what} is not a regular file (a FIFO, socket, "
                             f"device or directory); {fix}")
        if st.st_size > limit:
            raise InputError(f"{label}: {st.st_size} B is too big for a {what} (limit {limit} "
                             f"B); {fix}")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{label}: the {what} is not UTF-8 text; {fix}") from None
