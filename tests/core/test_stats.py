"""Pinned values for align.core.stats, on one process and on two fake ranks (threads summing each other's shards)."""

import math
import threading

import pytest
import torch

from align.core.masks import masked_whiten
from align.core.stats import explained_variance, identity, mean_var, pass_at_k, transform_scores, whiten

NAN = float("nan")


def on_two_ranks(fn, shard0, shard1):
    """Run ``fn(*shard, all_reduce)`` on two threads whose ``all_reduce`` sums the two ranks' tensors, like
    ``torch.distributed.all_reduce(op=SUM)``; returns both ranks' results."""
    barrier, slots, out = threading.Barrier(2, timeout=10), [None, None], [None, None]

    def rank(r, shard):
        def all_reduce(t):
            slots[r] = t
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # nobody overwrites a slot before both have read it
            return total

        out[r] = fn(*shard, all_reduce)

    threads = [threading.Thread(target=rank, args=(r, s)) for r, s in enumerate((shard0, shard1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert None not in out, "a rank failed"
    return out


# Rows split by rank: rank 0 holds row 0, rank 1 row 1. Valid values 1, 2 | 3, 7:
# sum 13, n 4, mean 3.25; deviations -2.25, -1.25, -0.25, 3.75; squares 5.0625 + 1.5625 + 0.0625 + 14.0625
# = 20.75; unbiased variance 20.75 / 3.
X = torch.tensor([[1.0, 2.0, NAN], [3.0, NAN, 7.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 1]])
MEAN, VAR = 3.25, 20.75 / 3


def test_identity_returns_its_input():
    t = torch.tensor([1.0, 2.0])
    assert identity(t) is t


def test_mean_var_of_valid_elements():
    # mean of [1, 2, 3] masked [1, 1, 1, 0] is 2; squared deviations 1 + 0 + 1 = 2; variance 2 / (3 - 1) = 1
    mean, var = mean_var(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1, 1, 1, 0]))
    assert mean.item() == 2.0 and var.item() == 1.0
    mean, var = mean_var(X, MASK)  # NaN padding stays out
    assert mean.item() == pytest.approx(MEAN) and var.item() == pytest.approx(VAR)


def test_mean_var_on_two_ranks_equals_the_whole_tensor_on_one_process():
    (m0, v0), (m1, v1) = on_two_ranks(lambda x, m, r: mean_var(x, m, r), (X[:1], MASK[:1]), (X[1:], MASK[1:]))
    assert m0.item() == m1.item() == pytest.approx(MEAN)
    assert v0.item() == v1.item() == pytest.approx(VAR)


def test_mean_var_of_nothing_valid_is_zero_and_of_one_value_has_zero_variance():
    mean, var = mean_var(torch.tensor([NAN, 4.0]), torch.tensor([0, 0]))
    assert mean.item() == 0.0 and var.item() == 0.0
    mean, var = mean_var(torch.tensor([5.0, NAN]), torch.tensor([1, 0]))  # n = 1: mean 5, variance 0 (not NaN)
    assert mean.item() == 5.0 and var.item() == 0.0


def test_variance_keeps_its_digits_when_the_mean_is_large():
    # Returns near 300 with a spread of 0.5 in float32: sum(x**2) - n * mean**2 cancels to a few percent off
    # (about 7% for this draw); the two-pass variance matches float64 to float32 rounding.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g) * 0.5 + 300.0
    mask = torch.rand(64, 32, generator=g) > 0.3
    exact = x.double()[mask].var().item()
    assert mean_var(x, mask)[1].item() == pytest.approx(exact, rel=1e-5)


def test_statistics_are_float32_and_detached():
    x = torch.tensor([1.0, 3.0], dtype=torch.bfloat16, requires_grad=True)
    mean, var = mean_var(x, torch.ones(2))
    assert mean.dtype == var.dtype == torch.float32 and not mean.requires_grad
    assert mean.item() == 2.0 and var.item() == 2.0  # deviations -1, 1: 2 / (2 - 1)
    assert mean_var(x.detach().double(), torch.ones(2))[0].dtype == torch.float64


def test_whiten_pinned_values():
    # mean 2, variance 1: (x - 2) / 1 on valid tokens, 0 on the masked one
    x = torch.tensor([[1.0, 2.0, 3.0, NAN]])
    torch.testing.assert_close(whiten(x, torch.tensor([[1, 1, 1, 0]])), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))


