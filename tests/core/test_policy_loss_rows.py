"""The CISPO, SAPO and GMPO rows of ``POLICY_LOSSES``, each against values worked out by hand from its paper."""

import math

import pytest
import torch

from align.core.policy_losses import POLICY_LOSSES, PolicyLossInputs, PolicyLossSettings


def inputs(log_ratios, advantages):
    """One row whose old log-probs are 0, so its log-probs are the log-ratios; every token valid."""
    logprobs = torch.tensor([log_ratios], requires_grad=True)
    adv = torch.tensor([advantages])
    return logprobs, PolicyLossInputs(logprobs, torch.zeros_like(adv), adv, torch.ones_like(adv, dtype=torch.bool))


def sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z))


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    # Ratios 0.5, 1, 2, 6 with advantages 1, -1, 1, 1. Defaults: no lower bound (clip_low 1), cap 1 + 4 = 5.
    # Weights 0.5, 1, 2, 5: per-token terms -0.5, +1, -2, -5, token mean -1.625; the gradient of token t is
    # -w_t * A_t / 4: -0.125, 0.25, -0.5, -1.25 (PPO's clip would drop tokens 3 and 4). One weight clipped.
    logprobs, x = inputs([math.log(0.5), 0.0, math.log(2.0), math.log(6.0)], [1.0, -1.0, 1.0, 1.0])
    row = POLICY_LOSSES["cispo"]
    loss, stats = row(x, PolicyLossSettings(clip_low=row.clip_low, clip_high=row.clip_high))
    torch.testing.assert_close(loss, torch.tensor(-1.625))
    assert float(stats.clipfrac) == 0.25
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.125, 0.25, -0.5, -1.25]]))


def test_cispo_in_the_papers_convention_with_a_lower_bound():
    # clip_low 0.2, clip_high 0.28: ratio 0.5 -> weight 0.8 and 2 -> 1.28, both clipped; their gradient is kept.
    logprobs, x = inputs([math.log(0.5), math.log(2.0)], [1.0, 1.0])
    loss, stats = POLICY_LOSSES["cispo"](x, PolicyLossSettings(clip_low=0.2, clip_high=0.28))
    torch.testing.assert_close(loss, torch.tensor(-(0.8 + 1.28) / 2))
    assert float(stats.clipfrac) == 1.0
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.4, -0.64]]))


def test_cispo_gradient_is_the_papers_weighted_log_prob_gradient():
    # The paper's objective sg(w) * A * log pi, differentiated by autograd, against the row's gradient.
    torch.manual_seed(0)
    logprobs = torch.randn(3, 5, requires_grad=True)
    old, adv, mask = torch.randn(3, 5), torch.randn(3, 5), torch.rand(3, 5) > 0.3
    loss, _ = POLICY_LOSSES["cispo"](PolicyLossInputs(logprobs, old, adv, mask), PolicyLossSettings(0.2, 0.28))
    (grad,) = torch.autograd.grad(loss, logprobs)
    weight = torch.exp(logprobs.detach() - old).clamp(0.8, 1.28)
    paper = -(weight * adv * logprobs)[mask].sum() / mask.sum()
    (paper_grad,) = torch.autograd.grad(paper, logprobs)
    torch.testing.assert_close(grad, paper_grad)


def test_sapo_gate_by_hand():
    # Token 1: ratio 1, A = 1, tau_pos 1: f = 4 * sigmoid(0) = 2, term -2, gate weight 4 * 0.25 = 1.
    # Token 2: ratio 2, A = -1, tau_neg 1.05: s = sigmoid(1.05), f = 4 / 1.05 * s, term +f;
    # gradient d term / d log pi = +1 * 4 * s * (1 - s) * 2.
    logprobs, x = inputs([0.0, math.log(2.0)], [1.0, -1.0])
    loss, stats = POLICY_LOSSES["sapo"](x, PolicyLossSettings(tau_pos=1.0, tau_neg=1.05))
    s = sigmoid(1.05)
    torch.testing.assert_close(loss, torch.tensor((-2.0 + 4.0 / 1.05 * s) / 2))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0 / 2, 4 * s * (1 - s) * 2 / 2]]))
    torch.testing.assert_close(stats.clipfrac, torch.tensor((0.0 + 1 - 4 * s * (1 - s)) / 2))


