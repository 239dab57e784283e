"""The response mask and the masked statistics (``align.core.masks``), pinned by hand and by property."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from align.core.masks import (
    fill_masked,
    last_valid_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    response_mask,
    truncated,
)

FAST = settings(max_examples=50, deadline=None)
EOS = 2


def test_response_mask_mixed_batch_with_pad_equal_to_eos():
    # pad_token_id == eos_token_id == 2: the padding after the first EOS is also 2.
    ids = torch.tensor(
        [
            [5, 6, 2, 2, 2],  # EOS mid-way: valid through the EOS at index 2
            [5, 6, 7, 8, 9],  # truncated: no EOS at all
            [2, 2, 2, 2, 2],  # starts with EOS: only the EOS is valid
            [5, 6, 7, 8, 2],  # EOS on the last position
            [5, 2, 7, 2, 2],  # tokens after the first EOS are padding even if not EOS
        ]
    )
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1],
            [1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1],
            [1, 1, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    mask = response_mask(ids, EOS)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)
    assert torch.equal(truncated(ids, EOS), torch.tensor([False, True, False, False, False]))
    # The EOS itself is valid: a mask built as ids != pad would drop it.
    assert not torch.equal(mask, ids != EOS)
    assert torch.equal(last_valid_index(mask), torch.tensor([2, 4, 0, 4, 1]))


def test_response_mask_truncated_rows_dropped_on_request():
    ids = torch.tensor([[5, 2, 0], [5, 6, 7], [2, 0, 0]])
    mask = response_mask(ids, EOS, mask_truncated=True)
    assert torch.equal(mask, torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool))
    assert torch.equal(last_valid_index(mask), torch.tensor([1, -1, 0]))
    # No EOS is appended: the truncated row is unchanged by default.
    assert torch.equal(response_mask(ids, EOS)[1], torch.tensor([True, True, True]))


@pytest.mark.parametrize("eos", [[2, 9], (9, 2), torch.tensor([2, 9])])
def test_response_mask_several_stop_tokens(eos):
    ids = torch.tensor([[5, 9, 2, 0], [5, 2, 9, 0], [5, 6, 7, 8], [9, 9, 9, 9]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(response_mask(ids, eos), expected)
    assert torch.equal(truncated(ids, eos), torch.tensor([False, False, True, False]))


def test_response_mask_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        response_mask(torch.tensor([1, 2, 3]), EOS)
    with pytest.raises(ValueError, match="empty"):
        response_mask(torch.tensor([[1, 2]]), [])


@st.composite
def token_rows(draw):
    t = draw(st.integers(1, 8))
    return draw(st.lists(st.lists(st.integers(0, 4), min_size=t, max_size=t), min_size=1, max_size=5))


@given(token_rows())
@FAST
def test_response_mask_property(rows):
    ids = torch.tensor(rows)
    mask = response_mask(ids, EOS)
    for row, m in zip(rows, mask.tolist()):
        n = row.index(EOS) + 1 if EOS in row else len(row)
        assert m == [True] * n + [False] * (len(row) - n)
    # A valid mask is a prefix, and last_valid_index is its length minus one.
    assert torch.equal(last_valid_index(mask), mask.sum(1) - 1)


def test_last_valid_index_general_and_empty():
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]])
    assert torch.equal(last_valid_index(mask), torch.tensor([2, -1, 3]))
    assert torch.equal(last_valid_index(torch.zeros(2, 0, dtype=torch.bool)), torch.tensor([-1, -1]))


def test_masked_statistics_pinned():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # valid values 1, 2, 3: sum 6, mean 2, squared deviations 1 + 0 + 1 = 2
    assert masked_sum(x, mask).item() == 6.0
    assert masked_mean(x, mask).item() == 2.0
    assert masked_var(x, mask).item() == pytest.approx(1.0)  # 2 / (3 - 1)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(2.0 / 3.0)
    # whitened: (x - 2) / 1 on valid tokens, 0 on the masked one
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    # shift_mean=False only rescales: (x - 2) / 1 + 2
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), torch.tensor([[1.0, 2.0, 3.0, 0.0]]))


def test_masked_statistics_dim():
    x = torch.tensor([[1.0, 3.0, 5.0], [2.0, 4.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    torch.testing.assert_close(masked_sum(x, mask, dim=1), torch.tensor([4.0, 0.0]))
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([2.0, 0.0]))  # empty row -> 0
    torch.testing.assert_close(masked_mean(x, mask, dim=0), torch.tensor([1.0, 3.0, 0.0]))


def test_masked_statistics_no_valid_element_is_zero_not_nan():
    x = torch.tensor([[float("nan"), 1.0]])
    mask = torch.zeros(1, 2)
    assert masked_sum(x, mask).item() == 0.0
    assert masked_mean(x, mask).item() == 0.0
    assert masked_var(x, mask).item() == 0.0
    assert torch.equal(masked_whiten(x, mask), torch.zeros(1, 2))


def test_masked_whiten_skipped_below_two_valid_tokens():
    x = torch.tensor([[5.0, float("nan"), -3.0]])
    mask = torch.tensor([[1, 0, 0]])
    # one valid value: returned unchanged; masked positions are 0
    assert torch.equal(masked_whiten(x, mask), torch.tensor([[5.0, 0.0, 0.0]]))
    assert masked_var(x, mask).item() == 0.0


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (3, 5), (7,)])
def test_masked_statistics_without_a_mask_equal_those_of_an_all_ones_mask(shape):
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3 + 1
    ones = torch.ones(shape, dtype=torch.bool)
    for fn in (masked_sum, masked_mean):
        torch.testing.assert_close(fn(x, None), fn(x, ones), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fn(x, None, dim=-1), fn(x, ones, dim=-1), rtol=1e-12, atol=1e-12)
    for unbiased in (True, False):
        torch.testing.assert_close(masked_var(x, None, unbiased), masked_var(x, ones, unbiased), rtol=1e-12, atol=1e-12)
    for shift_mean in (True, False):
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        a, b = masked_whiten(x1, None, shift_mean), masked_whiten(x2, ones, shift_mean)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        weights = torch.arange(x.numel(), dtype=x.dtype).view(shape)
        (a * weights).sum().backward(), (b * weights).sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-12)
    assert masked_mean(torch.zeros(0), None).item() == 0.0  # nothing to average: 0, not NaN


@st.composite
def values_and_mask(draw, max_b=4, max_t=8):
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.01, 1.0, 100.0]))
    noise = torch.randn(b, t, generator=g, dtype=torch.float64) * 1e6
    return x, torch.tensor(bits).view(b, t), noise


@given(values_and_mask())
@FAST
def test_whitened_valid_tokens_have_mean_zero_and_std_one(case):
    x, mask, _ = case
    n = int(mask.sum())
    out = masked_whiten(x, mask, eps=0.0)
    if n < 2:
        assert torch.equal(out, torch.where(mask, x, 0.0))
        return
    valid = out[mask]
    if x[mask].std() < 1e-6:
        return  # (near-)constant input: nothing to rescale
    assert abs(valid.mean().item()) < 1e-9
    assert valid.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-6)
    assert torch.all(out[~mask] == 0)


@given(values_and_mask())
@FAST
def test_masked_inputs_never_influence_masked_statistics(case):
    x, mask, noise = case
    y = torch.where(mask, x, noise)  # same valid values, different padding
    z = torch.where(mask, x, torch.full_like(x, float("nan")))
    for other in (y, z):
        assert torch.equal(masked_sum(x, mask), masked_sum(other, mask))
        assert torch.equal(masked_mean(x, mask), masked_mean(other, mask))
        assert torch.equal(masked_mean(x, mask, dim=1), masked_mean(other, mask, dim=1))
        assert torch.equal(masked_var(x, mask), masked_var(other, mask))
        assert torch.equal(masked_whiten(x, mask), masked_whiten(other, mask))


def test_masked_whiten_gradient_ignores_nan_padding():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    masked_whiten(x, mask).pow(2).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert x.grad[0, 2] == 0 and x.grad[1, 1] == 0


def test_fill_masked_puts_zero_where_invalid_and_keeps_nan_out_of_the_gradient():
    x = torch.tensor([[1.5, float("nan")], [float("inf"), -2.0]], requires_grad=True)
    valid = torch.tensor([[True, False], [False, True]])
    out = fill_masked(x, valid)
    assert out.tolist() == [[1.5, 0.0], [0.0, -2.0]]
    (out * torch.tensor([[3.0, 5.0], [7.0, 11.0]])).sum().backward()
    assert x.grad.tolist() == [[3.0, 0.0], [0.0, 11.0]]  # not NaN * 0 where invalid
    assert fill_masked(x, None) is x  # every element valid: x itself
