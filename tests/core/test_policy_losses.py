"""The policy losses (``align.core.policy_losses``) against values worked out by hand: the CISPO, SAPO and GMPO rows
of ``POLICY_LOSSES`` from their papers, PPO's clipped surrogate at the token and the sequence level (GSPO), the plain
policy gradient, and the ``clip`` and ``gspo`` rows."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from align.core.losses import aggregate, value_loss
from align.core.policy_losses import (
    POLICY_LOSSES,
    PolicyLossInputs,
    PolicyLossSettings,
    importance_ratio,
    policy_gradient_loss,
    ppo_policy_loss,
)

FAST = settings(max_examples=50, deadline=None)


# ---------------------------------------------------------------- CISPO, SAPO and GMPO


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


# ---------------------------------------------------------------- PPO policy loss


def _ppo(logp, old, adv, **kw):
    def t(v):
        return torch.tensor([[float(v)]])

    return ppo_policy_loss(t(logp), t(old), t(adv), torch.ones(1, 1), **kw)


def test_ppo_policy_loss_pinned():
    # ratio e, A = 1: unclipped -e, clipped -1.2; max -> -1.2 (clipped)
    loss, stats = _ppo(1.0, 0.0, 1.0)
    assert loss.item() == pytest.approx(-1.2)
    assert stats.clipfrac.item() == 1.0
    assert stats.ratio_mean.item() == pytest.approx(math.e)
    # approx_kl = k3 with samples from pi_old: exp(log_r) - 1 - log_r = e - 2
    assert stats.approx_kl.item() == pytest.approx(math.e - 2.0)
    # ratio e, A = -1: unclipped e, clipped 1.2; max -> e (not clipped: the pessimistic term)
    loss, stats = _ppo(1.0, 0.0, -1.0)
    assert loss.item() == pytest.approx(math.e)
    assert stats.clipfrac.item() == 0.0
    # ratio 1/e, A = 1: unclipped -1/e = -0.368, clipped -0.8; max -> -1/e
    assert _ppo(-1.0, 0.0, 1.0)[0].item() == pytest.approx(-math.exp(-1.0))
    # ratio 1/e, A = -1: unclipped 0.368, clipped 0.8; max -> 0.8 (clipped)
    loss, stats = _ppo(-1.0, 0.0, -1.0)
    assert loss.item() == pytest.approx(0.8)
    assert stats.clipfrac.item() == 1.0
    # ratio 1: the loss is -A
    assert _ppo(-0.3, -0.3, 2.5)[0].item() == pytest.approx(-2.5)


def test_ppo_decoupled_and_dual_clip_pinned():
    # DAPO clip-higher: ratio e, A = 1 clips to 1 + 0.28
    assert _ppo(1.0, 0.0, 1.0, clip_high=0.28)[0].item() == pytest.approx(-1.28)
    # lower side still 0.2: ratio 1/e, A = -1 clips to 0.8
    assert _ppo(-1.0, 0.0, -1.0, clip_high=0.28)[0].item() == pytest.approx(0.8)
    # dual clip c = 3, A = -1, ratio e**2 = 7.39: the loss max(7.39, 1.2) is capped at 3
    loss, stats = _ppo(2.0, 0.0, -1.0, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert stats.clipfrac.item() == 1.0
    # below the cap nothing changes: ratio e = 2.72 < 3
    assert _ppo(1.0, 0.0, -1.0, dual_clip=3.0)[0].item() == pytest.approx(math.e)
    # dual clip never touches positive advantages
    assert _ppo(2.0, 0.0, 1.0, dual_clip=3.0)[0].item() == pytest.approx(-1.2)


def test_ppo_bad_arguments():
    with pytest.raises(ValueError, match="dual_clip"):
        _ppo(0.0, 0.0, 1.0, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip"):
        _ppo(0.0, 0.0, 1.0, clip_low=-0.1)


def test_ppo_extreme_log_ratio_is_finite():
    loss, stats = _ppo(0.0, -1000.0, -1.0)
    assert torch.isfinite(loss) and torch.isfinite(stats.approx_kl)


def test_ppo_per_sequence_advantages_broadcast():
    logp = torch.tensor([[0.1, 0.2], [0.0, -0.1]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.ones(2, 2)
    a, _ = ppo_policy_loss(logp, torch.zeros(2, 2), adv[:, None], mask)
    b, _ = ppo_policy_loss(logp, torch.zeros(2, 2), adv[:, None].expand(2, 2), mask)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"adv\[:, None\]"):
        ppo_policy_loss(logp, torch.zeros(2, 2), adv, mask)


@st.composite
def policy_batch(draw, max_b=4, max_t=6):
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    mask = torch.arange(t).expand(b, t) < torch.tensor(lengths).unsqueeze(1)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = old + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    noise = 1e3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    return logp, old, adv, mask, noise


@given(policy_batch(), st.sampled_from([None, 0.28]), st.sampled_from([None, 2.0]))
@FAST
def test_ppo_zero_gradient_exactly_where_clipped(case, clip_high, dual_clip):
    logp, old, adv, mask, _ = case
    logp = logp.clone().requires_grad_()
    loss, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, clip_high, dual_clip)
    loss.backward()
    ratio = (logp.detach() - old).exp()
    high = 1 + (0.2 if clip_high is None else clip_high)
    clipped = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < 0.8))
    if dual_clip is not None:
        clipped |= (adv < 0) & (ratio > dual_clip)
    assert torch.all(logp.grad[clipped & mask] == 0)
    assert torch.all(logp.grad[~clipped & mask & (adv != 0)] != 0)
    assert torch.all(logp.grad[~mask] == 0)


@given(policy_batch(), st.sampled_from(["token_mean", "seq_mean", "constant"]))
@FAST
def test_masked_tokens_never_influence_ppo_value_and_aggregate(case, agg):
    logp, old, adv, mask, noise = case
    nan = torch.full_like(noise, float("nan"))

    def run(lp, o, a):
        lp = lp.clone().requires_grad_()
        loss, stats = ppo_policy_loss(lp, o, a, mask, dual_clip=3.0, agg=agg)
        loss.backward()
        return loss, stats, lp.grad

    clean = run(logp, old, adv)
    dirty = run(torch.where(mask, logp, noise), torch.where(mask, old, nan), torch.where(mask, adv, noise))
    assert torch.equal(clean[0], dirty[0])
    assert all(torch.equal(x, y) for x, y in zip(clean[1], dirty[1]))
    assert torch.equal(clean[2], dirty[2])

    def run_value(v, ov, r):
        v = v.clone().requires_grad_()
        loss, clipfrac = value_loss(v, ov, r, mask, clip=0.2, agg=agg)
        loss.backward()
        return loss, clipfrac, v.grad

    clean = run_value(adv, old, logp)
    dirty = run_value(torch.where(mask, adv, nan), torch.where(mask, old, noise), torch.where(mask, logp, nan))
    assert all(torch.equal(x, y) for x, y in zip(clean, dirty))

    assert torch.equal(aggregate(adv, mask, agg), aggregate(torch.where(mask, adv, noise), mask, agg))


@given(policy_batch(), st.sampled_from(["token_mean", "seq_mean", "constant"]), st.sampled_from(["token", "sequence"]))
@FAST
def test_no_mask_equals_an_all_ones_mask(case, agg, level):
    """``mask=None`` (every token valid, as classic RL's one action per row) is the same loss, statistics and
    gradient as a mask of ones."""
    logp, old, adv, _, _ = case
    ones = torch.ones_like(logp, dtype=torch.bool)

    def run(mask):
        lp = logp.clone().requires_grad_()
        loss, stats = ppo_policy_loss(lp, old, adv, mask, clip_high=0.3, dual_clip=3.0, agg=agg, level=level)
        v = adv.clone().requires_grad_()
        v_loss, v_clipfrac = value_loss(v, old, logp, mask, clip=0.2, agg=agg)
        (loss + v_loss).backward()
        return (loss, *stats, v_loss, v_clipfrac, lp.grad, v.grad, aggregate(adv, mask, agg))

    for a, b in zip(run(None), run(ones)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_policy_gradient_loss_pinned():
    # -A * log pi per element: [-2 * -0.5, -(-1) * -2.0, -3 * -0.25] = [1.0, -2.0, 0.75]; the mask drops the last.
    logp = torch.tensor([[-0.5, -2.0, -0.25]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.0, 3.0]])
    mask = torch.tensor([[True, True, False]])
    loss = policy_gradient_loss(logp, adv, mask)
    torch.testing.assert_close(loss, torch.tensor(-0.5))  # (1.0 - 2.0) / 2
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.5, 0.0]]))  # -A / 2 where valid
    torch.testing.assert_close(policy_gradient_loss(logp, adv, None), torch.tensor(-0.25 / 3))
    with pytest.raises(ValueError, match="must match"):
        policy_gradient_loss(logp, adv[:, :2], None)


@given(policy_batch(), st.sampled_from(["token_mean", "seq_mean", "constant"]))
@FAST
def test_policy_gradient_is_the_clipped_surrogates_at_ratio_one(case, agg):
    """At ratio 1 (an update right after sampling) the clipped surrogate's gradient is the plain policy gradient's,
    masked or not; padding never reaches either."""
    logp, _, adv, mask, _ = case
    for m in (mask, None):
        grads = []
        for surrogate in (True, False):
            lp = (logp if m is None else torch.where(m, logp, torch.nan)).clone().requires_grad_()
            loss = (
                ppo_policy_loss(lp, lp.detach(), adv, m, agg=agg)[0]
                if surrogate
                else policy_gradient_loss(lp, adv, m, agg=agg)
            )
            assert torch.isfinite(loss)
            loss.backward()
            grads.append(lp.grad)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


@st.composite
def accumulation_batch(draw):
    t = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, t), min_size=8, max_size=8))
    mask = torch.arange(t).expand(8, t) < torch.tensor(lengths).unsqueeze(1)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    old = -torch.rand(8, t, generator=g, dtype=torch.float64) * 3
    logp = old + 0.3 * torch.randn(8, t, generator=g, dtype=torch.float64)
    adv = torch.randn(8, t, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


@given(accumulation_batch(), st.sampled_from(["token_mean", "seq_mean", "constant"]))
@FAST
def test_eight_microbatches_of_one_equal_one_batch_of_eight_ppo(case, agg):
    logp, old, adv, mask = case
    b, t = mask.shape
    global_norm = {"token_mean": mask.sum().clamp(min=1), "seq_mean": b, "constant": b * t}[agg]

    full_lp = logp.clone().requires_grad_()
    full, _ = ppo_policy_loss(full_lp, old, adv, mask, agg=agg)  # default normaliser = whole batch
    full.backward()

    acc_lp = logp.clone().requires_grad_()
    total = 0.0
    for i in range(b):
        rows = slice(i, i + 1)
        loss, _ = ppo_policy_loss(acc_lp[rows], old[rows], adv[rows], mask[rows], agg=agg, normaliser=global_norm)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(acc_lp.grad, full_lp.grad)


# ---------------------------------------------------------------- GSPO: sequence-level ratio (arXiv 2507.18071)


def test_sequence_ratio_is_the_geometric_mean_of_the_valid_token_ratios():
    logp = torch.tensor([[0.5, -0.3, 0.0], [0.3, float("nan"), float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ratio = importance_ratio(torch.where(mask.bool(), logp, 0.0), torch.zeros(2, 3), mask, "sequence")
    # row 0: exp((0.5 - 0.3) / 2) = e**0.1 on every token; row 1: e**0.3
    torch.testing.assert_close(ratio[mask.bool()], torch.tensor([math.exp(0.1)] * 2 + [math.exp(0.3)]))
    with pytest.raises(ValueError, match="level"):
        importance_ratio(logp, logp, mask, "sentence")


def test_gspo_loss_pinned_against_the_token_level_loss():
    logp, old, adv, mask = torch.tensor([[0.5, -0.3]]), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)
    # sequence: s = e**0.1 = 1.105 inside [0.8, 1.2], loss -s on both tokens, nothing clipped
    loss, stats = ppo_policy_loss(logp, old, adv, mask, level="sequence")
    assert loss.item() == pytest.approx(-math.exp(0.1))
    assert stats.clipfrac.item() == 0.0 and stats.ratio_mean.item() == pytest.approx(math.exp(0.1))
    # token: e**0.5 clips to 1.2, e**-0.3 = 0.741 stays: (-1.2 - 0.741) / 2
    token, stats = ppo_policy_loss(logp, old, adv, mask)
    assert token.item() == pytest.approx((-1.2 - math.exp(-0.3)) / 2) and stats.clipfrac.item() == 0.5


def test_gspo_clips_the_whole_sequence():
    logp, old, mask = torch.tensor([[0.2, 0.4]], requires_grad=True), torch.zeros(1, 2), torch.ones(1, 2)
    # s = e**0.3 = 1.35 > 1.2 with A = 1: clipped at -1.2, no gradient on any token
    loss, stats = ppo_policy_loss(logp, old, torch.ones(1, 2), mask, level="sequence")
    assert loss.item() == pytest.approx(-1.2) and stats.clipfrac.item() == 1.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))
    # A = -1: the pessimistic term is the unclipped one, s = e**0.3
    loss, stats = ppo_policy_loss(logp, old, -torch.ones(1, 2), mask, level="sequence")
    assert loss.item() == pytest.approx(math.exp(0.3)) and stats.clipfrac.item() == 0.0


@pytest.mark.parametrize("agg, weights", [("seq_mean", [1 / 2, 1 / 2, 1 / 1]), ("token_mean", [1 / 3] * 3)])
def test_gspo_gradient_is_the_sequence_ratio_times_the_token_score(agg, weights):
    # Row 0: 2 tokens, mean log-ratio 0.1, A = 1; row 1: 1 token, log-ratio 0.05, A = -2. Unclipped, so
    # d loss / d logp_t = -A_i * s_i * w_t, with w_t = 1 / |y_i| / 2 rows under seq_mean (GSPO) and
    # 1 / 3 valid tokens under token_mean. The padding's log-prob 9.0 changes nothing.
    logp = torch.tensor([[0.5, -0.3], [0.05, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    loss, _ = ppo_policy_loss(logp, torch.zeros(2, 2), adv, mask, agg=agg, level="sequence")
    loss.backward()
    s0, s1 = math.exp(0.1), math.exp(0.05)
    scale = 0.5 if agg == "seq_mean" else 1.0  # seq_mean divides the sum of row means by 2 rows
    expected = torch.tensor([[-s0 * weights[0] * scale, -s0 * weights[1] * scale], [2 * s1 * weights[2] * scale, 0.0]])
    torch.testing.assert_close(logp.grad, expected)
    # GSPO's objective, -(1/B) sum_i A_i s_i, differentiated directly, is the seq_mean result
    if agg == "seq_mean":
        direct = logp.detach().clone().requires_grad_(True)
        seq = torch.stack([direct[0].mean(), direct[1, 0]])
        (-(torch.tensor([1.0, -2.0]) * seq.exp()).mean()).backward()
        torch.testing.assert_close(logp.grad, direct.grad)


def test_gspo_equals_the_token_level_loss_for_one_token_responses():
    torch.manual_seed(0)
    logp, old, adv = torch.randn(5, 1) * 0.3, torch.randn(5, 1) * 0.3, torch.randn(5, 1)
    out = {}
    for level in ("token", "sequence"):
        x = logp.clone().requires_grad_(True)
        loss, stats = ppo_policy_loss(x, old, adv, torch.ones(5, 1), level=level)
        loss.backward()
        out[level] = (loss.detach(), x.grad, stats.clipfrac)
    for a, b in zip(out["token"], out["sequence"]):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- the clip and gspo rows of POLICY_LOSSES


def test_the_clip_row_by_hand():
    # Ratio e on a token with advantage 1: clipped to 1.2, loss -1.2; ratio 1 on the other token: loss -1.
    # Token mean -1.1; the first token's gradient is clipped away (clipfrac 0.5).
    logprobs = torch.tensor([[1.0, 0.0]], requires_grad=True)
    x = PolicyLossInputs(logprobs, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool))
    loss, stats = POLICY_LOSSES["clip"](x, PolicyLossSettings(clip_low=0.2))
    torch.testing.assert_close(loss, torch.tensor(-1.1))
    assert float(stats.clipfrac) == 0.5
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5]]))


def test_the_gspo_row_clips_the_sequence_ratio():
    # Log-ratios 0.2 and 0: the sequence ratio is exp(0.1) = 1.105, inside [0.8, 1.2]: nothing clipped, loss -1.105
    # on both tokens; with clip_high 0.05 the whole sequence is clipped at 1.05.
    x = PolicyLossInputs(torch.tensor([[0.2, 0.0]]), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2).bool())
    loss, stats = POLICY_LOSSES["gspo"](x, PolicyLossSettings(clip_low=0.2))
    torch.testing.assert_close(loss, torch.tensor(-math.exp(0.1)))
    loss, stats = POLICY_LOSSES["gspo"](x, PolicyLossSettings(clip_low=0.2, clip_high=0.05))
    torch.testing.assert_close(loss, torch.tensor(-1.05))
    assert float(stats.clipfrac) == 1.0


@pytest.mark.parametrize("name, level", [("clip", "token"), ("gspo", "sequence")])
def test_each_row_is_the_pinned_surrogate_at_its_level(name, level):
    torch.manual_seed(0)
    logprobs, old, adv = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    mask = torch.rand(3, 4) > 0.3
    row, _ = POLICY_LOSSES[name](
        PolicyLossInputs(logprobs, old, adv, mask), PolicyLossSettings(0.2, 0.28, "seq_mean", 5)
    )
    pinned, _ = ppo_policy_loss(logprobs, old, adv, mask, 0.2, 0.28, agg="seq_mean", normaliser=5, level=level)
    assert torch.equal(row, pinned)
