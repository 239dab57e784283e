import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from align.core.kl import AdaptiveKLController, FixedKLController, KLController, kl_estimate

FAST = settings(max_examples=50, deadline=None)


# ---------------------------------------------------------------- pinned estimator values


def test_estimators_pinned_at_log_ratio_one():
    # log_r = logp - ref = 0 - (-1) = 1
    logp, ref = torch.tensor([0.0]), torch.tensor([-1.0])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5)  # 0.5 * 1**2
    # k3 = exp(ref - logp) - (ref - logp) - 1 = e**-1 + 1 - 1 = e**-1
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-1.0))


def test_estimators_pinned_at_log_ratio_minus_one():
    logp, ref = torch.tensor([-1.0]), torch.tensor([0.0])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-1.0)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5)
    # k3 = e**1 - 1 - 1 = e - 2
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.e - 2.0)


def test_estimators_are_zero_when_models_agree():
    x = torch.tensor([-3.0, -0.1, -7.5])
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(kl_estimate(x, x, kind), torch.zeros(3))


def test_log_ratio_is_clamped():
    logp, ref = torch.tensor([0.0, -50.0]), torch.tensor([-30.0, 0.0])  # log_r = 30, -50
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([20.0, -20.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k1", clamp=5.0), torch.tensor([5.0, -5.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k1", clamp=None), torch.tensor([30.0, -50.0]))
    # clamped k3 at log_r = -20 without its bound: exp(20) - 20 - 1, finite but ~5e8
    k3 = kl_estimate(logp, ref, "k3", k3_max=None)
    assert torch.isfinite(k3).all()
    assert k3[1].item() == pytest.approx(math.exp(20.0) - 21.0, rel=1e-6)


def test_k3_is_bounded_above_with_no_gradient_beyond_the_bound():
    # log_r = 20, -2, -20: k3 = e^-20 + 19 (= 19.0), e^2 - 3 (= 4.389), e^20 - 21; bounded at 10 by default.
    logp = torch.tensor([20.0, -2.0, -20.0], requires_grad=True)
    k3 = kl_estimate(logp, torch.zeros(3), "k3")
    torch.testing.assert_close(k3, torch.tensor([10.0, math.exp(2.0) - 3.0, 10.0]))
    k3.sum().backward()
    # d k3 / d log_r = 1 - exp(-log_r): 0 beyond the bound, 1 - e^2 at log_r = -2
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 1.0 - math.exp(2.0), 0.0]))
    torch.testing.assert_close(kl_estimate(logp, torch.zeros(3), "k3", k3_max=2.5)[1], torch.tensor(2.5))
    torch.testing.assert_close(kl_estimate(logp, torch.zeros(3), "k2"), torch.tensor([200.0, 2.0, 200.0]))
    with pytest.raises(ValueError, match="k3_max must be > 0"):
        kl_estimate(logp, torch.zeros(3), "k3", k3_max=0.0)


