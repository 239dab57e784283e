import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from align.core.losses import aggregate, sft_loss, value_loss
from align.core.policy_losses import importance_ratio, policy_gradient_loss, ppo_policy_loss

FAST = settings(max_examples=50, deadline=None)
LOG2 = math.log(2.0)


# ---------------------------------------------------------------- aggregate

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_aggregate_pinned():
    # valid values: row 0 -> 1, 2; row 1 -> 4. Sum 7 over 3 valid tokens.
    assert aggregate(PER_TOKEN, MASK, "token_mean").item() == pytest.approx(7 / 3)
    # per-sequence means 1.5 and 4, averaged over 2 sequences
    assert aggregate(PER_TOKEN, MASK, "seq_mean").item() == pytest.approx(2.75)
    # Dr. GRPO constant: 7 / (B * T) = 7 / 6
    assert aggregate(PER_TOKEN, MASK, "constant").item() == pytest.approx(7 / 6)
    # caller-given normalisers
    assert aggregate(PER_TOKEN, MASK, "token_mean", normaliser=10).item() == pytest.approx(0.7)
    assert aggregate(PER_TOKEN, MASK, "seq_mean", normaliser=4).item() == pytest.approx(5.5 / 4)
    assert aggregate(PER_TOKEN, MASK, "constant", normaliser=torch.tensor(14.0)).item() == pytest.approx(0.5)


def test_aggregate_empty_mask_is_zero():
    for mode in ("token_mean", "seq_mean", "constant"):
        out = aggregate(PER_TOKEN, torch.zeros(2, 3), mode)
        assert out.item() == 0.0


def test_aggregate_rejects_bad_input():
    with pytest.raises(ValueError, match="'constant', 'seq_mean', 'token_mean'"):
        aggregate(PER_TOKEN, MASK, "sum")
    with pytest.raises(ValueError, match="normaliser"):
        aggregate(PER_TOKEN, MASK, normaliser=0)
    with pytest.raises(ValueError, match="must match"):
        aggregate(PER_TOKEN, MASK[:, :2])


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


# ---------------------------------------------------------------- accumulation invariance


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


@given(st.integers(0, 2**31 - 1), st.sampled_from([torch.float32, torch.bfloat16]))
@settings(max_examples=20, deadline=None)
def test_eight_microbatches_of_one_equal_one_batch_of_eight_sft(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 5, 11, generator=g).to(dtype)
    labels = torch.randint(0, 11, (8, 5), generator=g)
    labels[torch.rand(8, 5, generator=g) < 0.4] = -100
    n_valid = (labels[:, 1:] != -100).sum()

    full_logits = logits.clone().requires_grad_()
    full = sft_loss(full_logits, labels)
    full.backward()

    acc_logits = logits.clone().requires_grad_()
    total = 0.0
    for i in range(8):
        loss = sft_loss(acc_logits[i : i + 1], labels[i : i + 1], normaliser=n_valid)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(acc_logits.grad.float(), full_logits.grad.float())


# ---------------------------------------------------------------- value loss


def test_value_loss_pinned():
    one = torch.ones(1, 1)

    def t(v):
        return torch.tensor([[float(v)]])

    # no clip: 0.5 * (1.9 - 2)**2 = 0.005
    loss, clipfrac = value_loss(t(1.9), t(1.0), t(2.0), one)
    assert loss.item() == pytest.approx(0.005)
    assert clipfrac.item() == 0.0
    # clip 0.5: V_clip = 1 + 0.5 = 1.5; max(0.01, 0.25) = 0.25 -> 0.125, the clipped term wins
    loss, clipfrac = value_loss(t(1.9), t(1.0), t(2.0), one, clip=0.5)
    assert loss.item() == pytest.approx(0.125)
    assert clipfrac.item() == 1.0
    # V = 2, old 1, R = 0: unclipped 4, V_clip 1.5 -> 2.25; max 4 -> 2.0, not clipped
    loss, clipfrac = value_loss(t(2.0), t(1.0), t(0.0), one, clip=0.5)
    assert loss.item() == pytest.approx(2.0)
    assert clipfrac.item() == 0.0


def test_value_loss_gradient_only_through_values():
    values = torch.tensor([[1.9, 0.0]], requires_grad=True)
    loss, _ = value_loss(
        values, torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]), torch.tensor([[1, 0]]), clip=0.5
    )
    loss.backward()
    # the clipped branch is constant in V once V - old exceeds the clip: zero gradient
    assert values.grad[0, 0] == 0 and values.grad[0, 1] == 0
    with pytest.raises(ValueError, match="clip"):
        value_loss(values, values, values, torch.ones(1, 2), clip=0.0)


# ---------------------------------------------------------------- SFT


def test_sft_loss_pinned():
    # uniform logits over 2 tokens: every predicted token costs log 2.
    logits = torch.zeros(1, 3, 2, requires_grad=True)
    labels = torch.tensor([[-100, 1, 0]])  # labels[0] has no prediction; 2 tokens predicted
    assert sft_loss(logits, labels).item() == pytest.approx(LOG2)
    assert sft_loss(logits, labels, normaliser=4).item() == pytest.approx(2 * LOG2 / 4)
    # logits[:, 0] predicts labels[:, 1]: making token 1 likely at position 0 lowers the loss
    sharp = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [9.0, 9.0]]])  # p(1) = 3/4 at t=0
    assert sft_loss(sharp, labels).item() == pytest.approx((-math.log(0.75) + LOG2) / 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sft_loss_matches_shifted_cross_entropy(dtype):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 6, 13, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 13, (3, 6), generator=g)
    labels[0, :3] = -100
    loss = sft_loss(logits, labels)
    assert loss.dtype == torch.float32
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits[:, :-1].float().reshape(-1, 13), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    loss.backward()
    ref.backward()
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sft_loss_without_valid_tokens_is_zero_with_grad(dtype):
    logits = torch.randn(2, 3, 5).to(dtype).requires_grad_()
    loss = sft_loss(logits, torch.full((2, 3), -100))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_sft_loss_rejects_bad_shapes():
    with pytest.raises(ValueError, match="labels"):
        sft_loss(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


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
