"""Policy losses of the RL algorithms: the ``POLICY_LOSSES`` table, its rows, and the importance ratio.

A row is one function with one signature, ``loss(x: PolicyLossInputs, p: PolicyLossSettings) -> (loss,
PolicyLossStats)``, with its default clip range, chosen by name from a module's ``policy_loss.name`` option
(docs/architecture.md, "How to add", "A policy loss"). A row starts from :func:`prepare_inputs` (shape check, detached
targets, padding replaced) and :func:`clip_range`, takes its ratio from :func:`importance_ratio` (clamped log-ratio),
reduces its per-token terms with :func:`align.core.losses.aggregate` and reports :func:`policy_loss_stats`. Rows:

* ``clip``: PPO's clipped surrogate on token ratios, Schulman et al. 2017 (arXiv 1707.06347), with DAPO's decoupled
  clip range ``clip_low``/``clip_high`` (Yu et al. 2025, arXiv 2503.14476).
* ``gspo``: the same clip on GSPO's sequence ratio, Zheng et al. 2025 (arXiv 2507.18071).
* ``cispo``: CISPO's clipped, detached importance weight times the token's log-prob, MiniMax 2025 (arXiv 2506.13585).
* ``sapo``: SAPO's soft, temperature-controlled gate on the token ratio, Gao et al. 2025 (arXiv 2511.20347).
* ``gmpo``: GMPO's geometric mean of the sequence's token ratios, clipped in log space, Zhao et al. 2025
  (arXiv 2507.20673).

Also here: the plain policy-gradient loss (REINFORCE, Williams 1992) and dual clip (Ye et al. 2020,
arXiv 1912.09729) of :func:`ppo_policy_loss`.

Departure from the papers: log-ratios are clamped to ``[-20, 20]`` before ``exp``, so one token with a collapsed
probability cannot overflow the ratio. Such a token is clipped by the PPO objective anyway (except for a negative
advantage without dual clip, where the unclamped gradient would be ``e**20``-sized). GMPO clamps its sequence's mean
log-ratio instead, above only (its weight is the exponent of a mean, and a token far out on the side its clip leaves
alone keeps its gradient there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from align.core.kl import kl_estimate
from align.core.losses import Normaliser, aggregate
from align.core.masks import fill_masked, masked_mean

__all__ = [
    "IMPORTANCE_LEVELS",
    "POLICY_LOSSES",
    "SEQUENCE_LEVEL_LOSSES",
    "PolicyLossInputs",
    "PolicyLossRow",
    "PolicyLossSettings",
    "PolicyLossStats",
    "PreparedInputs",
    "clip_range",
    "importance_ratio",
    "policy_loss_stats",
    "prepare_inputs",
    "ppo_policy_loss",
    "policy_gradient_loss",
    "clipped_token_loss",
    "clipped_sequence_loss",
    "cispo_loss",
    "sapo_loss",
    "gmpo_loss",
]

_LOG_RATIO_CLAMP = 20.0


IMPORTANCE_LEVELS = ("token", "sequence")


def importance_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor | None = None, level: str = "token"
) -> torch.Tensor:
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
            raise ValueError(
                "importance_ratio: level='sequence' needs (B, T) log-probs (and their (B, T) mask, or "
                "None when every token is valid)"
            )
        seq = masked_mean(log_ratio.detach(), mask, dim=-1)  # (B,) mean log-ratio; 0 for a row with no valid token
        log_ratio = seq[:, None] + logprobs - logprobs.detach()  # (B, T) value: seq; gradient: d logprobs
    return torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


class PolicyLossStats(NamedTuple):
    """Detached scalar diagnostics of a policy loss, means over valid tokens (:func:`policy_loss_stats`); the
    modules log ``clipfrac`` (``train/clipfrac``) and ``approx_kl`` (``train/approx_kl``).

    * ``clipfrac``: fraction of tokens where the loss's clip acted: for PPO's clip, the tokens whose gradient it
      removed (ratio clip or dual clip); for a loss that clips a weight instead, the tokens whose weight it clipped.
    * ``approx_kl``: k3 estimate of KL(pi_old || pi_theta) from tokens sampled
      by pi_old: ``exp(log_r) - 1 - log_r`` with ``log_r = logprobs - old_logprobs``.
    * ``ratio_mean``: mean importance ratio ``pi_theta / pi_old``.
    """

    clipfrac: torch.Tensor
    approx_kl: torch.Tensor
    ratio_mean: torch.Tensor


class PreparedInputs(NamedTuple):
    """A policy loss's tensors after the input handling every row shares (:func:`prepare_inputs`), ``(B, T)``."""

    logprobs: torch.Tensor  # with grad; 0 at padding
    old_logprobs: torch.Tensor  # detached; 0 at padding
    advantages: torch.Tensor  # detached, expanded to (B, T); 0 at padding
    valid: torch.Tensor | None  # bool response mask; None: every token is valid


