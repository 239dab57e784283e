import csv

import lightning as L
import pytest
import torch
from _helpers import PROMPTS, length_reward, prompt_batch, standalone
from lightning.pytorch.loggers import CSVLogger

from align.data.chat import ChatEncoder
from align.data.prompts import PromptBatch, PromptDataModule
from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.modules.grpo import GRPOModule
from align.modules.learner import RLBatch, minibatch_indices
from align.modules.options import ClipRange, GroupAdvantages, KLPenalty, PolicyLoss, Updates
from align.rollout.engine import SamplingConfig
from align.rollout.rewards import RewardSpec


def constant_reward(prompts, completions, **kw):
    return [1.0] * len(completions)


def make_module(updates=None, **kw):
    defaults = dict(
        policy=PolicyModel("tiny", seed=2),
        rewards=[length_reward],
        group_size=4,
        sampling=SamplingConfig(max_new_tokens=6),
        log_entropy=False,
    )
    return GRPOModule(updates=Updates(**{"max_grad_norm": None, **(updates or {})}), **{**defaults, **kw})


def fixed_batch(module, n_prompts=2):
    torch.manual_seed(0)
    rollout = module.sampler.rollout(prompt_batch(module.policy, PROMPTS[:n_prompts]))
    advantages = torch.linspace(-1.0, 1.0, len(rollout))
    return RLBatch.from_rollout(rollout, advantages)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "constant"])
