import csv
import math

import lightning as L
import pytest
import torch
from _helpers import PROMPTS, length_reward, prompt_batch, standalone
from _ppo import hand_rollout, make_module
from lightning.pytorch.loggers import CSVLogger

from align.core.kl import AdaptiveKLController
from align.data.prompts import PromptDataModule
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.options import KLPenalty, PolicyLoss, Updates, ValueTraining
from align.modules.ppo import PPOModule
from align.rollout.engine import SamplingConfig
from align.rollout.rewards import RewardSpec


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
