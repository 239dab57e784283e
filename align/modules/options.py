"""Typed option groups of the RL modules, shared by GRPO, PPO and TRPO.

Each group is one nested YAML block under ``model:`` (``kl:``, ``updates:``, ``clip:``, ``policy_loss:``, ...),
with its fields documented below and checked when it is built, so ``--help`` lists them and a bad value fails on
one line that names its key. A module whose default differs (PPO's KL coefficient, its four epochs) declares its own
default instance of the group; every other field keeps the group's default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from align.core.estimators import ADVANTAGE_ESTIMATORS, VALUE_ESTIMATORS
from align.core.kl import KLKind
from align.core.policy_losses import POLICY_LOSSES, SEQUENCE_LEVEL_LOSSES
from align.errors import AlignConfigError
from align.rollout.engine import HeldOutSampling

Aggregation = Literal["token_mean", "seq_mean", "constant"]


def _check(ok: bool, key: str, expected: str, got) -> None:
    if not ok:
        raise AlignConfigError(f"model.{key}: expected {expected}, got {got!r}")


@dataclass(frozen=True)
class KLPenalty:
    """The KL penalty to the reference policy (the initial policy, or ``policy.reference_model``)."""

    coef: float = 0.0
    """Weight of the KL term (the initial weight when ``target`` is set); 0 with no target loads no reference."""
    estimator: KLKind | None = None
    """Per-token estimate ``k1``, ``k2`` or ``k3`` (align.core.kl); null: ``k3`` in the loss, ``k1`` in the reward."""
    placement: Literal["loss", "reward"] = "loss"
    """``loss``: ``coef`` times the per-token estimate is added to the loss (GRPO). ``reward``: it is subtracted
    from the rewards (GRPO, RLOO: each completion's summed estimate; PPO and TRPO: per token, before GAE;
    REINFORCE++: per token, before the returns-to-go)."""
    target: float | None = None
    """Per-sequence KL that an adaptive controller steers to (Ziegler et al. 2019); null keeps ``coef`` fixed."""
    horizon: float = 10000.0
    """Horizon of the adaptive controller, in sequences."""

    def __post_init__(self) -> None:
        _check(self.coef >= 0, "kl.coef", ">= 0", self.coef)
        _check(self.estimator in (None, "k1", "k2", "k3"), "kl.estimator", "k1, k2, k3 or null", self.estimator)
        _check(self.placement in ("loss", "reward"), "kl.placement", "'loss' or 'reward'", self.placement)
        _check(self.horizon > 0, "kl.horizon", "> 0", self.horizon)
        _check(self.target is None or self.target > 0, "kl.target", "> 0 or null", self.target)
        if self.target is not None and self.coef <= 0:
            raise AlignConfigError(
                f"model.kl.coef: the adaptive controller (kl.target {self.target}) multiplies the "
                f"coefficient, so it must start > 0 (e.g. 0.05), got {self.coef}"
            )

    @property
    def enabled(self) -> bool:
        """Whether a reference is needed."""
        return self.coef > 0 or self.target is not None

    @property
    def kind(self) -> KLKind:
        return self.estimator or ("k3" if self.placement == "loss" else "k1")


@dataclass(frozen=True)
class ClipRange:
    """The clip range of the policy loss: ``[1 - low, 1 + high]`` on the importance ratio (``clip``, ``gspo``), on
    CISPO's importance weight (``cispo``), or ``[-low, high]`` on GMPO's log-ratios (``gmpo``). Null takes the
    policy loss's own default (:meth:`PolicyLoss.clip_bounds`)."""

    low: float | None = None
    """Lower clip range; null: the loss's default (``clip``, ``gspo``: 0.2; ``cispo``: 1, no lower bound on the
    weight; ``gmpo``: 0.4, the paper's ``e^-0.4``)."""
    high: float | None = None
    """Upper clip range; null: the loss's default (``cispo``: 4, a cap of 5 on the weight), else equal to ``low``.
    DAPO uses 0.28 (clip-higher)."""

    def __post_init__(self) -> None:
        _check(self.low is None or self.low >= 0, "clip.low", ">= 0 or null", self.low)
        _check(self.high is None or self.high >= 0, "clip.high", ">= 0 or null", self.high)


