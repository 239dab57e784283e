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

import torch
import torch.nn.functional as F

from align.core.masks import fill_masked

__all__ = ["generalized_jsd", "reverse_kl_advantages"]


@torch.no_grad()
def reverse_kl_advantages(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """``(B, T)`` per-token advantages ``log pi_T(y_t) - log pi_S(y_t)`` of the student's sampled tokens: minus the
    single-sample estimate of the reverse KL ``KL(pi_S || pi_T)`` at that position. Positive where the teacher likes
    the token more than the student; 0 at padding (``mask`` False) whatever the inputs hold there. Its policy gradient
    ``-A_t * grad log pi_S(y_t)``, summed over tokens sampled from the student, is an unbiased estimate of the gradient
    of the summed per-position reverse KL, each position taken as fixed (no credit for later tokens)."""
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"reverse_kl_advantages: student {tuple(student_logprobs.shape)} and teacher "
            f"{tuple(teacher_logprobs.shape)} log-probs must have one shape"
        )
    valid = None if mask is None else mask.bool()
    return fill_masked(teacher_logprobs.float(), valid) - fill_masked(student_logprobs.float(), valid)


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    # KL(p || q) over the last dimension from log-probabilities; 0 * log 0 counts as 0. Where p = 0 the term is
    # computed on the placeholder log p = log q = 0 and discarded: its inputs, not only its output, are replaced, so
    # no 0 * inf reaches the gradient (a where over an infinite branch passes NaN back to the logits).
    support = p_log > -math.inf  # (..., V)
    p_safe = torch.where(support, p_log, 0.0)
    q_safe = torch.where(support, q_log, 0.0)
    return torch.where(support, p_safe.exp() * (p_safe - q_safe), 0.0).sum(-1)


def generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5, temperature: float = 1.0
) -> torch.Tensor:
    """GKD's generalized Jensen-Shannon divergence per position, ``(..., V) -> (...)``, with gradients through the
    student only (the teacher's logits are detached).

    With ``P`` the teacher's and ``Q`` the student's next-token distribution (softmax of the logits divided by
    ``temperature``) and the mixture ``M = beta * P + (1 - beta) * Q``::

        JSD(beta) = beta * KL(P || M) + (1 - beta) * KL(Q || M)

    for ``0 < beta < 1``; ``beta = 0`` is the forward KL ``KL(P || Q)`` and ``beta = 1`` the reverse KL
    ``KL(Q || P)`` (the limits of ``JSD(beta) / beta`` and ``JSD(beta) / (1 - beta)``, as in the paper and TRL).
    Computed in float32 from log-softmaxes (the mixture by ``logsumexp``), so no probability underflows to ``log 0``.
    A logit of ``-inf`` (a masked vocabulary: top-k filtered, padded) is a probability of exactly 0, whose terms
    count as 0: the value and the student's gradient are those of the divergence over the entries with mass, and a
    masked student logit's gradient is 0. (The divergence is infinite where one side has mass the other cannot
    reach: a student-masked entry the teacher gives mass at ``beta = 0``, or the reverse at ``beta = 1``.)
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"generalized_jsd: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ; the teacher must share the student's vocabulary"
        )
    if temperature <= 0:
        raise ValueError(f"generalized_jsd: temperature must be > 0, got {temperature}")
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    if beta == 0.0:
        return _kl(teacher, student)
    if beta == 1.0:
        return _kl(student, teacher)
    # log M, where M = 0 (both distributions masked) on the placeholder log P = log Q = 0: no KL term reads it there,
    # and logsumexp's gradient at an all -inf entry is NaN (exp(-inf - -inf)).
    neither = (teacher == -math.inf) & (student == -math.inf)  # (..., V)
    mixture = torch.logsumexp(
        torch.stack(
            [
                teacher.masked_fill(neither, 0.0) + math.log(beta),
                student.masked_fill(neither, 0.0) + math.log(1.0 - beta),
            ]
        ),
        dim=0,
    )
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)
