"""Losses: token aggregation, PPO policy and value losses, preference losses, SFT.

Papers, one per variant:

* PPO clipped surrogate: Schulman et al. 2017 (arXiv 1707.06347). Decoupled
  clip range ``clip_low``/``clip_high``: DAPO, Yu et al. 2025 (arXiv 2503.14476).
  Sequence-level ratio: GSPO, Zheng et al. 2025 (arXiv 2507.18071).
  Dual clip: Ye et al. 2020 (arXiv 1912.09729).
* Clipped value loss: the OpenAI baselines PPO2 implementation, studied by
  Engstrom et al. 2020 (arXiv 2005.12729).
* DPO: Rafailov et al. 2023 (arXiv 2305.18290); conservative DPO (label
  smoothing) from Mitchell's cDPO note on the same loss. IPO: Azar et al. 2023
  (arXiv 2310.12036). Hinge: SLiC-HF, Zhao et al. 2023 (arXiv 2305.10425).
* SimPO: Meng et al. 2024 (arXiv 2405.14734).
* ORPO: Hong et al. 2024 (arXiv 2403.07691).
* KTO: Ethayarajh et al. 2024 (arXiv 2402.01306).
* Bradley-Terry reward-model loss with the optional margin of Llama 2,
  Touvron et al. 2023 (arXiv 2307.09288).

Normalisation (``aggregate``): every token loss is a *sum* over valid tokens
divided by a normaliser. By default the normaliser is computed from the tensors
passed in; the training modules pass the count for the whole optimizer step
(all microbatches, all ranks) instead, so that summing microbatch losses gives
exactly the full-batch loss and no later division by the number of
accumulation steps is needed.

Departures from the papers:

* Log-ratios are clamped to ``[-20, 20]`` before ``exp``, so one token with a
  collapsed probability cannot overflow the ratio. Such a token is clipped by
  the PPO objective anyway (except for a negative advantage without dual clip,
  where the unclamped gradient would be ``e**20``-sized).
* ``dpo_loss`` and ``simpo_loss`` take sequence log-probs as given; whether
  they are sums or per-token means is the caller's choice (see ``dpo_loss``).
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from align.core.kl import kl_estimate
from align.core.logprobs import masked_mean, masked_sum, selective_log_softmax

__all__ = [
    "AGGREGATIONS",
    "DPO_LOSSES",
    "PolicyLossStats",
    "aggregate",
    "IMPORTANCE_LEVELS",
    "importance_ratio",
    "ppo_policy_loss",
    "policy_gradient_loss",
    "value_loss",
    "dpo_loss",
    "dpo_sigmoid_loss",
    "ipo_loss",
    "hinge_loss",
    "simpo_loss",
    "log1mexp",
    "orpo_loss",
    "kto_loss",
    "bradley_terry_loss",
    "sft_loss",
]

Normaliser = Optional[Union[int, float, torch.Tensor]]

_LOG_RATIO_CLAMP = 20.0


IMPORTANCE_LEVELS = ("token", "sequence")


def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: Optional[torch.Tensor] = None,
                     level: str = "token") -> torch.Tensor:
    """``pi_theta / pi_old`` per token, from log-probs of any shape. The log-ratio is clamped to ``[-20, 20]``
    before ``exp`` (zero gradient outside), so one token whose probability collapsed cannot overflow.
    ``old_logprobs`` is used as given: detach it for a ratio whose gradient flows through ``logprobs`` only.

    ``level="sequence"`` (GSPO, Zheng et al. 2025, arXiv 2507.18071) takes ``(B, T)`` log-probs and the
    ``mask`` (``None``: every token is valid): every valid token of row ``i`` carries the value of the sequence ratio
    ``s_i = exp(mean_t (logprobs - old_logprobs))`` over the row's valid tokens, with the gradient of the paper's
    GSPO-token form: ``s_t = sg[s_i] * pi(y_t) / sg[pi(y_t)]``, so ``grad s_t = s_i * grad log pi(y_t)``.
    Averaged over a sequence's tokens, this is exactly the gradient of ``s_i``.
    """
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance_ratio: unknown level {level!r}; expected one of {list(IMPORTANCE_LEVELS)}")
    log_ratio = logprobs - old_logprobs
    if level == "sequence":
        if log_ratio.dim() != 2:
            raise ValueError("importance_ratio: level='sequence' needs (B, T) log-probs (and their (B, T) mask, or "
                             "None when every token is valid)")
        seq = masked_mean(log_ratio.detach(), mask, dim=-1)  # (B,) mean log-ratio; 0 for a row with no valid token
        log_ratio = seq[:, None] + logprobs - logprobs.detach()  # (B, T) value: seq; gradient: d logprobs
    return torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _fill_masked(x: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    if valid is None:  # every element is valid
        return x
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


# ----------------------------------------------------------------------------
# aggregation
# ----------------------------------------------------------------------------


def _check_normaliser(normaliser: Normaliser, fn: str) -> None:
    if isinstance(normaliser, (int, float)) and not normaliser > 0:
        raise ValueError(f"{fn}: normaliser must be > 0, got {normaliser}")


def _token_mean(per_token: torch.Tensor, mask: Optional[torch.Tensor], normaliser: Normaliser) -> torch.Tensor:
    total = masked_sum(per_token, mask)
    if normaliser is None:
        normaliser = max(per_token.numel(), 1) if mask is None else mask.bool().sum().clamp(min=1)
    return total / normaliser


def _seq_mean(per_token: torch.Tensor, mask: Optional[torch.Tensor], normaliser: Normaliser) -> torch.Tensor:
    per_seq = masked_mean(per_token, mask, dim=-1)  # (B,), 0 for a row with no valid token
    if normaliser is None:
        normaliser = max(per_seq.shape[0], 1)
    return per_seq.sum() / normaliser


def _constant(per_token: torch.Tensor, mask: Optional[torch.Tensor], normaliser: Normaliser) -> torch.Tensor:
    total = masked_sum(per_token, mask)
    if normaliser is None:
        normaliser = max(per_token.numel(), 1)
    return total / normaliser


AGGREGATIONS: Dict[str, Callable[[torch.Tensor, Optional[torch.Tensor], Normaliser], torch.Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean": _seq_mean,
    "constant": _constant,
}


def aggregate(
    per_token: torch.Tensor,
    mask: Optional[torch.Tensor],
    mode: str = "token_mean",
    normaliser: Normaliser = None,
) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar over valid tokens (``mask=None``: every token is valid).

    Modes (``normaliser`` default in brackets):

    * ``"token_mean"``: sum over valid tokens / normaliser [number of valid
      tokens here; 1 if there are none].
    * ``"seq_mean"``: sum over sequences of each sequence's mean over its valid
      tokens / normaliser [B]. A sequence with no valid token contributes 0
      but still counts in the default B.
    * ``"constant"``: sum over valid tokens / normaliser [B * T]; Dr. GRPO's
      constant normaliser (arXiv 2503.20783). Pass ``n_sequences *
      max_new_tokens`` for the whole step so that it does not depend on the
      padded width of a microbatch.

    ``normaliser`` (number or tensor) should be the count over the whole
    optimizer step (all microbatches and ranks) in the unit of the mode; then
    the sum of per-microbatch results equals the full-batch result. Masked
    positions of ``per_token`` never affect the result.
    """
    try:
        fn = AGGREGATIONS[mode]
    except KeyError:
        raise ValueError(f"aggregate: unknown mode {mode!r}; expected one of {sorted(AGGREGATIONS)}") from None
    if mask is not None and per_token.shape != mask.shape:
        raise ValueError(f"aggregate: per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} must match")
    _check_normaliser(normaliser, "aggregate")
    return fn(per_token, mask, normaliser)


