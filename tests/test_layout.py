"""The package layout keeps: no import cycle, no arrow from a lower layer to a higher one.

Every import of the package is read with ``ast`` (module level, inside functions and under
``TYPE_CHECKING`` alike), so a cycle hidden in a function body counts as one. The layers,
lowest first, are the table below; ``docs/architecture.md`` describes them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "dsv4_offload"
ROOT = Path(__file__).resolve().parent.parent / "src" / PACKAGE

# lowest first; a module may import its own layer and those below it, never one above
LAYERS: tuple[tuple[str, ...], ...] = (
    ("dsv4_offload", "dsv4_offload.core"),  # the version, errors, results, registry, host probes
    ("dsv4_offload.recipe",),
    ("dsv4_offload.workspace",),
    ("dsv4_offload.sources", "dsv4_offload.build", "dsv4_offload.weights",
     "dsv4_offload.serving", "dsv4_offload.acceptance"),
    ("dsv4_offload.stages",),
    ("dsv4_offload.pipeline",),
    ("dsv4_offload.cli", "dsv4_offload.__main__"),
)
DOMAIN = LAYERS[3]
MAX_LINES = 800
# the one module that starts child processes (own session, group stopped on interrupt)
RUNNER = "dsv4_offload.core.runner"
_SPAWNERS = {"run", "Popen", "call", "check_output", "check_call"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, wherever in the file the import stands."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` mod
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                       for a in node.names]
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a package attribute
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                found.add(target)
    return found


def _layer(module: str) -> int:
    best, rank = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank >= 0, f"{module} is in no layer of tests/test_layout.py: add it to LAYERS"
    return rank


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as the list of its modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _domain_of(module: str) -> str | None:
    return next((p for p in DOMAIN if module == p or module.startswith(p + ".")), None)


def test_no_import_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_points_up_a_layer() -> None:
    upward = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, targets in sorted(_graph().items()) for b in sorted(targets)
              if _layer(b) > _layer(a)]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_domain_packages_form_no_cycle() -> None:
    packages: dict[str, set[str]] = {p: set() for p in DOMAIN}
    for a, targets in _graph().items():
        pa = _domain_of(a)
        for b in targets:
            pb = _domain_of(b)
            if pa and pb and pa != pb:
                packages[pa].add(pb)
    cycle = _cycle(packages)
    assert cycle is None, "domain packages import each other in a cycle: " + " -> ".join(
        cycle or [])


def test_a_stage_imports_no_other_stage() -> None:
    """A stage is one module with one entry point: what two stages share lives below them."""
    crossing = [f"{a} imports {b}" for a, targets in sorted(_graph().items())
                if a.startswith("dsv4_offload.stages.") for b in sorted(targets)
                if b.startswith("dsv4_offload.stages.")]
    assert not crossing, "\n".join(crossing)


def test_no_module_is_over_the_size_limit() -> None:
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines())
             for name, path in _modules().items()}
    over = {n: s for n, s in sizes.items() if s > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_the_package_top_stays_small() -> None:
    entries = [p.name for p in ROOT.iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 14, sorted(entries)


def _direct_spawns(path: Path) -> list[int]:
    """Lines of ``path`` that start a process with ``subprocess`` itself: ``subprocess.run(``
    (the module under any name) or a spawner imported from it (``from subprocess import``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules, functions = {"subprocess"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "subprocess"}
        elif isinstance(node, ast.ImportFrom) and node.module == "subprocess":
            functions |= {a.asname or a.name for a in node.names if a.name in _SPAWNERS}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr in _SPAWNERS
                and isinstance(f.value, ast.Name) and f.value.id in modules) or (
                isinstance(f, ast.Name) and f.id in functions):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_runner_starts_processes() -> None:
    """Every child goes through core/runner (logged or captured, its group stopped on Ctrl-C
    or a timeout); a direct ``subprocess`` call elsewhere would skip that."""
    direct = [f"{path.relative_to(ROOT.parent)}:{line}"
              for name, path in sorted(_modules().items()) if name != RUNNER
              for line in _direct_spawns(path)]
    assert not direct, "subprocess called outside core/runner.py (use its capture, " \
        "run_attached, start or run_command):\n" + "\n".join(direct)


# the checker itself: it must see a cycle and an upward import where there are some


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / PACKAGE
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from dsv4_offload.core import b\n")
    (pkg / "core" / "b.py").write_text("def f():\n    from dsv4_offload.core.a import x\n")
    (pkg / "stages").mkdir()
    (pkg / "stages" / "__init__.py").write_text("")
    (pkg / "core" / "c.py").write_text("import dsv4_offload.stages\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    graph = _graph()
    assert _cycle(graph) == ["dsv4_offload.core.a", "dsv4_offload.core.b",
                             "dsv4_offload.core.a"]
    assert "dsv4_offload.stages" in graph["dsv4_offload.core.c"]
    assert _layer("dsv4_offload.stages") > _layer("dsv4_offload.core.c")


def test_a_new_stage_is_a_registry_row_and_a_module(tmp_path: Path) -> None:
    """Add a stage the way docs/architecture.md says (a row, a module) and nothing else: the
    CLI gets its command, `status` lists it, `run` runs it after the stage it needs."""
    import os
    import subprocess
    import sys

    site = tmp_path / "site"
    (site / "extrastages").mkdir(parents=True)
    # the row: appended to the registry before anything else of the package is imported
    (site / "sitecustomize.py").write_text(
        "from dsv4_offload.core import registry as r\n"
        "r.STAGES = (*r.STAGES, r.StageSpec('inventory', ('doctor',), ('host',),\n"
        "            summary='list what the host has'))\n"
        "r.STAGE_NAMES = tuple(s.name for s in r.STAGES)\n")
    (site / "extrastages" / "__init__.py").write_text("")
    # the module: one entry point; the other stages are the instrumented stand-ins
    for name in ("doctor", "fetch", "patch", "build", "selftest", "download", "convert",
                 "verify_gguf", "serve", "accept"):
        (site / "extrastages" / f"{name}.py").write_text(
            f"from fakestages import make\nrun = make({name.replace('_', '-')!r})\n")
    (site / "extrastages" / "inventory.py").write_text(
        "from dsv4_offload.core.results import StageResult, Status\n"
        "def run(ctx):\n"
        "    (ctx.workspace.root / 'inventory.txt').write_text(ctx.recipe.name)\n"
        "    return StageResult(Status.OK, 'inventory taken')\n")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "DSV4_STAGE_PACKAGE": "extrastages",
           "PYTHONPATH": os.pathsep.join([str(site), str(tests), str(ROOT.parent)])}
    env.pop("DSV4_WORKSPACE", None)
    ws = tmp_path / "ws"
    overlay = tmp_path / "host.yaml"  # this test is about the pipeline on one host
    # with sets of a few KiB: the disk preflight of `run` counts them, the stages write none
    overlay.write_text("extends: dsv4-flash-910b\nname: host-pipeline\nruntime:\n  kind: host\n"
                       "weights: {w8a8: {expected_bytes: 1}, mxfp4: {expected_bytes: 1}}\n"
                       "conversion: {expected_file_bytes: 1}\n")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", PACKAGE, "-w", str(ws), "-r", str(overlay),
                               *args], capture_output=True, text=True, env=env, timeout=120,
                              stdin=subprocess.DEVNULL)

    helped = cli("inventory", "--help")
    assert helped.returncode == 0 and "list what the host has" in helped.stdout, helped
    ran = cli("run", "--to", "inventory")
    assert ran.returncode == 0, ran
    assert (ws / "inventory.txt").read_text() == "host-pipeline"
    status = cli("--json", "status")
    rows = {r["name"]: r for r in __import__("json").loads(status.stdout)["data"]["stages"]}
    assert rows["inventory"]["state"] == "done", rows["inventory"]


