"""Importance weights and diagnostics of the sampler/trainer mismatch, pinned by hand."""

import math

import pytest
import torch

from align.core.mismatch import correction_weights, mismatch_stats

LOG2 = math.log(2.0)


def _pair():
    # One row, two tokens and a pad: pi = (1/2, 1/4), mu = (1/4, 1/2): ratios 2 and 1/2, their product 1.
    trainer = torch.log(torch.tensor([[0.5, 0.25, 1.0]]))
    engine = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    mask = torch.tensor([[True, True, False]])
    return trainer, engine, mask


def test_stats_mean_abs_difference_and_k3_kl():
    stats = mismatch_stats(*_pair())
    assert stats.logprob_diff.item() == pytest.approx(LOG2)
    # k3 = r - 1 - log r: (2 - 1 - log 2) and (1/2 - 1 + log 2), mean 0.25
    assert stats.kl.item() == pytest.approx(0.25)


def test_equal_logprobs_give_unit_weights_and_zero_kl():
    trainer = torch.randn(3, 5)
    mask = torch.rand(3, 5) > 0.3
    weights, stats = correction_weights(trainer, trainer.clone(), mask, mode="tis", cap=2.0)
    assert torch.equal(weights, mask.float())
    assert stats.kl.item() == 0 and stats.logprob_diff.item() == 0 and stats.clipped_frac.item() == 0


def test_token_tis_caps_the_ratio():
    weights, stats = correction_weights(*_pair(), mode="tis", level="token", cap=1.5)
    assert weights.tolist() == [[1.5, 0.5, 0.0]]
    assert stats.clipped_frac.item() == pytest.approx(0.5) and stats.masked_frac.item() == 0


def test_token_mis_drops_tokens_outside_the_band():
    weights, stats = correction_weights(*_pair(), mode="mis", level="token", low=0.5, high=1.5)
    assert weights.tolist() == [[0.0, 0.5, 0.0]]
    assert stats.masked_frac.item() == pytest.approx(0.5) and stats.clipped_frac.item() == 0


def test_sequence_level_uses_the_product_of_the_row_ratios():
    trainer, engine, mask = _pair()
    weights, _ = correction_weights(trainer, engine, mask, mode="tis", level="sequence", cap=1.5)
    assert weights.tolist() == [[1.0, 1.0, 0.0]]  # 2 * 1/2 = 1
    # A second row whose tokens both favour the trainer: ratio 2 * 2 = 4, capped at 3 on both tokens.
    trainer2 = torch.cat([trainer, torch.log(torch.tensor([[0.5, 0.5, 1.0]]))])
    engine2 = torch.cat([engine, torch.log(torch.tensor([[0.25, 0.25, 1.0]]))])
    mask2 = torch.cat([mask, mask])
    weights, stats = correction_weights(trainer2, engine2, mask2, mode="tis", level="sequence", cap=3.0)
    assert weights[1].tolist() == [3.0, 3.0, 0.0]
    assert stats.clipped_frac.item() == pytest.approx(0.5)  # one row of two
    weights, stats = correction_weights(trainer2, engine2, mask2, mode="mis", level="sequence", low=0.5, high=2.0)
    assert weights.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    assert stats.masked_frac.item() == pytest.approx(0.5)


def test_none_mode_is_one_on_valid_tokens():
    weights, stats = correction_weights(*_pair(), mode="none")
    assert weights.tolist() == [[1.0, 1.0, 0.0]]
    assert stats.kl.item() == pytest.approx(0.25)


def test_weights_are_detached_and_finite_for_extreme_ratios():
    trainer = torch.tensor([[0.0, -200.0]], requires_grad=True)
    engine = torch.tensor([[-200.0, 0.0]])
    weights, stats = correction_weights(
        trainer, engine, torch.ones(1, 2, dtype=torch.bool), mode="mis", low=0.5, high=2.0
    )
    assert not weights.requires_grad and torch.isfinite(weights).all() and weights.tolist() == [[0.0, 0.0]]
    assert torch.isfinite(stats.kl)


def test_bad_mode_or_level_fails():
    with pytest.raises(ValueError, match="mode"):
        correction_weights(*_pair(), mode="clip")
    with pytest.raises(ValueError, match="level"):
        correction_weights(*_pair(), level="row")


def test_sequence_level_sums_the_raw_log_ratios_before_the_overflow_clamp():
    # Token log-ratios +25 and -24 (each beyond the clamp of 20) sum to 1: the row's ratio is e, not the e^0 of
    # clamping each token first. A masked third token (log-ratio +30, and NaN in a second copy) is not counted.
    trainer = torch.tensor([[0.0, -24.0, 30.0], [0.0, -24.0, float("nan")]])
    engine = torch.tensor([[-25.0, 0.0, 0.0], [-25.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    e = math.exp(1.0)
    weights, stats = correction_weights(trainer, engine, mask, mode="tis", level="sequence", cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 2.0, 0.0]] * 2))  # min(e, 2)
    assert stats.clipped_frac.item() == 1.0
    weights, stats = correction_weights(trainer, engine, mask, mode="tis", level="sequence", cap=3.0)
    torch.testing.assert_close(weights, torch.tensor([[e, e, 0.0]] * 2))  # min(e, 3)
    assert stats.clipped_frac.item() == 0.0
    weights, stats = correction_weights(trainer, engine, mask, mode="mis", level="sequence", low=0.5, high=3.0)
    torch.testing.assert_close(weights, torch.tensor([[e, e, 0.0]] * 2))  # e in [0.5, 3]: kept
    assert stats.masked_frac.item() == 0.0
    weights, stats = correction_weights(trainer, engine, mask, mode="mis", level="sequence", low=0.5, high=2.0)
    assert weights.tolist() == [[0.0, 0.0, 0.0]] * 2 and stats.masked_frac.item() == 1.0  # e > 2: dropped


def test_sequence_level_clamps_the_summed_log_ratio():
    # Two tokens of +15 sum to 30, clamped at 20 before exp: the weight is finite (cap 1e12 lets e^20 through), and a
    # row summing to -30 gets e^-20.
    trainer = torch.tensor([[15.0, 15.0], [-15.0, -15.0]])
    weights, _ = correction_weights(
        trainer, torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), mode="tis", level="sequence", cap=1e12
    )
    torch.testing.assert_close(weights, torch.tensor([[math.exp(20.0)] * 2, [math.exp(-20.0)] * 2]))
