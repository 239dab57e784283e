"""Rewards to advantages: KL shaping, GAE, group-relative and leave-one-out baselines.

* :func:`shape_rewards`: the per-token PPO-RLHF reward of Ziegler et al. 2019
  (arXiv 1909.08593) and Ouyang et al. 2022 (arXiv 2203.02155): ``-kl_coef *
  KL`` on every response token, plus the sequence score on the last valid token.
* :func:`gae`: generalized advantage estimation, Schulman et al. 2015
  (arXiv 1506.02438).
* :func:`group_advantages`: GRPO, Shao et al. 2024 (arXiv 2402.03300); with
  ``scale="none"`` the unscaled variant of Dr. GRPO, Liu et al. 2025
  (arXiv 2503.20783).
* :func:`rloo_advantages`: REINFORCE leave-one-out, Ahmadian et al. 2024
  (arXiv 2402.14740).
* :func:`reinforce_pp_advantages`: REINFORCE++, Hu 2025 (arXiv 2501.03262),
  and its variant with a group baseline (REINFORCE++-baseline).

Departures and choices:

* GAE bootstraps with 0 after the last valid token of a response, whatever the
  value head says at padding. A masked position inside a response (a hole in
  the mask) is skipped, not treated as a zero-reward step: discounting carries
  across it. Returns are computed from the *unwhitened* advantages; whitening
  is left to the caller (:func:`align.core.masks.masked_whiten`, advantages only).
* GRPO divides by the unbiased (Bessel-corrected, ``n - 1``) standard deviation
  of the group, as ``torch.std`` does. The paper writes ``std`` without saying
  which. A group whose std is at most ``eps`` gets exactly zero advantage: the
  std is compared with ``eps`` instead of being added to the denominator.
  Rewards are first shifted by the first reward of their group, so a group of
  equal rewards has a std of exactly 0 (rounding in a float32 mean would
  otherwise leave a std of order 1e-7 times the reward, which for rewards of
  a few hundred is above the default eps).
* All functions here return tensors detached from the graph: advantages and
  returns are targets, never differentiated through.
"""

from __future__ import annotations

import torch

from align.core.kl import kl_estimate
from align.core.masks import last_valid_index
from align.core.stats import AllReduce, identity, whiten

__all__ = [
    "shape_rewards",
    "per_token_rewards",
    "gae",
    "group_view",
    "group_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "returns_to_go",
    "GROUP_SCALES",
]


