"""What the distributed tests run: small SFT / DPO / GRPO setups, and programs with known answers (an SFT step,
a GRPO update on fixed rollout rows, an adaptive-KL update) that a 1-process run reproduces in the test itself.

Imported by ``_worker.py`` (in each rank) and by the tests (for the 1-process references).
"""

from __future__ import annotations

import os
from functools import partial

import lightning as L
import torch

from align.core import stats
from align.core.kl import AdaptiveKLController
from align.data import SFTDataModule
from align.data.preference import PreferenceDataModule
from align.data.prompts import PromptDataModule
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules import SFTModule
from align.modules.dpo import DPOModule
from align.modules.grpo import GRPOModule
from align.modules.learner import RLBatch
from align.modules.online_dpo import OnlineDPOModule
from align.modules.options import GroupAdvantages, KLPenalty, Updates, ValueTraining
from align.modules.ppo import PPOModule
from align.rollout.engine import SamplingConfig
from align.rollout.rewards import RewardSpec

SFT_DATA = "align:sort/sft/train.jsonl"
PREF_DATA = "align:sort/preference/train.jsonl"
SFT_VAL = "align:sort/sft/validation.jsonl"
PREF_VAL = "align:sort/preference/validation.jsonl"
PROMPT_DATA = "align:sort/prompts/train.jsonl"
PROMPT_VAL = "align:sort/prompts/validation.jsonl"


# ---------------------------------------------------------------------------------------------------- smoke setups
def sft_setup():
    module = SFTModule(PolicyModel("tiny", seed=1), optimizer=partial(torch.optim.AdamW, lr=1e-3))
    return module, SFTDataModule(train_files=SFT_DATA, val_files=SFT_VAL, batch_size=4, max_length=64)


def dpo_setup():
    # A live reference: under FSDP2 and ZeRO-3 it is sharded like the policy.
    module = DPOModule(PolicyModel("tiny", seed=1), optimizer=partial(torch.optim.AdamW, lr=1e-3), beta=0.1)
    return module, PreferenceDataModule(train_files=PREF_DATA, val_files=PREF_VAL, batch_size=4, max_length=64)


def grpo_setup():
    module = GRPOModule(
        PolicyModel("tiny-sort"),
        rewards=[RewardSpec("align.rewards.sort_exact_match")],
        group_size=4,
        sampling=SamplingConfig(max_new_tokens=8, temperature=1.0),
        kl=KLPenalty(coef=0.02),
        log_entropy=False,
        optimizer=partial(torch.optim.AdamW, lr=1e-4),
    )
    return module, PromptDataModule(train_files=PROMPT_DATA, val_files=PROMPT_VAL, batch_size=2, val_batch_size=4)


def ppo_setup():
    # A separate critic (the shipped reward model's backbone) and a live reference, all sharded under ZeRO-3. The
    # first rollout trains the critic alone: a backward in which no policy parameter takes part.
    module = PPOModule(
        PolicyModel("tiny-sort", critic=CriticSettings(kind="separate", model="tiny-sort-rm")),
        rewards=[RewardSpec("align.rewards.sort_exact_match")],
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=8, temperature=1.0),
        value=ValueTraining(warmup_rollouts=1),
        updates=Updates(epochs=1),
        log_entropy=False,
        optimizer=partial(torch.optim.AdamW, lr=1e-4),
    )
    return module, PromptDataModule(train_files=PROMPT_DATA, val_files=PROMPT_VAL, batch_size=2, val_batch_size=4)


def episodes_setup():
    # Multi-turn GRPO: the ranks' episodes end after different numbers of turns (a turn cut at 6 tokens ends its
    # episode), so under ZeRO-3 a rank whose episodes have all ended keeps decoding a placeholder row.
    from align.rollout.envs.chat import EnvironmentSpec

    module = GRPOModule(
        PolicyModel("tiny-sort"),
        rewards=[],
        group_size=4,
        log_entropy=False,
        environment=EnvironmentSpec("align.rollout.envs.tasks.SortRounds", max_turns=2, max_tokens=40),
        sampling=SamplingConfig(max_new_tokens=6, temperature=1.0),
        kl=KLPenalty(coef=0.02),
        optimizer=partial(torch.optim.AdamW, lr=1e-4),
    )
    return module, PromptDataModule(
        train_files="align:sort/rounds/train.jsonl",
        val_files="align:sort/rounds/validation.jsonl",
        batch_size=2,
        val_batch_size=4,
    )