# ----------------------------------------------------------------------------
# PPO
# ----------------------------------------------------------------------------


class PolicyLossStats(NamedTuple):
    """Detached scalar diagnostics of :func:`ppo_policy_loss`, means over valid tokens.

    * ``clipfrac``: fraction of tokens whose gradient the clipping removed
      (ratio clip or dual clip).
    * ``approx_kl``: k3 estimate of KL(pi_old || pi_theta) from tokens sampled
      by pi_old: ``exp(log_r) - 1 - log_r`` with ``log_r = logprobs - old_logprobs``.
    * ``ratio_mean``: mean importance ratio ``pi_theta / pi_old``.
    """

    clipfrac: torch.Tensor
    approx_kl: torch.Tensor
    ratio_mean: torch.Tensor


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    clip_low: float = 0.2,
    clip_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    agg: str = "token_mean",
    normaliser: Normaliser = None,
    level: str = "token",
) -> Tuple[torch.Tensor, PolicyLossStats]:
    """Clipped surrogate policy loss (arXiv 1707.06347), to be minimised.

    Per token, with ``r = exp(logprobs - old_logprobs)`` and advantage ``A``:
    ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``. With
    ``dual_clip = c > 1`` and ``A < 0`` the result is further capped at
    ``-c * A`` (arXiv 1912.09729), so a huge ratio cannot produce an unbounded
    loss.

    Args:
        logprobs: ``(B, T)`` current policy log-probs (with grad).
        old_logprobs: ``(B, T)`` log-probs of the policy that sampled the tokens.
        advantages: ``(B, T)`` per-token advantages; pass ``adv[:, None]``
            broadcast to ``(B, T)`` for per-sequence advantages.
        mask: ``(B, T)`` response mask; ``None``: every token is valid (one
            action per row in classic RL), the same result with fewer operations.
        clip_low: lower clip range. ``clip_high``: upper clip range; ``None``
            means ``clip_low`` (symmetric). DAPO's "clip higher" sets it larger.
        dual_clip: ``c > 1`` or ``None``.
        agg, normaliser: see :func:`aggregate`.
        level: ``"token"`` ratios, or GSPO's ``"sequence"`` ratio (arXiv 2507.18071), see
            :func:`importance_ratio`: the whole sequence is clipped or not, and with per-sequence advantages
            and ``agg="seq_mean"`` the loss and its gradient are GSPO's. With one valid token per row both
            levels give the same loss.

    Returns:
        ``(loss, PolicyLossStats)``; the loss is a scalar.
    """
    if clip_high is None:
        clip_high = clip_low
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"ppo_policy_loss: clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"ppo_policy_loss: dual_clip must be > 1, got {dual_clip}")
    if advantages.dim() != logprobs.dim():
        # A (B,) tensor would broadcast along T, silently pairing row b with token b.
        raise ValueError(
            f"ppo_policy_loss: advantages must be (B, T) like logprobs {tuple(logprobs.shape)}, got "
            f"{tuple(advantages.shape)}; pass per-sequence advantages as adv[:, None]"
        )
    # Padding is replaced, not multiplied away, so a NaN there reaches neither
    # the loss nor any gradient.
    valid = None if mask is None else mask.bool()
    old_logprobs = _fill_masked(old_logprobs.detach(), valid)
    logprobs = _fill_masked(logprobs, valid)
    advantages = _fill_masked(advantages.detach().expand_as(logprobs), valid)
    ratio = importance_ratio(logprobs, old_logprobs, valid, level)  # (B, T)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)  # (B, T)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
        was_clipped = was_clipped | dual
    loss = aggregate(per_token, mask, agg, normaliser)
    with torch.no_grad():
        stats = PolicyLossStats(
            clipfrac=masked_mean(was_clipped.to(ratio.dtype), mask),
            approx_kl=masked_mean(kl_estimate(old_logprobs, logprobs.detach(), "k3", _LOG_RATIO_CLAMP), mask),
            ratio_mean=masked_mean(ratio.detach(), mask),
        )
    return loss, stats


