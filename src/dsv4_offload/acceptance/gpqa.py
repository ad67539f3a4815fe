"""GPQA-diamond accuracy through evalscope, as the delivery runs it (gpqa_accuracy_repeat.sh).

Each round is one ``evalscope eval`` against the server's OpenAI chat endpoint with the
script's generation config; its score is read from the report evalscope writes
(``<work-dir>/**/reports/**/gpqa_diamond.json``, field ``score``, a 0-1 accuracy: evalscope's
``Report`` model in evalscope/report/report.py). Library code: returns values, never prints.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dsv4_offload.core import proxies
from dsv4_offload.core.errors import InputError
from dsv4_offload.core.runner import run_command

# gpqa_accuracy_repeat.sh L59: temperature 1 is the standard GPQA setting; thinking off
GENERATION_CONFIG = {"temperature": 1, "top_p": 1, "max_tokens": 32768,
                     "extra_body": {"chat_template_kwargs": {"thinking": False,
                                                             "high_effort": False}}}
DATASET = "gpqa_diamond"
# one round's binomial standard error over 198 questions at temperature 1 (guide G429-430,
# script L18-21): a mean of N rounds is held to two standard errors of that mean
ROUND_SE_PP = 3.3
INSTALL = "pip install evalscope"


def find_evalscope() -> str:
    """The evalscope executable: $EVALSCOPE, else on PATH (as the script finds it, L55)."""
    chosen = os.environ.get("EVALSCOPE") or shutil.which("evalscope")
    if not chosen or not (shutil.which(chosen) or Path(chosen).is_file()):
        raise InputError(f"accept --gpqa: evalscope is not installed; {INSTALL} "
                         "(or set EVALSCOPE=/path/to/evalscope)")
    return chosen


def command(evalscope: str, model: str, api_url: str, api_key: str, work_dir: Path
            ) -> list[str]:
    """One round's command line, flag for flag as gpqa_accuracy_repeat.sh L88-92 has it."""
    return [evalscope, "eval", "--model", model, "--api-url", api_url, "--api-key", api_key,
            "--eval-type", "openai_api", "--datasets", DATASET,
            "--generation-config", json.dumps(GENERATION_CONFIG, separators=(",", ":")),
            "--eval-batch-size", "1", "--repeats", "1", "--work-dir", str(work_dir)]


def read_score(work_dir: Path) -> float | None:
    """The round's accuracy in percent, from the newest gpqa_diamond.json under reports/."""
    reports = sorted((p for p in work_dir.rglob(f"{DATASET}.json") if "reports" in p.parts),
                     key=lambda p: p.stat().st_mtime)
    if not reports:
        return None
    try:
        score = json.loads(reports[-1].read_text(encoding="utf-8")).get("score")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(score, int | float) or not 0 <= score <= 1:
        return None
    return round(100 * float(score), 2)


@dataclass
class GpqaResult:
    rounds: list[float | None] = field(default_factory=list)  # percent; None: the round failed
    logs: list[str] = field(default_factory=list)

    @property
    def scores(self) -> list[float]:
        return [s for s in self.rounds if s is not None]

    def summary(self) -> dict[str, float | int | None]:
        """n, mean, min, max and the population SD, as the script's summary (L120-125)."""
        xs = self.scores
        if not xs:
            return {"n": 0, "mean": None, "min": None, "max": None, "sd": None}
        mean = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) if len(xs) > 1 else 0.0
        return {"n": len(xs), "mean": round(mean, 2), "min": min(xs), "max": max(xs),
                "sd": round(sd, 2)}

    def tolerance_pp(self) -> float:
        return round(2 * ROUND_SE_PP / math.sqrt(max(1, len(self.scores))), 2)


def evaluator_env(api_url: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The evaluator's environment: the inherited one with the server's host, localhost and
    127.0.0.1 in no_proxy/NO_PROXY, as the delivery's script sets before its rounds (an
    exported http_proxy would otherwise carry every request)."""
    env = dict(os.environ if base is None else base)
    return proxies.bypassing(env, [proxies.host_of(api_url), "localhost", "127.0.0.1"])


def run_rounds(rounds: int, evalscope: str, model: str, api_url: str, api_key: str,
               out_dir: Path, on_round: Callable[[int], None] | None = None) -> GpqaResult:
    """N rounds, each in its own work dir with its own log; a failed round scores None."""
    result = GpqaResult()
    for i in range(1, rounds + 1):
        if on_round:
            on_round(i)
        work = out_dir / f"R{i}"
        shutil.rmtree(work, ignore_errors=True)
        log = out_dir / f"R{i}.log"
        log.unlink(missing_ok=True)  # the round's log alone, not an earlier run's too
        proc = run_command(command(evalscope, model, api_url, api_key, work), log=log,
                           check=False, secrets=[api_key], env=evaluator_env(api_url))
        result.logs.append(str(log))
        result.rounds.append(read_score(work) if proc.returncode == 0 else None)
    return result