def test_one_minibatch_of_8_equals_8_accumulated_micro_steps_of_1(agg):
    module = make_module(updates=dict(loss_aggregation=agg))
    data = fixed_batch(module)  # 2 prompts x 4 = 8 rows
    assert len(data) == 8
    grads = {}
    for micro in (None, 1):
        module.learner.updates = Updates(micro_batch_size=micro, loss_aggregation=agg, max_grad_norm=None)
        opt = standalone(module)
        module.update(data, module._loss)
        assert len(opt.grads) == 1
        grads[micro] = opt.grads[0]
    assert any(g.abs().sum() > 0 for g in grads[None])
    for full, accumulated in zip(grads[None], grads[1]):
        torch.testing.assert_close(full, accumulated, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("micro_batch_size, sizes", [(None, [2, 3, 3]), (2, [2, 2, 2, 2])])
def test_micro_batches_by_token_budget_give_the_gradient_of_the_whole_minibatch(micro_batch_size, sizes):
    module = make_module()
    data = fixed_batch(module)  # 8 rows: a 12-column prompt and 6 response columns
    for row, length in enumerate([1, 2, 3, 4, 5, 6, 1, 2]):  # responses that ended early, then padding
        data.response_mask[row, length:] = False
        data.attention_mask[row, 12 + length :] = 0
    widths = RLBatch.row_widths(data.attention_mask, data.response_length)
    assert widths == [13, 14, 15, 16, 17, 18, 13, 14]
    # A budget of 53 tokens, widest first: 18 + 17 (2 x 18 = 36), 16 + 15 + 14 (3 x 16 = 48), 14 + 13 + 13; with
    # at most 2 rows: 18 + 17, 16 + 15, 14 + 14, 13 + 13.
    budget = 53
    grads, seen = {}, {}
    for name, updates in (
        ("whole", Updates(max_grad_norm=None)),
        ("budget", Updates(max_tokens_per_microbatch=budget, micro_batch_size=micro_batch_size, max_grad_norm=None)),
    ):
        module.learner.updates = updates
        seen[name] = []
        loss_fn = lambda micro, normaliser: (seen[name].append(micro), module._loss(micro, normaliser))[1]  # noqa: B023, E731
        opt = standalone(module)
        module.update(data, loss_fn)
        assert len(opt.grads) == 1
        grads[name] = opt.grads[0]
    assert [len(m) for m in seen["whole"]] == [8] and [len(m) for m in seen["budget"]] == sizes
    assert all(len(m) * m.input_ids.shape[1] <= budget for m in seen["budget"])  # padded as selected
    assert any(g.abs().sum() > 0 for g in grads["whole"])
    for whole, budgeted in zip(grads["whole"], grads["budget"]):
        torch.testing.assert_close(whole, budgeted, atol=1e-6, rtol=1e-4)


def test_minibatches_and_epochs_give_one_step_each():
    idx = minibatch_indices(8, num_minibatches=2, micro_batch_size=3)
    assert [[len(m) for m in mb] for mb in idx] == [[3, 1], [3, 1]]
    assert sorted(torch.cat([m for mb in idx for m in mb]).tolist()) == list(range(8))
    module = make_module(updates=dict(epochs=2, minibatches=2))
    opt = standalone(module)
    module.update(fixed_batch(module), module._loss)
    assert len(opt.grads) == 4


def test_kl_coef_zero_needs_no_reference_and_trains():
    module = make_module()
    module.setup("fit")
    assert module.policy.ref_model is None
    opt = standalone(module)
    torch.manual_seed(0)
    module.training_step(prompt_batch(module.policy), 0)
    assert len(opt.grads) == 1
    assert "train/kl" not in module.last_metrics and module.last_metrics["rollout/reward_std"] >= 0


def test_zero_variance_groups_give_zero_gradient():
    module = make_module(rewards=[constant_reward])
    opt = standalone(module)
    torch.manual_seed(0)
    module.training_step(prompt_batch(module.policy), 0)
    assert all((g == 0).all() for g in opt.grads[0])
    assert module.last_metrics["rollout/zero_std_frac"] == 1.0


def test_kl_in_reward_and_off_policy_iterations_run():
    module = make_module(
        kl=KLPenalty(coef=0.1, placement="reward"),
        updates=dict(epochs=2),
        clip=ClipRange(high=0.28),
        advantages=GroupAdvantages(std_scale="batch"),
    )
    module.setup("fit")
    assert module.kl.kind == "k1" and module.policy.ref_model is not None
    opt = standalone(module)
    torch.manual_seed(0)
    module.training_step(prompt_batch(module.policy), 0)
    assert len(opt.grads) == 2 and "train/kl" in module.last_metrics


METRICS = [
    "train/loss",
    "train/policy_loss",
    "train/kl",
    "train/clipfrac",
    "train/approx_kl",
    "train/entropy",
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/response_length",
    "rollout/tokens_per_s",
    "rollout/truncated_frac",
    "rollout/reward/sort_format",
    "rollout/completion_tokens",
    "train/kl_coef",
    "time/generation_s",
    "time/scoring_s",
    "time/update_s",
]


def test_trains_a_few_steps_with_lightning_and_logs_the_metrics(tmp_path):
    module = GRPOModule(
        policy=PolicyModel("tiny", seed=2),
        rewards=[RewardSpec("align.rewards.sort_format")],
        group_size=4,
        sampling=SamplingConfig(max_new_tokens=6),
        kl=KLPenalty(coef=0.05),
        updates=Updates(minibatches=2, micro_batch_size=2),
    )
    data = PromptDataModule(batch_size=2, val_batch_size=4)
    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path, name=""),
        log_every_n_steps=1,
        limit_val_batches=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer.validate(module, datamodule=data, verbose=False)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4  # 2 rollouts x 2 minibatches
    assert any((a != b).any() for a, b in zip(before, module.policy.parameters()))
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    for name in METRICS + ["val/reward_mean", "val/accuracy"]:
        assert any(r.get(name) for r in rows), name


