"""Start-up time of `dsv4-offload --help` and `status`, against a bare interpreter start.

Run: .venv/bin/python bench/bench_cli_startup.py [--runs N]
Prints medians of N runs and the ratio to `python -c pass` measured in the same run.
The target of the foundation issue is a --help median under 0.4 s; `status` (global options
before or after the command) and one <TAB> of shell completion are measured beside it, with a
budget of 1.0 s for status (it loads and validates the recipe) and 0.5 s for a completion
(typer converts the words already typed, which loads pydantic).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_S = 0.4
BUDGETS = {"dsv4-offload --help": TARGET_S, "dsv4-offload status": 1.0,
           "dsv4-offload status --json -w WS": 1.0, "<TAB>: dsv4-offload build k": 0.5}


def median_seconds(args: list[str], runs: int, env: dict[str, str] | None = None) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(args, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    opts = parser.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as ws:
        cases = {
            "python -c pass (reference)": [py, "-c", "pass"],
            "dsv4-offload --help": [py, "-m", "dsv4_offload", "--help"],
            "dsv4-offload status": [py, "-m", "dsv4_offload", "-w", ws, "status"],
            "dsv4-offload status --json -w WS": [py, "-m", "dsv4_offload", "status", "--json",
                                                 "-w", ws],
        }
        results = {name: median_seconds(args, opts.runs) for name, args in cases.items()}
        tab = dict(os.environ, _DSV4_OFFLOAD_COMPLETE="complete_bash",
                   COMP_WORDS="dsv4-offload build k", COMP_CWORD="2")
        results["<TAB>: dsv4-offload build k"] = median_seconds(
            [py, "-m", "dsv4_offload"], opts.runs, tab)
    ref = results["python -c pass (reference)"]
    print(f"median of {opts.runs} runs each")
    missed = []
    for name, secs in results.items():
        budget = BUDGETS.get(name)
        verdict = "" if budget is None else f"  budget {budget} s: " + (
            "meets" if secs < budget else "MISSES")
        if budget is not None and secs >= budget:
            missed.append(name)
        print(f"  {name:34} {secs * 1000:7.1f} ms   {secs / ref:5.2f}x the bare interpreter"
              f"{verdict}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
