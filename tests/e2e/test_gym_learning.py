"""The shipped classic-RL configs learn: PPO (the gym recipe's default, trained once, through the recipe), A2C and DQN
reach a mean return of 475 on CartPole-v1 (20 greedy held-out episodes) within their configs' step budgets, REINFORCE
gets past 400, and tabular Q-learning solves deterministic FrozenLake 4x4. Each config run is built from its YAML
exactly as ``align fit --config`` builds it and stops at the first evaluation (every ``EVERY`` environment steps) that
reaches the goal."""

from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from align.cli.lightning_cli import AlignCLI

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


class EvaluateEvery(Callback):
    """Greedy evaluation every ``every`` environment steps; stops training once the mean return reaches ``goal``."""

    def __init__(self, every: int, goal: float):
        self.every, self.goal, self.next = every, goal, every
        self.history: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.env_steps < self.next:
            return
        self.next += self.every
        episodes = pl_module.evaluate()
        mean = sum(e.reward for e in episodes) / len(episodes)
        self.history.append((pl_module.env_steps, mean))
        if mean >= self.goal:
            trainer.should_stop = True


@pytest.mark.parametrize(
    "config, every, goal",
    [
        ("a2c-cartpole.yaml", 10_000, 475.0),
        ("dqn-cartpole.yaml", 2_500, 475.0),
        ("reinforce-cartpole.yaml", 10_000, 400.0),
        ("qlearning-frozenlake.yaml", 1_000, 1.0),
    ],
)
def test_shipped_config_reaches_the_goal_within_its_budget(config, every, goal, tmp_path):
    cli = AlignCLI(
        args=[
            "--config",
            str(ROOT / "configs" / "gym" / config),
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.callbacks",
            "null",
            "--trainer.logger",
            "false",
        ],
        run=False,
    )
    evaluate = EvaluateEvery(every, goal)
    cli.trainer.callbacks.append(evaluate)
    cli.trainer.fit(cli.model)
    history = ", ".join(f"{steps}: {mean:.1f}" for steps, mean in evaluate.history)
    assert evaluate.history and evaluate.history[-1][1] >= goal, f"{config}: held-out return by step: {history}"
    assert evaluate.history[-1][0] <= cli.model.total_steps + every


def test_recipe_runs_on_its_embedded_default(tmp_path):
    """``python recipes/gym.py`` with no settings but its run folder: PPO on CartPole-v1 to a held-out 475 or more,
    with the run's metrics, curves, config and checkpoint written."""
    import re
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "gym.py"), "--trainer.default_root_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = map(float, re.search(r"held-out val/episode_reward: ([\d.]+) -> ([\d.]+)", done.stdout).groups())
    assert before < 50 and after >= 475, done.stdout[-2000:]
    run = tmp_path / "version_0"
    for name in ("metrics.csv", "curves.png", "config.yaml", "checkpoints/last.ckpt"):
        assert (run / name).is_file(), name
