import math

import pytest
import torch
import torch.nn.functional as F
from _helpers import PROMPTS, length_reward, prompt_batch, standalone

from align.core.preference_losses import dpo_loss
from align.errors import AlignConfigError, NoLearningSignalError
from align.models.policy import PolicyModel, TokenLogprobs
from align.modules.learner import minibatch_indices
from align.modules.online_dpo import OnlineDPOModule, PairBatch
from align.modules.options import KLPenalty, Updates
from align.rollout.engine import SamplingConfig
from align.rollout.rewards import RewardSpec


def constant_reward(prompts, completions, **kw):
    return [1.0] * len(completions)


def make_module(**kw):
    defaults = dict(
        policy=PolicyModel("tiny", seed=2),
        rewards=[length_reward],
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=6),
        log_entropy=False,
        updates=Updates(max_grad_norm=None),
    )
    module = OnlineDPOModule(**{**defaults, **kw})
    module.setup("fit")
    return module


def sampled(module, n_prompts=4):
    torch.manual_seed(0)
    return module.sampler.rollout(prompt_batch(module.policy, PROMPTS[:n_prompts]))


def test_pairs_put_the_higher_reward_first_and_drop_ties():
    module = make_module()
    rollout = sampled(module)  # 4 prompts x 2 rows
    rewards = torch.tensor([0.0, 1.0, 2.0, 0.5, 0.3, 0.3, 1.0, 4.0])  # prompt 2 is a tie
    data, metrics = module.pair_batch(rollout, rewards)
    assert isinstance(data, PairBatch) and len(data) == 3
    rows = [1, 2, 7, 0, 3, 6]  # chosen of prompts 0, 1, 3, then their rejected
    torch.testing.assert_close(data.input_ids, rollout.input_ids[rows])
    torch.testing.assert_close(data.response_mask, rollout.response_mask[rows])
    assert data.advantages[:, 0].tolist() == [1.0, 2.0, 4.0, 0.0, 0.5, 1.0]
    assert metrics["rollout/tie_frac"] == 0.25
    assert metrics["rollout/reward_chosen"] == pytest.approx((1.0 + 2.0 + 0.3 + 4.0) / 4)
    # The reference is loaded with kl.coef 0 and scores exactly the selected rows (it is the initial policy).
    assert module.policy.ref_model is not None
    torch.testing.assert_close(data.ref_logprobs, module.scorer.logprobs(data).logprobs.detach())
    # select() takes pairs: pair 1 brings its chosen and its rejected row.
    assert data.select(torch.tensor([1])).input_ids.shape[0] == 2


def test_a_rank_with_too_few_decisive_pairs_keeps_weightless_ties():
    module = make_module(updates=Updates(minibatches=2, max_grad_norm=None))
    rollout = sampled(module)
    data, _ = module.pair_batch(rollout, torch.tensor([0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]))
    assert len(data) == 2  # one decisive pair, one tie to fill the second minibatch
    assert data.response_mask[[0, 2]].any() and not data.response_mask[[1, 3]].any()
    assert float(module.learner.normaliser(data.response_mask[:2], module.ranks)) == 1.0


def test_every_rank_keeps_as_many_pairs_as_the_rank_with_the_most_decisive_ones(monkeypatch):
    # This rank (0 of 2) has one decisive pair; the other rank has three. With micro-batches of one pair, both must
    # run three passes: this rank keeps its decisive pair and two weightless ties.
    from align.core.stats import Ranks

    other = torch.tensor([0.0, 3.0])
    monkeypatch.setattr(OnlineDPOModule, "ranks", property(lambda self: Ranks(0, 2, lambda t: t + other)))
    module = make_module(updates=Updates(micro_batch_size=1, max_grad_norm=None))
    data, _ = module.pair_batch(sampled(module), torch.tensor([0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]))
    assert len(data) == 3
    assert data.response_mask[:3].any(dim=1).tolist() == [True, False, False]
    passes = [len(mb) for mb in minibatch_indices(len(data), module.updates.minibatches, 1)]
    assert passes == [3]


