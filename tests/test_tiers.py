"""The two test tiers as the README states them: the default `pytest` leaves the `slow` tests
out, `.ci/run` runs the README's two commands as written, and every `slow` test names the
fast test that keeps a real check of its seam (or says why none can)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).parent
REPO = TESTS.parent
# a fast test named in a slow test's docstring: tests/test_x.py::test_name
NAMED = re.compile(r"tests/(test_\w+\.py)::(test_\w+)")
NONE_CAN = "no fast test can"


def _is_slow(node: ast.expr) -> bool:
    """``pytest.mark.slow`` (a decorator or a module's ``pytestmark``), in a list too."""
    if isinstance(node, ast.List | ast.Tuple):
        return any(_is_slow(item) for item in node.elts)
    return ast.unparse(node) == "pytest.mark.slow"


def _tests(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def slow_tests() -> dict[str, tuple[str | None, bool]]:
    """Every test of tests/ and whether it is slow: {"file::name": (docstring, slow)}."""
    found: dict[str, tuple[str | None, bool]] = {}
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module_slow = any(
            isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
            and _is_slow(node.value) for node in tree.body)
        for name, func in _tests(tree).items():
            slow = module_slow or any(_is_slow(d) for d in func.decorator_list)
            found[f"{path.name}::{name}"] = (ast.get_docstring(func), slow)
    return found


def test_every_slow_test_names_the_fast_test_of_its_seam() -> None:
    tests = slow_tests()
    slow = {test: doc for test, (doc, is_slow) in tests.items() if is_slow}
    assert slow, "no test is marked slow: the long tier would collect nothing"
    wrong = []
    for test, doc in slow.items():
        named = [f"{f}::{n}" for f, n in NAMED.findall(doc or "")]
        if not named and NONE_CAN not in (doc or "").lower():
            wrong.append(f"{test}: its docstring names no fast test (tests/test_x.py::test_y) "
                         f"and does not say why {NONE_CAN!r} cover its seam")
        for ref in named:
            if ref not in tests:
                wrong.append(f"{test}: names tests/{ref}, which does not exist")
            elif tests[ref][1]:
                wrong.append(f"{test}: names tests/{ref}, which is itself slow")
    assert not wrong, "\n".join(wrong)


def test_the_default_tier_leaves_the_slow_tests_out_and_ci_runs_both() -> None:
    # the file's text, not tomllib: the project supports python 3.10
    ini = (REPO / "pyproject.toml").read_text().split("[tool.pytest.ini_options]")[1]
    addopts = re.search(r'^addopts = "(.*)"$', ini, re.M)
    assert addopts is not None and "-m 'not slow'" in addopts[1]
    assert re.search(r'^    "slow: ', ini, re.M)
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^(?:.* && )?(\.venv/bin/python -m pytest[^\n#]*?)\s*(?:#.*)?$",
                          readme, re.M)
    assert ".venv/bin/python -m pytest" in commands
    assert ".venv/bin/python -m pytest -m slow" in commands
    ci = (REPO / ".ci" / "run").read_text()
    # the set-up before them is the README's too (bench/bench_test_tier.py reads it there)
    setup = re.search(r"^python3 -m venv \.venv && (\.venv/bin/pip install )([^&\n]*?) && "
                      r"\.venv/bin/python -m pytest$", readme, re.M)
    assert setup is not None, "README: the contributor's venv && pip install && pytest line"
    assert re.search(rf"^{re.escape(setup[1])}(-q )?{re.escape(setup[2])}$", ci, re.M), setup[0]
    for command in (".venv/bin/python -m pytest", ".venv/bin/python -m pytest -m slow"):
        assert re.search(rf"^{re.escape(command)} \|\| status=\$\?$", ci, re.M), command
