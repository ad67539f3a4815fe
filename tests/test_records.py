"""The state file's typed records (workspace/records): today's files read, round trips,
older files migrated, unreadable records told in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import Status
from dsv4_offload.core.states import StageState
from dsv4_offload.workspace.records import STATE_SCHEMA, StageRecord, State, load_state
from dsv4_offload.workspace.store import Workspace

# written by main at ef4a67b (the fake stages: doctor and fetch done, patch failed, build
# interrupted by Ctrl-C, selftest's process killed outright while running)
CAPTURED = Path(__file__).parent / "fixtures" / "state" / "main-ef4a67b.json"


def _workspace(tmp_path: Path, doc: object) -> Workspace:
    ws = Workspace(tmp_path / "ws")
    ws.ensure()
    ws.state_file.write_text(json.dumps(doc))
    return ws


def test_a_state_file_main_wrote_reads_typed_and_writes_back_the_same() -> None:
    doc = json.loads(CAPTURED.read_text())
    state = load_state(doc, CAPTURED)
    assert {n: r.status for n, r in state.stages.items()} == {
        "doctor": StageState.DONE, "fetch": StageState.DONE, "patch": StageState.FAILED,
        "build": StageState.INTERRUPTED, "selftest": StageState.RUNNING}
    doctor = state.stages["doctor"]
    assert doctor.result is Status.OK and doctor.summary == "doctor ok"
    assert doctor.fingerprint is not None and doctor.fingerprint["recipe.host.arch"]
    assert state.outputs("fetch") == {"stage": "fetch", "options": []}
    assert state.outputs("download") == {} and state.record("download") is None
    build = state.stages["build"]
    assert build.signal == "Ctrl-C" and build.error == "interrupted by Ctrl-C"
    selftest = state.stages["selftest"]
    assert isinstance(selftest.pid, int) and isinstance(selftest.pid_start_time, int)
    assert selftest.ended is None
    assert state.as_raw() == doc  # every key as it was, none added


def test_a_record_round_trips_through_the_file(tmp_path: Path) -> None:
    ws = _workspace(tmp_path, {"schema": 1, "stages": {}})
    done = StageRecord(status=StageState.DONE, started="a", ended="b", seconds=1.5,
                       fingerprint={"recipe.x": "0123"}, outputs={"n": [1, 2]},
                       summary="fine", result=Status.WARN, log="/l", container="c")
    ws.write_stage_record("convert", done)
    ws.write_stage_record("download", StageRecord(status=StageState.RUNNING, pid=7,
                                                  pid_start_time=None, started="s", log=None))
    assert ws.state().record("convert") == done
    on_disk = json.loads(ws.state_file.read_text())
    assert on_disk["schema"] == STATE_SCHEMA
    assert on_disk["stages"]["convert"]["result"] == "warn"
    assert on_disk["stages"]["convert"]["status"] == "done"
    # what its writer set, None included; nothing it did not
    assert on_disk["stages"]["download"] == {"status": "running", "pid": 7,
                                             "pid_start_time": None, "started": "s",
                                             "log": None}
    assert ws.read_state() == on_disk


def test_keys_a_record_does_not_know_are_kept(tmp_path: Path) -> None:
    ws = _workspace(tmp_path, {"schema": 1, "stages": {
        "fetch": {"status": "running", "pid": 1, "note": {"by": "hand"}}}})
    record = ws.state().record("fetch")
    assert record is not None
    ws.write_stage_record("fetch", record.changed(status=StageState.FAILED, error="gone"))
    assert json.loads(ws.state_file.read_text())["stages"]["fetch"] == {
        "status": "failed", "pid": 1, "note": {"by": "hand"}, "error": "gone"}


def test_an_unversioned_file_is_migrated_and_stamped_on_the_next_write(tmp_path: Path) -> None:
    doc = json.loads(CAPTURED.read_text())
    del doc["schema"]
    ws = _workspace(tmp_path, doc)
    state = ws.state()
    assert state.stages["patch"].error == "patch failed on purpose: told to fail"
    ws.write_stage_record("download", StageRecord(status=StageState.RUNNING, pid=1))
    written = json.loads(ws.state_file.read_text())
    assert written["schema"] == STATE_SCHEMA
    assert written["stages"]["doctor"] == doc["stages"]["doctor"]


def test_a_missing_file_is_an_empty_state(tmp_path: Path) -> None:
    ws = Workspace(tmp_path / "ws")
    assert ws.state() == State() and ws.read_state() == {"schema": STATE_SCHEMA, "stages": {}}


def test_a_file_of_a_newer_schema_is_one_line(tmp_path: Path) -> None:
    ws = _workspace(tmp_path, {"schema": STATE_SCHEMA + 1, "stages": {}})
    with pytest.raises(InputError) as caught:
        ws.state()
    assert "written by a newer dsv4-offload" in caught.value.one_line()


@pytest.mark.parametrize("doc", [[], {"schema": 1}, {"schema": "1", "stages": {}},
                                 {"schema": 1, "stages": []}])
def test_not_a_state_file_is_one_line(tmp_path: Path, doc: object) -> None:
    ws = _workspace(tmp_path, doc)
    with pytest.raises(InputError) as caught:
        ws.state()
    assert caught.value.one_line() == (f"{ws.state_file}: not a dsv4-offload state file; "
                                       "move it aside and rerun")


@pytest.mark.parametrize(("record", "why"), [
    ("garbage", "a str, not an object"),
    ({"status": 5}, "'status' is not text"),
    ({"fingerprint": [1]}, "'fingerprint' is not an object"),
    ({"status": "ok"}, "'status': Input should be 'pending', 'waiting', 'running'"),
    ({"status": "stale"}, "'status': 'stale' is a run's state, not a record's"),
    ({"status": "done", "pid": "me"}, "'pid': Input should be a valid integer"),
])
def test_an_unreadable_record_names_its_stage_and_why(tmp_path: Path, record: object,
                                                      why: str) -> None:
    ws = _workspace(tmp_path, {"schema": 1, "stages": {"doctor": record}})
    with pytest.raises(InputError) as caught:
        ws.state()
    line = caught.value.one_line()
    assert line.startswith(f"{ws.state_file}: the record of stage 'doctor' is malformed ({why}")
    assert line.endswith("; delete that entry (or move the file aside) and rerun: the stage "
                         "runs again")


def test_a_raw_record_is_checked_before_it_is_written(tmp_path: Path) -> None:
    ws = _workspace(tmp_path, {"schema": 1, "stages": {}})
    ws.write_stage_record("fetch", {"status": "done", "summary": "raw"})
    assert ws.state().stages["fetch"].summary == "raw"
    with pytest.raises(ValueError, match="the record of stage 'fetch': 'status' is not text"):
        ws.write_stage_record("fetch", {"status": 1})  # type: ignore[typeddict-item]


def test_a_state_word_prints_and_serialises_as_itself() -> None:
    assert f"{StageState.NOT_APPLICABLE}" == str(StageState.NOT_APPLICABLE) == "n/a"
    assert f"{StageState.DONE:<6}|" == "done  |"
    assert json.dumps({"s": StageState.BLOCKED}) == '{"s": "blocked"}'
    assert StageState.FAILED == "failed" and StageState("interrupted").stopped