def hand_built(module, logps, refs, decisive=(True, True)):
    """A PairBatch of 2 pairs with 2 response tokens each; the policy's log-probs are replaced by ``logps``."""
    mask = torch.tensor([[True, True]] * 4) & torch.tensor(list(decisive) * 2)[:, None]
    data = PairBatch(
        torch.zeros(4, 3, dtype=torch.long),
        torch.ones(4, 3, dtype=torch.long),
        mask,
        torch.zeros(4, 2),
        torch.zeros(4, 2),
        torch.tensor(refs),
    )
    token_logps = torch.tensor(logps, requires_grad=True)
    module.scorer.logprobs = lambda micro, **kw: TokenLogprobs(token_logps, None, None)
    return data, token_logps


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_is_dpo_loss_of_summed_logprobs_against_the_reference(loss_type):
    module = make_module(beta=0.5, loss_type=loss_type)
    # rows: chosen 0, chosen 1, rejected 0, rejected 1; sums -1, -2, -3, -3 (policy) and -2, -2, -1, -4 (reference)
    data, _ = hand_built(
        module,
        [[-0.5, -0.5], [-1.0, -1.0], [-1.0, -2.0], [-2.0, -1.0]],
        [[-1.0, -1.0], [-0.5, -1.5], [-0.5, -0.5], [-3.0, -1.0]],
    )
    loss, metrics = module._loss(data, torch.tensor(2.0))
    # h = (logp_c - ref_c) - (logp_r - ref_r): pair 0: 1 - (-2) = 3, pair 1: 0 - 1 = -1
    if loss_type == "sigmoid":
        expected = (-F.logsigmoid(torch.tensor(1.5)) - F.logsigmoid(torch.tensor(-0.5))) / 2
    else:  # per-token means (2 tokens): h = 1.5 and -0.5, target 1 / (2 beta) = 1
        expected = torch.tensor((0.5**2 + 1.5**2) / 2)
    torch.testing.assert_close(loss, expected)
    if loss_type == "sigmoid":
        t = torch.tensor
        ref, _, _ = dpo_loss(t([-1.0, -2.0]), t([-3.0, -3.0]), t([-2.0, -2.0]), t([-1.0, -4.0]), 0.5)
        torch.testing.assert_close(loss, ref.mean())
        torch.testing.assert_close(metrics["online_dpo/margin"], torch.tensor(0.5 * (3 - 1) / 2))
    assert metrics["online_dpo/accuracy"] == 0.5
    torch.testing.assert_close(metrics["online_dpo/logps_chosen"], torch.tensor(-1.5))


def test_a_weightless_pair_adds_nothing():
    module = make_module()
    data, logps = hand_built(
        module,
        [[-0.5, -0.5], [-1.0, -1.0], [-1.0, -2.0], [-2.0, -1.0]],
        [[-1.0, -1.0], [-0.5, -1.5], [-0.5, -0.5], [-3.0, -1.0]],
        decisive=(True, False),
    )
    loss, metrics = module._loss(data, torch.tensor(1.0))
    torch.testing.assert_close(loss, -F.logsigmoid(torch.tensor(0.3)))  # pair 0 alone: beta 0.1 * h 3
    loss.backward()
    assert (logps.grad[[1, 3]] == 0).all() and (logps.grad[[0, 2]] != 0).all()
    assert metrics["online_dpo/accuracy"] == 1.0


def test_a_step_trains_from_the_reference_and_logs_the_metrics():
    module = make_module(log_entropy=True)
    standalone(module, torch.optim.SGD(module.policy.parameters(), lr=0.5))
    before = [p.detach().clone() for p in module.policy.parameters()]
    batch = prompt_batch(module.policy)
    torch.manual_seed(1)
    module.training_step(batch, 0)
    m = module.last_metrics
    assert m["rollout/tie_frac"] < 1 and module.rl_counters["updates"] == 1
    assert m["train/loss"] == pytest.approx(math.log(2), abs=1e-5)  # the policy starts as its reference
    assert m["online_dpo/accuracy"] == 0.5 and m["train/kl"] == pytest.approx(0, abs=1e-6)
    assert m["train/entropy"] > 0
    assert any((a != b).any() for a, b in zip(before, module.policy.parameters()))
    for name in [
        "rollout/reward_mean",
        "rollout/reward_chosen",
        "rollout/reward_rejected",
        "rollout/tie_frac",
        "rollout/completion_tokens",
        "time/generation_s",
        "time/scoring_s",
        "time/update_s",
    ]:
        assert math.isfinite(m[name]), name
    assert m["rollout/reward_chosen"] >= m["rollout/reward_rejected"]


