"""The rollout sources (align.rollout.source): the inline source samples every step; the filtered source refuses
what it cannot filter and serves every RL module."""

import sys
from pathlib import Path

import pytest
import torch

from align.errors import AlignConfigError
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.online_dpo import OnlineDPOModule
from align.modules.ppo import PPOModule
from align.rollout.engine import SamplingConfig
from align.rollout.rewards import training_rewards
from align.rollout.sampler import Sampler
from align.rollout.source import FilteredSource, InlineSource

sys.path.insert(0, str(Path(__file__).parents[1] / "modules"))
from _helpers import PROMPTS, length_reward, prompt_batch, standalone  # noqa: E402


@pytest.fixture(scope="module")
def policy():
    return PolicyModel("tiny-sort")


def sampler_of(policy, group_size=2, **kw) -> Sampler:
    reward, _ = training_rewards([length_reward], None, None)
    return Sampler(policy, reward, group_size, SamplingConfig(max_new_tokens=6), **kw)


def test_the_inline_source_samples_every_step(policy):
    sampler = sampler_of(policy)
    source = InlineSource()
    source.bind(sampler)
    assert len(source.next(prompt_batch(policy, PROMPTS[:2]), 0).rollout) == 4 and not source.pending
    assert source.state_dict() == {} and source.max_steps_without_update == 0


def test_the_filtered_source_refuses_what_it_cannot_filter(policy):
    with pytest.raises(AlignConfigError, match=r"^model\.source: FilteredSource .* model\.group_size >= 2, got 1$"):
        FilteredSource().bind(sampler_of(policy, group_size=1))
    with pytest.raises(AlignConfigError, match=r"^model\.source\.reward: expected one of the rewards"):
        FilteredSource(reward="accuracy").bind(sampler_of(policy))


def half_reward(prompts, completions, **kw):
    """Differs within the group of the first prompt only: one informative group per batch of two prompts."""
    return [float(i % 2) if p == PROMPTS[0] else 1.0 for i, p in enumerate(prompts)]


@pytest.mark.parametrize(
    "make",
    [
        lambda policy, source: OnlineDPOModule(
            policy=policy,
            rewards=[half_reward],
            group_size=2,
            source=source,
            log_entropy=False,
            sampling=SamplingConfig(max_new_tokens=6),
        ),
        lambda policy, source: PPOModule(
            policy=PolicyModel("tiny-sort", critic=CriticSettings(kind="shared")),
            rewards=[half_reward],
            group_size=2,
            source=source,
            log_entropy=False,
            sampling=SamplingConfig(max_new_tokens=6),
        ),
    ],
    ids=["online_dpo", "ppo"],
)
def test_dynamic_sampling_serves_every_rl_module(policy, make):
    # Two prompts per batch, one informative group each: the first step buffers one group, the second fills the
    # update of two groups.
    module = make(policy, FilteredSource(max_batches=3))
    optimizer = standalone(module)
    batch = prompt_batch(policy, PROMPTS[:2])
    module.setup("fit")
    torch.manual_seed(0)
    module.training_step(batch, 0)
    assert optimizer.steps == 0 and module.source.pending and module.batches_without_update == 1
    module.training_step(batch, 1)
    assert optimizer.steps > 0 and not module.source.pending
    m = module.last_metrics
    assert m["rollout/sampling_batches"] == 2 and m["rollout/kept_groups"] == 2 and m["rollout/kept_frac"] == 0.5
    assert module.rl_counters["rollouts"] == 2
