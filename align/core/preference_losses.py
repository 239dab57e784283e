"""Preference losses on sequence log-probs: DPO and its variants, SimPO, ORPO, KTO, and the Bradley-Terry loss
of reward models; and online DPO's pairs of sampled completions (:func:`preference_pairs`).

Papers, one per variant:

* DPO: Rafailov et al. 2023 (arXiv 2305.18290); conservative DPO (label smoothing) from Mitchell's cDPO note on the
  same loss. IPO: Azar et al. 2023 (arXiv 2310.12036). Hinge: SLiC-HF, Zhao et al. 2023 (arXiv 2305.10425).
* SimPO: Meng et al. 2024 (arXiv 2405.14734).
* ORPO: Hong et al. 2024 (arXiv 2403.07691).
* KTO: Ethayarajh et al. 2024 (arXiv 2402.01306).
* Bradley-Terry reward-model loss with the optional margin of Llama 2, Touvron et al. 2023 (arXiv 2307.09288).
* Online DPO's pairs, the best against the worst completion of each prompt: Guo et al. 2024 (arXiv 2402.04792).

Departure: ``dpo_loss`` and ``simpo_loss`` take sequence log-probs as given; whether they are sums or per-token means
is the caller's choice (see ``dpo_loss``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from align.core.advantages import group_view

__all__ = [
    "DPO_LOSSES",
    "dpo_loss",
    "dpo_sigmoid_loss",
    "ipo_loss",
    "hinge_loss",
    "simpo_loss",
    "log1mexp",
    "orpo_loss",
    "kto_loss",
    "bradley_terry_loss",
    "preference_pairs",
    "PreferencePairs",
]


def dpo_sigmoid_loss(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (arXiv 2305.18290): ``-log sigmoid(beta * h)``.

    With ``label_smoothing = eps`` (conservative DPO, cDPO), the preference
    label is assumed flipped with probability ``eps``:
    ``-(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)``.
    """
    logits = beta * h
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def ipo_loss(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """IPO (arXiv 2310.12036): ``(h - 1 / (2 * beta))**2``, ``beta`` playing the paper's tau."""
    return (h - 1.0 / (2.0 * beta)).square()


def hinge_loss(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """SLiC-HF calibration loss (arXiv 2305.10425): ``relu(1 - beta * h)``."""
    return F.relu(1.0 - beta * h)


DPO_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": dpo_sigmoid_loss,
    "ipo": ipo_loss,
    "hinge": hinge_loss,
}


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Direct preference losses on sequence log-probs.

    ``h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)`` and
    the loss is ``DPO_LOSSES[loss_type](h, beta, label_smoothing)``.

    Inputs are ``(B,)`` sequence log-probs of the response tokens. The function
    uses them as given. For ``"sigmoid"`` and ``"hinge"`` they are usually sums
    over tokens, as in the papers. IPO's target margin ``1 / (2 beta)`` is an
    absolute number, so summed log-probs of long responses overshoot it easily;
    averaging the log-probs over response tokens keeps ``h`` on the scale of the
    margin, and that choice is the caller's.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``(B,)``; the
        rewards ``beta * (policy - ref)`` are detached.
    """
    try:
        fn = DPO_LOSSES[loss_type]
    except KeyError:
        raise ValueError(f"dpo_loss: unknown loss_type {loss_type!r}; expected one of {sorted(DPO_LOSSES)}") from None
    if beta <= 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo_loss: label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"dpo_loss: label_smoothing applies to loss_type='sigmoid' only, not {loss_type!r}")
    chosen_logratios = policy_chosen_logps - ref_chosen_logps.detach()  # (B,)
    rejected_logratios = policy_rejected_logps - ref_rejected_logps.detach()  # (B,)
    losses = fn(chosen_logratios - rejected_logratios, beta, label_smoothing)
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def simpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    beta: float = 2.0,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (arXiv 2405.14734): reference-free, length-normalised preference loss.

    ``-log sigmoid(beta * (logp_c / |y_c| - logp_r / |y_r|) - gamma)``.

    ``gamma`` is the target reward margin of the paper's objective, in reward
    units. Implementations that take a ``gamma_beta_ratio`` instead compute the
    same loss with ``gamma = gamma_beta_ratio * beta``; the defaults here
    (beta 2.0, gamma 1.0) correspond to a ratio of 0.5.

    Args:
        policy_chosen_logps: ``(B,)`` *summed* response log-probs of the chosen responses.
        policy_rejected_logps: ``(B,)`` *summed* response log-probs of the rejected responses.
        chosen_lengths: ``(B,)`` chosen response token counts; clamped to at least 1.
        rejected_lengths: ``(B,)`` rejected response token counts; clamped to at least 1.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each ``(B,)``; the
        rewards ``beta * logp / length`` are detached.
    """
    if beta <= 0:
        raise ValueError(f"simpo_loss: beta must be > 0, got {beta}")
    chosen = beta * policy_chosen_logps / chosen_lengths.clamp(min=1)  # (B,)
    rejected = beta * policy_rejected_logps / rejected_lengths.clamp(min=1)  # (B,)
    losses = -F.logsigmoid(chosen - rejected - gamma)
    return losses, chosen.detach(), rejected.detach()