def test_all_ties_take_no_step():
    module = make_module(rewards=[constant_reward])
    module.use_optimizer(torch.optim.SGD(module.policy.parameters(), lr=1.0))
    module.training_step(prompt_batch(module.policy), 0)
    assert module.rl_counters["updates"] == 0 and module.last_metrics["rollout/tie_frac"] == 1.0
    assert "train/loss" not in module.last_metrics


def test_a_run_whose_rewards_always_tie_stops_with_one_actionable_line():
    # trainer.max_steps counts updates: without the stop, a reward that never ranks would sample forever.
    module = make_module(rewards=[constant_reward])
    module.use_optimizer(torch.optim.SGD(module.policy.parameters(), lr=1.0))
    module.max_batches_without_update = 3
    batch = prompt_batch(module.policy, PROMPTS[:2])
    for step in range(2):
        module.training_step(batch, step)
    with pytest.raises(
        NoLearningSignalError,
        match=r"online DPO: the rewards tied for every prompt .* in 3 training "
        r"batches in a row, so no update was taken and trainer.max_steps",
    ):
        module.training_step(batch, 2)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(group_size=1), "model.group_size: expected >= 2"),
        (
            dict(rewards=None),
            "model.rewards: online DPO ranks its completions with rewards, a reward_model and/or an environment",
        ),
        (dict(rewards=[RewardSpec("align.rewards.sort_format", weight=0.0)]), "every training reward has weight 0"),
        (dict(kl=KLPenalty(coef=0.1)), "model.kl.coef: online DPO regularises towards the reference with beta"),
        (dict(loss_type="simpo"), "model.loss_type: expected one of ['sigmoid', 'ipo', 'hinge']"),
        (dict(beta=0.0), "model.beta: expected > 0"),
    ],
)
def test_config_errors_fail_before_any_compute(kw, message):
    with pytest.raises(AlignConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        OnlineDPOModule(**{"policy": PolicyModel("tiny", seed=2), "rewards": [length_reward], **kw})


def test_one_step_of_four_pairs_equals_four_accumulated_micro_steps_of_one():
    module = make_module()
    data, _ = module.pair_batch(sampled(module), torch.tensor([0.0, 1.0, 2.0, 0.5, 0.3, 0.9, 1.0, 4.0]))
    assert len(data) == 4
    grads = {}
    for micro in (None, 1):
        module.learner.updates = Updates(micro_batch_size=micro, max_grad_norm=None)
        opt = standalone(module)
        module.update(data, module._loss)
        grads[micro] = opt.grads[0]
    assert any(g.abs().sum() > 0 for g in grads[None])
    for full, accumulated in zip(grads[None], grads[1]):
        torch.testing.assert_close(full, accumulated, atol=1e-6, rtol=1e-4)


def test_a_pairwise_judge_ranks_the_pairs():
    """align.rewards.Judge with parser pairwise (an OpenAI-compatible server on loopback that prefers the shorter
    completion) as online DPO's ranking: one request per pair, each pair decisive, one DPO step."""
    import re

    from _loopback import Loopback, user_message

    def shorter(request):
        a, b = (
            re.search(rf"Response {x}:\n(.*?)(\n\nResponse B|\n\nWhich|$)", user_message(request), re.S).group(1)
            for x in "AB"
        )
        return "[[A]]" if len(a) <= len(b) else "[[B]]"

    with Loopback(shorter) as server:
        judge = RewardSpec(
            "align.rewards.Judge",
            name="judge",
            init_kwargs={
                "model": "m",
                "base_url": server.base_url,
                "parser": "pairwise",
                "template": "Prompt:\n{prompt}\n\nResponse A:\n{completion_a}\n\nResponse B:\n"
                "{completion_b}\n\nWhich is better? Reply A or B.",
                "backoff": 0.0,
            },
        )
        module = make_module(rewards=[judge])
        opt = standalone(module)
        torch.manual_seed(0)
        module.training_step(prompt_batch(module.policy), 0)
    assert len(server.requests) == len(PROMPTS)  # 4 prompts x group_size 2: one request per pair
    assert module.last_metrics["rollout/tie_frac"] == 0.0 and opt.steps == 1
    assert module.last_metrics["rollout/reward/judge"] == 0.5  # one of each pair preferred
    assert module.last_metrics["rollout/reward_errors/judge"] == 0.0
