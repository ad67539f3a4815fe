"""What a pipelined run shows: its events folded (core/inflight) and drawn (cli/live)."""

from __future__ import annotations

import datetime as dt
import os
import select
import subprocess
import time
from pathlib import Path

from conftest import CLI, SMALL_RECIPE
from rich.console import Console

from dsv4_offload.cli.live import plain_line, render_flight
from dsv4_offload.core.inflight import InFlight

T0 = dt.datetime(2026, 12, 4, 12, 0, tzinfo=dt.timezone.utc)
MIB = 1024**2


def _at(after: float, event: str, **fields: object) -> dict:
    return {"v": 1, "t": (T0 + dt.timedelta(seconds=after)).isoformat(timespec="milliseconds"),
            "event": event, "pid": 7, **fields}


def _run_of_events() -> list[dict]:
    return [
        _at(0, "run.started", mode="pipelined", plan={"build": "run", "download": "run",
                                                     "convert": "run", "serve": "run"}),
        _at(1, "stage.started", stage="build", log="/ws/logs/build", options={"jobs": 15}),
        _at(1, "stage.started", stage="download", log="/ws/logs/download", options={}),
        _at(2, "stage.started", stage="convert", log="/ws/logs/convert",
            options={"follow": True, "jobs": 1}),
        _at(3, "step.started", stage="build", step="kt-kernel"),
        _at(10, "stage.progress", stage="download", task="download mxfp4", completed=0,
            total=1000 * MIB, unit="B"),
        _at(20, "stage.progress", stage="download", task="download mxfp4", completed=100 * MIB,
            total=1000 * MIB, unit="B"),
        _at(20, "file.verified", stage="download", set="mxfp4", path="model-00002-of-00046",
            bytes=5 * MIB),
        *[_at(21, "layer.converted", stage="convert", layer=n) for n in range(12)],
        *[_at(21, "layer.verified", stage="convert", layer=n) for n in range(11)],
    ]


def test_the_flight_has_rate_eta_layers_and_the_build_step() -> None:
    flight = InFlight()
    for doc in _run_of_events():
        flight.feed(doc)
    now = (T0 + dt.timedelta(seconds=22)).timestamp()
    download = flight.stages["download"]
    assert download.sets["mxfp4"].rate == 10 * MIB and download.sets["mxfp4"].eta == 90
    assert download.progress_text() == ("mxfp4 100.0 MiB/1000.0 MiB at 10.0 MiB/s, ETA 1m30s, "
                                        "1 files verified")
    assert flight.stages["convert"].progress_text(43) == "12/43 layers converted, 11 verified"
    assert flight.stages["build"].progress_text() == "step kt-kernel"
    assert {s.stage for s in flight.running()} == {"build", "download", "convert"}
    # the last byte in 90 s, then one more layer at the pace so far (20 s for 12 layers)
    ready = flight.projected_ready(now, 43)
    assert ready is not None and abs(ready - (now + 90 + 20 / 12)) < 0.01
    console = Console(record=True, width=200)
    console.print(render_flight(flight, now, 43))
    text = console.export_text()
    for needle in ("weights", "download", "ETA 1m30s", "12/43 layers converted", "build",
                   "step kt-kernel", "elapsed 22s", "projected ready"):
        assert needle in text, (needle, text)
    assert "serve" in text and "waiting" in text  # planned, not started yet


def test_plain_lines_name_starts_ends_and_blocks() -> None:
    flight = InFlight()
    lines = {}
    for doc in [*_run_of_events(),
                _at(30, "stage.failed", stage="build", error="build step kt-kernel failed",
                    log="/ws/logs/build/kt-kernel.log"),
                _at(30, "stage.blocked", stage="serve", reason="needs build, which failed"),
                _at(40, "stage.done", stage="download", summary="2 sets", seconds=39)]:
        flight.feed(doc)
        line = plain_line(doc, flight)
        if line:
            lines[(doc["event"], doc.get("stage"))] = line
    assert lines[("stage.started", "convert")] == \
        "[bold]convert[/bold]: started (pid 7, follow, jobs 1)"
    assert "failed[/red] — build step kt-kernel failed (log: /ws/logs/build/kt-kernel.log)" \
        in lines[("stage.failed", "build")]
    assert lines[("stage.blocked", "serve")].endswith("blocked — needs build, which failed")
    assert "done[/green] in 39s — 2 sets" in lines[("stage.done", "download")]


def test_a_terminal_gets_the_live_panel(tmp_path: Path, fake_stages_env) -> None:
    """`run` on a terminal (a pty): the panel of every branch, then the end."""
    ws = tmp_path / "ws"
    leader, follower = os.openpty()
    env = {**os.environ, **fake_stages_env, "COLUMNS": "160", "LINES": "40", "TERM": "xterm"}
    env.pop("DSV4_WORKSPACE", None)
    proc = subprocess.Popen([*CLI, "-r", str(SMALL_RECIPE), "-w", str(ws), "run"], env=env,
                            stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = out.decode("utf-8", "replace")
    assert proc.returncode == 0, text
    for needle in ("branch", "weights", "download", "elapsed", "run done in"):
        assert needle in text, (needle, text[-2000:])
    assert "started (pid" not in text  # the panel, not the plain lines