def test_whiten_on_two_ranks_equals_the_whole_tensor_on_one_process():
    # (x - 3.25) / sqrt(20.75 / 3): 1 -> -0.8555, 2 -> -0.4753, 3 -> -0.0951, 7 -> 1.4259
    s = math.sqrt(VAR)
    expected = torch.tensor([[(1 - MEAN) / s, (2 - MEAN) / s, 0.0], [(3 - MEAN) / s, 0.0, (7 - MEAN) / s]])
    torch.testing.assert_close(whiten(X, MASK), expected)
    w0, w1 = on_two_ranks(lambda x, m, r: whiten(x, m, all_reduce=r), (X[:1], MASK[:1]), (X[1:], MASK[1:]))
    torch.testing.assert_close(torch.cat([w0, w1]), expected)


def test_whiten_counts_valid_elements_over_all_ranks():
    # One valid value per rank: alone each would be returned unchanged, but together n = 2: mean 3,
    # deviations 2 and -2, variance 8 / 1, so 5 -> 2 / sqrt(8) and 1 -> -2 / sqrt(8).
    w0, w1 = on_two_ranks(
        lambda x, m, r: whiten(x, m, all_reduce=r),
        (torch.tensor([[5.0, NAN]]), torch.tensor([[1, 0]])),
        (torch.tensor([[1.0, 9.0]]), torch.tensor([[1, 0]])),
    )
    torch.testing.assert_close(w0, torch.tensor([[1 / math.sqrt(2), 0.0]]))
    torch.testing.assert_close(w1, torch.tensor([[-1 / math.sqrt(2), 0.0]]))


def test_whiten_eps_is_added_to_the_variance():
    # [1, 3]: mean 2, variance (1 + 1) / 1 = 2; with eps 2 the scale is 1 / sqrt(2 + 2) = 0.5
    torch.testing.assert_close(whiten(torch.tensor([1.0, 3.0]), torch.ones(2), eps=2.0), torch.tensor([-0.5, 0.5]))
    # equal values: variance 0, (x - mean) = 0 times 1 / sqrt(eps) is exactly 0, not NaN
    assert torch.equal(whiten(torch.tensor([4.0, 4.0, 4.0]), torch.ones(3)), torch.zeros(3))


def test_whiten_with_nothing_valid_or_one_valid_value():
    assert torch.equal(whiten(torch.tensor([[NAN, 1.0]]), torch.zeros(1, 2)), torch.zeros(1, 2))
    assert torch.equal(
        whiten(torch.tensor([[5.0, NAN, -3.0]]), torch.tensor([[1, 0, 0]])), torch.tensor([[5.0, 0.0, 0.0]])
    )  # n = 1: unchanged, masked positions 0


def test_whiten_on_one_process_is_masked_whiten_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(4, 9, generator=g) * 3 + 1
        mask = torch.rand(4, 9, generator=g) > 0.4
        assert torch.equal(whiten(x, mask), masked_whiten(x, mask))


