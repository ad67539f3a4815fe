"""The reader fuzz at scale: many more seeded damaged GGUF and safetensors files than the suite.

Run: .venv/bin/python bench/bench_fuzz_readers.py [--cases N] [--seed S]
Prints, per reader, how many cases ended in a clear one-line answer, how many read as fine,
and how many escaped as another exception (must be 0), with the time per case against the
time to read the undamaged file in the same run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fuzz_headers import cases, run_reader, valid_gguf, valid_safetensors

from dsv4_offload.core.errors import InputError


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=18)
    args = parser.parse_args()
    escaped_total = 0
    with tempfile.TemporaryDirectory() as scratch:
        for kind, good in (("gguf", valid_gguf()), ("safetensors", valid_safetensors())):
            path = Path(scratch) / f"case.{kind}"
            path.write_bytes(good)
            t0 = time.perf_counter()
            for _ in range(50):
                run_reader(kind, path)
            reference = (time.perf_counter() - t0) / 50
            counts: Counter[str] = Counter()
            t0 = time.perf_counter()
            for i, data in enumerate(cases(kind, args.cases, args.seed)):
                path.write_bytes(data)
                try:
                    result = run_reader(kind, path)
                except InputError:
                    counts["clear error"] += 1
                except Exception as exc:  # counting what escapes is the point
                    counts["escaped"] += 1
                    print(f"  {kind} case {i}: {type(exc).__name__}: {exc}"[:200])
                else:
                    found = kind == "gguf" and bool(result)  # gguf answers with problem lines
                    counts["problem lines" if found else "read as fine"] += 1
            per_case = (time.perf_counter() - t0) / args.cases
            escaped_total += counts["escaped"]
            print(f"{kind}: {args.cases} cases: {dict(counts)}; {per_case * 1e3:.2f} ms/case, "
                  f"{per_case / reference:.2f}x the undamaged file's read")
    return 1 if escaped_total else 0


if __name__ == "__main__":
    raise SystemExit(main())
