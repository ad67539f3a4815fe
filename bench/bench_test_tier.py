"""The contributor's test tier on a fresh clone: set-up, pytest's wall time, the 15 slowest.

Run: python3 bench/bench_test_tier.py [--rev REV] [--keep]
Clones this repository at REV (default HEAD) into a temporary directory and runs the README's
test command there as written, read from the clone's README (`python3 -m venv .venv && pip
install ... && python -m pytest`, the default tier); prints the set-up time, pytest's wall
and CPU time, their total against the 5-minute target, and the 15 slowest tests (pytest's
`--durations`). Not a test: its figure goes to the README. The machine's load changes it:
quote the load average it prints.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 300.0
SLOWEST = 15
# pytest's --durations lines: "12.34s call     tests/test_x.py::test_y[param]"
DURATION = re.compile(r"^(\d+\.\d+)s (setup|call|teardown)\s+(\S.*)$")
# the README's contributor command: venv, install, the default tier (tests/test_tiers.py
# holds .ci/run to the same install)
README_COMMAND = re.compile(r"^(python3 -m venv \.venv) && (\.venv/bin/pip install [^&\n]*?) && "
                            r"(\.venv/bin/python -m pytest)$", re.M)


def children_cpu() -> float:
    """CPU seconds (user + system) of the children waited for so far."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def timed(args: list[str], cwd: Path, log: Path) -> tuple[float, int]:
    """Run ``args`` in ``cwd`` with its output appended to ``log``: seconds and exit code."""
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(args)}\n")
        fh.flush()
        t0 = time.monotonic()
        code = subprocess.run(args, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, check=False).returncode
    return time.monotonic() - t0, code


def slowest(log_text: str, count: int) -> list[tuple[float, str, str]]:
    """The ``count`` longest phases pytest's --durations printed: (seconds, phase, test id)."""
    found = []
    for line in log_text.splitlines():
        match = DURATION.match(line.strip())
        if match:
            found.append((float(match[1]), match[2], match[3]))
    return sorted(found, reverse=True)[:count]


def summary_line(log_text: str) -> str:
    """pytest's last line ("=== 960 passed, 2 skipped in 201.3s ===")."""
    lines = [line for line in log_text.splitlines() if line.startswith("=") and " in " in line]
    return lines[-1].strip("= ") if lines else "(no pytest summary: see the log)"


def readme_command(readme: Path) -> tuple[list[str], list[str], list[str]]:
    """The README's three steps (venv, pip install, pytest) as argument lists."""
    match = README_COMMAND.search(readme.read_text())
    if match is None:
        raise SystemExit(f"error: {readme}: no `python3 -m venv .venv && .venv/bin/pip install "
                         "... && .venv/bin/python -m pytest` line; the README's test command "
                         "is what this measures")
    venv, pip, pytest = (shlex.split(step) for step in match.groups())
    return [sys.executable, *venv[1:]], pip, pytest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD", help="the commit to clone (default HEAD)")
    parser.add_argument("--keep", action="store_true", help="keep the clone and its log")
    opts = parser.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--verify", f"{opts.rev}^{{commit}}"], cwd=REPO,
                         capture_output=True, text=True, check=False)
    if rev.returncode != 0:
        print(f"error: --rev {opts.rev}: not a commit of {REPO}", file=sys.stderr)
        return 2
    sha = rev.stdout.strip()
    top = Path(tempfile.mkdtemp(prefix="dsv4-tier-"))
    # as a clone in a shared directory: tests/test_access.py runs the CLI from it as nobody
    top.chmod(0o755)
    clone, log = top / "clone", top / "bench.log"
    try:
        subprocess.run(["git", "clone", "-q", "--no-checkout", str(REPO), str(clone)],
                       check=True)
        subprocess.run(["git", "checkout", "-q", sha], cwd=clone, check=True)
        print(f"clone of {sha[:12]} in {clone}; log: {log}", flush=True)
        venv, pip, pytest = readme_command(clone / "README.md")
        print(f"the README's command: {shlex.join(pip)}, then {shlex.join(pytest)}", flush=True)
        venv_s, code = timed(venv, clone, log)
        if code == 0:
            pip_s, code = timed(pip, clone, log)
        if code != 0:
            print(f"set-up failed (exit {code}); see {log}", file=sys.stderr)
            opts.keep = True
            return 1
        setup_s = venv_s + pip_s
        print(f"set-up: {setup_s:.1f} s (venv {venv_s:.1f} s, pip install {pip_s:.1f} s)",
              flush=True)
        # the README's command as written; --durations only adds the table read below
        cpu0 = children_cpu()
        test_s, code = timed([*pytest, f"--durations={SLOWEST}"], clone, log)
        # CPU against wall: how much of the run waited (on servers, processes, the disk)
        test_cpu = children_cpu() - cpu0
        text = log.read_text(errors="replace")
        total = setup_s + test_s
        print(f"pytest: {test_s:.1f} s wall, exit {code}: {summary_line(text)}")
        print(f"pytest CPU: {test_cpu:.1f} s (user + system of the processes it waited for), "
              f"{test_cpu / test_s:.2f} cores busy on average")
        verdict = "meets" if total < TARGET_S else "MISSES"
        print(f"total: {total:.1f} s ({total / 60:.2f} min); target {TARGET_S:.0f} s: {verdict}")
        print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
              f"on {os.cpu_count()} CPUs")
        print(f"the {SLOWEST} slowest tests (phase, seconds):")
        for secs, phase, test in slowest(text, SLOWEST):
            print(f"  {secs:7.2f} s  {phase:<8} {test}")
        if code != 0:
            opts.keep = True
            print(f"pytest failed; see {log}", file=sys.stderr)
        return code
    finally:
        if not opts.keep:
            shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
