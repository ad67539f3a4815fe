"""A recording stand-in for the `docker` client (no Docker engine runs in the tests).

Installed as `docker` on PATH by tests/test_container.py. It appends each argv as a JSON line
to $FAKE_DOCKER/argv.jsonl and answers as the client does for the verbs the tool uses:
`image inspect`, `pull`, `ps -a --filter name=^/N$ --format ...`, `run`, `rm -f`, `cp`,
`exec`. Containers live in $FAKE_DOCKER/state.json; a container's own files live under
$FAKE_DOCKER/fs/<name> (wiped when it is created again, as a new container starts from
the image). `exec` runs the command on this host, with the container's -e variables, its -w
directory and FAKE_CONTAINER_ROOT set: the workspace is mounted at its own path, so a
host process sees the same files the container would. As docker does, `-e NAME` takes the
value from the client's own environment (and sets nothing when the client has none); the
variables named in $FAKE_DOCKER_HOST_ONLY (comma-separated) stay out of the container unless
an `-e` names them, as every host variable would with a real engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HOME = Path(os.environ["FAKE_DOCKER"])
STATE = HOME / "state.json"


def load() -> dict:
    if STATE.exists():
        return json.loads(STATE.read_text())
    return {"images": [], "containers": {}, "next": 1}


def save(state: dict) -> None:
    STATE.write_text(json.dumps(state))


def fail(msg: str, code: int = 1) -> None:
    sys.stderr.write(msg + "\n")
    sys.exit(code)


def main(argv: list[str]) -> None:
    HOME.mkdir(parents=True, exist_ok=True)
    with open(HOME / "argv.jsonl", "a") as fh:
        fh.write(json.dumps(["docker", *argv]) + "\n")
    state = load()
    verb = argv[0] if argv else ""
    if argv[:2] == ["image", "inspect"]:
        image = argv[-1]
        if image not in state["images"]:
            fail(f"Error response from daemon: No such image: {image}")
        print("arm64")
    elif verb == "pull":
        image = argv[1]
        for line in ("2d4e1a7c: Pulling fs layer", "2d4e1a7c: Downloading 10MB/20MB",
                     "2d4e1a7c: Pull complete", f"Status: Downloaded newer image for {image}"):
            print(line, flush=True)
        state["images"].append(image)
        save(state)
    elif verb == "ps":
        name = argv[argv.index("--filter") + 1].removeprefix("name=^/").removesuffix("$")
        c = state["containers"].get(name)
        if c:
            print(f"{c['id']}\t{c['image']}\t{c['state']}\t{c['label']}")
    elif verb == "run":
        name = argv[argv.index("--name") + 1]
        if name in state["containers"]:
            fail(f'docker: Error response from daemon: Conflict. The container name "/{name}" '
                 "is already in use.", 125)
        label = next((a.split("=", 1)[1] for i, a in enumerate(argv)
                      if argv[i - 1] == "--label"), "")
        image = argv[-2]
        if image not in state["images"]:
            fail(f"Unable to find image '{image}' locally", 125)
        cid = f"{state['next']:012x}" * 5
        state["next"] += 1
        state["containers"][name] = {"id": cid[:64], "image": image, "state": "running",
                                     "label": label}
        shutil.rmtree(HOME / "fs" / name, ignore_errors=True)
        (HOME / "fs" / name).mkdir(parents=True)
        save(state)
        print(cid[:64])
    elif verb == "rm":
        name = argv[-1]
        if name not in state["containers"]:
            fail(f"Error response from daemon: No such container: {name}")
        del state["containers"][name]
        save(state)
        print(name)
    elif verb == "cp":
        src, dest = argv[1], argv[2]
        name, _, path = dest.partition(":")
        if name not in state["containers"]:
            fail(f"Error response from daemon: No such container: {name}")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, path)
    elif verb == "exec":
        host_only = [n for n in os.environ.get("FAKE_DOCKER_HOST_ONLY", "").split(",") if n]
        env = {k: v for k, v in os.environ.items() if k not in host_only}
        cwd = None
        i = 1
        while argv[i].startswith("-"):
            if argv[i] in ("-e", "-w"):
                if argv[i] == "-e":
                    key, eq, value = argv[i + 1].partition("=")
                    if eq:
                        env[key] = value
                    elif key in os.environ:
                        env[key] = os.environ[key]  # by name: the client's own value
                else:
                    cwd = argv[i + 1]
                i += 2
            else:
                i += 1
        name, command = argv[i], argv[i + 1:]
        c = state["containers"].get(name)
        if not c or c["state"] != "running":
            fail(f"Error response from daemon: container {name} is not running")
        env["FAKE_CONTAINER_ROOT"] = str(HOME / "fs" / name)
        sys.exit(subprocess.call(command, env=env, cwd=cwd))
    else:
        fail(f"recording docker: verb {verb!r} is not emulated")


if __name__ == "__main__":
    main(sys.argv[1:])
