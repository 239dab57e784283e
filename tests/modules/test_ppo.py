import csv
import math

import lightning as L
import pytest
import torch
from _helpers import PROMPTS, length_reward, prompt_batch, standalone
from lightning.pytorch.loggers import CSVLogger

from align.core.advantages import gae
from align.core.kl import AdaptiveKLController
from align.core.masks import masked_mean, response_mask, truncated
from align.data.chat import ChatEncoder
from align.data.prompts import PromptDataModule
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.actor_critic import GAEBatch
from align.modules.options import KLPenalty, PolicyLoss, ScoreShaping, Updates, ValueTraining
from align.modules.ppo import PPOModule
from align.rollout.engine import SamplingConfig
from align.rollout.rewards import RewardSpec
from align.rollout.types import Rollout


def row_reward(prompts, completions, **kw):
    """Scores 3, 5, 7, ... by row: each row's terminal reward is recognisable."""
    return [3.0 + 2 * i for i in range(len(completions))]


def make_module(policy=None, **kw):
    defaults = {
        "policy": policy or PolicyModel("tiny", seed=2, critic=CriticSettings()),
        "rewards": [length_reward],
        "sampling": SamplingConfig(max_new_tokens=6),
        "group_size": 2,
        "updates": Updates(max_grad_norm=None),
        "log_entropy": False,
    }
    return PPOModule(**{**defaults, **kw})


def hand_rollout(policy, responses, max_new_tokens):
    """A rollout of the given response ids (already padded) for the first len(responses) prompts."""
    tok = policy.tokenizer
    enc = ChatEncoder(tok)
    prompts = [enc.prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS[: len(responses)]]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    response_ids = torch.tensor(responses)
    mask = response_mask(response_ids, tok.eos_token_id)
    is_truncated = truncated(response_ids, tok.eos_token_id) & (response_ids.shape[1] >= max_new_tokens)
    logprobs = policy.token_logprobs(
        torch.cat([prompt_ids, response_ids], 1),
        torch.cat([prompt_mask, mask.long()], 1),
        response_length=response_ids.shape[1],
    ).logprobs.detach()
    logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    texts = tok.batch_decode(torch.where(mask, response_ids, tok.pad_token_id).tolist(), skip_special_tokens=True)
    return Rollout(
        prompt_ids,
        prompt_mask,
        response_ids,
        mask,
        logprobs,
        is_truncated,
        texts,
        torch.arange(len(responses)),
        1,
        0.0,
        {},
    )


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


def test_joint_update_steps_and_accumulation_matches_one_micro_batch():
    module = make_module(updates=Updates(minibatches=2, epochs=2, max_grad_norm=None))
    module.setup("fit")
    torch.manual_seed(0)
    data = module.make_batch(module.sampler.sample(prompt_batch(module.policy)))
    opt = standalone(module)
    stats = module.update_policy(data)
    assert opt.steps == 4
    for name in ("train/loss", "train/policy_loss", "train/value_loss", "train/clipfrac", "train/approx_kl"):
        assert name in stats, name
    grads = {}
    for micro in (None, 1):
        module.learner.updates = Updates(micro_batch_size=micro, max_grad_norm=None)
        opt = standalone(module)
        module.update_policy(data)
        grads[micro] = [g for g in opt.grads[0] if g is not None]
    assert any(g.abs().sum() > 0 for g in grads[None])
    for full, accumulated in zip(grads[None], grads[1]):
        torch.testing.assert_close(full, accumulated, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo"])
def test_each_per_token_policy_loss_takes_gaes_advantages(name):
    module = make_module(updates=Updates(minibatches=2, max_grad_norm=None), policy_loss=PolicyLoss(name=name))
    module.setup("fit")
    torch.manual_seed(0)
    data = module.make_batch(module.sampler.sample(prompt_batch(module.policy)))
    opt = standalone(module, lr=1e-2)
    stats = module.update_policy(data)
    assert opt.steps == 2 and any(g.abs().sum() > 0 for g in opt.grads[1] if g is not None)
    assert 0.0 <= stats["train/clipfrac"] <= 1.0 and all(math.isfinite(v) for v in stats.values())


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


def test_an_adaptive_kl_controller_must_start_above_zero():
    from align.errors import AlignConfigError

    with pytest.raises(AlignConfigError, match=r"^model.kl.coef: the adaptive controller .* must start > 0"):
        make_module(kl=KLPenalty(coef=0.0, target=0.5, placement="reward"))


METRICS = [
    "train/loss",
    "train/policy_loss",
    "train/value_loss",
    "train/entropy",
    "train/kl",
    "train/kl_coef",
    "train/clipfrac",
    "train/approx_kl",
    "train/explained_variance",
    "train/returns_mean",
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/response_length",
    "rollout/tokens_per_s",
    "rollout/reward/sort_format",
    "rollout/reward/length_reward",
    "time/generation_s",
    "time/scoring_s",
    "time/update_s",
]


def test_trains_a_few_steps_with_lightning_logs_metrics_and_checkpoints_the_kl_controller(tmp_path):
    module = PPOModule(
        policy=PolicyModel("tiny", seed=2, critic=CriticSettings()),
        rewards=[RewardSpec("align.rewards.sort_format")],
        eval_rewards=[length_reward],
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=6),
        kl=KLPenalty(coef=0.1, target=0.5, horizon=100, placement="reward"),
        updates=Updates(minibatches=2, micro_batch_size=2),
        value=ValueTraining(warmup_rollouts=1),
    )
    assert module.accuracy_reward == "length_reward"
    data = PromptDataModule(batch_size=2, val_batch_size=4)
    trainer = L.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path, name=""),
        log_every_n_steps=1,
        limit_val_batches=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = [p.detach().clone() for p in module.policy.model.parameters()]
    trainer.validate(module, datamodule=data, verbose=False)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 6 and module.rl_counters["rollouts"] == 3  # 1 warm-up + 2 PPO rollouts, 2 steps each
    assert any((a != b).any() for a, b in zip(before, module.policy.model.parameters()))
    assert isinstance(module.kl_controller, AdaptiveKLController) and module.kl_controller.value != 0.1
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    for name in METRICS + [
        "val/reward_mean",
        "val/accuracy",
        "val/kl",
        "val/reward/sort_format",
        "val/reward/length_reward",
    ]:
        assert any(r.get(name) for r in rows), name
    # rewards logged with weight 0 never enter the training total
    row = next(r for r in rows if r.get("rollout/reward_mean"))
    assert float(row["rollout/reward_mean"]) == pytest.approx(float(row["rollout/reward/sort_format"]))

    ckpt = tmp_path / "ppo.ckpt"
    trainer.save_checkpoint(ckpt)
    fresh = PPOModule(
        policy=PolicyModel("tiny", seed=2, critic=CriticSettings()),
        rewards=[RewardSpec("align.rewards.sort_format")],
        kl=KLPenalty(coef=0.1, target=0.5, placement="reward"),
    )
    fresh.on_load_checkpoint(torch.load(ckpt, weights_only=False))
    assert fresh.kl_controller.value == pytest.approx(module.kl_controller.value)
    assert fresh.rl_counters["rollouts"] == 3


