"""What PPO and TRPO share (``align.modules.actor_critic``), on PPO: the GAE batch of a rollout (terminal rewards,
values, returns, whitened advantages, KL shaping), the score options, the critic's warm-up and the value model it
needs."""

import pytest
import torch
from _helpers import PROMPTS, prompt_batch, standalone
from _ppo import hand_rollout, make_module, row_reward

from align.core.advantages import gae
from align.core.masks import masked_mean
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.actor_critic import GAEBatch
from align.modules.options import KLPenalty, ScoreShaping, Updates, ValueTraining
from align.rollout.engine import SamplingConfig


def test_terminal_reward_on_eos_when_pad_equals_eos_and_on_last_token_when_truncated():
    policy = PolicyModel("tiny", seed=2, critic=CriticSettings(), pad_equals_eos=True)
    eos = policy.tokenizer.eos_token_id
    assert policy.tokenizer.pad_token_id == eos
    # Row 0 stops at its EOS (index 2), then padding that is also EOS; row 1 never stops (truncated at 5).
    responses = [[40, 41, eos, eos, eos], [40, 41, 42, 43, 44]]
    module = make_module(
        policy,
        rewards=[row_reward],
        kl=KLPenalty(placement="reward"),
        group_size=1,
        sampling=SamplingConfig(max_new_tokens=5),
    )
    module.sampler.engine.generate = lambda *a, **k: hand_rollout(policy, responses, 5)
    data = module.make_batch(module.sampler.sample(prompt_batch(policy, PROMPTS[:2])))
    assert data.response_mask.tolist() == [[True, True, True, False, False], [True] * 5]
    expected = torch.tensor([[0.0, 0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
    torch.testing.assert_close(data.rewards, expected)
    assert data.scores.tolist() == [3.0, 5.0]
    assert data.metrics["rollout/truncated_frac"] == 0.5


def test_make_batch_shapes_returns_and_whitened_advantages():
    module = make_module(kl=KLPenalty(coef=0.1, placement="reward"))
    module.setup("fit")
    torch.manual_seed(0)
    with torch.no_grad():
        module.policy.critic.head.proj.bias.fill_(0.5)
    data = module.make_batch(module.sampler.sample(prompt_batch(module.policy)))
    assert isinstance(data, GAEBatch)
    n, r = len(data), data.response_length
    assert n == 8 and data.input_ids.shape[1] == data.attention_mask.shape[1] > r
    for name in ("old_logprobs", "advantages", "ref_logprobs", "values", "returns", "rewards", "kl"):
        assert getattr(data, name).shape == (n, r), name
        assert (getattr(data, name)[~data.response_mask] == 0).all(), name
    # returns are the unwhitened GAE advantages plus the values; only the advantages are whitened
    raw, returns = gae(data.rewards, data.values, data.response_mask, module.gae.gamma, module.gae.lam)
    torch.testing.assert_close(data.returns, returns)
    torch.testing.assert_close(data.returns - data.values, torch.where(data.response_mask, raw, 0.0))
    assert abs(float(masked_mean(data.advantages, data.response_mask))) < 1e-5
    # KL shaping: per-token -kl_coef * kl on response tokens, k1 by default
    kl = torch.where(data.response_mask, data.old_logprobs - data.ref_logprobs, 0.0)
    torch.testing.assert_close(data.kl, kl)
    sub = data.select(torch.tensor([1, 3]))
    assert isinstance(sub, GAEBatch) and len(sub) == 2 and sub.values.shape == sub.response_mask.shape


def test_explained_variance_rises_during_critic_warmup_on_a_fixed_rollout():
    policy = PolicyModel("tiny", seed=2, critic=CriticSettings(kind="separate"))
    module = make_module(
        policy,
        rewards=[row_reward],
        kl=KLPenalty(placement="reward"),
        value=ValueTraining(warmup_rollouts=25, clip=None),
        updates=Updates(epochs=2, max_grad_norm=None),
        group_size=1,
    )
    torch.manual_seed(0)
    fixed = module.sampler.engine.generate(policy, prompt_batch(policy).prompt_ids, 1)
    module.sampler.engine.generate = lambda *a, **k: fixed
    standalone(module, torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=3e-3))
    lm_before = [p.detach().clone() for p in policy.model.parameters()]
    batch = prompt_batch(policy)
    logged = []
    for step in range(25):
        module.training_step(batch, step)
        logged.append(module.last_metrics)
    ev = [m["train/explained_variance"] for m in logged]
    assert all(m["train/critic_warmup"] == 1.0 for m in logged)
    assert "train/policy_loss" not in logged[-1] and "train/value_loss" in logged[-1]
    assert ev[0] < 0.1 and ev[-1] > 0.5 and ev[-1] > ev[0] + 0.4, ev
    assert all(torch.equal(a, b) for a, b in zip(lm_before, policy.model.parameters()))  # the policy stays put
    assert module.rl_counters["rollouts"] == 25 and module.warming_up  # the 25th rollout was the last warm-up


def test_critic_warmup_with_a_shared_head_trains_the_head_alone():
    module = make_module(value=ValueTraining(warmup_rollouts=1), kl=KLPenalty(placement="reward"))
    standalone(module, torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-2))
    backbone = [p.detach().clone() for p in module.policy.model.parameters()]
    head = [p.detach().clone() for p in module.policy.critic.head.parameters()]
    torch.manual_seed(0)
    module.training_step(prompt_batch(module.policy), 0)
    assert all(torch.equal(a, b) for a, b in zip(backbone, module.policy.model.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(head, module.policy.critic.head.parameters()))
    assert module.warming_up and module.rl_counters["rollouts"] == 1  # the next rollout trains the policy


def test_score_options_penalty_whitening_scaling_clipping():
    module = make_module(scores=ScoreShaping(missing_eos_penalty=1.0, whiten=True, scale=2.0, clip=1.5))
    rollout = type("R", (), {"truncated": torch.tensor([True, False, False, False])})()
    out = module.transform_scores(torch.tensor([1.0, 0.0, 2.0, 4.0]), rollout.truncated)
    x = torch.tensor([0.0, 0.0, 2.0, 4.0])
    expected = ((x - x.mean()) / x.std() * 2.0).clamp(-1.5, 1.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(
        make_module().transform_scores(torch.tensor([7.0, -9.0]), rollout.truncated), torch.tensor([7.0, -9.0])
    )


def test_no_value_model_is_an_error_naming_the_setting():
    with pytest.raises(Exception, match="model.policy.critic"):
        make_module(PolicyModel("tiny", seed=2))
