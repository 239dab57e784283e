"""Every on-policy RL module trains on multi-turn episodes (``model.environment``) through a real trainer: GRPO,
RLOO, PPO (each turn's reward on its last token before GAE), TRPO and online DPO, with the episode metrics logged
to CSV; a single-turn config keeps working without an environment."""

import csv

import pytest
import torch
from _helpers import cpu_trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from align.core.advantages import gae
from align.data.chat import ChatEncoder
from align.data.prompts import PromptBatch
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.grpo import GRPOModule
from align.modules.online_dpo import OnlineDPOModule
from align.modules.options import GAE, GroupAdvantages, KLPenalty, PolicyLoss, Updates
from align.modules.ppo import PPOModule
from align.modules.trpo import TRPOModule
from align.rollout.engine import SamplingConfig
from align.rollout.envs.chat import EnvironmentSpec, EnvStep


class Rounds:
    """Two rounds; reward 1 for a reply of two or more words, on the turn it answers."""

    def reset(self, row):
        self.turn = 0
        return row["messages"]

    def step(self, message):
        self.turn += 1
        reward = float(len(message["content"].split()) >= 2)
        if self.turn == 2:
            return EnvStep([], reward, True, {"rounds": 1})
        return EnvStep([{"role": "user", "content": "sort: e b"}], reward, False, {"rounds": 1})


SPEC = EnvironmentSpec(Rounds, max_turns=2, max_tokens=40)
PROMPTS = ["sort: d a c", "sort: b a", "sort: c c a b", "sort: j e"]


def loader(policy, n=2):
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    encode = ChatEncoder(policy.tokenizer).prompt_ids
    batches = [PromptBatch([encode(m) for m in messages], list(PROMPTS), {}, messages) for _ in range(n)]
    return DataLoader(batches, batch_size=None)


def fit(module, tmp_path, steps=2):
    logger = CSVLogger(str(tmp_path), name="", version="")
    cpu_trainer(max_steps=steps, logger=logger, log_every_n_steps=1).fit(
        module, train_dataloaders=loader(module.policy)
    )
    return list(csv.DictReader(open(tmp_path / "metrics.csv")))


COMMON = dict(environment=SPEC, sampling=SamplingConfig(max_new_tokens=8), log_entropy=False)


@pytest.mark.parametrize("estimator, loss", [("grpo", "clip"), ("rloo", "cispo"), ("reinforce_pp_baseline", "gmpo")])
def test_group_estimators_train_on_episodes_and_log_the_episode_metrics(tmp_path, estimator, loss):
    torch.manual_seed(0)
    module = GRPOModule(
        policy=PolicyModel("tiny-sort"),
        group_size=4,
        kl=KLPenalty(coef=0.05),
        advantages=GroupAdvantages(estimator=estimator),
        policy_loss=PolicyLoss(name=loss),
        **COMMON,
    )
    before = [p.detach().clone() for p in module.policy.parameters()]
    rows = fit(module, tmp_path)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    logged = [r for r in rows if r.get("rollout/turns")]
    assert len(logged) == 2
    for row in logged:
        assert 1.0 <= float(row["rollout/turns"]) <= 2.0
        assert float(row["rollout/environment_tokens"]) > 0
        assert float(row["rollout/rounds"]) == float(row["rollout/turns"])
        assert 0.0 <= float(row["rollout/reward/env"]) <= 2.0 and float(row["time/env_s"]) >= 0
        assert float(row["train/kl"]) >= 0


def test_ppo_places_each_turns_reward_on_its_last_token_before_gae(tmp_path):
    torch.manual_seed(1)
    module = PPOModule(
        policy=PolicyModel("tiny-sort", critic=CriticSettings()),
        group_size=2,
        kl=KLPenalty(coef=0.0, placement="reward"),
        gae=GAE(gamma=1.0, lam=1.0, whiten_advantages=False),
        updates=Updates(max_grad_norm=None),
        **COMMON,
    )
    assert module.sampler.reward.names == [] and module.needs_reference is False
    batch = next(iter(loader(module.policy, 1)))
    data = module.make_batch(module.sampler.sample(batch))
    assert data.rewards.shape == data.response_mask.shape
    # gamma = lam = 1 and values taken away: the advantage of a token is the reward of its turn and every later
    # turn; an environment token has none.
    torch.testing.assert_close(gae(data.rewards, data.values, data.response_mask, 1.0, 1.0)[0], data.advantages)
    returns_to_go = data.rewards.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(
        data.advantages + data.values, torch.where(data.response_mask, returns_to_go, torch.zeros_like(returns_to_go))
    )
    assert (data.rewards[~data.response_mask] == 0).all()
    assert data.scores.abs().sum() == 0  # no sequence-level reward: the environment's are all per turn
    assert float(data.rewards.sum(dim=1).mean()) == pytest.approx(data.metrics["rollout/reward/env"])
    rows = fit(module, tmp_path)
    assert any(r.get("train/value_loss") for r in rows)


def test_trpo_and_online_dpo_train_on_episodes(tmp_path):
    torch.manual_seed(2)
    trpo = TRPOModule(policy=PolicyModel("tiny-sort", critic=CriticSettings(kind="separate")), group_size=2, **COMMON)
    rows = fit(trpo, tmp_path / "trpo", steps=1)
    assert any(r.get("rollout/turns") for r in rows)
    online = OnlineDPOModule(policy=PolicyModel("tiny-sort"), group_size=4, **COMMON)
    assert online.sampler.reward.names == []
    rows = fit(online, tmp_path / "online_dpo", steps=1)
    assert any(r.get("rollout/turns") for r in rows)


class FirstStepBonus:
    """Reports ``info={"bonus": 1}`` in the first training step's episodes only (one step is 4 prompts x 2)."""

    resets = 0

    def reset(self, row):
        FirstStepBonus.resets += 1
        return row["messages"]

    def step(self, message):
        return EnvStep([], 1.0, True, {"bonus": 1} if FirstStepBonus.resets <= 8 else {})


def test_an_info_key_no_episode_of_a_step_reports_is_absent_from_that_steps_row(tmp_path):
    FirstStepBonus.resets = 0
    torch.manual_seed(3)
    module = GRPOModule(
        policy=PolicyModel("tiny-sort"),
        group_size=2,
        log_entropy=False,
        environment=EnvironmentSpec(FirstStepBonus, max_turns=1, max_tokens=16),
        sampling=SamplingConfig(max_new_tokens=4),
    )
    rows = fit(module, tmp_path)
    train = [r for r in rows if r.get("rollout/reward_mean")]
    assert [(r["step"], r["rollout/bonus"]) for r in train] == [("0", "1.0"), ("1", "")]