def test_the_spawn_checker_sees_every_form(tmp_path: Path) -> None:
    code = ("import subprocess\nimport subprocess as sp\nfrom subprocess import Popen as P\n"
            "subprocess.run(['x'])\nsp.check_output(['x'])\nP(['x'])\n"
            "def f():\n    subprocess.call(['x'])\n"
            "subprocess.TimeoutExpired(['x'], 1)\nrun(['x'])\n")
    (tmp_path / "m.py").write_text(code)
    assert _direct_spawns(tmp_path / "m.py") == [4, 5, 6, 8]


# a stage with CPU and disk needs: its row says them, the generic parts read the row
REPACK_ROW = (
    "r.StageSpec('repack', ('download',), ('conversion',), summary='repack the experts',\n"
    "            cpu=r.Cpu.YIELDS, branch='weights', view=r.View.SETS,\n"
    "            disk_sets=(r.DiskSet('packed', 'conversion.gguf_dir',\n"
    "                                 ('conversion.layers', 'conversion.expected_file_bytes')),))")
REPACK_MODULE = (
    "from dsv4_offload.core.options import StageOptions\n"
    "from dsv4_offload.core.results import StageResult, Status\n"
    "class Options(StageOptions):\n"
    "    jobs: int | None = None  # a stage of a CPU class takes the jobs it is given\n"
    "def run(ctx):\n"
    "    with ctx.task('repack packed', total=4096, unit='B') as task:\n"
    "        task.update(completed=4096)\n"
    "    jobs = ctx.options_as(Options).jobs\n"
    "    (ctx.workspace.root / 'repack.jobs').write_text(str(jobs))\n"
    "    return StageResult(Status.OK, 'experts repacked')\n")


