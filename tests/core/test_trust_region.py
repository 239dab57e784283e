"""Trust-region math on a small softmax policy whose Fisher matrix can be formed explicitly.

The policy: ``S`` states with features ``x_s`` (d,), logits ``W x_s`` over ``A`` actions, parameters ``W`` (A, d).
Its Fisher information, the Hessian of the mean KL at the current parameters, is formed from per-state
Jacobians (analytic KL) or per-sample score vectors (sampled KL) and compared with the double-backprop
products of :mod:`align.core.trust_region`.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from align.core.kl import kl_estimate
from align.core.masks import masked_mean
from align.core.trust_region import (
    backtracking_line_search,
    conjugate_gradient,
    fisher_vector_product,
    fisher_vector_product_fn,
    flat_grad,
    flatten,
    scale_to_trust_region,
    trpo_step,
    unflatten,
)

FAST = settings(max_examples=25, deadline=None)
DT = torch.float64


class SoftmaxPolicy:
    """``pi(a | s) = softmax(W x_s)``; float64 so the comparisons are tight."""

    def __init__(self, n_states=5, n_actions=4, dim=3, seed=0, scale=1.0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n_states, dim, generator=g, dtype=DT)  # (S, d)
        self.w = (scale * torch.randn(n_actions, dim, generator=g, dtype=DT)).requires_grad_()  # (A, d)
        self.generator = g

    def logits(self, w=None):
        return self.x @ (self.w if w is None else w).T  # (S, A)

    def log_probs(self, w=None):
        return torch.log_softmax(self.logits(w), dim=-1)  # (S, A)

    def analytic_kl(self, old_log_probs):
        """Mean over states of KL(old || current), exact over the actions."""
        new = self.log_probs()
        return (old_log_probs.exp() * (old_log_probs - new)).sum(-1).mean()

    def explicit_fisher(self):
        """``mean_s J_s^T (diag p_s - p_s p_s^T) J_s`` with ``J_s = d logits_s / d vec(W)``."""
        w = self.w.detach()
        jac = torch.autograd.functional.jacobian(lambda v: self.logits(v.view_as(w)), w.reshape(-1))  # (S, A, P)
        p = torch.softmax(self.logits(w), -1)  # (S, A)
        cov = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # (S, A, A)
        return torch.einsum("sap,sab,sbq->pq", jac, cov, jac) / p.shape[0]

    def sample(self, per_state=3):
        """``(S, K)`` actions sampled from the current policy."""
        probs = torch.softmax(self.logits().detach(), -1)
        return torch.multinomial(probs, per_state, replacement=True, generator=self.generator)


def taken_logprobs(policy, actions, w=None):
    return policy.log_probs(w).gather(1, actions)  # (S, K)


# ---------------------------------------------------------------- flat vectors


def test_flatten_unflatten_round_trip_and_size_check():
    a, b = torch.arange(6.0).view(2, 3), torch.tensor([7.0, 8.0])
    flat = flatten([a, b])
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    back = unflatten(flat, [a, b])
    assert torch.equal(back[0], a) and torch.equal(back[1], b)
    with pytest.raises(ValueError, match="7 elements but the tensors hold 8"):
        unflatten(flat[:7], [a, b])
    with pytest.raises(ValueError, match="no tensors"):
        flatten([])


def test_flat_grad_gives_zeros_for_unused_parameters():
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    unused = torch.zeros(3, requires_grad=True)
    assert flat_grad((a**2).sum(), [a, unused]).tolist() == [2.0, 4.0, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------- Fisher-vector products


def test_fvp_pinned_on_two_uniform_actions():
    # One state, tabular logits theta = (0, 0): p = (0.5, 0.5), F = diag(p) - p p^T = [[.25, -.25], [-.25, .25]].
    theta = torch.zeros(2, dtype=DT, requires_grad=True)
    old = torch.log_softmax(theta.detach(), -1)
    new = torch.log_softmax(theta, -1)
    kl = (old.exp() * (old - new)).sum()
    v = torch.tensor([1.0, 0.0], dtype=DT)
    assert fisher_vector_product(kl, [theta], v).tolist() == pytest.approx([0.25, -0.25])
    assert fisher_vector_product(kl, [theta], v, damping=0.1).tolist() == pytest.approx([0.35, -0.25])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fvp_of_the_analytic_kl_matches_the_explicit_fisher(seed):
    policy = SoftmaxPolicy(seed=seed)
    old = policy.log_probs().detach()
    fisher = policy.explicit_fisher()  # (P, P)
    fvp = fisher_vector_product_fn(policy.analytic_kl(old), [policy.w], damping=0.05)
    for k in range(3):
        v = torch.randn(fisher.shape[0], dtype=DT, generator=torch.Generator().manual_seed(100 + k))
        torch.testing.assert_close(fvp(v), fisher @ v + 0.05 * v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["k2", "k3"])
def test_fvp_of_the_sampled_kl_is_the_fisher_of_the_sampled_tokens(kind):
    # The module's KL: kl_estimate(old, new) over sampled tokens, masked mean over valid ones. Its Hessian at
    # theta_old is the mean outer product of the score vectors of the valid samples (a Monte-Carlo Fisher).
    policy = SoftmaxPolicy(n_states=4, n_actions=5, dim=3, seed=3)
    actions = policy.sample(per_state=3)  # (S, K)
    mask = torch.ones_like(actions, dtype=torch.bool)
    mask[1, 2] = mask[3, 1:] = False  # padding: excluded from the Fisher
    old = taken_logprobs(policy, actions).detach()
    kl = masked_mean(kl_estimate(old, taken_logprobs(policy, actions), kind), mask)
    w = policy.w.detach()
    scores = torch.autograd.functional.jacobian(
        lambda v: taken_logprobs(policy, actions, v.view_as(w)), w.reshape(-1)
    )  # (S, K, P)
    g = scores[mask]  # (n_valid, P)
    fisher = g.T @ g / g.shape[0]
    v = torch.randn(fisher.shape[0], dtype=DT, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(fisher_vector_product(kl, [policy.w], v), fisher @ v, rtol=1e-10, atol=1e-12)


def test_fvp_checks_the_vector_shape_and_a_constant_kl_gives_pure_damping():
    w = torch.ones(3, requires_grad=True)
    fvp = fisher_vector_product_fn((w * 0).sum(), [w], damping=0.5)
    assert fvp(torch.tensor([1.0, 2.0, 3.0])).tolist() == [0.5, 1.0, 1.5]
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        fvp(torch.ones(4))


# ---------------------------------------------------------------- conjugate gradient


def test_cg_pinned_two_by_two_converges_in_two_steps():
    a = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=DT)
    b = torch.tensor([1.0, 2.0], dtype=DT)
    result = conjugate_gradient(lambda v: a @ v, b, max_iters=10, tol=1e-12)
    torch.testing.assert_close(result.solution, torch.tensor([1 / 11, 7 / 11], dtype=DT))
    assert result.iterations == 2 and result.converged and result.residual <= 1e-12


@pytest.mark.parametrize("seed", [0, 1])
def test_cg_on_the_damped_fisher_solves_to_tolerance_and_reports_the_true_residual(seed):
    policy = SoftmaxPolicy(n_states=6, n_actions=4, dim=3, seed=seed)
    fvp = fisher_vector_product_fn(policy.analytic_kl(policy.log_probs().detach()), [policy.w], damping=0.1)
    matrix = policy.explicit_fisher() + 0.1 * torch.eye(12, dtype=DT)
    b = torch.randn(12, dtype=DT, generator=torch.Generator().manual_seed(seed))
    result = conjugate_gradient(fvp, b, max_iters=50, tol=1e-10)
    assert result.converged and result.residual <= 1e-10
    true_residual = float((b - matrix @ result.solution).norm() / b.norm())
    assert true_residual <= 1e-9
    torch.testing.assert_close(result.solution, torch.linalg.solve(matrix, b), rtol=1e-8, atol=1e-10)
    # Stopped early: the reported residual is the true one of the returned iterate, above the tolerance.
    short = conjugate_gradient(fvp, b, max_iters=2, tol=1e-10)
    assert short.iterations == 2 and not short.converged
    assert short.residual == pytest.approx(float((b - matrix @ short.solution).norm() / b.norm()), rel=1e-6)
    assert short.residual > result.residual


def test_cg_zero_right_hand_side():
    result = conjugate_gradient(lambda v: 2 * v, torch.zeros(3))
    assert result.iterations == 0 and result.converged and result.residual == 0.0
    assert torch.equal(result.solution, torch.zeros(3))


# ---------------------------------------------------------------- step scaling and line search


def test_scale_to_trust_region_pinned():
    # s = (1, 0), F s = (2, 0): s^T F s = 2; delta = 0.01 -> scale sqrt(0.02 / 2) = 0.1
    step, shs = scale_to_trust_region(torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0]), 0.01)
    assert shs == 2.0
    torch.testing.assert_close(step, torch.tensor([0.1, 0.0]))
    assert 0.5 * 2.0 * 0.1**2 == pytest.approx(0.01)  # the quadratic KL of the step is delta
    zero, _ = scale_to_trust_region(torch.tensor([1.0]), torch.tensor([0.0]), 0.01)
    assert torch.equal(zero, torch.zeros(1))


def test_line_search_backtracks_until_the_kl_bound_holds():
    # Surrogate x, "KL" x**2, full step 1 from x = 0 and delta = 0.3: f = 1 gives KL 1 (rejected),
    # f = 0.5 gives KL 0.25 (accepted) with improvement 0.5.
    x = torch.zeros(1, requires_grad=True)

    def evaluate():
        return (x.detach().sum(), x.detach().square().sum())

    result = backtracking_line_search([x], torch.ones(1), evaluate, 0.0, max_kl=0.3, expected_improvement=1.0)
    assert result.accepted and result.fraction == 0.5 and result.steps == 2
    assert result.improvement == 0.5 and result.kl == 0.25 and result.expected_improvement == 0.5
    assert x.item() == 0.5


def test_line_search_accept_ratio_asks_for_a_share_of_the_expected_improvement():
    # Surrogate x - 2 x**2 from 0: f = 1 improves by -1, f = .5 by 0, f = .25 by .125 = 0.5 * (.25 * 1).
    x = torch.zeros(1)

    def evaluate():
        return (float(x - 2 * x**2), 0.0)

    strict = backtracking_line_search([x], torch.ones(1), evaluate, 0.0, 1.0, 1.0, accept_ratio=0.6)
    assert strict.fraction == 0.125
    x.zero_()
    loose = backtracking_line_search([x], torch.ones(1), evaluate, 0.0, 1.0, 1.0, accept_ratio=0.5)
    assert loose.fraction == 0.25


@pytest.mark.parametrize("failure", ["no_improvement", "kl_too_large", "nan"])
def test_rejected_line_search_restores_parameters_bit_for_bit(failure):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(7, 3, generator=g) * 1e3, torch.randn(5, generator=g) * 1e-3]
    for p in params:
        p.requires_grad_()
    before = [p.detach().clone() for p in params]
    step = torch.randn(26, generator=g) * 0.37  # not representable round trips: old + f*s - f*s != old
    values = {"no_improvement": (-1.0, 0.0), "kl_too_large": (1.0, 1.0), "nan": (float("nan"), 0.0)}[failure]
    calls = []

    def evaluate():
        return calls.append(1) or values

    result = backtracking_line_search(params, step, evaluate, 0.0, max_kl=0.01, max_backtracks=4)
    assert not result.accepted and result.steps == 5 and len(calls) == 5
    assert (result.fraction, result.improvement, result.kl) == (0.0, 0.0, 0.0)
    for p, b in zip(params, before):
        assert torch.equal(p.detach().view(torch.int32), b.view(torch.int32))


def _trpo_problem(policy, actions, advantages, old):
    """Surrogate gradient, Fisher product and evaluation of the sampled-token surrogate with analytic KL."""

    def surrogate(w=None):
        ratio = torch.exp(taken_logprobs(policy, actions, w) - old)  # (S, K)
        return (ratio * advantages).mean()

    def evaluate():
        with torch.no_grad():
            return surrogate(), policy.analytic_kl(old_full)

    old_full = policy.log_probs().detach()
    grad = flat_grad(surrogate(), [policy.w])
    fvp = fisher_vector_product_fn(policy.analytic_kl(old_full), [policy.w], damping=1e-3)
    with torch.no_grad():
        before = surrogate()
    return grad, fvp, evaluate, before, old_full


@given(seed=st.integers(0, 10_000), max_kl=st.sampled_from([1e-3, 1e-2, 0.05, 0.3]), scale=st.floats(0.1, 3.0))
@FAST
def test_every_accepted_trpo_step_improves_the_surrogate_within_the_kl_bound(seed, max_kl, scale):
    policy = SoftmaxPolicy(n_states=6, n_actions=4, dim=3, seed=seed, scale=scale)
    actions = policy.sample(per_state=2)
    old = taken_logprobs(policy, actions).detach()
    advantages = torch.randn(actions.shape, dtype=DT, generator=torch.Generator().manual_seed(seed))
    grad, fvp, evaluate, before, old_full = _trpo_problem(policy, actions, advantages, old)
    w_old = policy.w.detach().clone()
    result = trpo_step([policy.w], grad, fvp, evaluate, before, max_kl, cg_iters=20)
    with torch.no_grad():
        kl_after = float(policy.analytic_kl(old_full))
        surrogate_after = float((torch.exp(taken_logprobs(policy, actions) - old) * advantages).mean())
    if result.accepted:
        assert kl_after <= max_kl and result.kl == pytest.approx(kl_after)
        assert surrogate_after > float(before)
        assert result.improvement == pytest.approx(surrogate_after - float(before))
    else:
        assert torch.equal(policy.w.detach(), w_old)


def test_trpo_step_with_a_small_trust_region_lands_on_its_boundary():
    # For small delta the quadratic model is accurate: the full step is accepted and its measured KL is
    # close to delta (slightly below: the damping adds to s^T F s).
    policy = SoftmaxPolicy(n_states=8, n_actions=4, dim=3, seed=11)
    actions = policy.sample(per_state=4)
    old = taken_logprobs(policy, actions).detach()
    advantages = torch.randn(actions.shape, dtype=DT, generator=torch.Generator().manual_seed(1))
    grad, fvp, evaluate, before, _ = _trpo_problem(policy, actions, advantages, old)
    damped = policy.explicit_fisher() + 1e-3 * torch.eye(12, dtype=DT)
    natural = torch.linalg.solve(damped, grad)  # F^-1 g
    expected_step = natural * math.sqrt(2 * 1e-4 / float(natural @ damped @ natural))
    w_old = policy.w.detach().clone()
    result = trpo_step([policy.w], grad, fvp, evaluate, before, max_kl=1e-4, cg_iters=30)
    assert result.accepted and result.line_search_steps == 1 and result.fraction == 1.0
    assert 0.9e-4 <= result.kl <= 1e-4
    assert result.cg_residual < 1e-8
    assert result.improvement == pytest.approx(result.expected_improvement, rel=0.05)
    torch.testing.assert_close(flatten([policy.w.detach() - w_old]), expected_step, rtol=1e-6, atol=1e-9)


def test_trpo_step_with_zero_gradient_does_not_move():
    w = torch.ones(3, requires_grad=True)
    result = trpo_step([w], torch.zeros(3), lambda v: v, lambda: (1.0, 0.0), 0.0, max_kl=0.01)
    assert not result.accepted and result.cg_iterations == 0 and torch.equal(w.detach(), torch.ones(3))
    assert math.isfinite(result.cg_residual)
