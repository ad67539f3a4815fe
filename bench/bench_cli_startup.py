"""Start-up time of `dsv4-offload --help` and `status`, against a bare interpreter start.

Run: .venv/bin/python bench/bench_cli_startup.py [--runs N]
Prints medians of N runs and the ratio to `python -c pass` measured in the same run.
The target of the foundation issue is a --help median under 0.4 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_S = 0.4


def median_seconds(args: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(args, check=True, capture_output=True)
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
        }
        results = {name: median_seconds(args, opts.runs) for name, args in cases.items()}
    ref = results["python -c pass (reference)"]
    print(f"median of {opts.runs} runs each")
    for name, secs in results.items():
        print(f"  {name:28} {secs * 1000:7.1f} ms   {secs / ref:5.2f}x the bare interpreter")
    help_s = results["dsv4-offload --help"]
    verdict = "meets" if help_s < TARGET_S else "MISSES"
    print(f"--help median {help_s:.3f} s {verdict} the {TARGET_S} s target")
    return 0 if help_s < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
