"""PPO's kept critic pass (``align.modules.critic_pass``): the critic's rollout pass keeps the graph of the update's
first micro-batch, which reads it instead of running the critic again."""

import pytest
import torch
from _helpers import PROMPTS, prompt_batch, standalone
from _ppo import hand_rollout, make_module

from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.options import KLPenalty, Updates
from align.rollout.engine import SamplingConfig


@pytest.mark.parametrize("micro_batch_size", [None, 1])
def test_the_critics_rollout_pass_serves_the_update_first_micro_batch(micro_batch_size):
    # With a separate critic, make_batch keeps the graph of the critic's pass over the update's first micro-batch
    # (the first epoch's minibatches are drawn then), and the first step reads it instead of running the critic
    # again: the same values, and every gradient of every step, as running it again.
    policy = PolicyModel("tiny", seed=2, critic=CriticSettings(kind="separate"))
    eos = policy.tokenizer.eos_token_id
    responses = [[40, 41, eos, 0, 0], [40, 41, 42, 43, 44], [40, eos, 0, 0, 0], [40, 41, 42, eos, 0]]
    module = make_module(
        policy,
        kl=KLPenalty(coef=0.1, placement="reward"),
        group_size=1,
        sampling=SamplingConfig(max_new_tokens=5),
        log_entropy=True,
    )
    module.setup("fit")
    module.sampler.engine.generate = lambda *a, **k: hand_rollout(policy, responses, 5)
    with torch.no_grad():
        policy.critic.head.proj.weight.normal_(0.0, 0.1)  # values that differ by token
    critic_calls = []
    policy.critic.backbone.register_forward_pre_hook(
        lambda m, a, kw: critic_calls.append(torch.is_grad_enabled()), with_kwargs=True
    )
    batches, grads, calls = {}, {}, {}
    for keep in (True, False):
        module.keeps_critic_pass = keep
        module.learner.updates = Updates(epochs=2, minibatches=2, max_grad_norm=None, micro_batch_size=micro_batch_size)
        torch.manual_seed(1)
        critic_calls.clear()
        batches[keep] = data = module.make_batch(module.sampler.sample(prompt_batch(policy, PROMPTS[:4])))
        calls[keep, "rollout"] = list(critic_calls)
        opt = standalone(module)
        critic_calls.clear()
        module.update_policy(data)
        calls[keep, "update"] = list(critic_calls)
        grads[keep] = opt.grads
    micro_batches = 2 * (2 if micro_batch_size is None else 4)  # epochs x micro-batches per epoch
    assert calls[True, "rollout"] == [True, False] and calls[False, "rollout"] == [False]
    assert len(calls[True, "update"]) == micro_batches - 1 and len(calls[False, "update"]) == micro_batches
    torch.testing.assert_close(batches[True].values, batches[False].values, atol=1e-6, rtol=1e-5)
    assert len(grads[True]) == len(grads[False]) == 4
    for step_kept, step_again in zip(grads[True], grads[False]):
        for kept, again in zip(step_kept, step_again):
            torch.testing.assert_close(kept, again, atol=1e-6 * max(1.0, float(again.abs().max())), rtol=1e-4)
    assert batches[True].kept.values is None and batches[False].kept is None  # taken by the first micro-batch