@dataclass(frozen=True)
class PolicyLoss:
    """Which policy loss the update minimises: a row of :data:`align.core.policy_losses.POLICY_LOSSES`, with the
    clip range of ``clip`` (docs/algorithms.md, "Policy losses")."""

    name: str = "clip"
    """``clip``: PPO's clipped surrogate on each token's ratio (with DAPO's ``clip.high``); ``gspo``: the clip on
    GSPO's sequence ratio, whole sequences clipped or not (GRPO's estimators only; the paper pairs it with
    ``updates.loss_aggregation: seq_mean`` and clip ranges of about 3e-4 / 4e-4); ``cispo``: CISPO's clipped,
    detached importance weight times the log-prob, no token's gradient dropped; ``sapo``: SAPO's soft gate on the
    ratio (``tau_pos``, ``tau_neg``; no clip range); ``gmpo``: GMPO's geometric mean of the sequence's token ratios,
    clipped in log space (the paper pairs it with ``seq_mean``)."""
    tau_pos: float = 1.0
    """``sapo``: temperature of the gate where the advantage is positive (the paper's 1.0)."""
    tau_neg: float = 1.05
    """``sapo``: temperature where it is not (the paper's 1.05: negative updates damped faster off-policy)."""

    def __post_init__(self) -> None:
        _check(self.name in POLICY_LOSSES, "policy_loss.name", f"one of {sorted(POLICY_LOSSES)}", self.name)
        _check(self.tau_pos > 0, "policy_loss.tau_pos", "> 0", self.tau_pos)
        _check(self.tau_neg > 0, "policy_loss.tau_neg", "> 0", self.tau_neg)

    @property
    def sequence_level(self) -> bool:
        """Whether the loss's ratio is per sequence (it needs one advantage per sequence)."""
        return self.name in SEQUENCE_LEVEL_LOSSES

    def clip_bounds(self, clip: ClipRange) -> tuple[float, float | None]:
        """``(low, high)`` of ``clip`` for this loss, nulls replaced by the row's defaults (``high`` None: equal to
        ``low``). A loss without a clip range (``sapo``) refuses a set ``clip`` on one line."""
        row = POLICY_LOSSES[self.name]
        if row.clip_low is None:
            if clip.low is not None or clip.high is not None:
                raise AlignConfigError(
                    f"model.clip: policy_loss.name {self.name} has no clip range; remove clip.low "
                    f"and clip.high (its gate is set by policy_loss.tau_pos and tau_neg)"
                )
            return 1.0, None  # unused
        return (row.clip_low if clip.low is None else clip.low), (row.clip_high if clip.high is None else clip.high)

    def check_correction(self, engine) -> None:
        """A sequence-level loss under an engine-mismatch correction needs one weight per sequence: refuse
        ``sampling.correction.level: token`` with it, on one line."""
        correction = engine.sampling.correction
        if self.sequence_level and correction.level == "token" and correction.resolve(engine.exact_logprobs) != "none":
            raise AlignConfigError(
                f"model.sampling.correction.level: policy_loss.name {self.name} has one ratio per "
                "sequence, so its engine-mismatch weights must be too: set level: sequence"
            )