def policy_gradient_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor],
    agg: str = "token_mean",
    normaliser: Normaliser = None,
) -> torch.Tensor:
    """The plain policy-gradient (REINFORCE) loss ``-A * log pi``, aggregated, to be minimised (Williams 1992).

    Its gradient is :func:`ppo_policy_loss`'s at ratio 1 (sampling log-probs equal to the current ones, nothing
    clipped), ``-A * grad log pi``, for an update made right after sampling (A2C, REINFORCE). Its value is the
    surrogate's: Stable-Baselines3's A2C logs it as its policy loss.

    Args:
        logprobs: ``(B, T)`` log-probs of the taken actions or tokens (with grad).
        advantages: ``(B, T)`` advantages (detached here).
        mask: ``(B, T)`` valid tokens; ``None``: every element is valid.
        agg, normaliser: see :func:`aggregate`.

    Returns:
        The scalar loss.
    """
    if advantages.shape != logprobs.shape:
        raise ValueError(f"policy_gradient_loss: advantages {tuple(advantages.shape)} must match logprobs "
                         f"{tuple(logprobs.shape)}")
    valid = None if mask is None else mask.bool()
    per_token = -_fill_masked(advantages.detach(), valid) * _fill_masked(logprobs, valid)
    return aggregate(per_token, mask, agg, normaliser)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: Optional[torch.Tensor],
    clip: Optional[float] = None,
    agg: str = "token_mean",
    normaliser: Normaliser = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Squared-error value loss, optionally clipped around the rollout values.

    ``0.5 * (V - R)**2``; with ``clip`` set,
    ``0.5 * max((V - R)**2, (V_clip - R)**2)`` where
    ``V_clip = old_values + clamp(V - old_values, -clip, clip)``.

    Args:
        values: ``(B, T)`` current value predictions (with grad).
        old_values: ``(B, T)`` values recorded at rollout time.
        returns: ``(B, T)`` targets from :func:`align.core.advantages.gae`.
        mask: ``(B, T)`` response mask; ``None``: every token is valid (one
            action per row in classic RL), the same result with fewer operations.

    Returns:
        ``(loss, clipfrac)``: scalar loss and the detached fraction of valid
        tokens where the clipped term was the larger one (0 without ``clip``).
    """
    valid = None if mask is None else mask.bool()
    values = _fill_masked(values, valid)
    old_values = _fill_masked(old_values.detach(), valid)
    returns = _fill_masked(returns.detach(), valid)
    unclipped = (values - returns).square()
    if clip is None:
        per_token = 0.5 * unclipped
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        if clip <= 0:
            raise ValueError(f"value_loss: clip must be > 0 or None, got {clip}")
        v_clipped = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (v_clipped - returns).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        with torch.no_grad():
            clipfrac = masked_mean((clipped > unclipped).to(values.dtype), mask)
    return aggregate(per_token, mask, agg, normaliser), clipfrac


# ----------------------------------------------------------------------------
# preference losses
# ----------------------------------------------------------------------------


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


DPO_LOSSES: Dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (arXiv 2405.14734): reference-free, length-normalised preference loss.

    ``-log sigmoid(beta * (logp_c / |y_c| - logp_r / |y_r|) - gamma)``.

    ``gamma`` is the target reward margin of the paper's objective, in reward
    units. Implementations that take a ``gamma_beta_ratio`` instead compute the
    same loss with ``gamma = gamma_beta_ratio * beta``; the defaults here
    (beta 2.0, gamma 1.0) correspond to a ratio of 0.5.

    Args:
        policy_chosen_logps, policy_rejected_logps: ``(B,)`` *summed* response
            log-probs.
        chosen_lengths, rejected_lengths: ``(B,)`` response token counts;
            clamped to at least 1.

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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO (arXiv 2403.07691): SFT plus an odds-ratio preference term, reference-free.

    With the length-normalised likelihood ``log P(y|x) = logp / |y|`` (the paper's Eq. 3) and
    ``odds(y|x) = P / (1 - P)``, so ``log odds = log P - log(1 - P)`` (:func:`log1mexp`):
    ``loss = -log P(y_w|x) + lam * -log sigmoid(log odds(y_w|x) - log odds(y_l|x))`` (Eqs. 6-7).

    The NLL term is each pair's per-token mean over its chosen response, so a batch's loss is a mean of
    per-pair losses. ``log P`` is clamped to at most ``-1e-6``: a response the model already gives probability
    one has infinite odds, and that term then has no gradient.

    Args:
        policy_chosen_logps, policy_rejected_logps: ``(B,)`` *summed* response log-probs (with grad).
        chosen_lengths, rejected_lengths: ``(B,)`` response token counts; clamped to at least 1.
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
) -> Tuple[torch.Tensor, torch.Tensor]:
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
        desirable_weight, undesirable_weight: ``lambda_D``, ``lambda_U``.

    Returns:
        ``(losses, rewards)``, each ``(B,)``; the rewards ``beta * r`` are detached.
    """
    if beta <= 0:
        raise ValueError(f"kto_loss: beta must be > 0, got {beta}")
    logratios = policy_logps - ref_logps.detach()  # (B,)
    z0 = kl.detach()
    desirable = desirable.bool()
    losses = torch.where(desirable, desirable_weight * (1.0 - torch.sigmoid(beta * (logratios - z0))),
                         undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - logratios))))
    return losses, beta * logratios.detach()


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
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