@pytest.mark.parametrize("disable", [True, False])
def test_dropout_is_off_in_the_update_passes_by_default(disable):
    # LoRA dropout 0.3 and attention dropout 0.2 are configured; the module runs its passes in train mode.
    from align.models import LoraSettings

    policy = PolicyModel("tiny", seed=2, lora=LoraSettings(r=4, alpha=8, dropout=0.3))
    for module in policy.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.2
    module = make_module(policy=policy, updates=dict(epochs=2), disable_dropout=disable)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a trained adapter, so that its dropout matters
    torch.manual_seed(0)
    rollout = module.sampler.rollout(prompt_batch(policy, PROMPTS[:2]))
    data = RLBatch.from_rollout(rollout, torch.zeros(len(rollout)))
    policy.train()
    with torch.no_grad():
        first, second = module.scorer.logprobs(data).logprobs, module.scorer.logprobs(data).logprobs
    mask = data.response_mask
    ratio = torch.exp(first - data.old_logprobs)[mask]
    if disable:
        torch.testing.assert_close(first, second, atol=0, rtol=0)
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)  # the sampler's log-probs
        assert not any(m.p for m in policy.modules() if isinstance(m, torch.nn.Dropout))
    else:
        assert not torch.allclose(first[mask], second[mask], atol=1e-4)
        assert (ratio - 1).abs().max() > 1e-3


def test_rewards_receive_the_conversation_the_sampled_ids_and_truncation():
    seen = {}

    def capture(prompts, completions, **inputs):
        seen.update(inputs, completions=completions)
        return [0.0] * len(completions)

    module = make_module(rewards=[capture], sampling=SamplingConfig(max_new_tokens=3))
    tok = module.policy.tokenizer
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}] for p in PROMPTS[:2]]
    enc = ChatEncoder(tok)
    batch = PromptBatch([enc.prompt_ids(c) for c in chats], list(PROMPTS[:2]), {"answer": ["x", "y"]}, chats)
    torch.manual_seed(0)
    rollout = module.sampler.rollout(batch)
    module.sampler.score(batch, rollout)
    assert seen["prompt_messages"] == [c for c in chats for _ in range(module.group_size)]
    assert seen["answer"] == ["x"] * 4 + ["y"] * 4
    assert [tok.decode(ids, skip_special_tokens=True) for ids in seen["completion_ids"]] == seen["completions"]
    assert seen["completion_truncated"] == rollout.truncated.tolist()
    for ids, cut in zip(seen["completion_ids"], seen["completion_truncated"]):
        assert (ids[-1] != tok.eos_token_id) == cut and tok.eos_token_id not in ids[:-1]


# ---------------------------------------------------------------- advantages.estimator and policy_loss.name

# A hand-built rollout of 2 prompts x 2 completions: rewards 1 0 | 2 2, responses of 2, 1, 2, 2 tokens, a k1
# KL of 0.2 0.2 | 0.4 | 0 0 | 0 0 (NaN in the padding), kl.coef 0.5 in the reward.
REWARDS = torch.tensor([1.0, 0.0, 2.0, 2.0])
MASK = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]]).bool()
KL = torch.tensor([[0.2, 0.2], [0.4, float("nan")], [0.0, 0.0], [0.0, 0.0]])


def _whitened(values):  # the valid returns in row order, whitened with the unbiased std
    values = torch.tensor(values)
    out = torch.zeros(4, 2)
    out[MASK] = (values - values.mean()) / (values.var() + 1e-8).sqrt()
    return out


# Summed KL 0.4 | 0.4 | 0 | 0 -> shaped rewards 0.8 -0.2 | 2 2. grpo: +-0.5 / std 0.7071; rloo: 0.8 - (-0.2) = 1.
# REINFORCE++: per-token rewards -0.1 (-0.1 + 1) | (-0.2 + 0) | 2 at the end -> returns 0.8 0.9 | -0.2 | 2 2 | 2 2.
# Baseline: rewards centred in the group first (0.5 -0.5 | 0 0) -> returns 0.3 0.4 | -0.7 | 0 0 | 0 0.
EXPECTED = {
    "grpo": torch.tensor([0.5**0.5, -(0.5**0.5), 0.0, 0.0]),
    "rloo": torch.tensor([1.0, -1.0, 0.0, 0.0]),
    "reinforce_pp": _whitened([0.8, 0.9, -0.2, 2.0, 2.0, 2.0, 2.0]),
    "reinforce_pp_baseline": _whitened([0.3, 0.4, -0.7, 0.0, 0.0, 0.0, 0.0]),
}


