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


def _documented_modules() -> dict[str, set[str]]:
    """The modules docs/architecture.md's package section names, by package: in a bullet
    ``- **pkg/** —`` every code span that is a bare lowercase name (a function is written
    with its parentheses, a command with its options or in plain words)."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## The package\n", 1)[1].split("\n## ", 1)[0]
    named: dict[str, set[str]] = {}
    for pkg, body in re.findall(r"^- \*\*(\w+)/\*\* —(.*?)(?=^- \*\*|\Z)", section,
                                re.M | re.S):
        named.setdefault(pkg, set()).update(
            span for span in re.findall(r"`([^`]+)`", body)
            if re.fullmatch(r"[a-z_][a-z0-9_]*", span))
    return named


def test_the_architecture_names_every_module_and_no_other() -> None:
    """docs/architecture.md is checked against the tree: each package's modules, each
    package of the tree and of its outline."""
    root = REPO / "src" / "dsv4_offload"
    packages = {p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"}
    tree: dict[str, set[str]] = {}
    for path in root.glob("*/*.py"):
        if path.stem != "__init__":
            tree.setdefault(path.parent.name, set()).add(path.stem)
    named = _documented_modules()
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    outline = set(re.findall(r"^  (\w+)/ ", text.split("```", 2)[1], re.M))
    assert outline == packages, ("the outline of the package", sorted(outline ^ packages))
    assert set(named) == set(tree), ("a bullet per package of modules",
                                     sorted(set(named) ^ set(tree)))
    missing = {p: sorted(tree[p] - named[p]) for p in tree if tree[p] - named[p]}
    gone = {p: sorted(named[p] - tree[p]) for p in named if named[p] - tree.get(p, set())}
    assert not missing, f"modules docs/architecture.md does not name: {missing}"
    assert not gone, f"modules docs/architecture.md names that are not there: {gone}"
    assert not list(root.glob("*/*/*.py")), "a package deeper than one level: check it too"
