"""Capture real greedy answers of the real-peer model into tests/fixtures/peer-greedy-outputs.json.

Run once (the peer venv and model of tests/test_real_peer.py must exist; running that test
builds them):  python tests/capture_peer_outputs.py
It serves SmolLM2-135M-Instruct (Q4_1) with llama-cpp-python's OpenAI server on 127.0.0.1,
asks each prompt greedily (temperature 0) through /v1/completions or
/v1/chat/completions, then does the same with a
copy whose tensor bytes are noise (test_real_peer.scrambled_copy), and writes what came back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))
from serve_helpers import free_port
from test_real_peer import LLAMA_CPP_PYTHON, MODEL_FILE, cache_dir, scrambled_copy

OUT = Path(__file__).parent / "fixtures" / "peer-greedy-outputs.json"
# short prompts, and long greedy answers: a 135M model often settles into a loop, which is
# exactly what the degeneration rules must judge
PROMPTS = [  # (name, prompt, max tokens, chat)
    ("capital-fr", "The capital of France is", 48, False),
    ("capital-chat", "What is the capital of France? Answer in one sentence.", 32, True),
    ("story", "Once upon a time, in a small village,", 200, False),
    ("list", "Here are some tips for staying healthy:", 200, False),
    ("history", "The history of the printing press", 200, False),
    ("count", "1, 2, 3, 4,", 64, False),
    ("story-chat-long", "Once upon a time, in a small village,", 400, True),
    ("paris-chat-long", "Paris is", 400, True),
]


def _answers(model: Path) -> dict[str, str]:
    python = cache_dir() / f"peer-venv-{LLAMA_CPP_PYTHON}" / "bin" / "python"
    port = free_port()
    proc = subprocess.Popen([str(python), "-m", "llama_cpp.server", "--model", str(model),
                             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
                             "--n_threads", "2"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    session = requests.Session()
    session.trust_env = False
    try:
        for _ in range(600):
            try:
                if session.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.2)
        out = {}
        for name, prompt, tokens, chat in PROMPTS:
            common = {"max_tokens": tokens, "temperature": 0}
            if chat:
                resp = session.post(url + "/v1/chat/completions", timeout=1800, json={
                    "messages": [{"role": "user", "content": prompt}], **common})
            else:
                resp = session.post(url + "/v1/completions", timeout=1800,
                                    json={"prompt": prompt, **common})
            resp.raise_for_status()
            choice = resp.json()["choices"][0]
            out[name] = choice["message"]["content"] if chat else choice["text"]
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    model = cache_dir() / "models" / MODEL_FILE
    with tempfile.TemporaryDirectory() as tmp:
        noisy = scrambled_copy(model, Path(tmp) / "scrambled.gguf")
        doc = {
            "_how": ("captured by tests/capture_peer_outputs.py: llama-cpp-python "
                     f"{LLAMA_CPP_PYTHON} server, {MODEL_FILE}, /v1/completions or "
                     "/v1/chat/completions, temperature 0, "
                     "n_ctx 2048, 2 threads; 'scrambled' is the same file with every tensor's "
                     "bytes replaced by noise (seed 5)"),
            "prompts": {name: {"prompt": p, "max_tokens": n, "chat": c}
                        for name, p, n, c in PROMPTS},
            "good": _answers(model),
            "scrambled": _answers(noisy),
        }
    OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