def _uneven_preferences(prompts, completions, **columns):
    """Rank 1 ranks the completions of every prompt; rank 0 only those of its first prompt (the rest tie)."""
    group = len(completions) // len(set(prompts))
    decisive = len(completions) if os.environ.get("RANK", "0") == "1" else group
    return [float(i % group) if i < decisive else 0.0 for i in range(len(completions))]


def online_dpo_setup():
    # The ranks keep different numbers of decisive pairs (1 and 4) and update in micro-batches of one pair: every
    # rank must still run the same passes.
    module = OnlineDPOModule(
        PolicyModel("tiny-sort"),
        rewards=[RewardSpec(_uneven_preferences)],
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=8, temperature=1.0),
        updates=Updates(micro_batch_size=1),
        log_entropy=False,
        optimizer=partial(torch.optim.AdamW, lr=1e-4),
    )
    return module, PromptDataModule(train_files=PROMPT_DATA, val_files=PROMPT_VAL, batch_size=4, val_batch_size=4)


SETUPS = {
    "sft": sft_setup,
    "dpo": dpo_setup,
    "grpo": grpo_setup,
    "ppo": ppo_setup,
    "episodes": episodes_setup,
    "online_dpo": online_dpo_setup,
}
RL = ("grpo", "ppo", "episodes", "online_dpo")


def algorithms(strategy: str) -> tuple[str, ...]:
    """What a strategy's job trains: every strategy SFT, DPO and GRPO; ZeRO-3 also PPO; DDP and ZeRO-3 also
    multi-turn GRPO (ZeRO-3: ranks kept in step across turns) and online DPO (ranks with uneven pairs)."""
    return (
        ("sft", "dpo", "grpo")
        + (("ppo",) if strategy == "zero3" else ())
        + (("episodes", "online_dpo") if strategy in ("ddp", "zero3") else ())
    )


# ---------------------------------------------------------------------------------------------------- SFT equivalence
def sft_equivalence_run(trainer: L.Trainer, batch_size: int, train_files: str = SFT_DATA) -> SFTModule:
    """One SGD step of SFT, no clipping."""
    module = SFTModule(PolicyModel("tiny", seed=1), optimizer=partial(torch.optim.SGD, lr=0.5))
    data = SFTDataModule(train_files=train_files, val_files=None, batch_size=batch_size, max_length=64, shuffle=False)
    trainer.fit(module, data)
    return module


def first_distributed_rows(path, rows: int = 4, seed: int = 0) -> str:
    """Write to ``path`` the rows of the bundled SFT data that the first optimizer step of 2 ranks uses, and
    return the path. Lightning always shards a training loader with a *shuffled* ``DistributedSampler``
    (seed ``PL_GLOBAL_SEED``, default 0; ``data.shuffle`` only applies to one process): rank ``r`` takes
    ``perm[r::2]``, so a step of 2 x 2 rows covers ``perm[:4]``."""
    import json

    from align.data.io import read_rows

    data = read_rows(SFT_DATA)
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
    with open(path, "w") as f:
        for i in perm[:rows]:
            f.write(json.dumps(data[i]) + "\n")
    return str(path)


# ---------------------------------------------------------------------------------------------------- GRPO update
ROWS, PROMPT_LEN, RESPONSE_LEN = 8, 5, 7


