"""Time to a ready server: `run --serial`, the pipelined `run`, and the download alone.

Run: .venv/bin/python bench/bench_time_to_ready.py [--rate B/S] [--build-cpu S]
                                                  [--serve-start S] [--rounds N] [--events FILE]

Issue 23's benchmark, on 127.0.0.1 only:
- the stand-in hub (tests/standin_hub.py), throttled to --rate bytes/s per file body (one
  file at a time, as `download` fetches them by default), serving both sets:
  - MXFP4 (huggingface, deepseek-ai/DeepSeek-V4-Flash): a synthetic native checkpoint of
    43 layers x 8 experts (hidden 256, moe intermediate 256) in the real shard layout:
    config.json, model.safetensors.index.json, the embeddings in model-00001-of-00046,
    layer L's experts in model-{L+2:05d}-of-00046, the head in model-00045-of-00046 (the
    real set's 46th shard, MTP, is left out);
  - W8A8 (modelscope, sgl-npu/DeepSeek-V4-Flash-W8A8): the MXFP4 config.json (the pair
    check compares the two), an index and 20 shards in Hugging Face's standard naming
    (model-{i:05d}-of-00020.safetensors; the real set's listing is not known here), with
    275/150 of the MXFP4 set's bytes, the ratio of the recipe's expected_bytes;
- tests/pipestages: the REAL download, convert (following the download) and verify-gguf;
  a build stand-in that burns --build-cpu CPU-seconds in a child process (as many as the
  build's jobs: one on 2 cores); a serve stand-in that starts in --serve-start seconds.

Each round runs, each in a fresh workspace: `run --serial`, `run` (pipelined) and `run --from
download --to download` (the download alone). Time to ready: from the launch of `run` to
the serve stand-in's ready time. The download alone: from its launch to the download's
stage.done. The tail: in the pipelined run, from the download's stage.done (its last byte
verified) to ready. Prints the medians of --rounds, the ratio pipelined / (download alone
+ tail) against the goal (<= 1.05), and the pipelined run's timeline (median of each mark,
seconds from the launch). --events FILE keeps the `run --json` stream of the last
pipelined run. Asserts nothing but that every run ended well.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from standin_hub import HubRepo, StandinHub  # noqa: E402

from dsv4_offload.weights.checkpoint import (  # noqa: E402
    CONFIG_FILE,
    INDEX_FILE,
    MoeDims,
    write_synthetic_checkpoint,
)

DIMS = MoeDims(layers=43, experts=8, experts_per_token=2, hidden=256, intermediate=256)
MXFP4_REPO = "deepseek-ai/DeepSeek-V4-Flash"
W8A8_REPO = "sgl-npu/DeepSeek-V4-Flash-W8A8"
W8A8_SHARDS = 20
W8A8_OVER_MXFP4 = 275 / 150  # the recipe's weights.*.expected_bytes (GiB)
HOST_RECIPE = TESTS / "fixtures" / "recipes" / "host-910b.yaml"
GOAL = 1.05


def mxfp4_set(root: Path) -> HubRepo:
    src = write_synthetic_checkpoint(
        root / "mxfp4", DIMS, real_layout=True,
        shard_name=lambda i, n: f"model-{i:05d}-of-{n + 1:05d}.safetensors")
    return HubRepo(MXFP4_REPO, {p.name: p.read_bytes() for p in sorted(src.iterdir())})


def w8a8_set(mxfp4: HubRepo, root: Path) -> HubRepo:
    import numpy as np
    from safetensors.numpy import save_file

    total = int(sum(len(d) for d in mxfp4.files.values()) * W8A8_OVER_MXFP4)
    rng = np.random.default_rng(1)
    files = {CONFIG_FILE: mxfp4.files[CONFIG_FILE]}
    weight_map = {}
    root.mkdir(parents=True, exist_ok=True)
    for i in range(1, W8A8_SHARDS + 1):
        name = f"model-{i:05d}-of-{W8A8_SHARDS:05d}.safetensors"
        tensor = f"model.layers.{i}.weight"
        path = root / name
        save_file({tensor: rng.integers(-128, 128, total // W8A8_SHARDS, dtype=np.int8)},
                  str(path))
        files[name] = path.read_bytes()
        weight_map[tensor] = name
    files[INDEX_FILE] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return HubRepo(W8A8_REPO, files, commit="a" * 40)


def epoch(event: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(event["t"]).timestamp()


class Bench:
    def __init__(self, root: Path, hub: StandinHub, repos: list[HubRepo], args: Any) -> None:
        self.root, self.hub, self.args = root, hub, args
        from dsv4_offload.recipe import load_recipe_and_series
        from dsv4_offload.weights.gguf_io import LayerLayout

        conv = load_recipe_and_series(None)[0].conversion
        # the sizes the disk preflight counts (conversion.layers stays 43, as here)
        sets = [f"weights.mxfp4.expected_bytes={sum(len(d) for d in repos[0].files.values())}",
                f"weights.w8a8.expected_bytes={sum(len(d) for d in repos[1].files.values())}",
                f"conversion.expected_file_bytes={LayerLayout.for_layer(0, DIMS, conv).file_bytes}",
                "selftest.real_layer.enabled=false"]  # level 4 needs a kt-kernel build
        self.recipe = ["-r", str(HOST_RECIPE), *(a for s in sets for a in ("--set", s))]
        self.count = 0

    def launch(self, *run_args: str) -> tuple[float, Path, subprocess.CompletedProcess[str]]:
        """One `run` in a fresh workspace: (launch time, workspace, the finished process)."""
        self.count += 1
        here = self.root / f"run{self.count}"
        ws = here / "ws"
        (ws / "behave").mkdir(parents=True)
        (ws / "behave" / "build").write_text(f"burn {self.args.build_cpu}")
        (ws / "behave" / "serve").write_text(f"start {self.args.serve_start}")
        path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "DSV4_STAGE_PACKAGE": "pipestages",
               "PYTHONPATH": path.rstrip(os.pathsep), "HF_HOME": str(here / "hf-home"),
               "MODELSCOPE_CACHE": str(here / "ms"), "HF_ENDPOINT": self.hub.url,
               "MODELSCOPE_ENDPOINT": self.hub.url, "HF_HUB_OFFLINE": ""}
        env.pop("DSV4_WORKSPACE", None)
        argv = [sys.executable, "-m", "dsv4_offload", *self.recipe, "-w", str(ws), "--json",
                "run", *run_args]
        t0 = time.time()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"`run {' '.join(run_args)}` exited {proc.returncode} in {ws}:\n"
                             f"{proc.stderr[-2000:]}")
        return t0, ws, proc

    @staticmethod
    def ready(ws: Path) -> float:
        return float((ws / "serve.ready").read_text())

    def serial(self) -> float:
        t0, ws, _proc = self.launch("--serial")
        return self.ready(ws) - t0

    def download_alone(self) -> float:
        t0, _ws, proc = self.launch("--from", "download", "--to", "download")
        docs = [json.loads(line) for line in proc.stdout.splitlines()]
        done = next(d for d in docs if d["event"] == "stage.done" and d["stage"] == "download")
        return epoch(done) - t0

    def pipelined(self) -> tuple[float, float, dict[str, float], str]:
        """(time to ready, tail, the timeline's marks, the --json stream)."""
        t0, ws, proc = self.launch()
        docs = [json.loads(line) for line in proc.stdout.splitlines()]
        ready = self.ready(ws)

        def at(event: str, stage: str | None = None, **match: Any) -> float:
            return epoch(next(d for d in docs if d["event"] == event
                              and (stage is None or d.get("stage") == stage)
                              and all(d.get(k) == v for k, v in match.items()))) - t0

        layers = [d for d in docs if d["event"] == "layer.verified"]
        marks = {
            "doctor done": at("stage.done", "doctor"),
            "download started": at("stage.started", "download"),
            "layer 0 started": at("layer.started", "convert", layer=0),
            "build started": at("stage.started", "build"),
            "build done": at("stage.done", "build"),
            "last MXFP4 file verified": max(epoch(d) for d in docs if d["event"] ==
                                            "file.verified" and d["set"] == "mxfp4") - t0,
            f"layer {DIMS.layers - 1} verified": max(epoch(d) for d in layers) - t0,
            "download done": at("stage.done", "download"),
            "convert done": at("stage.done", "convert"),
            "verify-gguf started": at("stage.started", "verify-gguf"),
            "verify-gguf done": at("stage.done", "verify-gguf"),
            "serve started": at("stage.started", "serve"),
            "ready": ready - t0,
        }
        assert len(layers) == DIMS.layers, f"{len(layers)} layers verified in {ws}"
        return ready - t0, marks["ready"] - marks["download done"], marks, proc.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=4e6, help="hub bytes/s (4e6)")
    parser.add_argument("--build-cpu", type=float, default=10.0,
                        help="CPU-seconds the build stand-in burns (10)")
    parser.add_argument("--serve-start", type=float, default=3.0,
                        help="seconds the serve stand-in takes to start (3)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=Path, help="keep one pipelined `run --json` here")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-ttr-"))
    try:
        mxfp4 = mxfp4_set(root / "sets")
        w8a8 = w8a8_set(mxfp4, root / "sets" / "w8a8")
        sizes = [sum(len(d) for d in r.files.values()) for r in (mxfp4, w8a8)]
        print(f"sets: MXFP4 {len(mxfp4.files)} files {sizes[0] / 1e6:.1f} MB "
              f"({DIMS.layers} layers x {DIMS.experts} experts), W8A8 {len(w8a8.files)} "
              f"files {sizes[1] / 1e6:.1f} MB; hub {args.rate / 1e6:g} MB/s "
              f"(bytes alone {sum(sizes) / args.rate:.1f} s); build stand-in "
              f"{args.build_cpu:g} CPU-s; serve start {args.serve_start:g} s; "
              f"{os.cpu_count()} CPUs", flush=True)
        serial, piped, alone, tails = [], [], [], []
        timelines: list[dict[str, float]] = []
        with StandinHub([mxfp4, w8a8]) as hub:
            hub.throttle = args.rate
            bench = Bench(root, hub, [mxfp4, w8a8], args)
            for i in range(args.rounds):
                serial.append(bench.serial())
                ready, tail, marks, stream = bench.pipelined()
                piped.append(ready)
                tails.append(tail)
                timelines.append(marks)
                alone.append(bench.download_alone())
                print(f"round {i + 1}: serial {serial[-1]:.2f} s, pipelined {ready:.2f} s "
                      f"(tail {tail:.2f} s), download alone {alone[-1]:.2f} s", flush=True)
                if args.events:
                    args.events.write_text(stream)
                for run_dir in root.glob("run*"):
                    shutil.rmtree(run_dir, ignore_errors=True)
        med = statistics.median
        ratio = med(piped) / (med(alone) + med(tails))
        print(f"\nmedians of {args.rounds}:")
        print(f"  time to ready, run --serial      {med(serial):7.2f} s")
        print(f"  time to ready, run (pipelined)   {med(piped):7.2f} s")
        print(f"  download alone                   {med(alone):7.2f} s")
        print(f"  tail (download done -> ready)    {med(tails):7.2f} s")
        print(f"  pipelined / (download alone + tail) = {ratio:.3f} (goal <= {GOAL}): "
              f"{'met' if ratio <= GOAL else 'MISSED'}")
        print(f"  serial / pipelined = {med(serial) / med(piped):.2f}x")
        print("\npipelined timeline (median, seconds from launch):")
        for key in timelines[0]:
            print(f"  {key:28} {med(m[key] for m in timelines):7.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
