"""The held-out evaluator: what ``val/*`` and ``align evaluate`` report, by hand on a built rollout, across ranks, and
with a module's extra sums. (That ``align evaluate`` of a checkpoint equals the validation of the run that wrote it is
tests/rollout/test_generation.py's.)"""

import pytest
import torch

from align.rollout.evaluation import Evaluator
from align.rollout.types import Rollout


def rollout(lengths: list[int], truncated: list[bool], episodes: list[dict] | None = None) -> Rollout:
    """``len(lengths)`` completions of ``max(lengths)`` response columns, the first ``lengths[i]`` of row ``i``
    valid."""
    n, width = len(lengths), max(lengths)
    mask = torch.tensor([[j < length for j in range(width)] for length in lengths])
    return Rollout(
        torch.ones(n, 2, dtype=torch.long),
        torch.ones(n, 2, dtype=torch.long),
        torch.ones(n, width, dtype=torch.long),
        mask,
        torch.zeros(n, width),
        torch.tensor(truncated),
        ["x"] * n,
        torch.arange(n),
        1,
        0.1,
        episodes=episodes,
    )


def test_the_means_of_one_pass_by_hand():
    evaluator = Evaluator("exact", accuracy_threshold=1.0)
    parts = {"exact": torch.tensor([1.0, 0.0, 1.0, 0.0]), "format": torch.tensor([1.0, 1.0, 0.5, 0.0])}
    total = parts["exact"] + 0.5 * parts["format"]  # 1.5, 0.5, 1.25, 0
    evaluator.add(rollout([3, 1, 2, 4], [False, False, False, True]), total, parts)
    assert evaluator.count == 4 and float(evaluator.highest) == 1.0
    assert evaluator.means() == pytest.approx(
        {
            "reward_mean": 3.25 / 4,
            "accuracy": 0.5,
            "response_length": 2.5,
            "truncated_frac": 0.25,
            "reward/exact": 0.5,
            "reward/format": 2.5 / 4,
        }
    )


def test_two_batches_are_one_pass_and_a_threshold_below_one_counts_partial_credit():
    evaluator = Evaluator("score", accuracy_threshold=0.5)
    evaluator.add(rollout([1, 1], [False, False]), torch.tensor([0.2, 0.9]), {"score": torch.tensor([0.2, 0.9])})
    evaluator.add(rollout([2], [True]), torch.tensor([0.5]), {"score": torch.tensor([0.5])})
    means = evaluator.means()
    assert means["accuracy"] == pytest.approx(2 / 3) and means["reward_mean"] == pytest.approx(1.6 / 3)
    assert means["response_length"] == pytest.approx(4 / 3) and means["truncated_frac"] == pytest.approx(1 / 3)


def test_ranks_sum_their_completions_and_agree_on_the_highest_accuracy_reward():
    # Two ranks with the same completions: the sums double (all_reduce), so every mean is the one rank's; the
    # highest value of the accuracy reward is the largest over the ranks (all_max).
    evaluator = Evaluator("exact")
    evaluator.add(rollout([2, 2], [False, False]), torch.tensor([0.0, 1.0]), {"exact": torch.tensor([0.0, 0.4])})
    means = evaluator.means(all_reduce=lambda x: 2 * x, all_max=lambda x: torch.maximum(x, torch.tensor(0.8)))
    assert means == pytest.approx(
        {"reward_mean": 0.5, "accuracy": 0.0, "response_length": 2.0, "truncated_frac": 0.0, "reward/exact": 0.2}
    )
    assert float(evaluator.highest) == pytest.approx(0.8)


def test_a_modules_own_sums_and_an_episodes_turns_are_means_over_completions():
    evaluator = Evaluator("env")
    episodes = [{"turns": 2}, {"turns": 3}]
    evaluator.add(
        rollout([4, 4], [False, False], episodes), torch.tensor([1.0, 0.0]), {"env": torch.tensor([1.0, 0.0])}
    )
    evaluator.add_sum("kl", torch.tensor([0.25, 0.75]))  # PPO's per-sequence KL of the held-out completions
    means = evaluator.means()
    assert means["turns"] == 2.5 and means["kl"] == 0.5 and means["accuracy"] == 0.5


def test_no_completion_gives_no_means():
    evaluator = Evaluator("exact")
    assert evaluator.means() == {} and evaluator.count == 0 and float(evaluator.highest) == -float("inf")
