"""A hostile hub: listings that name files outside the weights directory, or are not listings.

A canary file outside the workspace must stay byte-identical and nothing new may appear
beside it; every bad listing ends in one line naming the entry, never a traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli_inproc as run_cli  # the commands in process: not the process
from standin_hub import StandinHub, tiny_model_repo

from dsv4_offload.core.errors import Dsv4Error, InputError
from dsv4_offload.weights import hubs

MXFP4_REPO = "deepseek-ai/DeepSeek-V4-Flash"  # huggingface in the bundled recipe
W8A8_REPO = "sgl-npu/DeepSeek-V4-Flash-W8A8"  # modelscope
SET_OF = {"huggingface": ("mxfp4", MXFP4_REPO), "modelscope": ("w8a8", W8A8_REPO)}
CANARY = b"the canary must not change\n"


def bad_paths(canary: Path) -> list[str]:
    return [str(canary), "../../outside/canary", "a/../../../outside/canary", "./config.json",
            "a//b", "", "x/..", "dir\\..\\evil", "a/\x01b", "/etc/passwd"]


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    d = tmp_path / "outside"
    d.mkdir()
    (d / "canary").write_bytes(CANARY)
    return d


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _env(tmp_path: Path) -> dict[str, str]:
    return {"HF_HOME": str(tmp_path / "hf-home"), "MODELSCOPE_CACHE": str(tmp_path / "ms"),
            "HF_ENDPOINT": "", "MODELSCOPE_ENDPOINT": ""}


@pytest.mark.parametrize("hub_name", ["huggingface", "modelscope"])
def test_every_bad_listing_path_is_refused_by_name(hub_name: str, outside: Path) -> None:
    counted = 0
    repos = [tiny_model_repo(f"hostile/case{i}") for i, _ in enumerate(bad_paths(outside))]
    with StandinHub(repos) as hub:
        for repo, bad in zip(repos, bad_paths(outside / "canary"), strict=True):
            repo.phantom[bad] = len(CANARY)
            with pytest.raises(InputError) as err:
                hubs.list_files(hub_name, repo.repo_id, "main", [], hub.url)
            line = err.value.one_line()
            assert "\n" not in line and "listing entry" in line and repr(bad)[1:-1][:60] in line
            counted += 1
    assert counted == len(bad_paths(outside / "canary"))
    assert _snapshot(outside) == {"canary": CANARY}


@pytest.mark.parametrize("hub_name", ["huggingface", "modelscope"])
def test_download_refuses_an_absolute_entry_and_writes_nothing_outside(
        hub_name: str, tmp_path: Path, outside: Path) -> None:
    which, repo_id = SET_OF[hub_name]
    repo = tiny_model_repo(repo_id)
    repo.phantom[str(outside / "canary")] = len(CANARY) + 5
    repo.phantom["../../../outside/new-file"] = 10
    ws = tmp_path / "ws"
    with StandinHub([repo]) as hub:
        res = run_cli("--workspace", str(ws), "download", which, "--endpoint", hub.url,
                      env=_env(tmp_path))
    assert res.code == 2, res
    lines = [x for x in res.err.splitlines() if x.strip()]
    assert len(lines) == 1 and "listing entry" in lines[0], res
    assert "Traceback" not in res.err
    assert _snapshot(outside) == {"canary": CANARY}
    assert not (ws / "weights").exists() or not any((ws / "weights").rglob("*.safetensors"))


def test_a_recorded_listing_with_dotdot_never_reaches_a_delete(tmp_path: Path,
                                                               outside: Path) -> None:
    """The weights record is read back offline; a '..' entry in it is refused, not deleted."""
    ws = tmp_path / "ws"
    record = ws / ".dsv4" / "weights" / "mxfp4.json"
    record.parent.mkdir(parents=True)
    listing = {"hub": "huggingface", "repo_id": MXFP4_REPO, "revision": "main",
               "resolved": "0" * 40,
               "endpoint": "http://127.0.0.1:9", "files": [
                   {"path": "../../outside/canary", "size": 1, "sha256": "0" * 64}]}
    doc = {"schema": 1, "listed": "now", "revision": "main",
           "allow_patterns": ["*.json", "*.safetensors", "*.py", "tokenizer*"],
           "listing": listing, "verified": {}}
    record.write_text(json.dumps(doc))
    res = run_cli("--workspace", str(ws), "download", "mxfp4", "--offline", env=_env(tmp_path))
    assert res.code == 2 and "Traceback" not in res.err, res
    assert "listing entry '../../outside/canary'" in res.err, res
    assert _snapshot(outside) == {"canary": CANARY}
    with pytest.raises(InputError, match="listing entry"):
        hubs.forget_local_copy("huggingface", ws / "weights", "../../outside/canary")
    with pytest.raises(InputError, match="listing entry"):
        hubs.forget_local_copy("modelscope", ws / "weights", str(outside / "canary"))
    assert _snapshot(outside) == {"canary": CANARY}


def test_a_symlink_on_the_way_is_refused(tmp_path: Path, outside: Path) -> None:
    local = tmp_path / "weights"
    local.mkdir()
    os.symlink(outside, local / "sub")
    with pytest.raises(InputError, match="symlink"):
        hubs.confined(local, "sub/canary", "weights.mxfp4 listing")
    with pytest.raises(InputError, match="symlink"):
        hubs.forget_local_copy("modelscope", local, "sub/canary")
    assert _snapshot(outside) == {"canary": CANARY}


@pytest.mark.parametrize("hub_name", ["huggingface", "modelscope"])
def test_an_html_page_instead_of_a_listing_is_one_line(hub_name: str) -> None:
    repo = tiny_model_repo(SET_OF[hub_name][1])
    repo.listing_body = b"<html><body>Please log in to the proxy</body></html>"
    with StandinHub([repo]) as hub, pytest.raises(Dsv4Error) as err:
        hubs.list_files(hub_name, repo.repo_id, "main", [], hub.url)
    assert "not a file listing" in err.value.one_line()
    assert "\n" not in err.value.one_line()


@pytest.mark.parametrize("hub_name", ["huggingface", "modelscope"])
def test_a_listing_with_junk_sizes_is_one_line(hub_name: str) -> None:
    repo = tiny_model_repo(SET_OF[hub_name][1])
    body = ([{"type": "file", "path": "a", "size": "huge", "oid": "0" * 40}]
            if hub_name == "huggingface" else
            {"Code": 200, "Success": True, "Data": {"Files": [
                {"Path": "a", "Name": "a", "Type": "blob", "Size": -5, "Sha256": "x"}]}})
    repo.listing_body = json.dumps(body).encode()
    with StandinHub([repo]) as hub, pytest.raises(Dsv4Error) as err:
        hubs.list_files(hub_name, repo.repo_id, "main", [], hub.url)
    assert "\n" not in err.value.one_line()


def test_a_dripping_hub_stalls_then_the_rerun_resumes(tmp_path: Path) -> None:
    import time

    repo = tiny_model_repo(W8A8_REPO)
    big = "model-00002-of-00002.safetensors"
    repo.files[big] = bytes(range(256)) * 256  # 64 KiB
    ws = tmp_path / "ws"
    env = {**_env(tmp_path), "DSV4_DOWNLOAD_STALL_S": "2"}
    with StandinHub([repo]) as hub:
        hub.throttle = 300  # bytes per second: a drip, under the 1 KB/s floor
        t0 = time.monotonic()
        res = run_cli("--workspace", str(ws), "download", "w8a8", "--endpoint", hub.url,
                      "--max-workers", "1", env=env, timeout=60)
        assert time.monotonic() - t0 < 30
        assert res.code == 1, res
        assert "stalled" in res.out and "Traceback" not in res.err + res.out
        hub.throttle = None
        hub.requests.clear()
        again = run_cli("--workspace", str(ws), "download", "w8a8", "--endpoint", hub.url,
                        env=_env(tmp_path))
        assert again.code == 0, again
        target = ws / "weights" / "DeepSeek-V4-Flash-W8A8" / big
        assert target.read_bytes() == repo.files[big]
    bad = run_cli("--workspace", str(ws), "download", "w8a8", "--endpoint", "http://127.0.0.1:9",
                  env={**env, "DSV4_DOWNLOAD_STALL_S": "soon"})
    assert bad.code == 2 and "DSV4_DOWNLOAD_STALL_S" in bad.err, bad


def test_credentials_in_an_endpoint_never_reach_output_records_or_logs(tmp_path: Path) -> None:
    import stat

    token = "hf_s3cr3tT0kenInTheUrl"
    repo = tiny_model_repo(W8A8_REPO)
    ws = tmp_path / "ws"
    with StandinHub([repo]) as hub:
        endpoint = hub.url.replace("http://", f"http://user:{token}@")
        res = run_cli("--workspace", str(ws), "--json", "download", "w8a8", "--endpoint",
                      endpoint, env=_env(tmp_path))
    assert res.code == 0, res
    assert token not in res.out + res.err
    for path in ws.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path
    log = ws / "logs" / "download" / "download.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert stat.S_IMODE((ws / ".dsv4" / "state.json").stat().st_mode) == 0o600


@pytest.mark.parametrize("blocker", ["file-for-dir", "dir-for-file"])
def test_something_in_the_way_of_the_weights_is_one_line(tmp_path: Path, blocker: str) -> None:
    ws = tmp_path / "ws"
    if blocker == "file-for-dir":
        ws.mkdir()
        (ws / "weights").write_text("not a directory")
    else:
        (ws / "weights" / "DeepSeek-V4-Flash-W8A8" / "config.json").mkdir(parents=True)
    with StandinHub([tiny_model_repo(W8A8_REPO)]) as hub:
        res = run_cli("--workspace", str(ws), "download", "w8a8", "--endpoint", hub.url,
                      env=_env(tmp_path))
    assert res.code == 2, res
    assert "Traceback" not in res.err and "move it aside" in res.err
