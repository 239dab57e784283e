"""The math of on-policy distillation: a teacher's token log-probs as a dense per-token reward, and GKD's generalized
Jensen-Shannon divergence over whole next-token distributions.

* :func:`reverse_kl_advantages`: the on-policy distillation recipe (Agarwal et al. 2024, arXiv 2306.13649, section
  on RL; Lu & Thinking Machines 2025, "On-Policy Distillation"): for the student's own sampled token ``y_t``, the
  per-token reverse KL estimate ``log pi_S(y_t) - log pi_T(y_t)`` is a cost, and its negation the token's advantage,
  with no discounting (each token is charged its own term only).
* :func:`generalized_jsd`: GKD's ``JSD(beta)`` (Agarwal et al. 2024, arXiv 2306.13649, eq. 2) between the teacher's
  and the student's distributions at every response position; ``beta`` 0 and 1 are the forward and reverse KL.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from align.core.masks import fill_masked

__all__ = ["generalized_jsd", "reverse_kl_advantages"]


@torch.no_grad()
def reverse_kl_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                          mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``(B, T)`` per-token advantages ``log pi_T(y_t) - log pi_S(y_t)`` of the student's sampled tokens: minus the
    single-sample estimate of the reverse KL ``KL(pi_S || pi_T)`` at that position. Positive where the teacher likes
    the token more than the student; 0 at padding (``mask`` False) whatever the inputs hold there. Its policy gradient
    ``-A_t * grad log pi_S(y_t)``, summed over tokens sampled from the student, is an unbiased estimate of the gradient
    of the summed per-position reverse KL, each position taken as fixed (no credit for later tokens)."""
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(f"reverse_kl_advantages: student {tuple(student_logprobs.shape)} and teacher "
                         f"{tuple(teacher_logprobs.shape)} log-probs must have one shape")
    valid = None if mask is None else mask.bool()
    return fill_masked(teacher_logprobs.float(), valid) - fill_masked(student_logprobs.float(), valid)


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    # KL(p || q) over the last dimension from log-probabilities; 0 * log 0 counts as 0.
    return torch.where(p_log > -math.inf, p_log.exp() * (p_log - q_log), torch.zeros_like(p_log)).sum(-1)


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5,
                    temperature: float = 1.0) -> torch.Tensor:
    """GKD's generalized Jensen-Shannon divergence per position, ``(..., V) -> (...)``, with gradients through the
    student only (the teacher's logits are detached).

    With ``P`` the teacher's and ``Q`` the student's next-token distribution (softmax of the logits divided by
    ``temperature``) and the mixture ``M = beta * P + (1 - beta) * Q``::

        JSD(beta) = beta * KL(P || M) + (1 - beta) * KL(Q || M)

    for ``0 < beta < 1``; ``beta = 0`` is the forward KL ``KL(P || Q)`` and ``beta = 1`` the reverse KL
    ``KL(Q || P)`` (the limits of ``JSD(beta) / beta`` and ``JSD(beta) / (1 - beta)``, as in the paper and TRL).
    Computed in float32 from log-softmaxes (the mixture by ``logsumexp``), so no probability underflows to ``log 0``.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"generalized_jsd: student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ; the teacher must share the student's vocabulary")
    if temperature <= 0:
        raise ValueError(f"generalized_jsd: temperature must be > 0, got {temperature}")
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    if beta == 0.0:
        return _kl(teacher, student)
    if beta == 1.0:
        return _kl(student, teacher)
    mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log(1.0 - beta)]), dim=0)
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)