def prepare_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    fn: str = "policy loss",
) -> PreparedInputs:
    """The input handling every policy loss shares: the advantages must be ``(B, T)`` like the log-probs (a
    ``(B,)`` tensor would broadcast along T, silently pairing row b with token b); old log-probs and advantages are
    detached (targets, never differentiated through); padding is *replaced* by 0, not multiplied away, so a NaN there
    reaches neither the loss nor any gradient."""
    if advantages.dim() != logprobs.dim():
        raise ValueError(
            f"{fn}: advantages must be (B, T) like logprobs {tuple(logprobs.shape)}, got "
            f"{tuple(advantages.shape)}; pass per-sequence advantages as adv[:, None]"
        )
    valid = None if mask is None else mask.bool()
    old_logprobs = fill_masked(old_logprobs.detach(), valid)
    logprobs = fill_masked(logprobs, valid)
    advantages = fill_masked(advantages.detach().expand_as(logprobs), valid)
    return PreparedInputs(logprobs, old_logprobs, advantages, valid)


def clip_range(clip_low: float, clip_high: float | None, fn: str = "policy loss") -> tuple[float, float]:
    """``(clip_low, clip_high)`` with ``clip_high=None`` read as ``clip_low`` (a symmetric range), both ``>= 0``."""
    if clip_high is None:
        clip_high = clip_low
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"{fn}: clip ranges must be >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    return clip_low, clip_high


@torch.no_grad()
def policy_loss_stats(x: PreparedInputs, ratio: torch.Tensor, clipped: torch.Tensor) -> PolicyLossStats:
    """:class:`PolicyLossStats` of a loss over the prepared inputs ``x``, its ``(B, T)`` ``ratio`` and the tokens
    where its clip acted (``clipped``: bool, or for a soft gate the share of each token's gradient it removed)."""
    return PolicyLossStats(
        clipfrac=masked_mean(clipped.to(ratio.dtype), x.valid),
        approx_kl=masked_mean(kl_estimate(x.old_logprobs, x.logprobs.detach(), "k3", _LOG_RATIO_CLAMP), x.valid),
        ratio_mean=masked_mean(ratio.detach(), x.valid),
    )


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token_mean",
    normaliser: Normaliser = None,
    level: str = "token",
) -> tuple[torch.Tensor, PolicyLossStats]:
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
        agg: see :func:`aggregate`.
        normaliser: see :func:`aggregate`.
        level: ``"token"`` ratios, or GSPO's ``"sequence"`` ratio (arXiv 2507.18071), see
            :func:`importance_ratio`: the whole sequence is clipped or not, and with per-sequence advantages
            and ``agg="seq_mean"`` the loss and its gradient are GSPO's. With one valid token per row both
            levels give the same loss.

    Returns:
        ``(loss, PolicyLossStats)``; the loss is a scalar.
    """
    clip_low, clip_high = clip_range(clip_low, clip_high, "ppo_policy_loss")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"ppo_policy_loss: dual_clip must be > 1, got {dual_clip}")
    x = prepare_inputs(logprobs, old_logprobs, advantages, mask, "ppo_policy_loss")
    ratio = importance_ratio(x.logprobs, x.old_logprobs, x.valid, level)  # (B, T)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)  # (B, T)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        cap = -dual_clip * x.advantages
        dual = (x.advantages < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
        was_clipped = was_clipped | dual
    return aggregate(per_token, mask, agg, normaliser), policy_loss_stats(x, ratio, was_clipped)


def policy_gradient_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
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
        agg: see :func:`aggregate`.
        normaliser: see :func:`aggregate`.

    Returns:
        The scalar loss.
    """
    if advantages.shape != logprobs.shape:
        raise ValueError(
            f"policy_gradient_loss: advantages {tuple(advantages.shape)} must match logprobs {tuple(logprobs.shape)}"
        )
    valid = None if mask is None else mask.bool()
    per_token = -fill_masked(advantages.detach(), valid) * fill_masked(logprobs, valid)
    return aggregate(per_token, mask, agg, normaliser)


# ----------------------------------------------------------------------------
# the table
# ----------------------------------------------------------------------------


class PolicyLossInputs(NamedTuple):
    """One micro-batch of a policy update, every tensor ``(B, T)``."""

    logprobs: torch.Tensor  # current policy (with grad)
    old_logprobs: torch.Tensor  # the policy that sampled the tokens (detached by the losses)
    advantages: torch.Tensor  # per token; a per-sequence advantage broadcast over its tokens
    mask: torch.Tensor | None  # response mask; None: every token is valid