_LOG_HALF = -0.6931471805599453  # log(1/2): where log1mexp switches formula


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation (Maechler 2012): ``log(-expm1(x))`` for ``x``
    near 0, ``log1p(-exp(x))`` below ``log(1/2)``. Each branch sees only its own range, so the branch not taken
    contributes no NaN gradient. ``x = 0`` gives ``-inf``."""
    near_zero = torch.log(-torch.expm1(torch.clamp(x, min=_LOG_HALF)))
    far = torch.log1p(-torch.exp(torch.clamp(x, max=_LOG_HALF)))
    return torch.where(x < _LOG_HALF, far, near_zero)


def orpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    lam: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO (arXiv 2403.07691): SFT plus an odds-ratio preference term, reference-free.

    With the length-normalised likelihood ``log P(y|x) = logp / |y|`` (the paper's Eq. 3) and
    ``odds(y|x) = P / (1 - P)``, so ``log odds = log P - log(1 - P)`` (:func:`log1mexp`):
    ``loss = -log P(y_w|x) + lam * -log sigmoid(log odds(y_w|x) - log odds(y_l|x))`` (Eqs. 6-7).

    The NLL term is each pair's per-token mean over its chosen response, so a batch's loss is a mean of
    per-pair losses. ``log P`` is clamped to at most ``-1e-6``: a response the model already gives probability
    one has infinite odds, and that term then has no gradient.

    Args:
        policy_chosen_logps: ``(B,)`` *summed* response log-probs of the chosen responses (with grad).
        policy_rejected_logps: ``(B,)`` *summed* response log-probs of the rejected responses (with grad).
        chosen_lengths: ``(B,)`` chosen response token counts; clamped to at least 1.
        rejected_lengths: ``(B,)`` rejected response token counts; clamped to at least 1.
        lam: the paper's lambda, the weight of the odds-ratio term (TRL's ``beta``).

    Returns:
        ``(losses, chosen_rewards, rejected_rewards, nll, log_odds_ratio)``, each ``(B,)``; the rewards
        ``lam * log P`` (as TRL logs them), the chosen NLL and the log-odds ratio are detached.
    """
    if lam < 0:
        raise ValueError(f"orpo_loss: lam must be >= 0, got {lam}")
    chosen = (policy_chosen_logps / chosen_lengths.clamp(min=1)).clamp(max=-1e-6)  # (B,) log P(y_w|x)
    rejected = (policy_rejected_logps / rejected_lengths.clamp(min=1)).clamp(max=-1e-6)  # (B,)
    log_odds = (chosen - log1mexp(chosen)) - (rejected - log1mexp(rejected))  # (B,)
    losses = -chosen - lam * F.logsigmoid(log_odds)
    return losses, lam * chosen.detach(), lam * rejected.detach(), -chosen.detach(), log_odds.detach()


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO (arXiv 2402.01306, Eq. 7) on unpaired examples.

    With the implicit reward ``r = policy_logps - ref_logps`` and the reference point ``z0 = kl``:
    ``lambda_D * (1 - sigmoid(beta * (r - z0)))`` for a desirable example and
    ``lambda_U * (1 - sigmoid(beta * (z0 - r)))`` for an undesirable one.

    ``kl`` is used as given and detached: the paper's ``z0 = max(0, KL estimate)``, an average over a batch of
    mismatched (prompt, completion) pairs, which the caller computes (on every rank) and clamps.

    Args:
        policy_logps: ``(B,)`` summed completion log-probs (with grad).
        ref_logps: ``(B,)`` the reference's.
        desirable: ``(B,)`` bool labels: True desirable, False undesirable.
        kl: scalar ``z0``.
        beta: inverse temperature of the implicit reward.
        desirable_weight: ``lambda_D``.
        undesirable_weight: ``lambda_U``.

    Returns:
        ``(losses, rewards)``, each ``(B,)``; the rewards ``beta * r`` are detached.
    """
    if beta <= 0:
        raise ValueError(f"kto_loss: beta must be > 0, got {beta}")
    logratios = policy_logps - ref_logps.detach()  # (B,)
    z0 = kl.detach()
    desirable = desirable.bool()
    losses = torch.where(
        desirable,
        desirable_weight * (1.0 - torch.sigmoid(beta * (logratios - z0))),
        undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - logratios))),
    )
    return losses, beta * logratios.detach()


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward-model loss ``mean(-log sigmoid(r_c - r_r - margin))``.

    ``margin`` (``(B,)`` or scalar) is the Llama 2 preference-strength margin
    (arXiv 2307.09288); ``None`` means 0.

    Returns:
        ``(loss, accuracy)``: scalar loss and the detached fraction of pairs with
        ``r_c > r_r`` (ties count as wrong; the margin is not used).
    """
    diff = chosen_scores - rejected_scores  # (B,)
    logits = diff if margin is None else diff - margin
    loss = -F.logsigmoid(logits).mean()
    accuracy = (diff.detach() > 0).float().mean()
    return loss, accuracy


