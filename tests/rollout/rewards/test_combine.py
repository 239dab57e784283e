"""Rewards combined with weights (align.rollout.rewards.combine): the weighted total and each part by name, the data's
columns passed on, None as "not applicable" (left out of the total, the other weights not spread), and a run's
reward lists named by their place in the config."""

import pytest

from align.errors import AlignConfigError
from align.rollout.rewards import CombinedReward, RewardCounts, RewardModelSpec, RewardSpec, sort_format
from align.rollout.rewards.combine import training_rewards


def test_combined_weights_names_and_columns():
    seen = {}

    def spy(prompts, completions, answer, level, **kw):
        seen.update(answer=answer, level=level, kw=kw)
        return [0.5] * len(completions)

    combined = CombinedReward([RewardSpec("align.rewards.sort_exact_match", weight=2.0), spy])
    total, parts = combined(["sort: b a", "sort: b a"], ["a b", "b a"], answer=["a b", "a b"], level=[1, 2])
    assert parts == {"sort_exact_match": [1.0, 0.0], "spy": [0.5, 0.5]}
    assert total == [2.5, 0.5]
    assert seen["answer"] == ["a b", "a b"] and seen["level"] == [1, 2]
    with pytest.raises(AlignConfigError, match="unique"):
        CombinedReward([sort_format, sort_format])


def test_the_rewards_of_a_run_are_named_by_their_list_and_index():
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.eval_rewards\[1\]\.concurrency: expected an integer >= 1, "
        r"got 0$",
    ):
        training_rewards(
            ["align.rewards.sort_format"],
            None,
            ["align.rewards.sort_position_match", RewardSpec("align.rewards.sort_format", concurrency=0)],
        )
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.rewards: expected unique metric names across reward_model "
        r"\('rm'\), rewards and eval_rewards, got \['sort_format', "
        r"'sort_format'\]; set 'name' on the duplicates$",
    ):
        training_rewards(["align.rewards.sort_format"], None, ["align.rewards.sort_format"])
    with pytest.raises(AlignConfigError, match=r"^model\.reward_model\.weight: expected a finite number, got nan$"):
        RewardModelSpec("tiny-sort-rm", weight=float("nan"))
    with pytest.raises(AlignConfigError, match=r"^model\.reward_model\.batch_size: expected an integer >= 1, got 0$"):
        RewardModelSpec("tiny-sort-rm", batch_size=0)
    with pytest.raises(AlignConfigError, match=r"^rewards: expected at least one reward function, got none$"):
        CombinedReward([])


def test_none_means_not_applicable_excluded_from_the_total_without_renormalising():
    def only_even(completions, **kw):
        return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

    async def only_first(completions, **kw):
        return [0.5] + [None] * (len(completions) - 1)

    combined = CombinedReward([RewardSpec(only_even, weight=2.0), RewardSpec(only_first, weight=1.0)])
    total, parts = combined(["p"] * 3, ["a", "b", "c"])
    # row 0: 2*1 + 1*0.5; row 1: nothing applies; row 2: 2*1 (only_first's weight is not spread onto only_even)
    assert total == [2.5, 0.0, 2.0]
    assert parts == {"only_even": [1.0, 0.0, 1.0], "only_first": [0.5, 0.0, 0.0]}
    assert combined.last_counts == RewardCounts(3, {"only_even": 1, "only_first": 2}, {})
    counts = RewardCounts(0, {"only_even": 0, "only_first": 0}, {})
    counts.add(combined.last_counts)
    counts.add(combined.last_counts)
    assert counts.metrics() == pytest.approx(
        {"rollout/reward_na/only_even": 2 / 6, "rollout/reward_na/only_first": 4 / 6}
    )
