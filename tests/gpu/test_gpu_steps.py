"""Every RL and preference module trains on the device under ``bf16-mixed`` and ``bf16-true``, through Lightning as
a recipe runs it, with a fused AdamW and gradient clipping (the combination Lightning's mixed-precision plugin
refuses on its own): two optimizer steps on the tiny model, the weights move, every logged number is finite."""

import math
from functools import partial

import pytest
import torch

from align.models import CriticSettings, LoraSettings, PolicyModel
from align.modules.options import Updates, ValueTraining
from align.rollout.engine import SamplingConfig

pytestmark = pytest.mark.gpu


def length_reward(prompts, completions, **kw):
    return [float(len(c) % 3) for c in completions]


FUSED_ADAMW = partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.0, fused=True)
RL = dict(
    rewards=[length_reward],
    group_size=2,
    sampling=SamplingConfig(max_new_tokens=6),
    log_entropy=True,
    optimizer=FUSED_ADAMW,
    updates=Updates(max_grad_norm=0.5),
)


def grpo(lora=False):
    from align.modules.grpo import GRPOModule

    return GRPOModule(policy=PolicyModel("tiny", seed=2, lora=LoraSettings(r=4, alpha=8) if lora else None), **RL)


def ppo():
    from align.modules.ppo import PPOModule

    return PPOModule(policy=PolicyModel("tiny", seed=2, critic=CriticSettings()), **{**RL, "value": ValueTraining()})


def trpo():
    from align.modules.trpo import TRPOModule

    return TRPOModule(policy=PolicyModel("tiny", seed=2, critic=CriticSettings(kind="separate")), **RL)


def online_dpo():
    from align.modules.online_dpo import OnlineDPOModule

    return OnlineDPOModule(policy=PolicyModel("tiny", seed=2), **RL)


def distill():
    from align.modules.distill import DistillModule

    return DistillModule(policy=PolicyModel("tiny", seed=2), teacher="tiny-sort", **RL)


def prompts():
    from align.data.prompts import PromptDataModule

    return PromptDataModule(batch_size=2)


def sft():
    from align.modules import SFTModule

    return SFTModule(PolicyModel("tiny", seed=2), optimizer=FUSED_ADAMW)


def dpo():
    from align.modules.dpo import DPOModule

    return DPOModule(PolicyModel("tiny", seed=2), optimizer=FUSED_ADAMW)


def sft_data():
    from align.data import SFTDataModule

    return SFTDataModule(batch_size=4, max_length=128)


def pairs():
    from align.data.preference import PreferenceDataModule

    return PreferenceDataModule(batch_size=4, max_length=128)


CASES = {
    "grpo": (grpo, prompts),
    "grpo-lora": (partial(grpo, lora=True), prompts),
    "ppo": (ppo, prompts),
    "trpo": (trpo, prompts),
    "online_dpo": (online_dpo, prompts),
    "distill": (distill, prompts),
    "sft": (sft, sft_data),
    "dpo": (dpo, pairs),
}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_steps_on_the_device(case, precision, accelerator, device):
    import lightning as L

    make_module, make_data = CASES[case]
    torch.manual_seed(0)
    module = make_module()
    automatic = module.automatic_optimization
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        precision=precision,
        max_steps=2,
        gradient_clip_val=1.0 if automatic else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    before = {n: p.detach().float().clone() for n, p in trainable}
    trainer.fit(module, datamodule=make_data())
    assert trainer.global_step == 2
    assert module.policy.model.device.type == device.type
    moved = [n for n, p in trainable if not torch.equal(p.detach().float().cpu(), before[n])]
    assert moved, "no trainable parameter changed"
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    metrics.update(getattr(module, "last_metrics", None) or {})
    assert metrics
    assert all(math.isfinite(v) for v in metrics.values()), {k: v for k, v in metrics.items() if not math.isfinite(v)}
