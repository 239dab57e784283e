"""The distillation math against values worked out by hand."""

import math

import pytest
import torch

from align.core.distillation import generalized_jsd, reverse_kl_advantages


def logits(*probs):
    return torch.log(torch.tensor(probs))


P, Q = (0.5, 0.5), (0.9, 0.1)  # teacher, student


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_the_endpoints_are_the_forward_and_reverse_kl():
    # KL(P || Q) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5108; KL(Q || P) = 0.9 ln 1.8 + 0.1 ln 0.2 = 0.3681.
    forward = generalized_jsd(logits(*Q), logits(*P), beta=0.0)
    reverse = generalized_jsd(logits(*Q), logits(*P), beta=1.0)
    assert float(forward) == pytest.approx(0.5108256, abs=1e-6) == pytest.approx(kl(P, Q))
    assert float(reverse) == pytest.approx(0.3680642, abs=1e-6) == pytest.approx(kl(Q, P))


def test_the_mixture_at_beta_one_half_is_the_jensen_shannon_divergence():
    # M = (0.7, 0.3): KL(P || M) = 0.5 ln(5/7) + 0.5 ln(5/3) = 0.08718, KL(Q || M) = 0.9 ln(9/7) + 0.1 ln(1/3)
    # = 0.11632, JSD = 0.5 * 0.08718 + 0.5 * 0.11632 = 0.10175.
    m = (0.7, 0.3)
    expected = 0.5 * kl(P, m) + 0.5 * kl(Q, m)
    assert expected == pytest.approx(0.101749, abs=1e-6)
    assert float(generalized_jsd(logits(*Q), logits(*P), beta=0.5)) == pytest.approx(expected, abs=1e-6)
    # beta 0.9: M = 0.9 P + 0.1 Q = (0.54, 0.46).
    m = (0.54, 0.46)
    assert float(generalized_jsd(logits(*Q), logits(*P), beta=0.9)) == pytest.approx(
        0.9 * kl(P, m) + 0.1 * kl(Q, m), abs=1e-6
    )


def test_jsd_is_zero_when_the_student_is_the_teacher_and_has_gradient_through_the_student_only():
    teacher = torch.randn(2, 3, 7, requires_grad=True)
    student = teacher.detach().clone().requires_grad_()
    for beta in (0.0, 0.3, 1.0):
        assert torch.allclose(generalized_jsd(student, teacher, beta), torch.zeros(2, 3), atol=1e-6)
    student = torch.randn(2, 3, 7, requires_grad=True)
    generalized_jsd(student, teacher, 0.3).sum().backward()
    assert student.grad is not None and student.grad.abs().sum() > 0 and teacher.grad is None


def test_a_token_the_teacher_never_gives_costs_the_forward_kl_nothing():
    # P = (1, 0): KL(P || Q) = ln(1 / 0.9); the zero-probability token adds 0, not NaN.
    teacher = torch.tensor([0.0, -math.inf])
    assert float(generalized_jsd(logits(*Q), teacher, beta=0.0)) == pytest.approx(math.log(1 / 0.9))
    assert math.isfinite(float(generalized_jsd(logits(*Q), teacher, beta=0.5)))


def test_temperature_and_bad_settings():
    # Temperature 2 on log-probs halves them: P stays uniform, Q becomes (3/4, 1/4).
    got = generalized_jsd(logits(*Q), logits(*P), beta=0.0, temperature=2.0)
    assert float(got) == pytest.approx(kl(P, (0.75, 0.25)), abs=1e-6)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(logits(*Q), logits(*P), beta=1.5)
    with pytest.raises(ValueError, match="share the student's vocabulary"):
        generalized_jsd(torch.zeros(3), torch.zeros(4))


def test_reverse_kl_advantages_by_hand():
    # Student log-probs -1, -2 | -0.5, pad; teacher -0.5, -3 | -0.5, NaN at the padding.
    student = torch.tensor([[-1.0, -2.0], [-0.5, 7.0]])
    teacher = torch.tensor([[-0.5, -3.0], [-0.5, float("nan")]])
    mask = torch.tensor([[True, True], [True, False]])
    assert reverse_kl_advantages(student, teacher, mask).tolist() == [[0.5, -1.0], [0.0, 0.0]]


INF = math.inf
# (student logits, teacher logits) with -inf entries: a vocabulary masked for both (top-k filtered, padded), for the
# student only, for the teacher only. Student-only masking at beta 0 (and teacher-only at beta 1) makes the divergence
# infinite, a mass the other side cannot reach, and is left out.
MASKED = {
    "both": ([1.0, -INF, 0.5, -INF, 2.0], [0.2, -INF, 1.0, -INF, -0.3]),
    "student": ([1.0, -INF, 0.5, 0.1, 2.0], [0.2, 0.3, 1.0, -0.5, -0.3]),
    "teacher": ([1.0, 0.7, 0.5, 0.1, 2.0], [0.2, -INF, 1.0, -INF, -0.3]),
}


def jsd_over_the_support(student, teacher, beta):
    """GKD's JSD(beta) in float64, each distribution a softmax over its own finite logits only and exactly 0 on the
    rest, each KL summed over its first argument's support: no -inf ever enters a sum, a log or a gradient."""
    s_keep, t_keep = torch.isfinite(student), torch.isfinite(teacher)
    q = torch.zeros(student.shape, dtype=torch.float64).index_put((s_keep,), torch.softmax(student[s_keep], -1))
    p = torch.zeros(teacher.shape, dtype=torch.float64).index_put((t_keep,), torch.softmax(teacher[t_keep], -1))

    def kl(a, b, support):
        return (a[support] * (a[support].log() - b[support].log())).sum()

    if beta == 0.0:
        return kl(p, q, t_keep)
    if beta == 1.0:
        return kl(q, p, s_keep)
    m = beta * p + (1.0 - beta) * q
    return beta * kl(p, m, t_keep) + (1.0 - beta) * kl(q, m, s_keep)


@pytest.mark.parametrize(
    "masked, beta",
    [
        ("both", 0.0),
        ("both", 0.5),
        ("both", 1.0),
        ("student", 0.5),
        ("student", 1.0),
        ("teacher", 0.0),
        ("teacher", 0.5),
    ],
)
def test_a_masked_vocabulary_gives_the_sub_vocabularys_divergence_and_a_finite_gradient(masked, beta):
    # The value and the student's gradient are those of the divergence over the entries with mass; a masked student
    # logit gets gradient 0 (its probability stays 0), where 0 * inf in a discarded branch used to give NaN.
    student, teacher = (torch.tensor(v, dtype=torch.float64) for v in MASKED[masked])
    got_logits = student.float().requires_grad_()
    got = generalized_jsd(got_logits, teacher.float(), beta)
    got.backward()
    ref_logits = student.clone().requires_grad_()
    ref = jsd_over_the_support(ref_logits, teacher, beta)
    ref.backward()
    assert torch.isfinite(got_logits.grad).all()
    assert float(got.detach()) == pytest.approx(float(ref.detach()), abs=1e-6)
    torch.testing.assert_close(got_logits.grad.double(), ref_logits.grad, rtol=0, atol=1e-6)
    assert (got_logits.grad[~torch.isfinite(student)] == 0).all()