class PolicyLossSettings(NamedTuple):
    """What a policy loss may read besides the tensors: its clip range, SAPO's temperatures and the step's
    aggregation."""

    clip_low: float = 0.2
    clip_high: float | None = None  # None: clip_low
    agg: str = "token_mean"  # see align.core.losses.aggregate
    normaliser: Normaliser = None  # the optimizer step's count, in the unit of agg
    tau_pos: float = 1.0  # sapo: the gate's temperature where the advantage is > 0
    tau_neg: float = 1.05  # sapo: where it is <= 0


PolicyLoss = Callable[[PolicyLossInputs, PolicyLossSettings], tuple[torch.Tensor, PolicyLossStats]]


def clipped_token_loss(x: PolicyLossInputs, p: PolicyLossSettings) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO's clipped surrogate on each token's ratio (arXiv 1707.06347; DAPO's clip-higher through ``clip_high``)."""
    return ppo_policy_loss(
        x.logprobs,
        x.old_logprobs,
        x.advantages,
        x.mask,
        p.clip_low,
        p.clip_high,
        agg=p.agg,
        normaliser=p.normaliser,
        level="token",
    )


def clipped_sequence_loss(x: PolicyLossInputs, p: PolicyLossSettings) -> tuple[torch.Tensor, PolicyLossStats]:
    """GSPO (arXiv 2507.18071): the clip on the sequence's geometric-mean ratio, whole sequences clipped or not.
    The paper pairs it with ``seq_mean`` aggregation, per-sequence advantages and ranges of about 3e-4 / 4e-4."""
    return ppo_policy_loss(
        x.logprobs,
        x.old_logprobs,
        x.advantages,
        x.mask,
        p.clip_low,
        p.clip_high,
        agg=p.agg,
        normaliser=p.normaliser,
        level="sequence",
    )


def cispo_loss(x: PolicyLossInputs, p: PolicyLossSettings) -> tuple[torch.Tensor, PolicyLossStats]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): per token ``-sg(w) * A * log pi`` with the importance weight clipped,
    ``w = clip(r, 1 - clip_low, 1 + clip_high)``, and detached. Unlike PPO's clip, no token's gradient is dropped: a
    token outside the range keeps ``-w * A * grad log pi`` with its weight capped. The row's defaults follow the paper
    (no lower bound: ``clip_low`` 1) and ScaleRL's cap of 5 (``clip_high`` 4, arXiv 2510.13786).

    Departure: the per-token term is ``-sg(w) * A * (1 + log pi - sg(log pi))``, whose gradient is the paper's and
    whose value is ``-w * A`` (the paper's ``-w * A * log pi`` differs by a term with no gradient), so
    ``train/policy_loss`` reads on the scale of the other rows. ``clipfrac``: the tokens whose weight was clipped."""
    low, high = clip_range(p.clip_low, p.clip_high, "cispo")
    y = prepare_inputs(x.logprobs, x.old_logprobs, x.advantages, x.mask, "cispo")
    ratio = importance_ratio(y.logprobs.detach(), y.old_logprobs)
    weight = ratio.clamp(1.0 - low, 1.0 + high)
    per_token = -y.advantages * weight * (1.0 + y.logprobs - y.logprobs.detach())
    clipped = (ratio < 1.0 - low) | (ratio > 1.0 + high)
    return aggregate(per_token, x.mask, p.agg, p.normaliser), policy_loss_stats(y, ratio, clipped)


def sapo_loss(x: PolicyLossInputs, p: PolicyLossSettings) -> tuple[torch.Tensor, PolicyLossStats]:
    """SAPO (arXiv 2511.20347): per token ``-A * f(r)`` with the soft gate ``f(r) = (4 / tau) * sigmoid(tau * (r - 1))``
    in place of the hard clip, ``tau = tau_pos`` where ``A > 0`` and ``tau_neg`` elsewhere (the paper's larger
    ``tau_neg`` damps negative updates faster). Its gradient is ``-A * g * r * grad log pi`` with the gate weight
    ``g = 4 * s * (1 - s)``, ``s = sigmoid(tau * (r - 1))``: 1 on-policy (``r = 1``), falling smoothly off it. No clip
    range. ``clipfrac``: the mean of ``1 - g``, the share of the gradient the gate removed (a hard clip's fraction
    when ``g`` is 0 or 1)."""
    if not (p.tau_pos > 0 and p.tau_neg > 0):
        raise ValueError(f"sapo: temperatures must be > 0, got tau_pos={p.tau_pos}, tau_neg={p.tau_neg}")
    y = prepare_inputs(x.logprobs, x.old_logprobs, x.advantages, x.mask, "sapo")
    ratio = importance_ratio(y.logprobs, y.old_logprobs)
    tau = torch.where(y.advantages > 0, ratio.new_tensor(p.tau_pos), ratio.new_tensor(p.tau_neg))  # (B, T)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -y.advantages * gate * (4.0 / tau)
    attenuation = 1.0 - 4.0 * gate.detach() * (1.0 - gate.detach())  # the share of each token's gradient removed
    return aggregate(per_token, x.mask, p.agg, p.normaliser), policy_loss_stats(y, ratio, attenuation)


def gmpo_loss(x: PolicyLossInputs, p: PolicyLossSettings) -> tuple[torch.Tensor, PolicyLossStats]:
    """GMPO (arXiv 2507.20673): each sequence's importance weight is the geometric mean of its token ratios, every
    token's log-ratio first clipped to ``[-clip_low, clip_high]`` on the side its advantage makes pessimistic (PPO's
    min, in log space: the paper's range ``(e^-0.4, e^0.4)`` is the row's default 0.4). Per token the term is
    ``-A * sg(s) * (1 + l - sg(l))`` with ``l`` the clipped log-ratio and ``s = exp(mean l)`` over the sequence, so a
    sequence's mean term has the value ``-A * s`` and the gradient of ``-A * s``: with per-sequence advantages and
    ``seq_mean`` aggregation the loss and gradient are the paper's.

    No token's log-ratio is clamped for overflow (as :func:`importance_ratio` does): a token 25 nats out on the side
    the clip leaves alone keeps its gradient ``-A * s * grad log pi`` and its full share of ``mean l``; only
    ``exp`` can overflow, so the mean is clamped at 20 before it. Departures: a sequence whose mean ``l`` exceeds 20
    (only tokens with ``A < 0`` can take it there) has the weight ``s = e^20`` instead of ``e^mean``, its gradient
    kept at that weight; with per-token advantages (GAE, REINFORCE++) each token's clip side follows its own advantage
    and the sequence's geometric mean weights ``-A_t * grad l_t`` (the paper defines one advantage per sequence).
    ``clipfrac``: the tokens whose log-ratio was clipped (their gradient removed)."""
    low, high = clip_range(p.clip_low, p.clip_high, "gmpo")
    y = prepare_inputs(x.logprobs, x.old_logprobs, x.advantages, x.mask, "gmpo")
    log_ratio = (y.logprobs - y.old_logprobs).detach()  # (B, T), not clamped: only exp(mean l) below can overflow
    bounded = log_ratio.clamp(-low, high)
    pessimistic = torch.where(y.advantages >= 0, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
    clipped = torch.where(y.advantages >= 0, log_ratio > high, log_ratio < -low)  # (B, T) l_t is the bound
    # s = exp(mean l) per sequence, its log clamped above (overflow safety: s is detached, so this removes no gradient)
    seq_log = masked_mean(pessimistic, y.valid, dim=-1).clamp(max=_LOG_RATIO_CLAMP)  # (B,)
    seq = torch.exp(seq_log)[:, None].expand_as(log_ratio)  # (B, T)
    # l - sg(l): value 0, gradient grad log pi where the clip left l_t = log r_t, 0 where it acted
    live = torch.where(clipped, torch.zeros_like(y.logprobs), y.logprobs - y.logprobs.detach())
    per_token = -y.advantages * seq * (1.0 + live)
    return aggregate(per_token, x.mask, p.agg, p.normaliser), policy_loss_stats(y, seq, clipped)


@dataclass(frozen=True)
class PolicyLossRow:
    """A row of :data:`POLICY_LOSSES`: the loss and what a module needs to know to call it."""

    loss: PolicyLoss
    clip_low: float | None
    """The row's default ``clip_low`` (a module's ``clip.low: null``); None: the loss has no clip range."""
    clip_high: float | None = None
    """The row's default ``clip_high``; None: equal to the clip low in use."""
    sequence_level: bool = False
    """Whether the ratio is one per sequence, so it needs one advantage per sequence (not GAE's per-token)."""

    def __call__(self, x: PolicyLossInputs, p: PolicyLossSettings) -> tuple[torch.Tensor, PolicyLossStats]:
        return self.loss(x, p)


POLICY_LOSSES: dict[str, PolicyLossRow] = {
    "clip": PolicyLossRow(clipped_token_loss, 0.2),
    "gspo": PolicyLossRow(clipped_sequence_loss, 0.2, sequence_level=True),
    "cispo": PolicyLossRow(cispo_loss, 1.0, 4.0),
    "sapo": PolicyLossRow(sapo_loss, None),
    "gmpo": PolicyLossRow(gmpo_loss, 0.4),
}
"""The policy losses by name: ``POLICY_LOSSES[name](inputs, settings) -> (loss, stats)``, the loss a scalar share of
the optimizer step's loss (``settings.normaliser``)."""

SEQUENCE_LEVEL_LOSSES = frozenset(name for name, row in POLICY_LOSSES.items() if row.sequence_level)
"""Rows whose ratio is per sequence: they need one advantage per sequence (not GAE's per-token advantages)."""