def test_a_stage_with_cpu_and_disk_needs_is_a_row_and_a_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage that takes jobs (yielding to the build) and writes a disk set of its own: the
    scheduler gives it jobs, the disk preflight counts its set, the live and in-flight views
    place it and show its bytes, none of them changed for it."""
    import json
    import os
    import subprocess
    import sys

    from dsv4_offload.cli.live import branches, cpu_words, render_flight
    from dsv4_offload.core import registry
    from dsv4_offload.core.inflight import InFlight

    site = tmp_path / "site"
    (site / "extrastages").mkdir(parents=True)
    (site / "sitecustomize.py").write_text(
        "from dsv4_offload.core import registry as r\n"
        f"r.STAGES = (*r.STAGES, {REPACK_ROW})\n"
        "r.STAGE_NAMES = tuple(s.name for s in r.STAGES)\n")
    (site / "extrastages" / "__init__.py").write_text("")
    for name in ("doctor", "fetch", "patch", "build", "selftest", "download", "convert",
                 "verify_gguf", "serve", "accept"):
        (site / "extrastages" / f"{name}.py").write_text(
            f"from fakestages import make\nrun = make({name.replace('_', '-')!r})\n")
    (site / "extrastages" / "repack.py").write_text(REPACK_MODULE)
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "DSV4_STAGE_PACKAGE": "extrastages",
           "PYTHONPATH": os.pathsep.join([str(site), str(tests), str(ROOT.parent)])}
    env.pop("DSV4_WORKSPACE", None)
    ws = tmp_path / "ws"
    overlay = tmp_path / "host.yaml"
    overlay.write_text("extends: dsv4-flash-910b\nname: host-pipeline\nruntime:\n  kind: host\n"
                       "weights: {w8a8: {expected_bytes: 1}, mxfp4: {expected_bytes: 1}}\n"
                       "conversion: {expected_file_bytes: 1}\n"
                       "pipeline: {cores: 8, convert_jobs: 3}\n")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", PACKAGE, "-w", str(ws), "-r", str(overlay),
                               *args], capture_output=True, text=True, env=env, timeout=120,
                              stdin=subprocess.DEVNULL)

    planned = cli("--json", "run", "--dry-run")
    assert planned.returncode == 0, planned
    data = json.loads(planned.stdout)["data"]
    plan = {p["stage"]: p for p in data["plan"]}
    # the jobs beside a build of this run (pipeline.convert_jobs_beside_build), as convert's
    assert plan["repack"]["options"] == {"jobs": 1} and plan["convert"]["options"]["jobs"] == 1
    assert plan["repack"]["waits_for"] == ["download"] and "build" in plan["repack"]["beside"]
    assert [s["set"] for fs in data["disk"] for s in fs["sets"]] == ["w8a8", "mxfp4", "gguf",
                                                                     "packed"]
    # no build in the run: the jobs it takes alone (pipeline.convert_jobs)
    alone = json.loads(cli("--json", "run", "--from", "download", "--dry-run").stdout)["data"]
    assert {p["stage"]: p for p in alone["plan"]}["repack"]["options"] == {"jobs": 3}
    ran = cli("--json", "run", "--from", "download", "--to", "repack")
    assert ran.returncode == 0, ran
    assert (ws / "repack.jobs").read_text() == "3"
    # the views, in this process, with the same row added
    monkeypatch.setattr(registry, "STAGES", (*registry.STAGES, eval(REPACK_ROW, {"r": registry})))
    flight = InFlight()
    for line in ran.stdout.splitlines():
        flight.feed(json.loads(line))
    repack = flight.stages["repack"]
    assert repack.state == "done" and repack.sets["packed"].completed == 4096, repack
    assert branches(flight)["weights"] == ["download", "convert", "verify-gguf", "repack"]
    assert cpu_words(type("Cpu", (), {"build_jobs": 7, "convert_beside_build": 1,
                                      "convert_alone": 3})()) == \
        "build 7 jobs, convert, repack 1 beside build, then 3"
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(render_flight(flight, flight.run_started or 0.0))
    assert "packed 4.0 KiB/4.0 KiB" in console.export_text()


# the generic parts: what they need of a stage is its registry row, never its name
GENERIC = ("pipeline/schedule.py", "pipeline/serial.py", "cli/live.py", "core/inflight.py")


def test_the_generic_parts_name_no_stage() -> None:
    from dsv4_offload.core.registry import STAGE_NAMES

    named = [f"{rel}:{node.lineno} {node.value!r}" for rel in GENERIC
             for node in ast.walk(ast.parse((ROOT / rel).read_text(encoding="utf-8")))
             if isinstance(node, ast.Constant) and node.value in STAGE_NAMES]
    assert not named, "a stage named where its registry row should say it:\n" + "\n".join(named)