def test_whiten_gradient_flows_through_x_only_and_ignores_nan_padding():
    x = torch.tensor([[1.0, 2.0, NAN], [4.0, float("inf"), 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    whiten(x, mask).sum().backward()
    # statistics are constants: d/dx sum((x - mean) / s) = 1 / s on every valid element
    # valid 1, 2, 4, 0: mean 1.75, squares 0.5625 + 0.0625 + 5.0625 + 3.0625 = 8.75, s = sqrt(8.75 / 3)
    g = 1 / math.sqrt(8.75 / 3 + 1e-8)
    torch.testing.assert_close(x.grad, torch.tensor([[g, g, 0.0], [g, 0.0, g]]))


def test_explained_variance_pinned_values():
    returns = torch.tensor([1.0, 2.0, 3.0, 50.0])
    mask = torch.tensor([1, 1, 1, 0])  # Var(returns) over [1, 2, 3] is 1
    assert explained_variance(returns, returns, mask).item() == 1.0  # perfect values
    assert explained_variance(torch.full((4,), 2.5), returns, mask).item() == 0.0  # a constant explains nothing
    # values [1, 2, 2]: errors [0, 0, 1], mean 1/3, squares 1/9 + 1/9 + 4/9 = 2/3, variance 1/3: 1 - 1/3
    assert explained_variance(torch.tensor([1.0, 2.0, 2.0, 0.0]), returns, mask).item() == pytest.approx(2 / 3)
    # values reversed [3, 2, 1]: errors [-2, 0, 2], variance 8 / 2 = 4: 1 - 4 / 1 = -3, worse than a constant
    assert explained_variance(torch.tensor([3.0, 2.0, 1.0, 0.0]), returns, mask).item() == pytest.approx(-3.0)


def test_explained_variance_is_zero_when_returns_do_not_vary_or_nothing_is_valid():
    assert explained_variance(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 2.0]), torch.ones(2)).item() == 0.0
    assert explained_variance(torch.tensor([NAN, 1.0]), torch.tensor([2.0, NAN]), torch.zeros(2)).item() == 0.0


def test_explained_variance_on_two_ranks_equals_one_process():
    returns = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    values = torch.tensor([[1.0, 2.0], [2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])  # the 2/3 case above, split 2 | 1 valid tokens
    e0, e1 = on_two_ranks(
        lambda v, r_, m, r: explained_variance(v, r_, m, r),
        (values[:1], returns[:1], mask[:1]),
        (values[1:], returns[1:], mask[1:]),
    )
    assert e0.item() == e1.item() == pytest.approx(2 / 3)
    assert explained_variance(values, returns, mask).item() == pytest.approx(2 / 3)


def test_transform_scores_penalty_whitening_scaling_clipping():
    scores, truncated = torch.tensor([1.0, 0.0, 2.0, 4.0]), torch.tensor([True, False, False, False])
    # penalty 1 on the truncated one: [0, 0, 2, 4]; mean 1.5, squares 2.25 + 2.25 + 0.25 + 6.25 = 11,
    # std sqrt(11 / 3); times 2: [-1.5667, -1.5667, 0.5222, 2.6112]; clipped to 1.5
    z = 2 / math.sqrt(11 / 3)
    expected = torch.tensor([-1.5, -1.5, 0.5 * z, 1.5])
    out = transform_scores(scores, truncated, missing_eos_penalty=1.0, whiten_scores=True, scale=2.0, clip=1.5)
    torch.testing.assert_close(out, expected)
    # the same on two ranks holding two sequences each
    o0, o1 = on_two_ranks(
        lambda s, t, r: transform_scores(s, t, 1.0, True, 2.0, 1.5, all_reduce=r),
        (scores[:2], truncated[:2]),
        (scores[2:], truncated[2:]),
    )
    torch.testing.assert_close(torch.cat([o0, o1]), expected)


def test_transform_scores_options_one_at_a_time():
    scores, truncated = torch.tensor([7.0, -9.0]), torch.tensor([True, False])
    assert torch.equal(transform_scores(scores, truncated), scores)  # every option off: unchanged
    assert torch.equal(transform_scores(scores, truncated, missing_eos_penalty=2.0), torch.tensor([5.0, -9.0]))
    assert torch.equal(transform_scores(scores, truncated, scale=0.5), torch.tensor([3.5, -4.5]))
    assert torch.equal(transform_scores(scores, truncated, clip=3.0), torch.tensor([3.0, -3.0]))
    # whitening [7, -9]: mean -1, variance (64 + 64) / 1 = 128, so +-8 / sqrt(128) = +-0.7071
    torch.testing.assert_close(
        transform_scores(scores, truncated, whiten_scores=True), torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)])
    )


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (10, 3, 1, 0.3),  # k = 1 is the share correct
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 1, 5, 0.5),  # 1 - C(9,5)/C(10,5) = 1 - 126/252
        (4, 3, 2, 1.0),  # fewer wrong samples than k: every draw of 2 holds a correct one
        (4, 0, 2, 0.0),
        (8, 1, 8, 1.0),  # k = n: any correct sample passes
        (200, 10, 1, 0.05),
    ],
)
def test_pass_at_k_pinned(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_grows_with_k_and_refuses_k_above_n():
    values = [pass_at_k(16, 3, k) for k in range(1, 17)]
    assert values == sorted(values) and values[-1] == 1.0
    with pytest.raises(ValueError, match="k must be in"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c must be in"):
        pass_at_k(4, 5, 1)