# ----------------------------------------------------------------------------
# SFT
# ----------------------------------------------------------------------------


def sft_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    normaliser: Normaliser = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Next-token negative log-likelihood, summed over label tokens / normaliser.

    Args:
        logits: ``(B, T, V)`` model outputs for ``input_ids``.
        labels: ``(B, T)`` aligned with ``input_ids`` (Hugging Face
            convention): ``logits[:, t]`` predicts ``labels[:, t + 1]``; the
            shift happens here. ``ignore_index`` marks tokens without loss.
        normaliser: defaults to the number of non-ignored (shifted) labels; pass
            the count for the whole optimizer step under accumulation or data
            parallelism.

    Returns:
        Scalar float32 loss; 0 with a gradient (not NaN) when no label is valid.

    float32 logits go through one fused ``F.cross_entropy(reduction="sum")``.
    bf16/fp16 logits go through :func:`align.core.logprobs.selective_log_softmax`,
    which upcasts one chunk at a time and keeps no float32 copy for backward.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"sft_loss: logits must be (B, T, V) and labels (B, T); got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    _check_normaliser(normaliser, "sft_loss")
    # Shift the labels instead of slicing the logits, which would copy them.
    ignore = torch.full_like(labels[:, :1], ignore_index)
    targets = torch.cat([labels[:, 1:], ignore], dim=1)  # (B, T)
    valid = targets != ignore_index  # (B, T)
    vocab = logits.shape[-1]
    if logits.dtype in (torch.float32, torch.float64):
        total = F.cross_entropy(
            logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=ignore_index, reduction="sum"
        ).float()
    else:
        token_logps = selective_log_softmax(logits, torch.where(valid, targets, 0))  # (B, T)
        total = -masked_sum(token_logps, valid)
    if normaliser is None:
        normaliser = valid.sum().clamp(min=1)
    return total / normaliser