def test_value_lr_scale_gives_the_value_parameters_their_own_learning_rate():
    from functools import partial

    module = make_module(
        PolicyModel("tiny", seed=2, critic=CriticSettings(kind="separate")),
        value=ValueTraining(lr_scale=10.0),
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
    )
    optimizer = module.configure_optimizers()
    value_ids = {id(p) for p in module.policy.critic.parameters()}
    seen = set()
    for group in optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        seen |= ids
        assert ids <= value_ids if group["value_params"] else not ids & value_ids
        assert group["lr"] == pytest.approx(1e-2 if group["value_params"] else 1e-3)
    assert seen == {id(p) for p in module.parameters() if p.requires_grad}


@pytest.mark.parametrize("from_rm", [True, False])
def test_critic_head_starts_from_the_shipped_reward_models_head(from_rm):
    """The default critic's backbone is ``tiny-sort-rm`` (a sequence-classification export): its head starts as the
    reward model's ``score`` (bias 0), or at zero when ``policy.critic.head_from_reward_model`` is off."""
    from safetensors.torch import load_file

    from align.hub.tiny import TINY_SORT_RM_DIR

    policy = PolicyModel(
        "tiny-sort", critic=CriticSettings(kind="separate", model="tiny-sort-rm", head_from_reward_model=from_rm)
    )
    head = PPOModule(policy=policy).policy.critic.head.proj
    score = load_file(str(TINY_SORT_RM_DIR / "model.safetensors"))["score.weight"]
    if from_rm:
        torch.testing.assert_close(head.weight.detach(), score)
    else:
        assert not head.weight.any()
    assert not head.bias.any()


@pytest.mark.parametrize("kind", ["shared", "separate"])
def test_padding_free_rollout_scoring_and_update_equal_the_padded_rows(kind):
    # updates.padding_free: the reference log-probs and values of make_batch (hence rewards, returns and
    # advantages), and the gradients of every PPO step, are those of the padded rows.
    policy = PolicyModel("tiny", seed=2, critic=CriticSettings(kind=kind))
    eos = policy.tokenizer.eos_token_id
    responses = [[40, 41, eos, 0, 0], [40, 41, 42, 43, 44], [40, eos, 0, 0, 0], [40, 41, 42, eos, 0]]
    module = make_module(
        policy, kl=KLPenalty(coef=0.1, placement="reward"), group_size=1, sampling=SamplingConfig(max_new_tokens=5)
    )
    module.setup("fit")
    module.sampler.engine.generate = lambda *a, **k: hand_rollout(policy, responses, 5)
    with torch.no_grad():
        head = policy.critic.head
        head.proj.weight.normal_(0.0, 0.1)  # values that differ by token
    batches, grads = {}, {}
    for free in (False, True):
        module.learner.updates = Updates(epochs=2, minibatches=2, max_grad_norm=None, padding_free=free)
        torch.manual_seed(1)  # the same minibatches (the first epoch's are drawn as the rollout is scored)
        batches[free] = data = module.make_batch(module.sampler.sample(prompt_batch(policy, PROMPTS[:4])))
        opt = standalone(module)
        module.update_policy(data)
        grads[free] = opt.grads
    real = batches[False].response_mask
    assert torch.equal(batches[True].response_mask, real) and not bool(real.all())
    for name in ("ref_logprobs", "values", "rewards", "returns", "advantages"):
        torch.testing.assert_close(
            getattr(batches[True], name)[real], getattr(batches[False], name)[real], atol=1e-5, rtol=1e-5, msg=name
        )
    assert len(grads[True]) == 4
    for step_free, step_padded in zip(grads[True], grads[False]):
        for free, padded in zip(step_free, step_padded):
            torch.testing.assert_close(free, padded, atol=1e-5 * max(1.0, float(padded.abs().max())), rtol=1e-4)


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