def test_sapo_is_the_policy_gradient_on_policy():
    # At ratio 1 every gate weight is 1: the gradient is -A * grad log pi / n, as the clip row's.
    torch.manual_seed(1)
    logprobs = torch.randn(2, 4, requires_grad=True)
    adv, mask = torch.randn(2, 4), torch.rand(2, 4) > 0.2
    x = PolicyLossInputs(logprobs, logprobs.detach(), adv, mask)
    grads = [torch.autograd.grad(POLICY_LOSSES[n](x, PolicyLossSettings())[0], logprobs)[0] for n in ("sapo", "clip")]
    torch.testing.assert_close(grads[0], grads[1])


def test_sapo_temperatures_must_be_positive():
    _, x = inputs([0.0], [1.0])
    with pytest.raises(ValueError, match="sapo: temperatures must be > 0"):
        POLICY_LOSSES["sapo"](x, PolicyLossSettings(tau_pos=0.0))


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_gmpo_geometric_mean_by_hand(advantage):
    # Log-ratios log 2, log 0.5, 0; clip 0.4 in log space. A = +1 takes min(l, clip(l)): 0.4, -0.693, 0 (token 1
    # clipped); A = -1 takes max: 0.693, -0.4, 0 (token 2 clipped). s = exp(mean), loss -A * s on seq_mean; the
    # gradient of token t is -A * s / 3 where its log-ratio was kept, 0 where it was clipped.
    logprobs, x = inputs([math.log(2.0), math.log(0.5), 0.0], [advantage] * 3)
    loss, stats = POLICY_LOSSES["gmpo"](x, PolicyLossSettings(clip_low=0.4, agg="seq_mean"))
    kept = [0.4, math.log(0.5), 0.0] if advantage > 0 else [math.log(2.0), -0.4, 0.0]
    s = math.exp(sum(kept) / 3)
    torch.testing.assert_close(loss, torch.tensor(-advantage * s))
    assert float(stats.clipfrac) == pytest.approx(1 / 3)
    torch.testing.assert_close(stats.ratio_mean, torch.tensor(s))
    loss.backward()
    live = [0.0, 1.0, 1.0] if advantage > 0 else [1.0, 0.0, 1.0]
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-advantage * s / 3 * k for k in live]]))


def test_gmpo_is_the_papers_product_of_clipped_ratios_per_sequence():
    # The paper's objective, written as a product: prod_t |min(r_t A, clip(r_t) A)| ** (1 / |o|) * sgn(A), with
    # padding excluded; the row's value (seq_mean) and gradient match it.
    torch.manual_seed(2)
    logprobs = (0.3 * torch.randn(3, 4)).requires_grad_()
    old = torch.zeros(3, 4)
    adv = torch.tensor([1.5, -0.5, 2.0])[:, None].expand(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]).bool()
    loss, _ = POLICY_LOSSES["gmpo"](PolicyLossInputs(logprobs, old, adv, mask), PolicyLossSettings(0.2, agg="seq_mean"))
    (grad,) = torch.autograd.grad(loss, logprobs)
    r = torch.exp(logprobs)
    per_seq = []
    for i in range(3):
        a, ri = adv[i, 0], r[i][mask[i]]
        terms = torch.minimum(ri * a, ri.clamp(math.exp(-0.2), math.exp(0.2)) * a).abs()
        per_seq.append(terms.prod() ** (1.0 / len(ri)) * torch.sign(a))
    paper = -torch.stack(per_seq).mean()
    (paper_grad,) = torch.autograd.grad(paper, logprobs)
    torch.testing.assert_close(loss, paper)
    torch.testing.assert_close(grad, paper_grad)


