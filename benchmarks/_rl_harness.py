"""Pieces shared by the RL step benchmarks (``grpo.py``, ``ppo.py``): bundled prompts, the per-trial summary
and the subprocess that runs one framework's trial."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def peak_rss_mb() -> float:
    """The process's peak resident memory so far (imports, model, activations)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def sort_prompts(n: int) -> list[str]:
    """The first ``n`` bundled sort-task training prompts."""
    from align.data.io import read_rows

    return [r["prompt"] for r in read_rows("align:sort/prompts/train.jsonl")[:n]]


def step_summary(step_seconds: list[float], tokens: list[int], warmup: int, **phase_seconds: list[float]) -> dict:
    """Throughput of full steps after ``warmup``: completion tokens/s, median step time, the share of each named
    phase (``<phase>_share``) and of the rest (``update_share``), and the peak RSS."""
    s, t = step_seconds[warmup:], tokens[warmup:]
    total = sum(s)
    shares = {f"{name}_share": sum(seconds[warmup:]) / total for name, seconds in phase_seconds.items()}
    return {
        "tokens_per_s": sum(t) / total,
        "step_s": statistics.median(s),
        **shares,
        "update_share": 1.0 - sum(shares.values()),
        "completion_tokens_per_step": statistics.mean(t),
        "peak_rss_mb": peak_rss_mb(),
    }


def run_child(script: str, framework: str, spec: dict) -> dict:
    """Run ``script --child framework --spec JSON`` in a fresh process and return the JSON it prints last."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, script, "--child", framework, "--spec", json.dumps(spec)],
                          capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{framework} trial failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
