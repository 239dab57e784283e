"""The rows of ``ADVANTAGE_ESTIMATORS`` (align.core.estimators), each checked against values worked out by hand or
against the pinned function it composes, and the documented rows of the two tables of the RL math (those of
``POLICY_LOSSES`` are pinned in test_policy_losses.py)."""

import pytest
import torch

from align.core.advantages import gae, shape_rewards
from align.core.estimators import ADVANTAGE_ESTIMATORS, VALUE_ESTIMATORS, AdvantageInputs
from align.core.policy_losses import POLICY_LOSSES, SEQUENCE_LEVEL_LOSSES
from align.core.stats import whiten

from .test_stats import on_two_ranks

MASK = torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()


def test_the_tables_hold_the_documented_rows():
    # Rows may be added; these are documented and must stay, each with a docstring.
    assert {"grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"} <= set(ADVANTAGE_ESTIMATORS)
    assert VALUE_ESTIMATORS <= set(ADVANTAGE_ESTIMATORS) and "gae" in VALUE_ESTIMATORS
    assert {"clip", "gspo"} <= set(POLICY_LOSSES) and SEQUENCE_LEVEL_LOSSES <= set(POLICY_LOSSES)
    assert {"cispo", "sapo", "gmpo"} <= set(POLICY_LOSSES)
    assert all(row.loss.__doc__ for row in POLICY_LOSSES.values())


def test_group_rows_by_hand():
    # Rewards 1 0 | 3 3: GRPO's group baseline 0.5, unbiased std 0.7071 -> +-0.7071; the tied group gets 0.
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    mask = torch.ones(4, 2, dtype=torch.bool)
    out = ADVANTAGE_ESTIMATORS["grpo"](AdvantageInputs(rewards, mask, group_size=2))
    torch.testing.assert_close(out.advantages, torch.tensor([0.5**0.5, -(0.5**0.5), 0.0, 0.0]))
    assert out.returns is None and out.token_rewards is None
    # RLOO: 1 - 0 = 1 against the other sample; Dr. GRPO ("none"): 1 - 0.5 = 0.5.
    torch.testing.assert_close(
        ADVANTAGE_ESTIMATORS["rloo"](AdvantageInputs(rewards, mask, 2)).advantages, torch.tensor([1.0, -1.0, 0.0, 0.0])
    )
    torch.testing.assert_close(
        ADVANTAGE_ESTIMATORS["grpo"](AdvantageInputs(rewards, mask, 2, std_scale="none")).advantages,
        torch.tensor([0.5, -0.5, 0.0, 0.0]),
    )


def test_sequence_rows_take_the_summed_kl_out_of_the_rewards():
    # kl 0.5 per valid token, coef 0.4: each row loses 0.4 * (0.5 * its tokens): 0.4 | 0.6 -> rewards 0.6 | -0.6.
    rewards, kl = torch.tensor([1.0, 0.0]), torch.full((2, 3), 0.5)
    out = ADVANTAGE_ESTIMATORS["rloo"](AdvantageInputs(rewards, MASK, 2, kl=kl, kl_coef=0.4))
    torch.testing.assert_close(out.advantages, torch.tensor([1.2, -1.2]))


def test_reinforce_pp_rows_whiten_over_every_rank():
    # Two ranks holding two rows each give the advantages of the whole batch: the whitening is global.
    rewards, mask = torch.tensor([1.0, 0.0, 2.0, 5.0]), torch.ones(4, 2, dtype=torch.bool)
    whole = ADVANTAGE_ESTIMATORS["reinforce_pp"](AdvantageInputs(rewards, mask)).advantages

    def row(r, m, reduce):
        return ADVANTAGE_ESTIMATORS["reinforce_pp"](AdvantageInputs(r, m, all_reduce=reduce)).advantages

    first, second = on_two_ranks(row, (rewards[:2], mask[:2]), (rewards[2:], mask[2:]))
    torch.testing.assert_close(torch.cat([first, second]), whole)


def test_the_gae_row_is_shaped_rewards_then_gae_then_whitening():
    torch.manual_seed(0)
    scores, old, ref = torch.tensor([1.0, -2.0]), torch.randn(2, 3), torch.randn(2, 3)
    values = torch.randn(2, 3)
    shaped, kl = shape_rewards(scores, old, ref, MASK, 0.1, kind="k1")
    raw, returns = gae(shaped, values, MASK, 0.9, 0.8)
    out = ADVANTAGE_ESTIMATORS["gae"](
        AdvantageInputs(scores, MASK, kl=kl, kl_coef=0.1, values=values, gamma=0.9, lam=0.8)
    )
    assert torch.equal(out.token_rewards, shaped) and torch.equal(out.raw, raw) and torch.equal(out.returns, returns)
    assert torch.equal(out.advantages, whiten(raw, MASK))
    plain = ADVANTAGE_ESTIMATORS["gae"](
        AdvantageInputs(scores, MASK, kl=kl, kl_coef=0.1, values=values, gamma=0.9, lam=0.8, whiten=False)
    )
    assert torch.equal(plain.advantages, raw)


def test_the_gae_row_by_hand():
    # One row of two tokens, no KL, values 0: rewards 0 then the score 2 on the last token; gamma 1, lam 1 ->
    # advantages (returns) 2 2.
    out = ADVANTAGE_ESTIMATORS["gae"](
        AdvantageInputs(
            torch.tensor([2.0]),
            torch.ones(1, 2, dtype=torch.bool),
            values=torch.zeros(1, 2),
            gamma=1.0,
            lam=1.0,
            whiten=False,
        )
    )
    torch.testing.assert_close(out.advantages, torch.tensor([[2.0, 2.0]]))
    with pytest.raises(ValueError, match="gae: needs the critic's values"):
        ADVANTAGE_ESTIMATORS["gae"](AdvantageInputs(torch.tensor([2.0]), torch.ones(1, 2, dtype=torch.bool)))
