"""The protocol between the tool's own processes (core/childrun) and the one JSON document
every command prints (core/envelope): a stage child's argv and environment, the options
handed to it, its result read back, and the document built and parsed in one place."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO

from dsv4_offload.core import childrun
from dsv4_offload.core.envelope import Envelope, MalformedDocument
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.results import Problem, StageResult, Status

SRC = REPO / "src" / "dsv4_offload"


def test_a_stage_child_runs_the_one_stage_forced_on_the_same_workspace_and_recipe() -> None:
    argv = [*childrun.tool_argv("/py", Path("/ws"), ["--recipe", "/r.yaml"],
                                ["serve.port=1", "x=y"], verbose=True),
            *childrun.stage_argv("convert")]
    assert argv == ["/py", "-m", "dsv4_offload", "--workspace", "/ws", "--recipe", "/r.yaml",
                    "--set", "serve.port=1", "--set", "x=y", "--verbose", "--json", "run",
                    "--serial", "--from", "convert", "--to", "convert", "--force", "convert"]
    assert childrun.tool_argv("/py", "/ws", [], []) == [
        "/py", "-m", "dsv4_offload", "--workspace", "/ws"]
    assert childrun.stage_argv("serve", device=3)[-2:] == ["--device", "3"]
    assert "--device" not in childrun.stage_argv("serve", device=None)


def test_a_stage_childs_environment_carries_the_lent_lock_options_events_and_run() -> None:
    base = {"PATH": "/bin", childrun.LENDER_PIPE_ENV: "1", childrun.STAGE_OPTIONS_ENV: "{}"}
    env = childrun.stage_env(base, "tok", {"follow": True, "out": Path("/o")},
                             events_file=Path("/ws/events.jsonl"), scheduler_pid=42)
    assert env["PATH"] == "/bin" and env[childrun.HANDOFF_ENV] == "tok"
    assert json.loads(env[childrun.STAGE_OPTIONS_ENV]) == {"follow": True, "out": "/o"}
    assert env[childrun.EVENTS_ENV] == "/ws/events.jsonl"
    assert env[childrun.SCHEDULER_PID_ENV] == "42"
    assert childrun.LENDER_PIPE_ENV not in env  # its lender is the process starting it
    assert base[childrun.LENDER_PIPE_ENV] == "1"  # the parent's own is left alone
    assert childrun.passed_names(env) == [childrun.HANDOFF_ENV, childrun.STAGE_OPTIONS_ENV,
                                          childrun.EVENTS_ENV]
    # only what is given: a stand-alone command lends its lock and nothing else
    bare = childrun.stage_env({"PATH": "/bin"}, "tok")
    assert bare == {"PATH": "/bin", childrun.HANDOFF_ENV: "tok"}
    assert childrun.passed_names(bare) == [childrun.HANDOFF_ENV]


def test_handed_options_are_read_once_and_taken_out_of_the_environment() -> None:
    environ = childrun.stage_env({}, "tok", {"jobs": 4, "mirrors": ["a=b"]})
    assert childrun.handed_options(environ) == {"jobs": 4, "mirrors": ["a=b"]}
    assert childrun.STAGE_OPTIONS_ENV not in environ  # the stage's own children never see it
    assert childrun.handed_options(environ) == {}
    assert environ == {childrun.HANDOFF_ENV: "tok"}


@pytest.mark.parametrize(("raw", "says"), [("{not json", "is not JSON"),
                                           ("[1, 2]", "is not a JSON object")])
def test_handed_options_that_are_not_a_json_object_are_one_line_input_errors(
        raw: str, says: str) -> None:
    environ = {childrun.STAGE_OPTIONS_ENV: raw}
    with pytest.raises(InputError) as caught:
        childrun.handed_options(environ)
    message = caught.value.one_line()
    assert says in message and "\n" not in message and "unset it" in message
    assert environ == {}


def _run_document(stage: str, result: StageResult) -> str:
    """What `run --json` prints for a serial run of ``stage`` (cli/pipeline.py)."""
    return Envelope("run", "ok", {"skipped": [], "stopped_at": None,
                                  "stages": {stage: result.as_dict()}}).to_json()


def test_a_childs_result_is_read_back_whole_by_the_one_reader() -> None:
    result = StageResult(Status.WARN, "converted 3 layers", data={"layers": [1, 2, 3]},
                         problems=[Problem("warning", "slow disk", "use a faster one", "io")],
                         outputs={"gguf": "/ws/gguf"}, log="/ws/logs/convert")
    report = childrun.read_report(_run_document("convert", result), "convert")
    assert report.result == result and report.error == ""
    # another stage's document holds no result for this one
    assert childrun.read_report(_run_document("convert", result), "serve").result is None


def test_a_child_that_ended_with_an_error_or_printed_nothing_has_no_result() -> None:
    error = Envelope.error("run", "workspace /ws is in use by pid 7", 3).to_json()
    report = childrun.read_report(error, "convert")
    assert report.result is None and report.error == "workspace /ws is in use by pid 7"
    for text in ("", "Traceback (most recent call last):\n", '{"schema": 1}', "[]"):
        assert childrun.read_report(text, "convert") == childrun.ChildReport()
    # a status word this version does not know reads as no result, not as a crash
    odd = Envelope("run", "ok", {"stages": {"convert": {"status": "teleported"}}}).to_json()
    assert childrun.read_report(odd, "convert").result is None


def test_the_envelope_prints_as_before_and_parses_back() -> None:
    data = {"stages": {"doctor": {"status": "ok", "summary": "héllo"}}, "path": Path("/p")}
    doc = Envelope("doctor", "ok", data)
    text = doc.to_json()
    # the bytes every command printed before the type: indented, UTF-8 as is, str() for paths
    assert text == json.dumps({"schema": 1, "command": "doctor", "status": "ok", "data": data},
                              indent=2, ensure_ascii=False, default=str) + "\n"
    back = Envelope.parse(text)
    assert back == Envelope("doctor", "ok", {**data, "path": "/p"})
    assert Envelope.parse(back.to_json()) == back
    error = Envelope.error("run", "bad --set", 2, usage="Usage: x")
    assert Envelope.parse(error.to_json()).data == {"error": "bad --set", "exit_code": 2,
                                                    "usage": "Usage: x"}
    assert error.error_message == "bad --set" and back.error_message == ""


@pytest.mark.parametrize(("text", "says"), [
    ("", "not a JSON document: (empty)"),
    ("Traceback (most recent call last):\n  File x\n" * 9, "not a JSON document: 'Traceback"),
    ('{"status": "ok"}', "not a dsv4-offload document (it needs schema, command, status"),
    ("[1]", "not a dsv4-offload document"),
    ('{"schema": 2, "command": "run", "status": "ok", "data": {}}', "document schema 2"),
    ('{"schema": 1, "command": 1, "status": "ok", "data": {}}',
     "its command and status are not text"),
])
def test_a_malformed_document_is_one_line_error(text: str, says: str) -> None:
    with pytest.raises(MalformedDocument) as caught:
        Envelope.parse(text)
    message = str(caught.value)
    assert message.startswith(says) and "\n" not in message and len(message) < 200
    assert isinstance(caught.value, ValueError)  # readers that caught ValueError still do


def test_a_real_commands_documents_parse_and_print_back_byte_for_byte(cli, tmp_path: Path
                                                                       ) -> None:
    usage = cli("--json", "run", "--no-such-option", "-w", str(tmp_path / "ws"))
    doc = Envelope.parse(usage.out)
    assert doc.command == "run" and doc.status == "error" and doc.data["exit_code"] == 2
    assert doc.to_json() == usage.out
    error = cli("--json", "--recipe", str(tmp_path / "missing.yaml"), "recipe", "show")
    doc = Envelope.parse(error.out)
    assert doc.status == "error" and "file not found" in doc.error_message
    assert doc.to_json() == error.out


def test_every_internal_variable_is_named_in_the_protocol_module_alone() -> None:
    names = set(childrun.INTERNAL_ENV)
    assert names == {"DSV4_IN_CONTAINER", "DSV4_STAGE_OPTIONS", "DSV4_LOCK_HANDOFF",
                     "DSV4_LENDER_PIPE", "DSV4_SCHEDULER_PID", "DSV4_EVENTS_FILE",
                     "DSV4_GROUP_MARK"}
    defined = re.compile(r"""["'](DSV4_[A-Z_]+)["']""")
    elsewhere = {f"{path.relative_to(SRC)}: {name}"
                 for path in SRC.rglob("*.py") if path.name != "childrun.py"
                 for name in defined.findall(path.read_text(encoding="utf-8"))
                 if name in names}
    assert not elsewhere, "use the constant of core/childrun instead"