class PreferencePairs(NamedTuple):
    """One pair per prompt: row indices into the ``(B*G,)`` rollout and whether the pair carries a preference."""

    chosen: torch.Tensor  # (B,) long, the row with the highest reward of each group
    rejected: torch.Tensor  # (B,) long, the row with the lowest reward
    decisive: torch.Tensor  # (B,) bool, False where every reward of the group is equal (a tie)


@torch.no_grad()
def preference_pairs(rewards: torch.Tensor, group_size: int) -> PreferencePairs:
    """Online DPO's pairs (arXiv 2402.04792): in each group of ``group_size`` consecutive rewards the best
    completion is chosen and the worst rejected (for G = 2, the paper's two samples). Among equal best (or worst)
    rewards the first row wins. A group whose best and worst rewards are equal is a tie: it states no
    preference and is marked not ``decisive``, so the caller can leave it out of the loss.

    Args:
        rewards: ``(B*G,)``.
        group_size: G >= 2.

    Returns:
        :class:`PreferencePairs` of ``(B,)`` tensors.
    """
    if group_size < 2:
        raise ValueError(f"preference_pairs: group_size must be >= 2 to form a pair, got {group_size}")
    grouped = group_view(rewards, group_size, "preference_pairs")  # (B, G)
    offset = torch.arange(grouped.shape[0], device=grouped.device) * group_size  # (B,)
    best, worst = grouped.max(dim=1), grouped.min(dim=1)
    return PreferencePairs(offset + best.indices, offset + worst.indices, best.values > worst.values)
