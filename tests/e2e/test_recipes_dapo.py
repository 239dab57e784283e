import csv
import math
from pathlib import Path

from align.cli.recipes import run_recipe
from align.data.prompts import PromptDataModule
from align.modules.grpo import GRPOModule

ROOT = Path(__file__).resolve().parents[2]


def test_dapo_config_trains_through_the_recipe_one_row_per_update(tmp_path, capsys):
    """configs/dapo/tiny.yaml through the GRPO recipe, a few updates on small batches: max_steps counts
    optimizer steps, a batch that only fills the buffer writes no metrics row, and every update row carries the
    fill's and the overlong penalty's metrics."""
    root = tmp_path / "run"
    run_recipe(
        "grpo",
        GRPOModule,
        PromptDataModule,
        args=[
            "--config",
            str(ROOT / "configs" / "dapo" / "tiny.yaml"),
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
            "--trainer.default_root_dir",
            str(root),
        ],
    )
    assert "held-out val/reward_mean:" in capsys.readouterr().out
    rows = list(csv.DictReader(open(next(root.rglob("metrics.csv")))))
    train = [r for r in rows if r.get("train/loss")]
    assert len(train) == 2  # one row per optimizer step, none for the batches that only sampled
    assert not [r for r in rows if r.get("rollout/reward_mean") and not r.get("train/loss")]
    for r in train:
        values = {
            k: float(r[k])
            for k in (
                "train/loss",
                "rollout/reward_mean",
                "rollout/reward/overlong",
                "rollout/kept_frac",
                "rollout/sampling_batches",
                "rollout/kept_groups",
            )
        }
        assert all(math.isfinite(v) for v in values.values()), values
        assert 1 <= values["rollout/sampling_batches"] <= 4 and 1 <= values["rollout/kept_groups"] <= 4
        assert -1.0 <= values["rollout/reward/overlong"] <= 0.0 and 0 < values["rollout/kept_frac"] <= 1
        assert float(r["rollout/zero_std_frac"]) == 0.0  # only groups with differing exact match are trained on
    steps = [int(r["step"]) for r in train]
    assert steps[1] - steps[0] == int(float(train[1]["rollout/sampling_batches"]))  # the batches of the 2nd fill
