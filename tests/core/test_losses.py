import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from align.core.losses import aggregate, loss_count, sft_loss, value_loss

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


# ---------------------------------------------------------------- accumulation invariance


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


# ---------------------------------------------------------------- loss count

# (3, 4): rows with 2, 1 and 3 valid tokens
ROWS = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)


@pytest.mark.parametrize("aggregation, expected", [("token_mean", 6.0), ("seq_mean", 3.0), ("constant", 15.0)])
def test_loss_count_of_a_hand_made_mask(aggregation, expected):
    count = loss_count(ROWS, aggregation, max_length=5)  # constant: 3 rows x 5, not the padded width 4
    assert count.dtype == torch.float32 and count.shape == () and float(count) == expected


def test_loss_count_refuses_an_unknown_aggregation_or_a_constant_without_length():
    with pytest.raises(ValueError, match="max_length"):
        loss_count(ROWS, "constant")
    with pytest.raises(ValueError, match="seq_sum"):
        loss_count(ROWS, "seq_sum")
