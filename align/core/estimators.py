"""The advantage estimators: the ``ADVANTAGE_ESTIMATORS`` table, rewards in, advantages out.

Every estimator takes one :class:`AdvantageInputs` (everything any of them needs: the rewards, the response mask, the
group size, the KL term that goes into the reward, a critic's values, the data-parallel all-reduce) and returns
:class:`Advantages`, so a module does one lookup, ``ADVANTAGE_ESTIMATORS[name](inputs)``, whatever the estimator
(docs/architecture.md, "Add an advantage estimator"). Rows, each a thin composition of the functions of
:mod:`align.core.advantages` that carry the pinned-value tests:

* ``grpo``: the group baseline, scaled by the group's, the batch's or no std (GRPO, arXiv 2402.03300; Dr. GRPO,
  arXiv 2503.20783);
* ``rloo``: the leave-one-out mean of the group (RLOO, arXiv 2402.14740);
* ``reinforce_pp``: per-token returns with the per-token KL in the reward, whitened over the global batch
  (REINFORCE++, arXiv 2501.03262); ``reinforce_pp_baseline``: the group mean subtracted first;
* ``gae``: KL-shaped per-token rewards with the score on the last valid token, then GAE over a critic's values,
  advantages whitened (PPO-RLHF; arXiv 1506.02438, 1909.08593).

``grpo`` and ``rloo`` give one advantage per sequence ``(N,)``; the others one per token ``(N, R)``. With ``kl`` set,
the KL goes into the rewards: summed over each completion's tokens for the sequence estimators, per token for the
others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from align.core.advantages import gae, group_advantages, per_token_rewards, reinforce_pp_advantages, rloo_advantages
from align.core.masks import masked_sum
from align.core.stats import AllReduce, identity, whiten

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageInputs", "Advantages", "VALUE_ESTIMATORS"]


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator may read. ``N`` rows (a prompt's ``group_size`` rows consecutive), ``R``
    response tokens."""

    rewards: torch.Tensor  # (N,) each completion's total reward (PPO: its score after the score options)
    mask: torch.Tensor  # (N, R) response mask
    group_size: int = 1
    kl: torch.Tensor | None = None  # (N, R) KL estimate of the sampled tokens to put into the rewards; None: none
    kl_coef: float | torch.Tensor = 0.0
    std_scale: str = "group"  # grpo: "group", "batch" or "none"
    token_rewards: torch.Tensor | None = None  # (N, R) rewards already on tokens (a multi-turn turn's reward): gae
    values: torch.Tensor | None = None  # (N, R) V(s_t) at rollout time: gae
    gamma: float = 1.0  # gae
    lam: float = 0.95  # gae
    whiten: bool = True  # gae: whiten the advantages over the valid tokens of every rank
    all_reduce: AllReduce = identity  # sums over the data-parallel ranks


class Advantages(NamedTuple):
    """An estimator's output; only ``advantages`` is always set."""

    advantages: torch.Tensor  # (N,) one per completion, or (N, R) per token
    returns: torch.Tensor | None = None  # (N, R) value targets: unwhitened advantages + values (gae)
    token_rewards: torch.Tensor | None = None  # (N, R) the per-token rewards the returns are built from (gae)
    raw: torch.Tensor | None = None  # (N, R) advantages before whitening (gae)


def _with_sequence_kl(x: AdvantageInputs) -> torch.Tensor:
    # (N,) rewards minus kl_coef times each completion's summed KL estimate.
    return x.rewards if x.kl is None else x.rewards - x.kl_coef * masked_sum(x.kl, x.mask, dim=1)


def grpo(x: AdvantageInputs) -> Advantages:
    return Advantages(group_advantages(_with_sequence_kl(x), x.group_size, x.std_scale, all_reduce=x.all_reduce))


def rloo(x: AdvantageInputs) -> Advantages:
    return Advantages(rloo_advantages(_with_sequence_kl(x), x.group_size))


def reinforce_pp(x: AdvantageInputs) -> Advantages:
    return Advantages(reinforce_pp_advantages(x.rewards, x.mask, x.kl, x.kl_coef, None, all_reduce=x.all_reduce))


def reinforce_pp_baseline(x: AdvantageInputs) -> Advantages:
    return Advantages(
        reinforce_pp_advantages(x.rewards, x.mask, x.kl, x.kl_coef, x.group_size, all_reduce=x.all_reduce)
    )


@torch.no_grad()
def generalized(x: AdvantageInputs) -> Advantages:
    if x.values is None:
        raise ValueError("gae: needs the critic's values (AdvantageInputs.values)")
    kl = torch.zeros_like(x.values) if x.kl is None else x.kl
    rewards = per_token_rewards(x.rewards, kl, x.mask, x.kl_coef, x.token_rewards)  # (N, R)
    raw, returns = gae(rewards, x.values, x.mask, x.gamma, x.lam)
    advantages = whiten(raw, x.mask, all_reduce=x.all_reduce) if x.whiten else raw
    return Advantages(advantages, returns, rewards, raw)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageInputs], Advantages]] = {
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "gae": generalized,
}
"""The advantage estimators by name: ``ADVANTAGE_ESTIMATORS[name](inputs) -> Advantages``."""

VALUE_ESTIMATORS = frozenset({"gae"})
"""Rows that need a critic's values (PPO and TRPO's); the critic-free modules refuse them."""
