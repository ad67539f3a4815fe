"""The pipelined `run` (issue 23, the scheduler): stages as processes on the stage graph.

Every test runs the real CLI with the instrumented stages (tests/fakestages), whose
behaviours make overlap observable without sleeping: 'await STAGE' waits until STAGE has
started too (it fails after 30 s if the two never run at once), 'until STAGE STATUS' waits
until STAGE's record says STATUS.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dsv4_offload.workspace.store import Workspace

WRITER = """
import sys
from dsv4_offload.workspace.store import Workspace
ws = Workspace(sys.argv[1])
me = sys.argv[2]
for i in range(int(sys.argv[3])):
    ws.write_stage_record(f"{me}-{i}", {"status": "done", "summary": f"{me} {i}"})
    ws.update_provenance(f"{me}-{i}", {"n": i})
"""


def test_concurrent_record_writes_lose_nothing(tmp_path: Path) -> None:
    """Stage processes of one run write the state file and the provenance at once: each
    read-modify-write holds the records lock, so no writer's record is lost."""
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    writers, each = 4, 25
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(ws.root), f"w{n}", str(each)])
             for n in range(writers)]
    assert [p.wait(timeout=120) for p in procs] == [0] * writers
    stages = ws.read_state()["stages"]
    expected = {f"w{n}-{i}" for n in range(writers) for i in range(each)}
    assert set(stages) == expected
    prov = json.loads(ws.provenance_file.read_text())
    assert expected <= set(prov)
    assert not [p.name for p in ws.meta_dir.iterdir() if p.name.endswith(".tmp")]
