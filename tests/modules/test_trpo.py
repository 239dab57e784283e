import csv

import lightning as L
import pytest
import torch
from _helpers import length_reward, prompt_batch, standalone
from lightning.pytorch.loggers import CSVLogger

from align.core.kl import kl_estimate
from align.core.masks import masked_mean
from align.data.prompts import PromptDataModule
from align.errors import AlignConfigError
from align.models.critic import CriticSettings
from align.models.loading import LoraSettings
from align.models.policy import PolicyModel
from align.modules.options import TrustRegion, Updates, ValueTraining
from align.modules.trpo import TRPOModule
from align.rollout.engine import SamplingConfig


def make_module(policy=None, trust_region=None, **kw):
    defaults = dict(
        policy=policy or PolicyModel("tiny", seed=2, critic=CriticSettings(kind="separate")),
        rewards=[length_reward],
        sampling=SamplingConfig(max_new_tokens=6),
        group_size=2,
        log_entropy=False,
    )
    region = TrustRegion(**{"max_kl": 0.01, "cg_iters": 4, **(trust_region or {})})
    return TRPOModule(trust_region=region, **{**defaults, **kw})


def fixed_batch(module):
    torch.manual_seed(0)
    return module.make_batch(module.sampler.sample(prompt_batch(module.policy)))


def snapshot(params):
    return [p.detach().clone() for p in params]


def measured_kl(module, data, old):
    """Mean k3 KL(old || current) over valid tokens, computed independently of the module's step."""
    with torch.no_grad():
        new = module.policy.token_logprobs(
            data.input_ids,
            data.attention_mask,
            response_length=data.response_length,
            temperature=module.scorer.temperature,
        ).logprobs
    return float(masked_mean(kl_estimate(old, new, "k3"), data.response_mask))


def current_logprobs(module, data):
    with torch.no_grad():
        return module.policy.token_logprobs(
            data.input_ids,
            data.attention_mask,
            response_length=data.response_length,
            temperature=module.scorer.temperature,
        ).logprobs


def test_accepted_step_stays_inside_the_trust_region_and_improves_the_surrogate():
    module = make_module()
    data = fixed_batch(module)
    old = current_logprobs(module, data)
    metrics = module.trust_region_step(data)
    assert metrics["trpo/accepted"] == 1.0
    kl = measured_kl(module, data, old)
    assert 0 < kl <= module.trust_region.max_kl
    assert metrics["trpo/kl"] == pytest.approx(kl, rel=1e-4)
    assert metrics["trpo/surrogate_improvement"] > 0
    assert metrics["trpo/cg_iterations"] == 4 and metrics["trpo/cg_residual"] >= 0
    assert metrics["trpo/line_search_steps"] >= 1


def test_rejected_step_leaves_the_policy_bit_identical():
    # accept_ratio 100: the measured improvement would have to be 100 times the linear model's, so every
    # candidate is rejected and the line search restores theta_old.
    module = make_module(trust_region=dict(accept_ratio=100.0, max_backtracks=3))
    data = fixed_batch(module)
    before = snapshot(module.policy.parameters())
    metrics = module.trust_region_step(data)
    assert metrics["trpo/accepted"] == 0.0 and metrics["trpo/line_search_steps"] == 4
    assert metrics["trpo/kl"] == 0.0 and metrics["trpo/surrogate_improvement"] == 0.0
    for a, b in zip(before, module.policy.parameters()):
        assert torch.equal(a, b.detach())


def test_micro_batches_and_the_fisher_subsample_give_the_step_they_should():
    full = make_module(trust_region=dict(cg_iters=2))
    data = fixed_batch(full)
    start = snapshot(full.policy_parameters())
    full.trust_region_step(data)
    step_full = [p.detach() - s for p, s in zip(full.policy_parameters(), start)]
    micro = make_module(updates=Updates(micro_batch_size=3), trust_region=dict(cg_iters=2))
    micro.trust_region_step(data)
    for p, s, d in zip(micro.policy_parameters(), start, step_full):
        torch.testing.assert_close(p.detach() - s, d, rtol=1e-3, atol=1e-6)
    # Fewer rows for the Fisher: a different step, still inside the trust region.
    sub = make_module(trust_region=dict(fisher_fraction=0.5, cg_iters=2))
    old = current_logprobs(sub, data)
    metrics = sub.trust_region_step(data)
    assert metrics["trpo/accepted"] == 0.0 or measured_kl(sub, data, old) <= sub.trust_region.max_kl