@torch.no_grad()
def shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float | torch.Tensor,
    kind: str = "k1",
    clamp: float = 20.0,
    token_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards with a KL penalty and the score at the last valid token.

    Args:
        scores: ``(B,)`` sequence rewards.
        logprobs: ``(B, T)`` policy log-probs of the sampled tokens.
        ref_logprobs: ``(B, T)`` reference log-probs of the same tokens.
        mask: ``(B, T)`` response mask.
        kl_coef: KL penalty coefficient (for example ``controller.value``).
        kind: KL estimator, see :func:`align.core.kl.kl_estimate`.
        clamp: log-ratio clamp, see :func:`align.core.kl.kl_estimate`.
        token_rewards: ``(B, T)`` rewards already placed on tokens, added where ``mask`` is valid (a multi-turn
            episode's environment reward of each turn, at the turn's last token); None: none.

    Returns:
        ``rewards`` ``(B, T)`` and ``kl`` ``(B, T)``, both 0 at masked
        positions. A row with no valid token receives no score at all.
    """
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            "shape_rewards: logprobs, ref_logprobs and mask must share one (B, T) shape, got "
            f"{tuple(logprobs.shape)}, {tuple(ref_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"shape_rewards: scores must be (B,) = {tuple(logprobs.shape[:1])}, got {tuple(scores.shape)}")
    if token_rewards is not None and token_rewards.shape != mask.shape:
        raise ValueError(
            f"shape_rewards: token_rewards must be (B, T) = {tuple(mask.shape)}, got {tuple(token_rewards.shape)}"
        )
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    kl = torch.where(valid, kl_estimate(logprobs, ref_logprobs, kind=kind, clamp=clamp), zero)  # (B, T)
    return per_token_rewards(scores, kl, valid, kl_coef, token_rewards), kl


@torch.no_grad()
def per_token_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float | torch.Tensor,
    token_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`shape_rewards` from a KL estimate already computed: ``-kl_coef * kl`` on every valid token, plus
    ``token_rewards`` where valid, plus each row's score on its last valid token. ``(B,), (B, T) x 2 -> (B, T)``, 0 at
    masked positions."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    per_token = -kl_coef * torch.where(valid, kl, zero)
    if token_rewards is not None:
        per_token = per_token + torch.where(valid, token_rewards.to(per_token.dtype), zero)
    return _add_terminal(per_token, scores, valid)


def _add_terminal(rewards: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # (B, T) rewards plus each row's (B,) score at its last valid token; a row with no valid token gets none.
    last = last_valid_index(valid)  # (B,), -1 for an empty row
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    bonus = torch.where(last >= 0, scores.to(rewards.dtype), zero)  # (B,)
    return rewards.scatter_add(1, last.clamp(min=0).unsqueeze(1), bonus.unsqueeze(1))


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over response tokens (arXiv 1506.02438).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and
    ``A_t = delta_t + gamma * lam * A_{t+1}``, where ``t + 1`` is the next
    *valid* position and ``V`` and ``A`` after the last valid token are 0.

    Args:
        rewards: ``(B, T)`` per-token rewards (for example from :func:`shape_rewards`).
        values: ``(B, T)`` value estimates ``V(s_t)``.
        mask: ``(B, T)`` response mask.

    Returns:
        ``advantages`` ``(B, T)`` unwhitened and ``returns = advantages + values``
        ``(B, T)``; both 0 at masked positions. Masked rewards and values never
        influence any output.
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            "gae: rewards, values and mask must share one (B, T) shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.bool()
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    rewards = torch.where(valid, rewards.to(dtype), zero)
    values = torch.where(valid, values.to(dtype), zero)
    b, t_max = rewards.shape
    advantages = torch.zeros_like(rewards)  # (B, T)
    next_value = torch.zeros(b, dtype=dtype, device=rewards.device)  # (B,)
    next_adv = torch.zeros(b, dtype=dtype, device=rewards.device)  # (B,)
    for t in reversed(range(t_max)):
        m = valid[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(m, adv, zero)
        next_adv = torch.where(m, adv, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
    returns = torch.where(valid, advantages + values, zero)
    return advantages, returns


def group_view(rewards: torch.Tensor, group_size: int, fn: str) -> torch.Tensor:
    """``(B*G,) -> (B, G)``: each prompt's ``group_size`` consecutive rewards as one row (as float), or a ValueError
    naming ``fn`` when the rewards are not 1-D or do not split into whole groups."""
    if rewards.dim() != 1:
        raise ValueError(f"{fn}: rewards must be 1-D (B*G,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"{fn}: {rewards.numel()} rewards cannot be split into groups of group_size={group_size}; "
            "rewards must be laid out (B*G,) with each prompt's G completions consecutive"
        )
    if not rewards.is_floating_point():
        rewards = rewards.float()
    return rewards.view(-1, group_size)  # (B, G)


def _shift(grouped: torch.Tensor) -> torch.Tensor:
    # Shift by each group's first reward: a constant group becomes exactly 0.
    # Without the shift, the rounding of the mean of a float32 group such as
    # [123.456] * 5 leaves a std of ~1e-5, which passes an epsilon test and
    # would be divided by. Centring and variances are shift-invariant.
    return grouped - grouped[:, :1]


def _unbiased_std(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    # Bessel-corrected std along ``dim`` that is 0 (not NaN) for a single element.
    n = x.shape[dim]
    centered = x - x.mean(dim, keepdim=True)
    return (centered.square().sum(dim, keepdim=keepdim) / max(n - 1, 1)).sqrt()


def _global_unbiased_std(x: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
    # The Bessel-corrected std of x laid end to end over every rank. x is shifted first, as _shift shifts a group,
    # so a constant batch gives exactly 0: by the mean of the ranks' first elements, the same on every rank (one
    # process: x's first element).
    world, first = all_reduce(torch.stack([torch.ones((), dtype=x.dtype, device=x.device), x.reshape(-1)[0]]))
    x = x - first / world
    total: torch.Tensor
    n: torch.Tensor
    total, n = all_reduce(torch.stack([x.sum(), torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device)]))
    squares = all_reduce((x - total / n).square().sum())
    return (squares / (n - 1).clamp(min=1)).sqrt()


GROUP_SCALES = ("group", "batch", "none")

SIGNAL_EPS = 1e-6
"""A group carries a learning signal when its rewards differ by more than this: GRPO's advantages are exactly 0 for a
group whose std is at most it, and dynamic sampling keeps only groups with a signal (:func:`has_signal`)."""


def has_signal(rewards: torch.Tensor, group_size: int, eps: float = SIGNAL_EPS) -> torch.Tensor:
    """``(B,)`` bool: whether each group of ``group_size`` consecutive rewards ``(B*G,)`` carries a learning signal,
    i.e. whether its unbiased std (computed as :func:`group_advantages` computes it) exceeds ``eps``. A group this
    rejects gets exactly zero advantage from :func:`group_advantages`, and one it keeps a non-zero one."""
    grouped = _shift(group_view(rewards, group_size, "has_signal"))
    return _unbiased_std(grouped, dim=1) > eps


@torch.no_grad()
def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: str = "group",
    eps: float = SIGNAL_EPS,
    all_reduce: AllReduce = identity,
) -> torch.Tensor:
    """Group-relative advantages of GRPO (arXiv 2402.03300).

    ``A_i = (r_i - mean_group(r)) / s`` where ``s`` is, by ``scale``:

    * ``"group"``: the unbiased std of the group (GRPO);
    * ``"batch"``: the unbiased std of the whole batch: the rewards passed in on every data-parallel rank
      (``all_reduce`` sums over the ranks; the default is one process);
    * ``"none"``: 1, no scaling (Dr. GRPO, arXiv 2503.20783).

    A group whose unbiased std is ``<= eps`` gets exactly 0 for every scale,
    never NaN. Likewise when the batch std is ``<= eps`` under ``"batch"``. ``eps`` is
    :data:`SIGNAL_EPS`, the same test as dynamic sampling's (:func:`has_signal`).

    Args:
        rewards: ``(B*G,)``, the G completions of each prompt consecutive.
        group_size: G.

    Returns:
        ``(B*G,)`` advantages, one per completion (broadcast over its tokens).
    """
    if scale not in GROUP_SCALES:
        raise ValueError(f"group_advantages: unknown scale {scale!r}; expected one of {list(GROUP_SCALES)}")
    raw = group_view(rewards, group_size, "group_advantages")  # (B, G)
    grouped = _shift(raw)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (B, G)
    group_std = _unbiased_std(grouped, dim=1, keepdim=True)  # (B, 1)
    constant_group = group_std <= eps  # (B, 1)
    if scale == "group":
        scaled = centered / group_std.clamp(min=eps)
    elif scale == "batch":
        batch_std = _global_unbiased_std(raw, all_reduce)
        scaled = torch.where(batch_std > eps, centered / batch_std.clamp(min=eps), torch.zeros_like(centered))
    else:
        scaled = centered
    return torch.where(constant_group, torch.zeros_like(scaled), scaled).reshape(-1)


@torch.no_grad()
def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (arXiv 2402.14740).

    ``A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r))`` within
    each group of ``group_size`` consecutive rewards. A group whose rewards are
    all equal gets exactly 0: rewards are shifted by the group's first reward
    before any sum, so no rounding is left to leak.

    Args:
        rewards: ``(B*G,)``.
        group_size: G >= 2 (with one sample there is no other sample to
            build the baseline from).

    Returns:
        ``(B*G,)``.
    """
    if group_size < 2:
        raise ValueError(f"rloo_advantages: group_size must be >= 2 for a leave-one-out baseline, got {group_size}")
    grouped = _shift(group_view(rewards, group_size, "rloo_advantages"))  # (B, G); constant -> 0
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # (B, G)
    return (grouped - others_mean).reshape(-1)


