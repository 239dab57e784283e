"""DAPO's dynamic sampling (align.rollout.filter, align.rollout.source.FilteredSource) and the overlong penalty in the
RL base's rewards."""

import pytest
import torch
from _helpers import PROMPTS, prompt_batch, standalone

from align.core.shaping import overlong_penalty
from align.errors import AlignConfigError, NoLearningSignalError
from align.models.policy import PolicyModel
from align.modules.grpo import GRPOModule
from align.modules.options import GroupAdvantages, OverlongPenalty, Updates
from align.rollout.engine import SamplingConfig
from align.rollout.source import FilteredSource
from align.rollout.types import Scored

# ---------------------------------------------------------------- in GRPO


def prompt_dependent_reward(prompts, completions, **kw):
    """Constant for the second prompt (no signal), completion-dependent for the others."""
    return [1.0 if p == PROMPTS[1] else float(len(c) % 3) for p, c in zip(prompts, completions)]


def make_module(**kw):
    defaults = dict(
        policy=PolicyModel("tiny", seed=2),
        rewards=[prompt_dependent_reward],
        group_size=4,
        sampling=SamplingConfig(max_new_tokens=6),
        log_entropy=False,
        updates=Updates(max_grad_norm=None),
        source=FilteredSource(max_batches=3),
    )
    return GRPOModule(**{**defaults, **kw})


def test_grpo_fills_the_batch_before_one_optimizer_step():
    module = make_module()
    opt = standalone(module)
    torch.manual_seed(0)
    steps = []
    for i in range(3):
        module.training_step(prompt_batch(module.policy), i)
        steps.append(len(opt.grads))
    # 4 prompts per batch, one always uninformative: the first batch buffers at most 3 groups, the second fills it.
    assert steps[0] == 0 and steps[1] == 1
    m = module.last_metrics
    assert m["rollout/kept_groups"] == 4 and m["rollout/sampling_batches"] == 2 and m["rollout/zero_std_frac"] == 0
    assert m["rollout/kept_frac"] <= 6 / 8 and module.rl_counters == {"rollouts": 3, "updates": steps[2]}
    assert m["time/generation_s"] > 0 and "train/loss" in m


def constant_reward(prompts, completions, **kw):
    return [0.0] * len(completions)


def test_a_run_with_no_informative_group_stops_after_twice_the_cap():
    # Every fill ends at the cap with nothing to train on; trainer.max_steps, which counts updates, is never
    # reached, so after 2 * max_batches such batches the run stops on one line.
    module = make_module(rewards=[constant_reward], source=FilteredSource(max_batches=2))
    standalone(module)
    assert module.max_batches_without_update == 50  # the floor; 2 * max_batches is lower here
    module.max_batches_without_update = 4
    batch = prompt_batch(module.policy, PROMPTS[:2])
    for step in range(3):
        module.training_step(batch, step)
    with pytest.raises(
        NoLearningSignalError,
        match="dynamic sampling: no update could be filled with groups whose "
        "rewards differ in 4 training batches in a row",
    ):
        module.training_step(batch, 3)
    assert module.rl_counters["updates"] == 0


def test_bad_dynamic_sampling_and_overlong_settings_fail_on_one_line():
    with pytest.raises(AlignConfigError, match=r"^model\.source\.reward: expected one of the rewards"):
        make_module(source=FilteredSource(reward="accuracy"))
    with pytest.raises(AlignConfigError, match=r"^model\.source\.max_batches: expected >= 1"):
        FilteredSource(max_batches=0)
    with pytest.raises(AlignConfigError, match=r"^model\.overlong\.buffer: expected <= sampling\.max_new_tokens \(6\)"):
        make_module(overlong=OverlongPenalty(buffer=8))
    with pytest.raises(AlignConfigError, match=r"^model\.group_size: expected >= 2"):
        make_module(group_size=1)
    with pytest.raises(AlignConfigError, match=r"^model\.source: FilteredSource .* needs model\.group_size >= 2"):
        make_module(group_size=1, advantages=GroupAdvantages(estimator="reinforce_pp"))


def named_overlong(prompts, completions, **kw):
    return [0.0] * len(completions)


named_overlong.__name__ = "overlong"


def test_overlong_penalty_is_a_reward_part_and_in_the_total():
    module = make_module(overlong=OverlongPenalty(buffer=3, coef=0.5), source=None)
    torch.manual_seed(0)
    batch = prompt_batch(module.policy)
    rollout = module.sampler.rollout(batch)
    total, parts = module.sampler.score(batch, rollout)
    expected = overlong_penalty(rollout.response_lengths, 6, 3)
    assert (expected < 0).any()  # the random tiny model runs into the ramp
    torch.testing.assert_close(parts["overlong"], expected)
    torch.testing.assert_close(total, parts["prompt_dependent_reward"] + 0.5 * expected)
    assert "rollout/reward/overlong" in module.sampler.rollout_metrics(Scored(rollout, total, parts))
    with pytest.raises(AlignConfigError, match=r"^model\.rewards: the name 'overlong'"):
        make_module(rewards=[named_overlong], overlong=OverlongPenalty(buffer=3))
