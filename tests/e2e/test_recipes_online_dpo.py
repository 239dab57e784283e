import csv
import math
from pathlib import Path

from align.cli.recipes import run_recipe
from align.data.prompts import PromptDataModule
from align.modules.online_dpo import OnlineDPOModule

METRICS = [
    "train/loss",
    "train/kl",
    "online_dpo/accuracy",
    "online_dpo/margin",
    "online_dpo/rewards_chosen",
    "online_dpo/rewards_rejected",
    "online_dpo/logps_chosen",
    "online_dpo/logps_rejected",
    "rollout/reward_mean",
    "rollout/reward_chosen",
    "rollout/reward_rejected",
    "rollout/tie_frac",
    "rollout/completion_tokens",
    "time/generation_s",
    "time/update_s",
    "val/reward_mean",
    "val/accuracy",
]
QUICK = [
    "--trainer.max_steps",
    "2",
    "--trainer.limit_val_batches",
    "1",
    "--data.init_args.val_batch_size",
    "4",
    "--data.init_args.batch_size",
    "4",
    "--model.init_args.group_size",
    "4",
    "--trainer.enable_checkpointing",
    "false",
    "--trainer.callbacks",
    "null",
]


def test_recipe_default_config_takes_two_dpo_steps_and_logs_the_metrics(tmp_path, capsys):
    root = tmp_path / "run"
    cli = run_recipe(
        "online_dpo", OnlineDPOModule, PromptDataModule, args=[*QUICK, "--trainer.default_root_dir", str(root)]
    )
    assert cli.trainer.global_step == 2 and cli.model.rl_counters["updates"] == 2
    assert "held-out val/reward_mean:" in capsys.readouterr().out
    rows = list(csv.DictReader(open(next(Path(root).rglob("metrics.csv")))))
    for name in METRICS:
        values = [float(r[name]) for r in rows if r.get(name)]
        assert values and all(math.isfinite(v) for v in values), name
    steps = [r for r in rows if r.get("train/loss")]
    first = steps[0]
    assert abs(float(first["train/loss"]) - math.log(2)) < 1e-4  # step 1: the policy is its reference
    assert all(0.0 <= float(r["rollout/tie_frac"]) < 1.0 for r in steps)
    assert all(float(r["rollout/reward_chosen"]) >= float(r["rollout/reward_rejected"]) for r in steps)