@dataclass(frozen=True)
class Updates:
    """How a rollout is consumed: passes, optimizer steps per pass, micro-batches, clipping, loss reduction."""

    epochs: int = 1
    """Passes over each rollout (GRPO's mu, PPO's epochs)."""
    minibatches: int = 1
    """Optimizer steps per pass; the rollout's rows are split evenly between them."""
    micro_batch_size: int | None = None
    """Rows per forward/backward pass (gradient accumulation); null: a whole minibatch."""
    max_tokens_per_microbatch: int | None = None
    """Tokens per forward/backward pass, counted as padded (rows x the widest row): a minibatch's rows, widest
    first, are grouped into micro-batches within this budget (and within ``micro_batch_size`` rows when that is
    set too); a row wider than the budget is a micro-batch of its own. Null: micro-batches by row count only."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient norm of every optimizer step; null: no clipping."""
    loss_aggregation: Aggregation = "token_mean"
    """``token_mean`` over the step (DAPO), ``seq_mean`` (per-sequence means, the GRPO paper) or Dr. GRPO's
    ``constant`` (sequences x max_new_tokens)."""
    padding_free: bool = False
    """Run every scoring pass of a rollout (the update's, the reference's, PPO's values) with the rows' real
    tokens laid end to end instead of padded rows (docs/performance.md): no arithmetic on padding, but no
    shared-prompt pass either, so it pays when lengths vary widely and rows do not share their prompt."""

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "updates.epochs", ">= 1", self.epochs)
        _check(self.minibatches >= 1, "updates.minibatches", ">= 1", self.minibatches)
        _check(
            self.micro_batch_size is None or self.micro_batch_size >= 1,
            "updates.micro_batch_size",
            ">= 1 or null",
            self.micro_batch_size,
        )
        _check(
            self.max_tokens_per_microbatch is None or self.max_tokens_per_microbatch >= 1,
            "updates.max_tokens_per_microbatch",
            ">= 1 or null",
            self.max_tokens_per_microbatch,
        )
        _check(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "updates.max_grad_norm",
            "> 0 or null",
            self.max_grad_norm,
        )
        _check(
            self.loss_aggregation in ("token_mean", "seq_mean", "constant"),
            "updates.loss_aggregation",
            "token_mean, seq_mean or constant",
            self.loss_aggregation,
        )

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout: the policy that sampled is the one being updated."""
        return self.epochs == 1 and self.minibatches == 1


@dataclass(frozen=True)
class GroupAdvantages:
    """How the critic-free modules' rollout rewards become advantages: a row of
    :data:`align.core.estimators.ADVANTAGE_ESTIMATORS`."""

    estimator: str = "grpo"
    """``grpo``: the group baseline, scaled by ``std_scale``; ``rloo``: the leave-one-out mean of the group
    (RLOO); ``reinforce_pp``: per-token returns whitened over the batch (REINFORCE++); ``reinforce_pp_baseline``:
    the group mean subtracted first, then as ``reinforce_pp``. (``gae`` needs a value model: PPO and TRPO.)"""
    std_scale: Literal["group", "batch", "none"] | None = None
    """``grpo``: divide by the reward std of the ``group`` (the paper, and null), of the whole ``batch``, or
    ``none`` (Dr. GRPO). The other estimators take null only (RLOO is unscaled, REINFORCE++ whitens)."""

    def __post_init__(self) -> None:
        critic_free = sorted(set(ADVANTAGE_ESTIMATORS) - VALUE_ESTIMATORS)
        _check(
            self.estimator in critic_free,
            "advantages.estimator",
            f"one of {critic_free} (gae needs a value model: PPO or TRPO)",
            self.estimator,
        )
        _check(
            self.std_scale in (None, "group", "batch", "none"),
            "advantages.std_scale",
            "group, batch, none or null",
            self.std_scale,
        )
        _check(
            self.std_scale is None or self.estimator == "grpo",
            "advantages.std_scale",
            f"null with estimator {self.estimator} (it applies to grpo only)",
            self.std_scale,
        )

    @property
    def scale(self) -> str:
        """The std scale of the ``grpo`` estimator (null: ``group``)."""
        return self.std_scale or "group"

    @property
    def min_group_size(self) -> int:
        """The smallest ``group_size`` with a baseline: 2, except for plain REINFORCE++ (1)."""
        return 1 if self.estimator == "reinforce_pp" else 2


@dataclass(frozen=True)
class GAE:
    """Generalised advantage estimation over per-token rewards (Schulman et al. 2016)."""

    gamma: float = 1.0
    """Discount per token."""
    lam: float = 0.95
    """Lambda: 0 is the one-step TD error, 1 the Monte-Carlo return minus the value."""
    whiten_advantages: bool = True
    """Whiten advantages over the valid tokens of each rollout, on every rank (returns are not)."""

    def __post_init__(self) -> None:
        _check(0.0 <= self.gamma <= 1.0, "gae.gamma", "a value in [0, 1]", self.gamma)
        _check(0.0 <= self.lam <= 1.0, "gae.lam", "a value in [0, 1]", self.lam)


@dataclass(frozen=True)
class ScoreShaping:
    """What happens to each completion's total reward before it enters the per-token rewards, in this order."""

    missing_eos_penalty: float | None = None
    """Subtract this from the score of responses truncated without EOS; null: none."""
    whiten: bool = False
    """Whiten the scores over the rollout (mean and std over every rank)."""
    scale: float = 1.0
    """Multiply the scores by this factor."""
    clip: float | None = None
    """Clip the scores to ``[-clip, clip]``; null: no clipping."""

    def __post_init__(self) -> None:
        _check(self.clip is None or self.clip > 0, "scores.clip", "> 0 or null", self.clip)