@pytest.mark.parametrize("kind", ["separate", "shared"])
def test_value_optimizer_owns_the_value_model_and_never_moves_the_policy(kind):
    module = make_module(
        policy=PolicyModel("tiny", seed=2, critic=CriticSettings(kind=kind)), updates=Updates(minibatches=2)
    )
    optimizer = standalone(module, module.configure_optimizers())
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized and not optimized & {id(p) for p in module.policy_parameters()}
    value_ids = {id(p) for p in module.value_parameters()}
    assert optimized == value_ids
    data = fixed_batch(module)
    policy_before = snapshot(module.policy_parameters())
    values_before = snapshot(module.value_parameters())
    stats = module.update_value(data)
    assert stats["train/value_loss"] > 0
    assert all(torch.equal(a, b.detach()) for a, b in zip(policy_before, module.policy_parameters()))
    assert all(p.grad is None for p in module.policy_parameters())  # a shared backbone got no gradient
    assert any(not torch.equal(a, b.detach()) for a, b in zip(values_before, module.value_parameters()))
    assert all(p.requires_grad for p in module.policy_parameters())


def test_lora_trust_region_is_the_adapter():
    policy = PolicyModel("tiny", seed=2, critic=CriticSettings(kind="separate"), lora=LoraSettings(r=2, alpha=4))
    module = make_module(policy=policy, trust_region=dict(cg_iters=2), group_size=1)
    params = module.policy_parameters()
    assert params and all("lora_" in name for name, p in policy.model.named_parameters() if p.requires_grad)
    assert sum(p.numel() for p in params) < sum(p.numel() for p in policy.model.parameters()) / 10
    data = fixed_batch(module)
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    old = current_logprobs(module, data)
    metrics = module.trust_region_step(data)
    assert all(torch.equal(frozen[n], p) for n, p in policy.model.named_parameters() if n in frozen)
    if metrics["trpo/accepted"]:
        assert measured_kl(module, data, old) <= module.trust_region.max_kl


def test_bad_settings_are_rejected():
    policy = PolicyModel("tiny", seed=2, critic=CriticSettings(kind="separate"))
    for kwargs, match in (
        ({"max_kl": 0.0}, "max_kl"),
        ({"backtrack_ratio": 1.0}, "backtrack_ratio"),
        ({"cg_iters": 0}, "cg_iters"),
        ({"fisher_fraction": 0.0}, "fisher_fraction"),
    ):
        with pytest.raises(AlignConfigError, match=rf"^model\.trust_region\.{match}: expected"):
            TRPOModule(policy=policy, rewards=[length_reward], trust_region=TrustRegion(**kwargs))
    with pytest.raises(
        AlignConfigError, match=r"^model\.value\.coef: TRPO trains the value model with its own optimizer"
    ):
        TRPOModule(policy=policy, rewards=[length_reward], value=ValueTraining(coef=0.5))


METRICS = [
    "trpo/kl",
    "trpo/max_kl",
    "trpo/surrogate_improvement",
    "trpo/line_search_steps",
    "trpo/accepted",
    "trpo/cg_residual",
    "train/value_loss",
    "train/explained_variance",
    "train/policy_loss",
    "train/entropy",
    "rollout/reward_mean",
    "rollout/response_length",
    "val/reward_mean",
    "val/accuracy",
]


def test_trains_a_few_steps_with_lightning_and_every_accepted_step_respects_the_bound(tmp_path):
    module = TRPOModule(
        policy=PolicyModel("tiny", seed=2, critic=CriticSettings(kind="separate")),
        rewards=[length_reward],
        sampling=SamplingConfig(max_new_tokens=6),
        group_size=2,
        trust_region=TrustRegion(max_kl=0.005, cg_iters=4),
        updates=Updates(epochs=2),
    )
    data = PromptDataModule(batch_size=4, val_batch_size=4)
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
    before = snapshot(module.policy_parameters())
    trainer.validate(module, datamodule=data, verbose=False)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4  # 2 rollouts x 2 value epochs
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    for name in METRICS:
        assert any(r.get(name) for r in rows), name
    steps = [r for r in rows if r.get("trpo/accepted")]
    assert len(steps) == 2
    for r in steps:
        if float(r["trpo/accepted"]):
            assert 0 < float(r["trpo/kl"]) <= float(r["trpo/max_kl"])
            assert float(r["trpo/max_kl"]) == pytest.approx(0.005)
    if any(float(r["trpo/accepted"]) for r in steps):
        assert any(not torch.equal(a, b.detach()) for a, b in zip(before, module.policy_parameters()))


def test_padding_free_trust_region_step_equals_the_padded_rows():
    # The Fisher-vector products differentiate the padding-free log-probs twice; the step they give is the
    # padded rows' step.
    module = make_module()
    data = fixed_batch(module)
    params = [p for p in module.policy.model.parameters() if p.requires_grad]
    start = snapshot(params)
    after, metrics = {}, {}
    for free in (False, True):
        module.learner.updates = Updates(padding_free=free)
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        metrics[free] = module.trust_region_step(data)
        after[free] = snapshot(params)
    assert metrics[True]["trpo/accepted"] == metrics[False]["trpo/accepted"] == 1.0
    assert metrics[True]["trpo/kl"] == pytest.approx(metrics[False]["trpo/kl"], rel=1e-4)
    for free, padded, s in zip(after[True], after[False], start):
        torch.testing.assert_close(free - s, padded - s, atol=1e-6, rtol=1e-3)
