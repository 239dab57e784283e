"""Per-token KL estimators and KL-coefficient controllers.

Estimators follow J. Schulman, "Approximating KL divergence" (2020,
http://joschu.net/blog/kl-approx.html). Tokens are sampled from the policy
``q = pi_theta`` and compared with the reference ``p = pi_ref``. With the
log-ratio ``log_r = logp - ref_logp = log q(x)/p(x)``:

* ``k1 = log_r``: unbiased for KL(q || p), high variance, can be negative.
* ``k2 = 0.5 * log_r**2``: biased, low variance, always >= 0; close to the
  KL when q and p are close.
* ``k3 = exp(-log_r) + log_r - 1``: unbiased for KL(q || p), low variance,
  always >= 0.

These are statements about the *value* of the estimate. Used as a loss term
and differentiated with the samples held fixed, the estimators behave
differently (verl PR #2953 and TRL issue #4967 discuss this). On-policy, i.e.
with ``x ~ pi_theta``, the per-sample gradients are
``grad k1 = grad log q``, ``grad k2 = log_r * grad log q`` and
``grad k3 = (1 - p/q) * grad log q``, whose expectations under q are

* k1: 0 (the score function has mean zero; k1 only works as a reward, where
  the policy-gradient estimator supplies the missing term),
* k2: ``grad KL(q || p)``, the gradient of the KL we report,
* k3: ``-E_p[grad log q] = grad KL(p || q)``, the gradient of the *other*
  direction of the KL. It vanishes at q = p and still pulls the policy towards
  the reference, but it is not the gradient of the value it estimates.

``tests/core/test_kl.py`` checks all three by exact expectation over a
categorical distribution. What ``align`` does about it: PPO shapes ``k1`` into
the per-token reward (Ziegler et al. 2019, arXiv 1909.08593; Ouyang et al.
2022, arXiv 2203.02155), where the policy gradient makes it correct in
expectation. GRPO adds ``k3`` to the loss by default because that is the
estimator of the GRPO paper (Shao et al. 2024, arXiv 2402.03300); choosing
``k2`` there gives the on-policy gradient of KL(pi_theta || pi_ref) instead.
Off-policy minibatches (several PPO epochs on one rollout) add a further bias
to every choice, because no importance weight is applied to the KL term.

Departures: the log-ratio is clamped to ``[-clamp, clamp]`` before use, so one
token whose probability collapsed under either model cannot overflow ``exp``
in k3 or dominate a batch mean. The clamp has zero gradient outside the range.
That alone leaves k3 as large as ``e**20`` (and its gradient with it) for a
token the policy has made 20 nats less likely than the reference, so k3 is
also bounded above by ``k3_max`` (10 by default, as verl does), again with zero
gradient beyond the bound. k3 >= 0, so only the upper side needs a bound.

The adaptive controller is the one of Ziegler et al. 2019 (arXiv 1909.08593).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

__all__ = [
    "KLKind",
    "KL_ESTIMATORS",
    "kl_estimate",
    "KLController",
    "FixedKLController",
    "AdaptiveKLController",
]


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # (r - 1) - log r with r = p/q = exp(-log_ratio); expm1 keeps precision near 0.
    return torch.expm1(-log_ratio) + log_ratio


KLKind = Literal["k1", "k2", "k3"]
"""The name of a per-token KL estimator."""

KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: str = "k1",
    clamp: float | None = 20.0,
    k3_max: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from log-probs of tokens sampled by pi.

    Args:
        logprobs: ``(B, T)`` log-probs of the sampled tokens under the policy.
        ref_logprobs: ``(B, T)`` log-probs of the same tokens under the reference.
        kind: ``"k1"``, ``"k2"`` or ``"k3"`` (see the module docstring).
        clamp: bound on ``|logprobs - ref_logprobs|``; ``None`` disables it.
        k3_max: upper bound on each ``k3`` estimate (zero gradient above it); ``None`` disables it.

    Returns:
        ``(B, T)`` per-token estimates; padding is not masked here.
    """
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"kl_estimate: unknown kind {kind!r}; expected one of {sorted(KL_ESTIMATORS)}") from None
    log_ratio = logprobs - ref_logprobs  # (B, T)
    if clamp is not None:
        if clamp <= 0:
            raise ValueError(f"kl_estimate: clamp must be > 0 or None, got {clamp}")
        log_ratio = log_ratio.clamp(-clamp, clamp)
    estimate = estimator(log_ratio)
    if kind == "k3" and k3_max is not None:
        if k3_max <= 0:
            raise ValueError(f"kl_estimate: k3_max must be > 0 or None, got {k3_max}")
        estimate = estimate.clamp(max=k3_max)
    return estimate


def _as_finite_float(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


class KLController:
    """Holds the KL coefficient ``value`` and updates it once per optimizer step.

    ``update`` takes the KL already averaged over every rank (the caller
    all-reduces it), so all ranks compute the same coefficient.
    """

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(value={self.value:.6g})"


class FixedKLController(KLController):
    """A constant coefficient; ``update`` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        kl_coef = _as_finite_float("FixedKLController: kl_coef", kl_coef)
        if kl_coef < 0:
            raise ValueError(f"FixedKLController: kl_coef must be >= 0, got {kl_coef}")
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        return None


class AdaptiveKLController(KLController):
    """Proportional controller of Ziegler et al. 2019 (arXiv 1909.08593).

    ``err = clip(current_kl / target - 1, -0.2, 0.2)`` and
    ``value *= 1 + err * n_steps / horizon``, where ``n_steps`` is the number
    of samples (or steps, consistently with ``horizon``) since the last update.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        init_kl_coef = _as_finite_float("AdaptiveKLController: init_kl_coef", init_kl_coef)
        target = _as_finite_float("AdaptiveKLController: target", target)
        horizon = _as_finite_float("AdaptiveKLController: horizon", horizon)
        if init_kl_coef <= 0:
            raise ValueError(
                f"AdaptiveKLController: init_kl_coef must be > 0 (the update multiplies it, so a "
                f"controller started at 0 would stay at 0), got {init_kl_coef}"
            )
        if target <= 0:
            raise ValueError(f"AdaptiveKLController: target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = _as_finite_float("AdaptiveKLController.update: current_kl", current_kl)
        if n_steps < 0:
            raise ValueError(f"AdaptiveKLController.update: n_steps must be >= 0, got {n_steps}")
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