@dataclass(frozen=True)
class ValueTraining:
    """How the value model (``policy.critic``) is trained."""

    coef: float = 0.1
    """Weight of the value loss in PPO's joint loss."""
    clip: float | None = 0.2
    """Clip new values to ``old -/+ clip`` in the value loss; null: no clipping."""
    lr_scale: float = 1.0
    """Learning rate of the value head and critic relative to the policy's (PPO's single optimizer); a
    zero-initialised head needs many more steps than the policy to reach the scale of the returns."""
    warmup_rollouts: int = 0
    """Rollouts at the start of training that update only the value model."""

    def __post_init__(self) -> None:
        _check(self.coef >= 0, "value.coef", ">= 0", self.coef)
        _check(self.clip is None or self.clip > 0, "value.clip", "> 0 or null", self.clip)
        _check(self.lr_scale > 0, "value.lr_scale", "> 0", self.lr_scale)
        _check(self.warmup_rollouts >= 0, "value.warmup_rollouts", ">= 0", self.warmup_rollouts)


@dataclass(frozen=True)
class Evaluation:
    """Held-out evaluation of the RL modules (each validation prompt answered once)."""

    sampling: HeldOutSampling | None = None
    """How held-out completions are drawn; null: greedy with the training ``sampling.max_new_tokens``. Its
    ``engine`` unset: the training engine (``sampling.engine`` and its settings)."""
    accuracy_reward: str | None = None
    """Reward whose value counts for ``val/accuracy``; null: the first eval reward, else the first reward."""
    accuracy_threshold: float = 1.0
    """A held-out completion is accurate when that reward is at least this."""


@dataclass(frozen=True)
class TrustRegion:
    """TRPO's policy step: the natural gradient by conjugate gradient, then a backtracking line search."""

    max_kl: float = 0.01
    """Trust-region radius delta: bound on the mean KL(old || new) over valid response tokens."""
    damping: float = 0.1
    """Added to the Fisher's diagonal in the Fisher-vector products (makes CG well posed)."""
    cg_iters: int = 10
    """Conjugate-gradient iterations (Fisher-vector products) per policy step."""
    cg_tol: float = 1e-10
    """Stop CG early when the relative residual falls to this."""
    backtrack_ratio: float = 0.5
    """Factor by which the line search shrinks a rejected step."""
    max_backtracks: int = 10
    """Shrinks tried after the full step before the step is rejected."""
    accept_ratio: float = 0.0
    """Required share of the linearly expected improvement (0: any improvement)."""
    fisher_fraction: float = 1.0
    """Share of the rollout's rows used for Fisher-vector products (cost vs. accuracy)."""

    def __post_init__(self) -> None:
        _check(self.max_kl > 0, "trust_region.max_kl", "> 0", self.max_kl)
        _check(0 < self.backtrack_ratio < 1, "trust_region.backtrack_ratio", "a value in (0, 1)", self.backtrack_ratio)
        for key in ("damping", "cg_tol", "accept_ratio", "max_backtracks"):
            _check(getattr(self, key) >= 0, f"trust_region.{key}", ">= 0", getattr(self, key))
        _check(self.cg_iters >= 1, "trust_region.cg_iters", ">= 1", self.cg_iters)
        _check(0 < self.fisher_fraction <= 1, "trust_region.fisher_fraction", "a value in (0, 1]", self.fisher_fraction)


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), added to every completion's
    reward (:func:`align.core.shaping.overlong_penalty`) and logged as the reward part ``overlong``."""

    buffer: int | None = None
    """``L_cache``: the penalty falls linearly from 0 to -1 over the last ``buffer`` tokens up to ``max_length``;
    0 or null: off."""
    max_length: int | None = None
    """``L_max``: responses longer than this get -1; null: ``sampling.max_new_tokens``."""
    coef: float = 1.0
    """Weight of the penalty in the training reward."""

    def __post_init__(self) -> None:
        _check(self.buffer is None or self.buffer >= 0, "overlong.buffer", ">= 0 or null", self.buffer)
        _check(self.max_length is None or self.max_length >= 1, "overlong.max_length", ">= 1 or null", self.max_length)
        _check(self.coef >= 0, "overlong.coef", ">= 0", self.coef)
        if self.buffer and self.max_length is not None:  # enabled, with its own L_max
            _check(
                self.buffer <= self.max_length,
                "overlong.buffer",
                f"<= overlong.max_length ({self.max_length})",
                self.buffer,
            )

    @property
    def enabled(self) -> bool:
        return bool(self.buffer)

    def resolve(self, max_new_tokens: int) -> int:
        """``L_max`` for a run that samples at most ``max_new_tokens``; checks the buffer against it."""
        max_length = self.max_length or max_new_tokens
        _check(
            not self.buffer or self.buffer <= max_length,  # off, or within L_max
            "overlong.buffer",
            f"<= sampling.max_new_tokens ({max_length}) when overlong.max_length is null",
            self.buffer,
        )
        return max_length
