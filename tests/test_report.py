"""`dsv4-offload report`: a redacted bundle for a bug report (issue 21).

Secrets are planted where they really end up (the environment, logs, URLs in records, an
API key file a serve record names); the extracted bundle must hold none of them, and still
hold what a maintainer needs.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from conftest import HOST_RECIPE, run_cli_inproc

from dsv4_offload.workspace.store import Workspace

HF = "hf_PlantedTokenAbCdEfGhIjKlMnOp1234"
GH = "ghp_PlantedGithubToken0123456789abcd"
URL_PASS = "s3cr3t-url-pass"
URL_USER_TOKEN = "glpat-PlantedUserToken12345"
API_KEY = "planted-api-key-9f8e7d6c5b4a"
OTHER = "Planted-Password-Zz9"
SK = "sk-PlantedOpenAiKey1234567890"
SECRETS = [HF, GH, URL_PASS, URL_USER_TOKEN, API_KEY, OTHER, SK]


def _plant(tmp_path: Path) -> tuple[Workspace, dict[str, str]]:
    ws = Workspace(tmp_path / "ws")
    ws.meta_dir.mkdir(parents=True)
    ws.run_dir.mkdir()
    key_file = tmp_path / "api.key"
    key_file.write_text(API_KEY + "\n")
    server_log = tmp_path / "server.log"
    server_log.write_text(f"starting with --api-key {API_KEY}\nready\n")
    ws.state_file.write_text(json.dumps({"stages": {"fetch": {
        "status": "ok", "outputs": {
            "url": f"https://builder:{URL_PASS}@git.example.com/ktransformers.git",
            "mirror": f"https://{URL_USER_TOKEN}@gitlab.example.com/sglang.git"}}}}))
    ws.serve_record.write_text(json.dumps({"pid": 1, "log": str(server_log),
                                           "extra": {"api_key_file": str(key_file)}}))
    ws.sources_lock_file.write_text(json.dumps({"sglang": {"commit": "a" * 40}}))
    log = ws.log_dir("download") / "download.log"
    log.parent.mkdir(parents=True)
    log.write_text("\n".join([
        f"$ env HF_TOKEN={HF} huggingface-cli download",
        f"GET https://x:{URL_PASS}@hub.example.com/api",
        f"Authorization: Bearer {SK}",
        f"git clone https://{GH}@github.com/kvcache-ai/ktransformers",
        f"password={OTHER}",
        "download finished",
    ]) + "\n")
    env = {"HF_TOKEN": HF, "GITHUB_TOKEN": GH, "MY_SERVICE_PASSWORD": OTHER,
           "OPENAI_API_KEY": SK, "HTTPS_PROXY": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
    return ws, env


def _extract(bundle: Path) -> dict[str, str]:
    with tarfile.open(bundle) as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode()  # type: ignore[union-attr]
                for m in tar.getmembers() if m.isfile()}


def test_report_bundle_has_what_a_maintainer_needs_and_no_secret(tmp_path: Path) -> None:
    ws, env = _plant(tmp_path)
    out = tmp_path / "bug.tar.gz"
    res = run_cli_inproc("-w", str(ws.root), "-r", str(HOST_RECIPE), "report", "--out", str(out),
                  env=env, timeout=300)
    assert res.code == 0, res
    assert str(out) in res.out
    files = _extract(out)
    for name in ("README.txt", "recipe.yaml", "sources.lock.json", "doctor.json",
                 "versions.json", "records/state.json", "records/run/serve.json",
                 "logs/download/download.log.tail"):
        assert name in files, sorted(files)
    assert any(n.endswith("server.log.tail") for n in files), sorted(files)
    assert "name: dsv4-flash-910b" in files["recipe.yaml"]
    versions = json.loads(files["versions.json"])
    assert versions["packages"]["typer"] and versions["dsv4-offload"]
    assert {s["name"] for s in versions["sources"]} >= {"ktransformers", "sglang"}
    doctor = json.loads(files["doctor.json"])
    assert doctor["status"] in ("ok", "warn", "failed", "error"), doctor
    assert "download finished" in files["logs/download/download.log.tail"]
    # the secrets are gone, wherever they were planted; the rest of the line stays
    blob = "\n".join(files.values())
    for secret in SECRETS:
        assert secret not in blob, (secret, [n for n, t in files.items() if secret in t])
    assert "git.example.com/ktransformers.git" in files["records/state.json"]
    assert "***" in files["logs/download/download.log.tail"]


def test_report_works_without_a_workspace_or_a_valid_recipe(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [\n")
    out = tmp_path / "r.tar.gz"
    res = run_cli_inproc("-w", str(tmp_path / "none"), "-r", str(bad), "--json", "report",
                  "--out", str(out), env={"HTTPS_PROXY": "http://127.0.0.1:9"})
    assert res.code == 0, res
    doc = res.json()
    assert doc["data"]["report"] == str(out)
    files = _extract(out)
    assert "recipe-error.txt" in files and "bad.yaml" in files["recipe-error.txt"]
    assert "error" in json.loads(files["doctor.json"])["status"] or files["doctor.json"]
    assert "does not exist" in files["README.txt"]
    assert not (tmp_path / "none").exists()


def test_two_bundles_written_at_once_to_one_name_both_finish(tmp_path: Path) -> None:
    """Two reports in the same second share the default name: each writes a part of its
    own (one .part for both lost the second's rename: seen in a CI run of test_access)."""
    import threading

    from dsv4_offload.cli.report import write_bundle

    out = tmp_path / "dsv4-report-20261207-145119.tar.gz"
    files = {f"logs/{i}.log": "line\n" * 20000 for i in range(20)}
    errors: list[BaseException] = []

    def write() -> None:
        try:
            write_bundle(files, [], out)
        except BaseException as exc:  # what a thread met, for the assertion
            errors.append(exc)

    for _ in range(5):
        threads = [threading.Thread(target=write) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temp file left
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask_now())


def _umask_now() -> int:
    import os

    current = os.umask(0)
    os.umask(current)
    return current
