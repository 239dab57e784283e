"""Pieces shared by the RL step benchmarks (``grpo.py``, ``ppo.py``): the policy model (``--model`` or the tiny
Llama), bundled prompts, the per-trial summary and the subprocess that runs one framework's trial."""

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


def add_model_args(parser) -> None:
    """``--model`` and the tiny Llama's size flags (used only without ``--model``)."""
    from _model import MODEL_HELP

    parser.add_argument("--model", default=None, help=MODEL_HELP)
    tiny = parser.add_argument_group("tiny Llama size (the default model; ignored with --model)")
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--intermediate", type=int, default=192)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)


def prepare_model(ns, tmp: str) -> tuple[str, str, int]:
    """``(folder, description, parameter count)`` of the policy both frameworks load: the folder ``--model``
    resolves to, or else a tiny random Llama with the size flags and the shipped tokenizer saved under ``tmp``."""
    from _model import model_config_and_parameters, resolve_model_dir

    if ns.model:
        model_dir = resolve_model_dir(ns.model)
        return model_dir, ns.model, model_config_and_parameters(model_dir)[1]
    from align.hub.tiny import build_tiny_model, load_tiny_tokenizer

    model_dir = Path(tmp) / "model"
    model = build_tiny_model(seed=0, hidden_size=ns.hidden_size, num_hidden_layers=ns.layers,
                             intermediate_size=ns.intermediate, num_attention_heads=ns.heads,
                             num_key_value_heads=ns.kv_heads)
    model.save_pretrained(model_dir)
    load_tiny_tokenizer().save_pretrained(model_dir)
    description = (f"tiny (hidden {ns.hidden_size}, {ns.layers} layers, intermediate {ns.intermediate}, "
                   f"heads {ns.heads}/{ns.kv_heads})")
    return str(model_dir), description, sum(p.numel() for p in model.parameters())