@pytest.mark.parametrize("estimator", list(EXPECTED))
def test_each_estimator_gives_its_advantages_on_a_hand_built_rollout(estimator):
    module = make_module(
        group_size=2, kl=KLPenalty(coef=0.5, placement="reward"), advantages=GroupAdvantages(estimator=estimator)
    )
    torch.testing.assert_close(module.estimate_advantages(REWARDS, KL, MASK), EXPECTED[estimator])


def test_kl_in_the_loss_leaves_the_rewards_alone():
    module = make_module(group_size=2, kl=KLPenalty(coef=0.5), advantages=GroupAdvantages(estimator="rloo"))
    torch.testing.assert_close(module.estimate_advantages(REWARDS, KL, MASK), torch.tensor([1.0, -1.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    "estimator, loss",
    [
        ("rloo", "clip"),
        ("reinforce_pp", "gspo"),
        ("reinforce_pp_baseline", "clip"),
        ("grpo", "gspo"),
        ("grpo", "cispo"),
        ("rloo", "sapo"),
        ("reinforce_pp", "gmpo"),
    ],
)
def test_each_estimator_and_policy_loss_runs_one_update(estimator, loss):
    module = make_module(
        kl=KLPenalty(coef=0.1, placement="reward"),
        updates=dict(minibatches=2),
        advantages=GroupAdvantages(estimator=estimator),
        policy_loss=PolicyLoss(name=loss),
    )
    module.setup("fit")
    opt = standalone(module, lr=1e-2)
    torch.manual_seed(0)
    module.training_step(prompt_batch(module.policy, PROMPTS[:2]), 0)
    assert len(opt.grads) == 2 and any(g.abs().sum() > 0 for g in opt.grads[1])
    metrics = module.last_metrics
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert 0.0 <= metrics["train/clipfrac"] <= 1.0 and "train/kl" in metrics


def test_one_sample_per_prompt_is_refused_where_the_estimator_needs_a_group():
    for estimator in ("grpo", "rloo", "reinforce_pp_baseline"):
        with pytest.raises(AlignConfigError, match=rf"^model\.group_size: expected >= 2 .*{estimator}, got 1$"):
            make_module(group_size=1, advantages=GroupAdvantages(estimator=estimator))
    assert make_module(group_size=1, advantages=GroupAdvantages(estimator="reinforce_pp")).group_size == 1


def test_padding_free_update_equals_the_padded_rows():
    # updates.padding_free: the KL-penalised update of responses that ended at different lengths gives every
    # optimizer step the padded rows' gradients, and the same logged losses.
    module = make_module(kl=KLPenalty(coef=0.1), log_entropy=True, updates=dict(epochs=2, minibatches=2))
    module.setup("fit")
    data = fixed_batch(module)
    ends = torch.tensor([6, 1, 3, 6, 2, 6, 1, 4])[:, None] > torch.arange(data.response_length)
    data.response_mask &= ends
    data.attention_mask[:, -data.response_length :] *= ends
    data.ref_logprobs = module.scorer.reference_logprobs(data)
    grads, metrics = {}, {}
    for free in (False, True):
        module.learner.updates = Updates(epochs=2, minibatches=2, max_grad_norm=None, padding_free=free)
        opt = standalone(module)
        torch.manual_seed(1)  # the same minibatches
        metrics[free] = module.update(data, module._loss)
        grads[free] = opt.grads
    assert len(grads[True]) == 4
    for step_free, step_padded in zip(grads[True], grads[False]):
        for free, padded in zip(step_free, step_padded):
            torch.testing.assert_close(free, padded, atol=1e-5 * max(1.0, float(padded.abs().max())), rtol=1e-4)
    for name in ("train/loss", "train/policy_loss", "train/kl", "train/entropy"):
        assert metrics[True][name] == pytest.approx(metrics[False][name], rel=1e-5, abs=1e-6), name