def test_every_row_ignores_padding_and_nan_there():
    logprobs = torch.tensor([[0.1, float("nan")]], requires_grad=True)
    x = PolicyLossInputs(
        logprobs,
        torch.tensor([[0.0, float("nan")]]),
        torch.tensor([[1.0, float("nan")]]),
        torch.tensor([[True, False]]),
    )
    for name, row in POLICY_LOSSES.items():
        loss, stats = row(x, PolicyLossSettings(clip_low=row.clip_low or 0.2, clip_high=row.clip_high))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all(), name
        assert all(torch.isfinite(v) for v in stats), name
        logprobs.grad = None


def test_sapo_in_float64_matches_a_float64_reference():
    # tau_neg = 1.05 has no exact float32 form (1.0499999523); float64 inputs must get the float64 temperatures, so
    # the loss and its gradient agree with the formula written in float64 to rounding (1e-12), not to ~1e-8.
    torch.manual_seed(3)
    logprobs = (0.5 * torch.randn(2, 5, dtype=torch.float64)).requires_grad_()
    old = 0.5 * torch.randn(2, 5, dtype=torch.float64)
    adv = torch.randn(2, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]).bool()
    loss, _ = POLICY_LOSSES["sapo"](
        PolicyLossInputs(logprobs, old, adv, mask), PolicyLossSettings(tau_pos=1.0, tau_neg=1.05)
    )
    assert loss.dtype == torch.float64
    (grad,) = torch.autograd.grad(loss, logprobs)
    n = int(mask.sum())
    expected, expected_grad = 0.0, torch.zeros(2, 5, dtype=torch.float64)
    for b, t in mask.nonzero().tolist():
        r, a = math.exp(float(logprobs.detach()[b, t] - old[b, t])), float(adv[b, t])
        tau = 1.0 if a > 0 else 1.05
        s = sigmoid(tau * (r - 1.0))
        expected += -a * (4.0 / tau) * s / n
        expected_grad[b, t] = -a * 4.0 * s * (1.0 - s) * r / n  # d/dlog r of -A (4 / tau) sigmoid(tau (r - 1))
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_gmpo_keeps_the_gradient_of_a_token_far_out_on_the_pessimistic_side(advantage):
    # Log-ratios -25 A, 0.1 A, 0, log 2 A: the first lies 25 nats out on the side GMPO's clip leaves alone (min for
    # A > 0, max for A < 0), the last is clipped to 0.4 A. l = -25 A, 0.1 A, 0, 0.4 A, so
    # s = exp(mean l) = exp(-6.125 A) and the loss (seq_mean) is -A * s. Every kept token's gradient is -A * s / 4,
    # the first's included (a per-token clamp at -20 gave it 0 and s = exp(-4.875 A)); the clipped token's is 0.
    a = advantage
    logprobs, x = inputs([-25.0 * a, 0.1 * a, 0.0, math.log(2.0) * a], [a] * 4)
    loss, stats = POLICY_LOSSES["gmpo"](x, PolicyLossSettings(clip_low=0.4, agg="seq_mean"))
    s = math.exp((-25.0 + 0.1 + 0.0 + 0.4) * a / 4)
    torch.testing.assert_close(loss, torch.tensor(-a * s))
    torch.testing.assert_close(stats.ratio_mean, torch.tensor(s))
    assert float(stats.clipfrac) == pytest.approx(1 / 4)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-a * s / 4, -a * s / 4, -a * s / 4, 0.0]]))


def test_gmpo_caps_an_overflowing_sequence_weight_at_e20_and_keeps_its_gradient():
    # One token, A = -1, log-ratio 100: the paper's weight e^100 overflows float32. The sequence's mean log-ratio is
    # clamped at 20 before exp, so the loss is e^20 and the token's gradient -A * e^20 (the weight is detached: the
    # clamp caps it, it removes no gradient).
    logprobs, x = inputs([100.0], [-1.0])
    loss, _ = POLICY_LOSSES["gmpo"](x, PolicyLossSettings(clip_low=0.4, agg="seq_mean"))
    torch.testing.assert_close(loss, torch.tensor(math.exp(20.0)))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[math.exp(20.0)]]))