@torch.no_grad()
def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Undiscounted returns ``G_t = sum_{s >= t} r_s`` over the valid tokens of each row, ``(B, T) -> (B, T)``.

    Masked rewards count as 0 and masked outputs are 0. (GAE with ``gamma = lam = 1`` and zero values gives
    the same numbers, one token at a time.)
    """
    if rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"returns_to_go: rewards and mask must share one (B, T) shape, got "
            f"{tuple(rewards.shape)}, {tuple(mask.shape)}"
        )
    valid = mask.bool()
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    kept = torch.where(valid, rewards, zero)
    return torch.where(valid, kept.flip(1).cumsum(1).flip(1), zero)


@torch.no_grad()
def reinforce_pp_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float | torch.Tensor = 0.0,
    group_size: int | None = None,
    all_reduce: AllReduce = identity,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ advantages (Hu 2025, arXiv 2501.03262), per token.

    The per-token reward is ``r_t = -kl_coef * kl_t``, plus the sequence reward at the last valid token
    (:func:`shape_rewards`); the advantage is the return-to-go with gamma 1,
    ``A_t = r - kl_coef * sum_{s >= t} kl_s`` (:func:`returns_to_go`), whitened with the mean and unbiased std
    of every valid token of the global batch (:func:`align.core.stats.whiten` with ``all_reduce``).

    With ``group_size`` (REINFORCE++-baseline), each reward first has its group's mean subtracted
    (:func:`group_advantages` with ``scale="none"``: a group of equal rewards becomes exactly 0 before the KL
    term). The batch whitening then re-centres: a token of such a group gets ``-mean / std`` of the batch,
    as in the paper, not 0.

    Args:
        rewards: ``(N,)`` sequence rewards; with ``group_size``, each prompt's G completions consecutive.
        mask: ``(N, R)`` response mask.
        kl: ``(N, R)`` per-token KL estimate of the sampled tokens, or None for no KL term in the reward.
        kl_coef: Weight of the KL penalty.
        group_size: G for the group-mean baseline; None: no baseline (plain REINFORCE++).
        all_reduce: Sums over the data-parallel ranks, for the whitening statistics.
        eps: Added to the variance in the whitening.

    Returns:
        ``(N, R)`` advantages, 0 at masked positions.
    """
    if mask.dim() != 2 or rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"reinforce_pp_advantages: rewards must be (N,) and mask (N, R), got "
            f"{tuple(rewards.shape)} and {tuple(mask.shape)}"
        )
    if kl is not None and kl.shape != mask.shape:
        raise ValueError(f"reinforce_pp_advantages: kl must be (N, R) = {tuple(mask.shape)}, got {tuple(kl.shape)}")
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    if group_size is not None:
        rewards = group_advantages(rewards, group_size, scale="none")  # (N,) r - mean of its group
    valid = mask.bool()
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    per_token = (
        torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
        if kl is None
        else torch.where(valid, -kl_coef * kl.to(rewards.dtype), zero)
    )  # (N, R)
    returns = returns_to_go(_add_terminal(per_token, rewards, valid), valid)  # (N, R)
    return whiten(returns, valid, eps=eps, all_reduce=all_reduce)
