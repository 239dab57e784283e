import math

import pytest
import torch

from align.core.preference_losses import (
    bradley_terry_loss,
    dpo_loss,
    kto_loss,
    log1mexp,
    orpo_loss,
    preference_pairs,
    simpo_loss,
)

LOG2 = math.log(2.0)


def softplus(x):  # -log sigmoid(-x) = log(1 + e**x)
    return math.log1p(math.exp(x))


# ---------------------------------------------------------------- DPO family


def _dpo(h_chosen, h_rejected, **kw):
    # policy log-probs h_*, reference log-probs 0: h = h_chosen - h_rejected
    def t(v):
        return torch.tensor([float(v)])

    return dpo_loss(t(h_chosen), t(h_rejected), t(0.0), t(0.0), **kw)


def test_dpo_equal_logps_is_log_two_and_variants():
    losses, chosen, rejected = dpo_loss(*(torch.tensor([-5.0]),) * 4)
    assert losses.item() == pytest.approx(LOG2)
    assert chosen.item() == 0.0 and rejected.item() == 0.0
    # IPO at h = 0: (0 - 1 / (2 * 0.1))**2 = 25
    assert _dpo(0, 0, loss_type="ipo")[0].item() == pytest.approx(25.0)
    # hinge at h = 0: relu(1 - 0) = 1
    assert _dpo(0, 0, loss_type="hinge")[0].item() == pytest.approx(1.0)
    # cDPO keeps log 2 at h = 0
    assert _dpo(0, 0, label_smoothing=0.1)[0].item() == pytest.approx(LOG2)


def test_dpo_pinned_values():
    # h = -1 - (-3) = 2, beta 0.5: -log sigmoid(1) = log(1 + e**-1) = 0.31326
    losses, chosen, rejected = _dpo(-1.0, -3.0, beta=0.5)
    assert losses.item() == pytest.approx(softplus(-1.0))
    assert chosen.item() == pytest.approx(-0.5) and rejected.item() == pytest.approx(-1.5)
    # cDPO eps = 0.1: 0.9 * softplus(-1) + 0.1 * softplus(1) = 0.9 * 0.31326 + 0.1 * 1.31326 = 0.41326
    assert _dpo(-1.0, -3.0, beta=0.5, label_smoothing=0.1)[0].item() == pytest.approx(
        0.9 * softplus(-1.0) + 0.1 * softplus(1.0)
    )
    # IPO h = 2, beta 0.5: (2 - 1)**2 = 1; h = 4: 9
    assert _dpo(-1.0, -3.0, beta=0.5, loss_type="ipo")[0].item() == pytest.approx(1.0)
    assert _dpo(1.0, -3.0, beta=0.5, loss_type="ipo")[0].item() == pytest.approx(9.0)
    # hinge: relu(1 - 0.5 * 2) = 0; relu(1 - 0.5 * 1) = 0.5
    assert _dpo(-1.0, -3.0, beta=0.5, loss_type="hinge")[0].item() == pytest.approx(0.0)
    assert _dpo(-1.0, -2.0, beta=0.5, loss_type="hinge")[0].item() == pytest.approx(0.5)


def test_dpo_reference_enters_the_margin_and_rewards():
    # h = (-1 - -2) - (-3 - -1) = 1 - (-2) = 3; beta 0.1 -> softplus(-0.3)
    def t(v):
        return torch.tensor([v])

    losses, chosen, rejected = dpo_loss(t(-1.0), t(-3.0), t(-2.0), t(-1.0), beta=0.1)
    assert losses.item() == pytest.approx(softplus(-0.3))
    assert chosen.item() == pytest.approx(0.1) and rejected.item() == pytest.approx(-0.2)


def test_dpo_gradient_flows_to_policy_only_and_rewards_are_detached():
    pc = torch.tensor([-1.0], requires_grad=True)
    rc = torch.tensor([-1.0], requires_grad=True)
    losses, chosen, _ = dpo_loss(pc, torch.tensor([-2.0]), rc, torch.tensor([-2.0]))
    losses.sum().backward()
    assert pc.grad.item() == pytest.approx(-0.1 * 0.5)  # d/dh softplus(-beta h) at h = 0 = -beta / 2
    assert rc.grad is None and not chosen.requires_grad


