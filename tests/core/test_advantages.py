import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from align.core.advantages import (
    gae,
    group_advantages,
    reinforce_pp_advantages,
    returns_to_go,
    rloo_advantages,
    shape_rewards,
)
from align.core.masks import response_mask

FAST = settings(max_examples=50, deadline=None)


@st.composite
def response_batch(draw, max_b=4, max_t=8, holes=False):
    """(rewards, values, mask, noise) with prefix masks, optionally with holes."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    mask = torch.arange(t).expand(b, t) < torch.tensor(lengths).unsqueeze(1)
    if holes:
        bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
        mask = mask & torch.tensor(bits).view(b, t)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rewards = torch.randn(b, t, generator=g, dtype=torch.float64)
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    noise = 1e3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    return rewards, values, mask, noise


# ---------------------------------------------------------------- shape_rewards


def test_shape_rewards_pinned():
    # k1 = logp - ref = [1, 0, 2]; the third token is padding.
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0, -3.0]])
    mask = torch.tensor([[1, 1, 0]])
    rewards, kl = shape_rewards(torch.tensor([1.0]), logprobs, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[1.0, 0.0, 0.0]]))
    # -0.1 * kl, plus the score 1.0 at the last valid token (index 1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 1.0, 0.0]]))


def test_shape_rewards_k3_pinned():
    # log_r = 1 on the only token: k3 = e**-1; reward = -0.5 * e**-1 + 2
    rewards, kl = shape_rewards(
        torch.tensor([2.0]), torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.tensor([[1]]), 0.5, kind="k3"
    )
    assert kl.item() == pytest.approx(math.exp(-1))
    assert rewards.item() == pytest.approx(2.0 - 0.5 * math.exp(-1))


def test_shape_rewards_score_on_eos_when_pad_equals_eos():
    eos = 0
    ids = torch.tensor([[7, 8, 0, 0, 0], [7, 8, 9, 9, 9], [0, 0, 0, 0, 0]])
    mask = response_mask(ids, eos)
    zeros = torch.zeros(3, 5)
    rewards, _ = shape_rewards(torch.tensor([1.0, 2.0, 3.0]), zeros, zeros, mask, kl_coef=0.1)
    expected = torch.zeros(3, 5)
    expected[0, 2] = 1.0  # on the EOS, not the first pad after it
    expected[1, 4] = 2.0  # truncated: last generated token
    expected[2, 0] = 3.0  # immediate EOS
    torch.testing.assert_close(rewards, expected)


def test_shape_rewards_empty_row_gets_no_score():
    ids = torch.tensor([[7, 8, 9], [7, 2, 2]])
    mask = response_mask(ids, 2, mask_truncated=True)
    zeros = torch.zeros(2, 3)
    rewards, kl = shape_rewards(torch.tensor([5.0, 1.0]), zeros, zeros, mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))


def test_shape_rewards_with_turn_rewards_pinned():
    # A two-turn episode: tokens 0-1 are turn 1, 2-3 the environment's reply (masked), 4-5 turn 2, 6 padding.
    # Turn rewards 0.5 (end of turn 1, index 1) and 2.0 (end of turn 2, index 5); k1 = [1, 0, -, -, 0, 1, -].
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
    logprobs = torch.tensor([[-1.0, -1.0, 0.0, 0.0, -1.0, -1.0, 0.0]])
    ref = torch.tensor([[-2.0, -1.0, -5.0, -5.0, -1.0, -2.0, -5.0]])
    turns = torch.tensor([[0.0, 0.5, 9.0, 0.0, 0.0, 2.0, 9.0]])  # 9.0 on masked tokens is ignored
    rewards, kl = shape_rewards(torch.tensor([1.0]), logprobs, ref, mask, kl_coef=0.1, token_rewards=turns)
    torch.testing.assert_close(kl, torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]))
    # -0.1 * kl + the turn rewards; the sequence score 1.0 joins the last valid token (index 5): -0.1 + 2 + 1
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.5, 0.0, 0.0, 0.0, 2.9, 0.0]]))
    # GAE with gamma = lam = 1 and no values: the return of every policy token of turn 1 includes turn 2's
    advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[3.3, 3.4, 0.0, 0.0, 2.9, 2.9, 0.0]]))
    with pytest.raises(ValueError, match="token_rewards must be"):
        shape_rewards(torch.tensor([1.0]), logprobs, ref, mask, 0.1, token_rewards=torch.zeros(1, 3))


def test_shape_rewards_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="scores"):
        shape_rewards(torch.zeros(3), torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4), 0.1)
    with pytest.raises(ValueError, match="share"):
        shape_rewards(torch.zeros(2), torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(2, 4), 0.1)


@given(response_batch())
@FAST
def test_shape_rewards_ignores_masked_inputs(case):
    logprobs, ref, mask, noise = case
    scores = noise[:, 0]
    r1, kl1 = shape_rewards(scores, logprobs, ref, mask, 0.05)
    r2, kl2 = shape_rewards(
        scores, torch.where(mask, logprobs, noise), torch.where(mask, ref, float("nan")), mask, 0.05
    )
    assert torch.equal(r1, r2) and torch.equal(kl1, kl2)
    assert torch.all(r1[~mask] == 0) and torch.all(kl1[~mask] == 0)


# ---------------------------------------------------------------- GAE


def test_gae_pinned_three_tokens():
    # gamma = 0.9, lam = 0.8, gamma * lam = 0.72, V after the last token = 0
    # t=2: delta = 2 + 0.9 * 0   - 1.5 = 0.5;  A2 = 0.5
    # t=1: delta = 0 + 0.9 * 1.5 - 1.0 = 0.35; A1 = 0.35 + 0.72 * 0.5  = 0.71
    # t=0: delta = 1 + 0.9 * 1.0 - 0.5 = 1.4;  A0 = 1.4  + 0.72 * 0.71 = 1.9112
    # returns = A + V = [2.4112, 1.71, 2.0]
    rewards = torch.tensor([[1.0, 0.0, 2.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 1.0, 1.5]], dtype=torch.float64)
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[1.9112, 0.71, 0.5]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[2.4112, 1.71, 2.0]], dtype=torch.float64))

    # Padding after the response (reward 7, value 99) changes nothing: bootstrap is 0.
    padded_r = torch.tensor([[1.0, 0.0, 2.0, 7.0]], dtype=torch.float64)
    padded_v = torch.tensor([[0.5, 1.0, 1.5, 99.0]], dtype=torch.float64)
    adv_p, ret_p = gae(padded_r, padded_v, torch.tensor([[1, 1, 1, 0]]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv_p, torch.tensor([[1.9112, 0.71, 0.5, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(ret_p, torch.tensor([[2.4112, 1.71, 2.0, 0.0]], dtype=torch.float64))


def test_gae_skips_a_hole_in_the_mask():
    # Position 1 is masked: t=2 gives A2 = 2 - 1.5 = 0.5, then t=0 sees V_next = 1.5:
    # delta0 = 1 + 0.9 * 1.5 - 0.5 = 1.85; A0 = 1.85 + 0.72 * 0.5 = 2.21
    rewards = torch.tensor([[1.0, 50.0, 2.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, -50.0, 1.5]], dtype=torch.float64)
    adv, ret = gae(rewards, values, torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[2.21, 0.0, 0.5]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[2.71, 0.0, 2.0]], dtype=torch.float64))


def test_gae_lam_zero_is_one_step_td():
    rewards = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    values = torch.tensor([[3.0, 5.0]], dtype=torch.float64)
    adv, _ = gae(rewards, values, torch.ones(1, 2), gamma=0.5, lam=0.0)
    # A0 = 1 + 0.5 * 5 - 3 = 0.5; A1 = 2 + 0 - 5 = -3
    torch.testing.assert_close(adv, torch.tensor([[0.5, -3.0]], dtype=torch.float64))


def test_gae_outputs_are_detached():
    values = torch.ones(1, 2, requires_grad=True)
    adv, ret = gae(torch.ones(1, 2), values, torch.ones(1, 2))
    assert not adv.requires_grad and not ret.requires_grad


@given(response_batch(holes=True))
@FAST
def test_gae_with_gamma_lam_one_is_reward_to_go_minus_value(case):
    rewards, values, mask, _ = case
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # reward-to-go over valid positions only
    valid_rewards = torch.where(mask, rewards, 0.0)
    to_go = valid_rewards.flip(1).cumsum(1).flip(1)
    expected = torch.where(mask, to_go - values, 0.0)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, torch.where(mask, to_go, 0.0))


@given(response_batch(holes=True), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
@FAST
def test_gae_ignores_masked_inputs_and_returns_use_unwhitened_advantages(case, gamma, lam):
    rewards, values, mask, noise = case
    adv, ret = gae(rewards, values, mask, gamma, lam)
    adv2, ret2 = gae(torch.where(mask, rewards, noise), torch.where(mask, values, float("nan")), mask, gamma, lam)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    torch.testing.assert_close(ret, torch.where(mask, adv + values, 0.0))
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


# ---------------------------------------------------------------- group advantages


def test_group_advantages_pinned_group_of_two():
    # groups [1, 0] and [1, 0]: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 1/sqrt(2)
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=2)
    s = 0.5 * math.sqrt(2.0)
    torch.testing.assert_close(adv, torch.tensor([s, -s, s, -s]))


def test_group_advantages_pinned_unbiased_std():
    # one group [1, 0, 1, 0]: deviations +-0.5, unbiased std = sqrt(1 / 3); 0.5 * sqrt(3) = 0.8660
    # (a biased std of 0.5 would give +-1: this pins the Bessel-corrected choice)
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), group_size=4)
    a = 0.5 * math.sqrt(3.0)
    torch.testing.assert_close(adv, torch.tensor([a, -a, a, -a]))
    # scale="none" (Dr. GRPO): only centred
    torch.testing.assert_close(
        group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4, scale="none"), torch.tensor([0.5, -0.5, 0.5, -0.5])
    )


def test_group_advantages_pinned_batch_scale():
    # rewards [1,0,1,0 | 2,2,2,2]; batch mean 1.25, squared deviations sum to 5.5, unbiased var 5.5 / 7
    # group 1: +-0.5 / sqrt(5.5 / 7) = +-0.56408; group 2 is constant: exactly 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0]), 4, scale="batch")
    a = 0.5 / math.sqrt(5.5 / 7.0)
    torch.testing.assert_close(adv, torch.tensor([a, -a, a, -a, 0.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_constant_group_is_exactly_zero(scale):
    # In float32 the mean of five 123.456 is off by rounding: a naive std is ~8.5e-6 > eps.
    rewards = torch.tensor([123.456] * 5 + [1.0, 0.0, 0.5, 0.5, 0.5])
    naive = rewards[:5] - rewards[:5].mean()
    assert naive.abs().max() > 0  # the rounding this test guards against
    adv = group_advantages(rewards, 5, scale=scale)
    assert torch.equal(adv[:5], torch.zeros(5))
    assert torch.isfinite(adv).all()
    assert adv[5] > 0 and adv[6] < 0 and torch.all(adv[7:] == 0)  # the other group is centred on 0.5


def test_group_advantages_single_member_groups_and_int_rewards():
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0]), 1), torch.zeros(2))
    torch.testing.assert_close(group_advantages(torch.tensor([1, 0]), 2, scale="none"), torch.tensor([0.5, -0.5]))


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="'group', 'batch', 'none'"):
        group_advantages(torch.zeros(4), 2, scale="max")


@st.composite
def grouped_rewards(draw):
    n_groups = draw(st.integers(1, 4))
    g = draw(st.integers(2, 6))
    rows = []
    for _ in range(n_groups):
        if draw(st.booleans()):
            rows += [draw(st.floats(-1e3, 1e3))] * g  # a zero-variance group
        else:
            rows += draw(st.lists(st.floats(-1e3, 1e3), min_size=g, max_size=g))
    return torch.tensor(rows, dtype=torch.float32), g


@given(grouped_rewards(), st.sampled_from(["group", "batch", "none"]))
@FAST
def test_zero_variance_groups_get_zero_never_nan(case, scale):
    rewards, g = case
    adv = group_advantages(rewards, g, scale=scale)
    assert torch.isfinite(adv).all()
    grouped = rewards.view(-1, g)
    constant = (grouped == grouped[:, :1]).all(1)
    assert torch.all(adv.view(-1, g)[constant] == 0)
    # advantages are centred within every group
    torch.testing.assert_close(adv.view(-1, g).mean(1), torch.zeros(grouped.shape[0]), atol=1e-4, rtol=0)


# ---------------------------------------------------------------- RLOO


def test_rloo_pinned():
    # G = 2: each sample's baseline is the other one: [1 - 0, 0 - 1, ...]
    torch.testing.assert_close(
        rloo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2), torch.tensor([1.0, -1.0, 1.0, -1.0])
    )
    # G = 4, [1, 0, 1, 0]: 1 - (0 + 1 + 0) / 3 = 2/3 and 0 - (1 + 1 + 0) / 3 = -2/3
    torch.testing.assert_close(
        rloo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4), torch.tensor([2 / 3, -2 / 3, 2 / 3, -2 / 3])
    )
    # G = 3, [3, 1, 2]: 3 - 1.5, 1 - 2.5, 2 - 2
    torch.testing.assert_close(rloo_advantages(torch.tensor([3.0, 1.0, 2.0]), 3), torch.tensor([1.5, -1.5, 0.0]))
    assert torch.equal(rloo_advantages(torch.tensor([0.1, 0.1, 0.1]), 3), torch.zeros(3))


def test_rloo_requires_two_samples_per_group():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        rloo_advantages(torch.tensor([1.0, 2.0]), 1)


@given(grouped_rewards())
@FAST
def test_rloo_is_scaled_centred_reward(case):
    rewards, g = case
    rewards = rewards.double()
    adv = rloo_advantages(rewards, g)
    grouped = rewards.view(-1, g)
    expected = g / (g - 1) * (grouped - grouped.mean(1, keepdim=True))
    torch.testing.assert_close(adv.view(-1, g), expected, atol=1e-9, rtol=1e-9)


# ---------------------------------------------------------------- REINFORCE++ (arXiv 2501.03262)

NAN = float("nan")


def test_returns_to_go_pinned_and_masked():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    torch.testing.assert_close(returns_to_go(rewards, mask), torch.tensor([[6.0, 5.0, 3.0], [9.0, 5.0, 0.0]]))


def test_returns_to_go_is_gae_with_gamma_and_lambda_one_and_no_values():
    torch.manual_seed(0)
    rewards, mask = torch.randn(3, 5), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 1, 1, 0]])
    expected, _ = gae(rewards, torch.zeros(3, 5), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(returns_to_go(rewards, mask), expected)


def test_reinforce_pp_pinned_per_token_kl_returns_then_batch_whitening():
    # kl_coef 0.5; row 0: r = 1, kl 0.1 0.2 0.3 -> per-token rewards -0.05 -0.1 (-0.15 + 1) -> returns 0.7 0.75 0.85.
    # Row 1: r = 0, kl 0.5 0.5 and a NaN in the padding -> rewards -0.25 -0.25 -> returns -0.5 -0.25.
    # Valid returns: sum 1.55, n 5, mean 0.31; squared deviations 0.1521 + 0.1936 + 0.2916 + 0.6561 + 0.3136
    # = 1.607, unbiased variance 1.607 / 4 = 0.40175.
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, NAN]])
    adv = reinforce_pp_advantages(rewards, mask, kl, kl_coef=0.5)
    returns = torch.tensor([[0.7, 0.75, 0.85], [-0.5, -0.25, 0.31]])  # the last is padding: 0 after whitening
    expected = (returns - 0.31) / math.sqrt(0.40175 + 1e-8) * mask
    torch.testing.assert_close(adv, expected)
    assert adv.shape == (2, 3) and adv[1, 2] == 0.0


def test_reinforce_pp_without_kl_whitens_the_outcome_reward_over_tokens():
    # r = 1 on 2 tokens, r = 0 on 1 token: values 1 1 0, mean 2/3, unbiased var 1/3.
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.tensor([[1, 1], [1, 0]]))
    s = math.sqrt(1 / 3 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[1 / 3 / s, 1 / 3 / s], [-2 / 3 / s, 0.0]]))


def test_reinforce_pp_constant_batch_is_zero():
    adv = reinforce_pp_advantages(torch.tensor([2.0, 2.0, 2.0]), torch.tensor([[1, 1], [1, 0], [1, 1]]))
    assert torch.equal(adv, torch.zeros(3, 2))


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
    # Groups of 2: rewards 1 0 | 3 3 -> 0.5 -0.5 | 0 0, every row 2 tokens: values 0.5 0.5 -0.5 -0.5 0 0 0 0,
    # mean 0, unbiased var 1 / 7: advantages 0.5 * sqrt(7), and exactly 0 for the constant group.
    mask = torch.ones(4, 2)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), mask, group_size=2)
    a = 0.5 / math.sqrt(1 / 7 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[a, a], [-a, -a], [0.0, 0.0], [0.0, 0.0]]))
    # Without the baseline the second group dominates the batch statistics instead.
    plain = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), mask)
    assert plain[2, 0] > 0 > plain[0, 0]


def test_reinforce_pp_baseline_recentres_over_tokens_so_a_constant_group_moves_with_lengths():
    # Rows of 2 and 1 tokens in the first group: values 0.5 0.5 -0.5 | 0 0 0 0, mean 0.5 / 7 > 0, so the
    # constant group's tokens get -mean / std < 0 (the paper's batch normalisation, documented).
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), mask, group_size=2)
    values = torch.tensor([0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    mean, std = values.mean(), values.std()
    torch.testing.assert_close(adv[2:], torch.full((2, 2), float(-mean / std)))


def test_reinforce_pp_on_two_ranks_equals_the_whole_batch_on_one_process():
    from .test_stats import on_two_ranks

    rewards, mask = torch.tensor([1.0, 0.0, 0.5, 2.0]), torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    kl = torch.rand(4, 3)
    whole = reinforce_pp_advantages(rewards, mask, kl, 0.1, group_size=2)

    def fn(r, m, k, all_reduce):
        return reinforce_pp_advantages(r, m, k, 0.1, group_size=2, all_reduce=all_reduce)

    ranks = on_two_ranks(fn, (rewards[:2], mask[:2], kl[:2]), (rewards[2:], mask[2:], kl[2:]))
    torch.testing.assert_close(torch.cat(ranks), whole)


def test_reinforce_pp_rejects_bad_shapes():
    with pytest.raises(ValueError, match="reinforce_pp_advantages"):
        reinforce_pp_advantages(torch.zeros(3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="kl must be"):
        reinforce_pp_advantages(torch.zeros(2), torch.ones(2, 4), torch.zeros(2, 3), 0.1)


def test_batch_std_is_over_every_rank():
    # Rank 0 holds groups [0, 1] and [0, 1], rank 1 [0, 4] and [0, 4]. The batch of 8 rewards has mean 1.25 and
    # unbiased std sqrt(((-1.25)^2 * 4 + (-0.25)^2 * 2 + 2.75^2 * 2) / 7) = sqrt(21.5 / 7); each rank's own std
    # (0.5774 and 2.3094) would scale its rank's advantages differently.
    from .test_stats import on_two_ranks

    shard0, shard1 = torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([0.0, 4.0, 0.0, 4.0])
    out0, out1 = on_two_ranks(
        lambda r, reduce: group_advantages(r, 2, "batch", all_reduce=reduce), (shard0,), (shard1,)
    )
    std = math.sqrt(21.5 / 7)
    torch.testing.assert_close(out0, torch.tensor([-0.5, 0.5, -0.5, 0.5]) / std)
    torch.testing.assert_close(out1, torch.tensor([-2.0, 2.0, -2.0, 2.0]) / std)
    torch.testing.assert_close(torch.cat([out0, out1]), group_advantages(torch.cat([shard0, shard1]), 2, "batch"))


def test_the_filter_and_the_advantages_share_one_signal_test():
    # A group of 2 whose rewards differ by 1.2e-6 has a range above 1e-6 but an unbiased std of 0.85e-6, at most
    # 1e-6: its advantages are 0, so dynamic sampling must not keep it either. Every group the filter keeps has a
    # non-zero advantage, and every group it drops has none.
    from align.rollout.filter import informative_groups

    rewards = torch.tensor([0.0, 1.2e-6, 0.0, 2e-6, 5.0, 5.0, 123.456, 123.456, 0.0, 1.0])
    kept = informative_groups(rewards, 2)
    assert kept.tolist() == [False, True, False, False, True]
    for scale in ("group", "batch", "none"):
        nonzero = (group_advantages(rewards, 2, scale).view(-1, 2) != 0).any(dim=1)
        assert torch.equal(kept, nonzero), scale
