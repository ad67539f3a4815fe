"""The operator documents cover what they promise."""

from __future__ import annotations

import re

from conftest import REPO


def test_troubleshooting_covers_every_item_of_the_delivery_audit() -> None:
    text = (REPO / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| (W?\d+) \|", text, re.M))
    assert {str(n) for n in range(1, 54)} <= rows, sorted({str(n) for n in range(1, 54)} - rows)
    assert {f"W{n}" for n in range(1, 7)} <= rows


def test_guide_walks_both_platforms_and_every_stage() -> None:
    text = (REPO / "docs" / "guide.md").read_text(encoding="utf-8")
    for stage in ("doctor", "fetch", "patch", "build", "download", "convert", "verify-gguf",
                  "serve", "accept"):
        assert f"dsv4-offload {stage}" in text or f"--to {stage}" in text, stage
    for heading in ("910B", "A3", "Ctrl-C", "reboot", "full disk", "network", "failed build",
                    "x86 rehearsal"):
        assert heading.lower() in text.lower(), heading


def test_exit_code_table_is_generated_from_the_code() -> None:
    from dsv4_offload.core.errors import (
        EXIT_CODE_MEANINGS,
        REGENERATE_EXIT_CODES,
        ExitCode,
        exit_codes_markdown,
    )

    assert set(EXIT_CODE_MEANINGS) == set(ExitCode)  # every code has its row
    committed = (REPO / "docs" / "exit-codes.md").read_text(encoding="utf-8")
    assert committed == exit_codes_markdown(), (
        f"docs/exit-codes.md is out of date with core/errors.py; regenerate it: "
        f"{REGENERATE_EXIT_CODES}")


def test_guide_says_how_to_survive_an_ssh_drop() -> None:
    text = (REPO / "docs" / "guide.md").read_text(encoding="utf-8")
    for needle in ("tmux", "nohup", "--json run", "SIGHUP", "SIGTERM", "exit-codes.md"):
        assert needle in text, needle
