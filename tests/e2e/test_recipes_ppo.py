import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from align.cli.recipes import run_recipe
from align.data.prompts import PromptDataModule
from align.hub.tiny import TINY_SORT_RM_DIR
from align.modules.ppo import PPOModule

ROOT = Path(__file__).resolve().parents[2]
DESIGN_METRICS = [
    "train/loss",
    "train/policy_loss",
    "train/value_loss",
    "train/kl",
    "train/clipfrac",
    "train/approx_kl",
    "train/entropy",
    "train/explained_variance",
    "train/kl_coef",
    "train/returns_mean",
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/response_length",
    "rollout/tokens_per_s",
    "val/reward_mean",
    "val/reward/rm",
    "val/reward/sort_exact_match",
    "val/kl",
]
QUICK = [
    "--trainer.max_steps",
    "4",
    "--trainer.limit_val_batches",
    "1",
    "--data.init_args.val_batch_size",
    "4",
    "--data.init_args.batch_size",
    "4",
    "--model.init_args.value.warmup_rollouts",
    "1",
]


def read_metrics(root: Path) -> list[dict]:
    files = list(root.rglob("metrics.csv"))
    assert len(files) == 1, files
    return list(csv.DictReader(open(files[0])))


def before_after(out: str, name: str) -> tuple[float, float]:
    line = next(line for line in out.splitlines() if line.startswith(f"held-out {name}:"))
    before, after = (float(x) for x in line.split(":", 1)[1].split("->"))
    return before, after


def test_default_config_runs_a_few_steps_and_checkpoints_the_kl_controller(tmp_path, capsys):
    root = tmp_path / "run"
    run_recipe(
        "ppo",
        PPOModule,
        PromptDataModule,
        args=[
            *QUICK,
            "--trainer.default_root_dir",
            str(root),
            "--model.init_args.kl.target",
            "3.0",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps=2",
        ],
    )
    out = capsys.readouterr().out
    for name in ("val/reward_mean", "val/reward/rm", "val/reward/sort_exact_match", "val/kl"):
        before_after(out, name)
    rows = read_metrics(root)
    assert any(r.get("train/critic_warmup") == "1.0" for r in rows)
    ckpt = max(root.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["align"]["rl"]
    assert state["rollouts"] >= 1 and state["kl_controller"]["value"] > 0


@pytest.mark.slow
def test_shipped_reward_model_is_reproduced_by_its_script(tmp_path):
    args = json.loads((TINY_SORT_RM_DIR / "training_args.json").read_text())
    assert args["recipe"] == "recipes/rm.py" and args["val_rm_accuracy"] >= 0.9
    size = sum(p.stat().st_size for p in TINY_SORT_RM_DIR.iterdir())
    assert size <= 10 * 2**20
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_tiny_sort_rm.py"),
            "--max_steps",
            "2",
            "--output",
            str(tmp_path / "rm"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from align.rollout.rewards import RewardModelScorer

    scores = RewardModelScorer(str(tmp_path / "rm"))(["sort: b a"], ["a b"])
    assert len(scores) == 1 and (tmp_path / "rm" / "training_args.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a few minutes on 2 idle cores; shared machines are much slower
def test_ppo_recipe_end_to_end_raises_the_true_task_reward_with_bounded_kl(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "ppo.py"), "--trainer.default_root_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1700,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = before_after(proc.stdout, "val/reward/sort_exact_match")
    assert after - before >= 0.15 - 1e-9, proc.stdout[-2000:]  # printed with 4 decimals
    kl_before, kl_after = before_after(proc.stdout, "val/kl")
    assert abs(kl_before) < 0.5 and kl_after < 20.0, proc.stdout[-2000:]
    rows = read_metrics(tmp_path)
    for name in DESIGN_METRICS:
        assert any(r.get(name) for r in rows), name
    assert list(tmp_path.rglob("*.ckpt"))
