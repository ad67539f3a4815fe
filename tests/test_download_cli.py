"""`dsv4-offload download` as a user runs it, against the stand-in hub on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CLI, run_cli_inproc
from standin_hub import StandinHub, tiny_model_repo

MXFP4_REPO = "deepseek-ai/DeepSeek-V4-Flash"
W8A8_REPO = "sgl-npu/DeepSeek-V4-Flash-W8A8"
TINY_BYTES = sum(len(d) for d in tiny_model_repo("x/y").files.values())
SIZES = [arg for w in ("w8a8", "mxfp4")
         for arg in ("--set", f"weights.{w}.expected_bytes={TINY_BYTES}")]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"HF_HOME": str(tmp_path / "hf-home"), "MODELSCOPE_CACHE": str(tmp_path / "ms"),
            "HF_ENDPOINT": "", "MODELSCOPE_ENDPOINT": ""}


def test_download_json_then_status_shows_done(tmp_path: Path, env: dict[str, str]) -> None:
    ws = str(tmp_path / "ws")
    with StandinHub([tiny_model_repo(MXFP4_REPO), tiny_model_repo(W8A8_REPO)]) as hub:
        res = run_cli_inproc("--workspace", ws, *SIZES, "--json", "download",
                             "--endpoint", f"huggingface={hub.url}",
                             "--endpoint", f"modelscope={hub.url}", env=env)
        assert res.code == 0, res
        doc = res.json()
        assert doc["schema"] == 1 and doc["command"] == "download"
        assert doc["status"] == "ok"
        outputs = doc["data"]["outputs"]
        assert outputs["mxfp4"]["resolved"] == hub.repos[MXFP4_REPO].commit
        assert outputs["w8a8"]["files"] == 4
        hub.requests.clear()
        again = run_cli_inproc("--workspace", ws, *SIZES, "--json", "download", "mxfp4",
                               "--endpoint", hub.url, env=env)
        assert again.code == 0, again
        assert hub.data_requests() == []
    offline = run_cli_inproc("--workspace", ws, *SIZES, "--json", "download", "--offline", env=env)
    assert offline.code == 0, offline
    status = run_cli_inproc("--workspace", ws, *SIZES, "--json", "status", env=env)
    stages = {s["name"]: s for s in status.json()["data"]["stages"]}
    assert stages["download"]["state"] == "done"


def test_unreachable_hub_exits_1_with_one_line(tmp_path: Path, env: dict[str, str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(env, HF_ENDPOINT=f"http://127.0.0.1:{port}")
    res = run_cli_inproc("--workspace", str(tmp_path / "ws"), "download", "mxfp4", env=env)
    assert res.code == 1, res
    lines = [x for x in res.err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot list"), res
    assert "Traceback" not in res.err


def test_bad_arguments_exit_2(tmp_path: Path, env: dict[str, str]) -> None:
    ws = str(tmp_path / "ws")
    assert run_cli_inproc("--workspace", ws, "download", "fp8", env=env).code == 2
    bad = run_cli_inproc("--workspace", ws, "download", "--endpoint", "a", "--endpoint", "b",
                         env=env)
    assert bad.code == 2 and "HUB=URL" in bad.err
    both = run_cli_inproc("--workspace", ws, "download", "--endpoint", "http://127.0.0.1:9",
                          env=env)
    assert both.code == 2 and "name the set" in both.err


def test_ctrl_c_mid_file_then_rerun_resumes(tmp_path: Path, env: dict[str, str]) -> None:
    ws = tmp_path / "ws"
    repo = tiny_model_repo(W8A8_REPO)
    big = "model-00002-of-00002.safetensors"
    repo.files[big] = bytes(range(256)) * 256  # 64 KiB
    target = ws / "weights" / "DeepSeek-V4-Flash-W8A8" / big
    partial = target.with_name(big + ".incomplete")  # where modelscope keeps a partial file
    with StandinHub([repo]) as hub:
        hub.throttle = 16 * 1024  # 4 s for the big file: time to interrupt it
        args = [*CLI, "--workspace", str(ws), "download", "w8a8", "--endpoint", hub.url,
                "--max-workers", "1"]
        proc = subprocess.Popen(args, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (partial.exists() and partial.stat().st_size >= 16 * 1024):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, (out, err)
        assert not target.exists()  # never a half file under the final name
        kept = partial.stat().st_size
        assert 0 < kept < len(repo.files[big])
        state = json.loads((ws / ".dsv4" / "state.json").read_text())
        # Ctrl-C is recorded as what it was (issue 19), not as a failure of the download
        record = state["stages"]["download"]
        assert record["status"] == "interrupted" and "Ctrl-C" in record["error"], record

        hub.throttle = None
        hub.requests.clear()
        again = run_cli_inproc("--workspace", str(ws), "download", "w8a8", "--endpoint", hub.url,
                               env=env)
        assert again.code == 0, again
        assert target.read_bytes() == repo.files[big]
        ranges = [r.range for r in hub.data_requests() if big in r.path]
        assert ranges == [f"bytes={kept}-"]


def test_status_says_when_a_branch_moved_past_the_lock(tmp_path: Path,
                                                        env: dict[str, str]) -> None:
    import datetime as dt

    ws = str(tmp_path / "ws")
    repos = [tiny_model_repo(MXFP4_REPO), tiny_model_repo(W8A8_REPO, commit="a" * 40)]
    with StandinHub(repos) as hub:
        hubs = ["--endpoint", f"huggingface={hub.url}", "--endpoint", f"modelscope={hub.url}"]
        assert run_cli_inproc("--workspace", ws, *SIZES, "download", *hubs, env=env).code == 0
        quiet = run_cli_inproc("--workspace", ws, *SIZES, "--json", "status", env=env)
        assert quiet.json()["data"]["weights_moved"] == []
        hub.repos[W8A8_REPO].move_to("b" * 40, dict(hub.repos[W8A8_REPO].files),
                                     dt.datetime(2026, 10, 1, tzinfo=dt.timezone.utc))
        again = run_cli_inproc("--workspace", ws, *SIZES, "download", *hubs, env=env)
        assert again.code == 0, again  # the date rule holds: nothing to fetch
        hub.stop()  # status asks no hub
        status = run_cli_inproc("--workspace", ws, *SIZES, "status", env=env)
    assert status.code == 0, status
    line = next(x for x in status.out.splitlines() if x.startswith("weights:"))
    assert f"w8a8: {W8A8_REPO}@master has moved past the lock: its head was {'b' * 40} " \
        "(2026-10-01T00:00:00Z)" in line
    assert f"the lock holds {'a' * 40} (2026-07-01T08:00:00Z)" in line


def test_status_asks_the_hubs_again_when_the_cached_heads_are_old(tmp_path: Path,
                                                                   env: dict[str, str]) -> None:
    import datetime as dt

    ws = tmp_path / "ws"
    repos = [tiny_model_repo(MXFP4_REPO), tiny_model_repo(W8A8_REPO, commit="a" * 40)]
    with StandinHub(repos) as hub:
        env = dict(env, HF_ENDPOINT=hub.url, MODELSCOPE_ENDPOINT=hub.url)
        assert run_cli_inproc("--workspace", str(ws), *SIZES, "download", env=env).code == 0
        lock_file = ws / "weights.lock.json"
        doc = json.loads(lock_file.read_text())
        for entry in doc.values():  # seen a day ago
            entry["head"]["seen"] = "2026-12-01T00:00:00+00:00"
        lock_file.write_text(json.dumps(doc))
        hub.repos[MXFP4_REPO].move_to("2" * 40, dict(hub.repos[MXFP4_REPO].files),
                                      dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc))
        status = run_cli_inproc("--workspace", str(ws), *SIZES, "--json", "status", env=env)
        assert status.code == 0, status
        (moved,) = status.json()["data"]["weights_moved"]
        assert moved.startswith(f"mxfp4: {MXFP4_REPO}@main has moved past the lock: its head "
                                f"was {'2' * 40} (2026-11-01T00:00:00Z) when seen 2026-12-")
        hub.requests.clear()
        again = run_cli_inproc("--workspace", str(ws), *SIZES, "--json", "status", env=env)
        assert again.json()["data"]["weights_moved"] == [moved]
        assert hub.requests == []  # cached: the heads were asked a moment ago
        for entry in doc.values():
            entry["head"]["seen"] = "2026-12-01T00:00:00+00:00"
        lock_file.write_text(json.dumps(doc))
    # old heads and a hub that cannot be reached: said, and status still exits 0
    gone = run_cli_inproc("--workspace", str(ws), *SIZES, "--json", "status", env=env)
    assert gone.code == 0, gone
    lines = gone.json()["data"]["weights_moved"]
    assert any(x.startswith("mxfp4: could not ask huggingface where main points now")
               for x in lines)