def test_dpo_bad_arguments():
    with pytest.raises(ValueError, match=r"\['hinge', 'ipo', 'sigmoid'\]"):
        _dpo(0, 0, loss_type="robust")
    with pytest.raises(ValueError, match="label_smoothing"):
        _dpo(0, 0, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        _dpo(0, 0, label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta"):
        _dpo(0, 0, beta=0.0)


def test_simpo_pinned():
    # avg chosen -2 / 2 = -1, avg rejected -6 / 3 = -2; beta 2, gamma 1: 2 * (-1 + 2) - 1 = 1
    losses, chosen, rejected = simpo_loss(
        torch.tensor([-2.0]), torch.tensor([-6.0]), torch.tensor([2]), torch.tensor([3]), beta=2.0, gamma=1.0
    )
    assert losses.item() == pytest.approx(softplus(-1.0))
    assert chosen.item() == pytest.approx(-2.0) and rejected.item() == pytest.approx(-4.0)
    # gamma 0 and equal averages: log 2
    same = simpo_loss(torch.tensor([-4.0]), torch.tensor([-2.0]), torch.tensor([4]), torch.tensor([2]), gamma=0.0)
    assert same[0].item() == pytest.approx(LOG2)


def test_log1mexp_matches_the_naive_formula_and_keeps_gradients_finite():
    x = torch.tensor([-1e-7, -1e-3, -0.5, -LOG2, -1.0, -5.0, -40.0], dtype=torch.float64, requires_grad=True)
    y = log1mexp(x)
    # log(1 - e**-1) = log(0.63212) = -0.45868
    assert y[4].item() == pytest.approx(-0.4586751453870819, rel=1e-12)
    # near 0 the naive formula loses every digit; log(1 - e**-1e-7) = log(1e-7 - 5e-15) = -16.118096
    assert y[0].item() == pytest.approx(math.log(1e-7 - 5e-15), rel=1e-9)
    torch.testing.assert_close(y[1:6], torch.log(1 - torch.exp(x[1:6].detach())))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    # d/dx log(1 - e**x) = -e**x / (1 - e**x): -1 / (e - 1) = -0.58198 at x = -1
    assert x.grad[4].item() == pytest.approx(-1.0 / (math.e - 1.0))


def test_orpo_pinned():
    # mean log P: chosen -2 / 2 = -1, rejected -6 / 3 = -2.
    # log odds = log P - log(1 - P): -1 - log(1 - e**-1) = -0.54132 and -2 - log(1 - e**-2) = -1.85459;
    # ratio 1.31327, -log sigmoid(1.31327) = softplus(-1.31327) = 0.23818; NLL of chosen 1; lambda 0.1.
    log_odds = (-1.0 - math.log(1 - math.exp(-1.0))) - (-2.0 - math.log(1 - math.exp(-2.0)))
    assert log_odds == pytest.approx(1.31327, abs=1e-5)
    losses, chosen, rejected, nll, ratio = orpo_loss(
        torch.tensor([-2.0]), torch.tensor([-6.0]), torch.tensor([2]), torch.tensor([3]), lam=0.1
    )
    assert losses.item() == pytest.approx(1.0 + 0.1 * softplus(-log_odds), rel=1e-6)
    assert losses.item() == pytest.approx(1.023818, abs=1e-6)
    assert nll.item() == pytest.approx(1.0) and ratio.item() == pytest.approx(log_odds, rel=1e-6)
    assert chosen.item() == pytest.approx(-0.1) and rejected.item() == pytest.approx(-0.2)
    # equal likelihoods: the odds term is log 2
    same = orpo_loss(torch.tensor([-3.0]), torch.tensor([-1.5]), torch.tensor([2]), torch.tensor([1]), lam=0.5)
    assert same[0].item() == pytest.approx(1.5 + 0.5 * LOG2)


def test_orpo_gradients():
    chosen = torch.tensor([-2.0, -1e-9], requires_grad=True)
    rejected = torch.tensor([-6.0, -3.0], requires_grad=True)
    lengths = torch.tensor([2, 1])
    # lambda 0 is plain SFT on the chosen response: d(-logp / n)/dlogp = -1 / n, nothing on the rejected one
    orpo_loss(chosen, rejected, lengths, lengths, lam=0.0)[0].sum().backward()
    torch.testing.assert_close(chosen.grad, torch.tensor([-0.5, 0.0]))  # the second is clamped at P = 1
    assert torch.count_nonzero(rejected.grad) == 0
    chosen.grad, rejected.grad = None, None
    losses = orpo_loss(chosen, rejected, lengths, lengths, lam=1.0)[0]
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(chosen.grad).all()
    assert (rejected.grad > 0).all()  # lowering the rejected likelihood lowers the loss


def test_kto_pinned():
    # beta 0.5, z0 0.4. Desirable: r = -1 - -2 = 1, 1 - sigmoid(0.5 * (1 - 0.4)) = 1 - sigmoid(0.3) = 0.42556.
    # Undesirable: r = -3 - -2 = -1, weight 2: 2 * (1 - sigmoid(0.5 * (0.4 + 1))) = 2 * (1 - sigmoid(0.7)) = 0.66362.
    policy = torch.tensor([-1.0, -3.0], requires_grad=True)
    kl = torch.tensor(0.4, requires_grad=True)
    losses, rewards = kto_loss(
        policy,
        torch.tensor([-2.0, -2.0]),
        torch.tensor([True, False]),
        kl,
        beta=0.5,
        desirable_weight=1.0,
        undesirable_weight=2.0,
    )
    sigmoid = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    assert losses.tolist() == pytest.approx([1 - sigmoid(0.3), 2 * (1 - sigmoid(0.7))])
    assert losses.tolist() == pytest.approx([0.425557, 0.663624], abs=1e-6)
    assert rewards.tolist() == pytest.approx([0.5, -0.5])
    losses.sum().backward()
    assert kl.grad is None  # z0 is a detached reference point
    # d/dr (1 - sigmoid(b (r - z))) = -b s (1 - s): raising a desirable reward, lowering an undesirable one
    assert policy.grad[0].item() == pytest.approx(-0.5 * sigmoid(0.3) * (1 - sigmoid(0.3)))
    assert policy.grad[1].item() == pytest.approx(2 * 0.5 * sigmoid(0.7) * (1 - sigmoid(0.7)))
    # at r = z0 each loss is half its weight
    at_z0, _ = kto_loss(
        torch.tensor([0.4, 0.4]),
        torch.zeros(2),
        torch.tensor([True, False]),
        torch.tensor(0.4),
        desirable_weight=3.0,
        undesirable_weight=1.0,
    )
    assert at_z0.tolist() == pytest.approx([1.5, 0.5])


def test_bradley_terry_pinned():
    # diffs [1, -1]: losses softplus(-1) = 0.31326 and softplus(1) = 1.31326, mean 0.81326
    loss, acc = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert loss.item() == pytest.approx((softplus(-1.0) + softplus(1.0)) / 2)
    assert acc.item() == 0.5
    # margin [1, 0]: -log sigmoid(1 - 1) = log 2 and softplus(1)
    loss, acc = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), margin=torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx((LOG2 + softplus(1.0)) / 2)
    assert acc.item() == 0.5
    # ties count as wrong
    assert bradley_terry_loss(torch.zeros(2), torch.zeros(2))[1].item() == 0.0


# ---------------------------------------------------------------- online DPO pairs


def test_preference_pairs_pinned():
    # G = 2: prompt 0 prefers its second sample, prompt 1 its first, prompt 2 is a tie.
    pairs = preference_pairs(torch.tensor([0.2, 0.9, 1.0, -1.0, 0.5, 0.5]), 2)
    assert pairs.chosen.tolist() == [1, 2, 4] and pairs.rejected.tolist() == [0, 3, 4]
    assert pairs.decisive.tolist() == [True, True, False]
    # G = 3: best against worst; equal best (or worst) rewards pick the first row.
    pairs = preference_pairs(torch.tensor([1.0, 3.0, 3.0, 0.0, 0.0, 2.0]), 3)
    assert pairs.chosen.tolist() == [1, 5] and pairs.rejected.tolist() == [0, 3]
    assert pairs.decisive.tolist() == [True, True]


def test_preference_pairs_needs_two_samples_per_prompt():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        preference_pairs(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match="cannot be split into groups"):
        preference_pairs(torch.tensor([1.0, 2.0, 3.0]), 2)
