"""Exact resume of classic RL after SIGKILL: PPO (observation statistics, schedules, episodes in progress) and DQN
(replay buffer, target network, epsilon) killed after an iteration whose checkpoint is not written, then resumed
with ``--ckpt_path last``, log the same metrics row for row as a run that was never killed.

The episodes in progress at the checkpoint are rebuilt by replaying their actions from their reset seeds
(align.gym.runner), and :class:`~align.trainer.checkpointing.ExactResume` restores the RNG that samples actions and
replay batches."""

from pathlib import Path

import pytest
from test_resume import metrics_by_step, rows_of, run, steps_in_order

from align.trainer.checkpointing import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

CHECKPOINT = "[{class_path: align.trainer.checkpointing.AlignCheckpoint, init_args: {every_n_train_steps: 4}}]"
COMMON = [
    "--trainer.log_every_n_steps",
    "1",
    "--trainer.enable_progress_bar",
    "false",
    "--eval_before_after",
    "false",
    "--trainer.callbacks",
    CHECKPOINT,
]
SETTINGS = {
    # 2 environments x 8 steps per iteration, 2 epochs of one minibatch: 2 optimizer steps per iteration, 8 iterations.
    "ppo": [
        "--model.init_args.env.num_envs",
        "2",
        "--model.init_args.steps_per_iteration",
        "8",
        "--model.init_args.updates.minibatch_size",
        "16",
        "--model.init_args.updates.epochs",
        "2",
        "--model.init_args.normalize_observations",
        "true",
        "--model.init_args.normalize_rewards",
        "true",
        "--model.init_args.total_steps",
        "128",
    ],
    # 2 environments x 4 steps per iteration; updates (2 per iteration) start at 16 environment steps; 12 iterations.
    "dqn": [
        "--model.init_args.env.num_envs",
        "2",
        "--model.init_args.steps_per_iteration",
        "4",
        "--model.init_args.learning_starts",
        "16",
        "--model.init_args.updates.gradient_steps",
        "2",
        "--model.init_args.updates.minibatch_size",
        "8",
        "--model.init_args.target_update_interval",
        "12",
        "--model.init_args.hidden",
        "[32, 32]",
        "--model.init_args.total_steps",
        "96",
        "--model.init_args.exploration.fraction",
        "0.5",
    ],
}
ITERATIONS = {"ppo": 8, "dqn": 12}
KILL = {"ppo": (10, 8), "dqn": (14, 12)}  # (kill once global_step reaches, the last checkpoint's global step)


@pytest.mark.parametrize("algorithm", ["ppo", "dqn"])
def test_sigkill_then_resume_logs_the_same_metrics(tmp_path, algorithm):
    full_root, cut_root = tmp_path / "full", tmp_path / "cut"

    def gym(root: Path, *extra: str, **kill):
        # The config comes first: its default_root_dir would otherwise replace the one given before it.
        config = [
            "--config",
            str(ROOT / "configs" / "gym" / f"{algorithm}-cartpole.yaml"),
            "--trainer.default_root_dir",
            str(root),
        ]
        return run("gym", root, [*config, *COMMON, *SETTINGS[algorithm]], *extra, **kill)

    done = gym(full_root)
    assert done.returncode == 0, done.stderr[-3000:]
    full = metrics_by_step(full_root, 0)
    assert sorted(full) == list(range(ITERATIONS[algorithm])), sorted(full)
    assert any("rollout/episode_reward" in row for row in full.values())

    kill_at, restart = KILL[algorithm]
    killed = gym(cut_root, kill_at=kill_at)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])
    last = cut_root / "version_0" / "checkpoints" / "last.ckpt"
    state = AtomicCheckpointIO().load_checkpoint(last)
    assert state["global_step"] == restart
    in_progress = [len(a) for a in state["classic_rl"]["runner"]["actions"]]
    assert any(in_progress), "no episode was in progress at the checkpoint: the replay is not exercised"
    if algorithm == "dqn":
        assert state["classic_rl"]["extra"]["buffer"]["size"] > 0
    killed_rows = rows_of(cut_root, 0) if (cut_root / "version_0" / "metrics.csv").exists() else []

    resumed = gym(cut_root, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = rows_of(cut_root, 0)
    assert rows[: len(killed_rows)] == killed_rows
    appended: dict[int, dict[str, str]] = {}
    for row in rows[len(killed_rows) :]:
        appended.setdefault(int(row["step"]), {}).update(row)
    first = min(appended)
    assert steps_in_order(rows[len(killed_rows) :])[-1] == ITERATIONS[algorithm] - 1
    for step in range(first, ITERATIONS[algorithm]):
        assert appended[step] == full[step], f"{algorithm}: iteration {step} differs after the resume"