def fixed_rollout_rows(vocab: int) -> RLBatch:
    """Eight rollout rows with very different response lengths (1 to 7 tokens), so a per-rank token mean differs
    from the global one. Left-padded prompts of 2-5 tokens."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (ROWS, PROMPT_LEN + RESPONSE_LEN), generator=g)
    prompt_lengths = torch.tensor([5, 3, 4, 2, 5, 5, 3, 4])
    response_lengths = torch.tensor([7, 1, 2, 6, 1, 3, 7, 2])
    attention = torch.zeros(ROWS, PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    response_mask = torch.zeros(ROWS, RESPONSE_LEN, dtype=torch.bool)
    for i in range(ROWS):
        attention[i, PROMPT_LEN - prompt_lengths[i] : PROMPT_LEN + response_lengths[i]] = 1
        response_mask[i, : response_lengths[i]] = True
    ids = ids.masked_fill(attention == 0, 0)
    advantages = torch.linspace(-1.0, 1.2, ROWS)[:, None].expand(ROWS, RESPONSE_LEN).clone()
    return RLBatch(ids, attention, response_mask, torch.zeros(ROWS, RESPONSE_LEN), advantages)


class FixedRowsGRPO(GRPOModule):
    """GRPO whose update runs on fixed rollout rows, split between ranks (rank ``r`` takes rows ``r::world``),
    instead of sampling: the parameters after one step must not depend on the number of ranks, and every rank
    feeds the same all-reduced KL to its adaptive controller."""

    def __init__(self, loss_aggregation: str = "token_mean", micro_batch_size: int | None = None):
        super().__init__(
            PolicyModel("tiny", seed=1),
            rewards=[RewardSpec(_zero_reward)],
            group_size=2,
            updates=Updates(loss_aggregation=loss_aggregation, micro_batch_size=micro_batch_size, max_grad_norm=None),
            log_entropy=False,
            optimizer=partial(torch.optim.SGD, lr=0.5),
        )
        self.kl_controller = AdaptiveKLController(init_kl_coef=0.1, target=0.05, horizon=100)
        self.kl_seen: list[float] = []
        # The RL modules' own controller update, fed the same per-token KL (its input is the per-sequence KL over
        # all ranks).
        self.ppo = [
            PPOModule(
                PolicyModel("tiny", critic=CriticSettings(), seed=1),
                rewards=[RewardSpec(_zero_reward)],
                kl=KLPenalty(coef=0.1, target=0.5, horizon=100.0, placement="reward"),
            )
        ]  # not a submodule

    def training_step(self, batch, batch_idx: int) -> None:
        rows = fixed_rollout_rows(self.policy.config.vocab_size)
        rank, world = self.global_rank, self.trainer.world_size
        mine = torch.arange(rank, ROWS, world)
        data = rows.select(mine)
        data = RLBatch(
            *(
                None if t is None else t.to(self.device)
                for t in (
                    data.input_ids,
                    data.attention_mask,
                    data.response_mask,
                    data.old_logprobs,
                    data.advantages,
                    data.ref_logprobs,
                )
            )
        )
        # A per-token "KL" that differs between ranks: the controller must see the mean over all ranks' tokens.
        kl = (data.input_ids[:, -data.response_length :] % 5).float() / 10.0  # (n, R)
        global_kl = float(stats.mean_var(kl, data.response_mask, all_reduce=self.all_reduce_sum)[0])
        self.kl_controller.update(global_kl, n_steps=ROWS)
        ppo = self.ppo[0]
        ppo.trainer = self.trainer
        ppo.update_kl_controller(kl * data.response_mask, data.response_mask)
        self.kl_seen = [global_kl, self.kl_controller.value, ppo.kl_controller.value]
        # Whitening over every rank's valid tokens (PPO advantages): this rank's rows of the global result.
        self.whitened = stats.whiten(kl * 3.0 - 0.2, data.response_mask, all_reduce=self.all_reduce_sum).tolist()
        # GRPO's advantages with std_scale batch: this rank's groups scaled by the std of every rank's rewards.
        rewards = BATCH_REWARDS.view(world, -1)[rank].to(self.device)
        self.advantages = GroupAdvantages(std_scale="batch")
        self.batch_scaled = self.estimate_advantages(rewards, None, torch.ones(len(rewards), 1)).tolist()
        self.update(data, self._loss)


BATCH_REWARDS = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 4.0, 0.0, 4.0])
"""Rewards of groups of 2 split between ranks in contiguous halves: each rank's own std differs from the batch's."""


def _zero_reward(prompts, completions, **columns):
    return [0.0] * len(completions)


def pooled_whitened() -> torch.Tensor:
    """What ``align.core.stats.whiten`` over 2 ranks must give on all rows together: ``masked_whiten`` on one process.
    (N, R)"""
    from align.core.masks import masked_whiten

    rows = fixed_rollout_rows(PolicyModel("tiny", seed=1).config.vocab_size)
    kl = (rows.input_ids[:, -rows.response_length :] % 5).float() / 10.0
    return masked_whiten(kl * 3.0 - 0.2, rows.response_mask)


def pooled_kl() -> float:
    """The KL the controller must receive: the token mean over all rows (what one process sees)."""
    rows = fixed_rollout_rows(PolicyModel("tiny", seed=1).config.vocab_size)
    kl = (rows.input_ids[:, -rows.response_length :] % 5).float() / 10.0
    return float((kl * rows.response_mask).sum() / rows.response_mask.sum())


class _OneBatch(L.LightningDataModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader([0], batch_size=1)


def grpo_equivalence_run(trainer: L.Trainer, **kwargs) -> FixedRowsGRPO:
    module = FixedRowsGRPO(**kwargs)
    trainer.fit(module, _OneBatch())
    return module


def flat_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in module.policy.model.named_parameters()}


def flat_params_init() -> dict[str, torch.Tensor]:
    """The parameters every program starts from."""
    return {n: p.detach().float().clone() for n, p in PolicyModel("tiny", seed=1).model.named_parameters()}
