"""The RL modules on the vLLM engine (tiny model): GRPO off-policy minibatches, PPO with a critic, multi-turn episodes
and a Lightning fit, each with the engine-mismatch metrics; the correction weighing a bfloat16 engine's rollouts; the
sequence-level losses' level check."""

import csv

import pytest
import torch
from _helpers import cpu_trainer, length_reward, prompt_batch, standalone
from lightning.pytorch.loggers import CSVLogger

from align.errors import AlignConfigError
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.grpo import GRPOModule
from align.modules.options import KLPenalty, PolicyLoss, Updates
from align.modules.ppo import PPOModule
from align.rollout.engine import EngineCorrection, SamplingConfig
from align.rollout.vllm_engine import VLLMEngine

pytestmark = pytest.mark.slow  # vLLM: its import and an engine start take seconds per test

pytest.importorskip("vllm", exc_type=ImportError)
vllm_engine = pytest.importorskip("align.rollout.vllm_engine")

MISMATCH = [
    "rollout/engine_logprob_diff",
    "rollout/engine_kl",
    "rollout/correction_clipped_frac",
    "rollout/correction_masked_frac",
    "time/engine_sync_s",
]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    vllm_engine.close_engines()


def vllm(max_new_tokens=6, **kw) -> SamplingConfig:
    return SamplingConfig(**{"engine": "vllm", "max_new_tokens": max_new_tokens, **kw})


def grpo(**kw):
    defaults = dict(
        policy=PolicyModel("tiny-sort"), rewards=[length_reward], group_size=4, sampling=vllm(), log_entropy=False
    )
    return GRPOModule(**{**defaults, **kw})


def test_grpo_off_policy_minibatches_train_on_the_trainers_logprobs_and_log_the_mismatch():
    module = grpo(updates=Updates(minibatches=2, max_grad_norm=None))
    opt = standalone(module, lr=1e-3)
    torch.manual_seed(0)
    module.training_step(prompt_batch(module.policy), 0)
    metrics = module.last_metrics
    assert len(opt.grads) == 2 and all(name in metrics for name in MISMATCH)
    # float32 engine: the trainer sees the same distribution, every weight is 1 (up to rounding).
    assert metrics["rollout/engine_kl"] < 1e-6 and metrics["rollout/engine_logprob_diff"] < 1e-4
    assert metrics["rollout/correction_clipped_frac"] == 0 and metrics["rollout/correction_masked_frac"] == 0


def test_a_bfloat16_engine_drifts_and_the_update_is_weighted():
    module = grpo(
        sampling=vllm(
            max_new_tokens=8, engine=VLLMEngine(dtype="bfloat16"), correction=EngineCorrection(mode="tis", cap=1.01)
        )
    )
    torch.manual_seed(0)
    scored = module.sampler.sample(prompt_batch(module.policy))
    rollout, mask = scored.rollout, scored.rollout.response_mask
    assert rollout.engine_logprobs is not None and rollout.correction_weights is not None
    assert not torch.equal(rollout.engine_logprobs[mask], rollout.old_logprobs[mask])  # bf16 vs fp32
    weights = rollout.correction_weights[mask]
    assert (weights <= 1.01 + 1e-6).all() and (weights != 1).any()
    assert scored.rollout.metrics["rollout/engine_kl"] > 0
    # The trainer's own log-probs are what the update's ratio starts from.
    trainer = module.scorer.logprobs(rollout).logprobs
    assert torch.allclose(rollout.old_logprobs[mask], trainer[mask], atol=1e-5)
    from align.modules.learner import RLBatch

    advantages = torch.linspace(-1, 1, len(rollout))
    batch = RLBatch.from_rollout(rollout, advantages)
    assert torch.allclose(batch.advantages, advantages[:, None] * rollout.correction_weights)


def test_a_sequence_level_loss_needs_sequence_level_weights():
    with pytest.raises(AlignConfigError, match=r"^model\.sampling\.correction\.level: policy_loss\.name gspo"):
        grpo(policy_loss=PolicyLoss(name="gspo"))
    grpo(policy_loss=PolicyLoss(name="gspo"), sampling=vllm(correction=EngineCorrection(level="sequence")))
    grpo(policy_loss=PolicyLoss(name="gmpo"), sampling=vllm(correction=EngineCorrection(mode="none")))


def test_ppo_with_a_critic_steps_on_the_engines_rollouts():
    module = PPOModule(
        policy=PolicyModel("tiny-sort", critic=CriticSettings()),
        rewards=[length_reward],
        sampling=vllm(),
        group_size=2,
        updates=Updates(max_grad_norm=None),
        log_entropy=False,
        kl=KLPenalty(coef=0.05, placement="reward"),
    )
    module.setup("fit")
    opt = standalone(module, lr=1e-3)
    torch.manual_seed(0)
    module.training_step(prompt_batch(module.policy), 0)
    assert opt.steps >= 1 and module.last_metrics["rollout/engine_kl"] < 1e-6


def test_multi_turn_episodes_and_a_lightning_fit_on_the_engine(tmp_path):
    from test_multiturn import Rounds, loader

    from align.rollout.envs.chat import EnvironmentSpec

    module = grpo(
        environment=EnvironmentSpec(Rounds, max_turns=2, max_tokens=40),
        rewards=None,
        sampling=vllm(max_new_tokens=8),
        updates=Updates(minibatches=2),
    )
    cpu_trainer(max_steps=4, logger=CSVLogger(str(tmp_path), name="", version=""), log_every_n_steps=1).fit(
        module, train_dataloaders=loader(module.policy)
    )
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    logged = [r for r in rows if r.get("rollout/engine_kl")]
    assert len(logged) == 2 and all(float(r["rollout/engine_kl"]) < 1e-6 for r in logged)
    assert all(float(r["rollout/turns"]) >= 1 for r in logged) and all(r.get("time/engine_sync_s") for r in logged)
