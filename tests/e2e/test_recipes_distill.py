"""The distillation recipe and the 2025 policy-loss configs, end to end through the recipes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_recipes_grpo import QUICK, read_metrics

from align.cli.recipes import run_recipe
from align.data.prompts import PromptDataModule
from align.modules.distill import DistillModule
from align.modules.grpo import GRPOModule

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo"])
def test_each_2025_loss_config_trains_off_policy_through_the_grpo_recipe(name, tmp_path):
    run_recipe(
        "grpo",
        GRPOModule,
        PromptDataModule,
        args=[
            "--config",
            str(ROOT / "configs" / name / "tiny.yaml"),
            *QUICK,
            "--trainer.default_root_dir",
            str(tmp_path),
        ],
    )
    rows = [r for r in read_metrics(tmp_path) if r.get("train/policy_loss")]
    assert len(rows) == 1  # one rollout, two optimizer steps (minibatches: 2), logged once
    assert 0.0 <= float(rows[0]["train/clipfrac"]) <= 1.0


def test_gkd_with_mixed_data_runs_through_the_recipe(tmp_path):
    run_recipe(
        "distill",
        DistillModule,
        PromptDataModule,
        args=[
            *QUICK,
            "--trainer.max_steps",
            "4",
            "--model.objective",
            "gkd",
            "--model.lmbda",
            "0.5",
            "--trainer.default_root_dir",
            str(tmp_path),
        ],
    )
    rows = [r for r in read_metrics(tmp_path) if r.get("distill/jsd")]
    assert len(rows) == 4 and {r["distill/on_policy"] for r in rows} == {"0.0", "1.0"}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_distill_recipe_moves_the_student_half_way_to_the_teacher(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "distill.py"), "--trainer.default_root_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1700,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split(":")[0]: line for line in proc.stdout.splitlines() if line.startswith("held-out val/")}
    before, after = (float(x) for x in lines["held-out val/accuracy"].split(":")[1].split("->"))
    teacher = float(lines["held-out val/teacher_accuracy"].split(":")[1].split("->")[-1])
    assert teacher > before + 0.1, lines
    assert after - before >= 0.5 * (teacher - before), lines
    rows = read_metrics(tmp_path)
    assert any(r.get("distill/reverse_kl") for r in rows)