def test_unknown_kind_and_bad_clamp():
    with pytest.raises(ValueError, match=r"'k1', 'k2', 'k3'"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    with pytest.raises(ValueError, match="clamp"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k1", clamp=0.0)


@given(st.floats(-40, 40), st.floats(-40, 40))
@FAST
def test_k2_and_k3_never_negative(a, b):
    logp, ref = torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64)
    assert kl_estimate(logp, ref, "k2").item() >= 0.0
    assert kl_estimate(logp, ref, "k3").item() >= 0.0
    assert kl_estimate(logp.float(), ref.float(), "k3").item() >= 0.0


# ---------------------------------------------------------------- bias, by exact expectation and sampling


def _categorical_pair(seed, vocab, spread):
    g = torch.Generator().manual_seed(seed)
    q_logits = torch.randn(vocab, generator=g, dtype=torch.float64)
    p_logits = q_logits + spread * torch.randn(vocab, generator=g, dtype=torch.float64)
    return torch.log_softmax(q_logits, -1), torch.log_softmax(p_logits, -1)


def _exact_kl(log_a, log_b):
    return (log_a.exp() * (log_a - log_b)).sum()


@given(st.integers(0, 2**31 - 1), st.integers(2, 12), st.sampled_from([0.05, 0.5, 2.0]))
@FAST
def test_k1_and_k3_are_unbiased_by_exact_expectation(seed, vocab, spread):
    log_q, log_p = _categorical_pair(seed, vocab, spread)  # sampling from q = policy
    kl = _exact_kl(log_q, log_p)
    q = log_q.exp()
    for kind in ("k1", "k3"):
        expectation = (q * kl_estimate(log_q, log_p, kind, k3_max=None)).sum()  # the bound is a departure
        assert expectation.item() == pytest.approx(kl.item(), rel=1e-9, abs=1e-12)
    # k2 is biased, but its bias is third order in the log-ratio: close for nearby models.
    k2 = (q * kl_estimate(log_q, log_p, "k2")).sum()
    if spread == 0.05:
        assert k2.item() == pytest.approx(kl.item(), rel=0.1)


def test_k2_is_biased_for_distant_models():
    log_q, log_p = _categorical_pair(0, 6, 2.0)
    q = log_q.exp()
    k2 = (q * kl_estimate(log_q, log_p, "k2")).sum()
    assert abs(k2.item() - _exact_kl(log_q, log_p).item()) > 0.05


@given(st.integers(0, 2**31 - 1))
@settings(max_examples=10, deadline=None, derandomize=True)  # statistical: fixed examples
def test_sample_means_converge_to_kl(seed):
    log_q, log_p = _categorical_pair(seed, 5, 0.3)
    kl = _exact_kl(log_q, log_p).item()
    n = 100_000
    x = torch.multinomial(log_q.exp(), n, replacement=True, generator=torch.Generator().manual_seed(seed))
    for kind in ("k1", "k3"):
        samples = kl_estimate(log_q[x], log_p[x], kind)
        stderr = samples.std().item() / math.sqrt(n)
        assert abs(samples.mean().item() - kl) < 5 * stderr + 1e-12
    # k2's sample mean converges too, but to E_q[k2], which is not the KL.
    samples = kl_estimate(log_q[x], log_p[x], "k2")
    k2_expectation = (log_q.exp() * kl_estimate(log_q, log_p, "k2")).sum().item()
    assert abs(samples.mean().item() - k2_expectation) < 5 * samples.std().item() / math.sqrt(n)


# ---------------------------------------------------------------- gradients used as a loss


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expected_gradient_of_each_estimator_used_as_a_loss(seed):
    # Samples x ~ q_theta held fixed, each estimator differentiated, expectation taken exactly.
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    log_p = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)

    def expected_grad(kind):
        log_q = torch.log_softmax(theta, -1)
        loss = (log_q.exp().detach() * kl_estimate(log_q, log_p, kind)).sum()
        return torch.autograd.grad(loss, theta)[0]

    log_q = torch.log_softmax(theta, -1)
    grad_kl_qp = torch.autograd.grad(_exact_kl(log_q, log_p), theta)[0]  # KL(q || p): the reported KL
    grad_kl_pq = torch.autograd.grad(_exact_kl(log_p, torch.log_softmax(theta, -1)), theta)[0]  # KL(p || q)

    torch.testing.assert_close(expected_grad("k1"), torch.zeros(6, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(expected_grad("k2"), grad_kl_qp)
    torch.testing.assert_close(expected_grad("k3"), grad_kl_pq)
    assert not torch.allclose(grad_kl_qp, grad_kl_pq, atol=1e-3)


# ---------------------------------------------------------------- controllers


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 512)
    assert ctl.value == 0.05
    assert ctl.state_dict() == {"value": 0.05}
    assert isinstance(ctl, KLController)
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-1.0)


@pytest.mark.parametrize(
    "current_kl, expected",
    [
        # err = clip(12 / 6 - 1, -0.2, 0.2) = 0.2; value = 0.2 * (1 + 0.2 * 256 / 10000) = 0.201024
        (12.0, 0.2 * (1 + 0.2 * 256 / 10000)),
        # err = 6.6 / 6 - 1 = 0.1 (inside the clip); 0.2 * (1 + 0.1 * 0.0256) = 0.200512
        (6.6, 0.200512),
        # err = clip(0 / 6 - 1) = -0.2; 0.2 * (1 - 0.2 * 0.0256) = 0.198976
        (0.0, 0.198976),
        # on target: unchanged
        (6.0, 0.2),
    ],
)
def test_adaptive_controller_one_update(current_kl, expected):
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    ctl.update(current_kl, n_steps=256)
    assert ctl.value == pytest.approx(expected, rel=1e-12)


def test_adaptive_controller_accepts_a_tensor_and_round_trips_state():
    ctl = AdaptiveKLController(0.2, 6.0, 10000)
    ctl.update(torch.tensor(12.0), 256)
    state = ctl.state_dict()
    restored = AdaptiveKLController(0.2, 6.0, 10000)
    restored.load_state_dict(state)
    assert restored.value == ctl.value == pytest.approx(0.201024)
    ctl.update(12.0, 256)
    restored.update(12.0, 256)
    assert restored.value == ctl.value


def test_adaptive_controller_rejects_bad_input():
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.2, 0.0, 10000)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.2, 6.0, 0)
    with pytest.raises(ValueError, match="init_kl_coef must be > 0 .* would stay at 0"):
        AdaptiveKLController(0.0, 6.0, 10000)
    ctl = AdaptiveKLController(0.2, 6.0, 10000)
    with pytest.raises(ValueError, match="current_kl"):
        ctl.update(float("nan"), 1)
    assert ctl.value == 0.2
