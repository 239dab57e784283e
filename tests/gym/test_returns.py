"""The classic-RL returns (align.gym.returns): step-wise GAE, discounted returns and TD targets. Pinned values are
worked out by hand in the comments."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from align.gym.returns import discounted_returns, step_gae, td_targets

FAST = settings(max_examples=50, deadline=None)


def col(*xs, dtype=torch.float64):
    """A (T, 1) single-environment column."""
    return torch.tensor(xs, dtype=dtype).unsqueeze(1)


def flags(*xs):
    return torch.tensor(xs, dtype=torch.bool).unsqueeze(1)


# ---------------------------------------------------------------- step_gae

# One window used by several tests: gamma 0.9, lam 0.8 (gamma * lam = 0.72).
# next_values[t] == values[t + 1] where the episode goes on, as a real rollout gives.
R = (1.0, 0.0, 2.0)
V = (1.0, 2.0, 1.0)
NV = (2.0, 1.0, 3.0)
NO = (False, False, False)


def test_step_gae_no_episode_end_pinned():
    adv, ret = step_gae(col(*R), col(*V), col(*NV), flags(*NO), flags(*NO), gamma=0.9, lam=0.8)
    # delta_0 = 1 + 0.9*2 - 1 = 1.8
    # delta_1 = 0 + 0.9*1 - 2 = -1.1
    # delta_2 = 2 + 0.9*3 - 1 = 3.7   (the window's last step bootstraps from next_values)
    # A_2 = 3.7
    # A_1 = -1.1 + 0.72*3.7 = -1.1 + 2.664 = 1.564
    # A_0 = 1.8 + 0.72*1.564 = 1.8 + 1.12608 = 2.92608
    torch.testing.assert_close(adv, col(2.92608, 1.564, 3.7))
    # returns = A + V = [3.92608, 3.564, 4.7]
    torch.testing.assert_close(ret, col(3.92608, 3.564, 4.7))


def test_step_gae_termination_in_the_middle_pinned():
    # The episode terminates at t=1; next_values[1] = 100 must be ignored (a terminal state has no value).
    adv, ret = step_gae(
        col(*R), col(*V), col(2.0, 100.0, 3.0), flags(False, True, False), flags(False, True, False), gamma=0.9, lam=0.8
    )
    # delta_0 = 1.8, delta_1 = 0 + 0.9*0*100 - 2 = -2, delta_2 = 3.7
    # A_2 = 3.7
    # A_1 = -2 (done: A_2 does not flow back across the episode boundary)
    # A_0 = 1.8 + 0.72*(-2) = 0.36
    torch.testing.assert_close(adv, col(0.36, -2.0, 3.7))
    torch.testing.assert_close(ret, col(1.36, 0.0, 4.7))


def test_step_gae_truncation_bootstraps_but_cuts_pinned():
    # Truncated at t=1 (done, not terminated): the cut-off state's value 5 is bootstrapped.
    adv, _ = step_gae(col(*R), col(*V), col(2.0, 5.0, 3.0), flags(*NO), flags(False, True, False), gamma=0.9, lam=0.8)
    # delta_1 = 0 + 0.9*5 - 2 = 2.5
    # A_2 = 3.7; A_1 = 2.5 (cut); A_0 = 1.8 + 0.72*2.5 = 3.6
    torch.testing.assert_close(adv, col(3.6, 2.5, 3.7))


def test_step_gae_lambda_one_is_n_step_returns_minus_values():
    adv, _ = step_gae(col(*R), col(*V), col(*NV), flags(*NO), flags(*NO), gamma=0.9, lam=1.0)
    # G_2 = 2 + 0.9*3 = 4.7; G_1 = 0 + 0.9*4.7 = 4.23; G_0 = 1 + 0.9*4.23 = 4.807
    # A = G - V = [3.807, 2.23, 3.7]
    torch.testing.assert_close(adv, col(3.807, 2.23, 3.7))
    n_step = discounted_returns(col(*R), flags(*NO), gamma=0.9, bootstrap=torch.tensor([3.0], dtype=torch.float64))
    torch.testing.assert_close(adv, n_step - col(*V))


def test_step_gae_lambda_zero_is_one_step_td_errors():
    adv, _ = step_gae(col(*R), col(*V), col(*NV), flags(*NO), flags(*NO), gamma=0.9, lam=0.0)
    torch.testing.assert_close(adv, col(1.8, -1.1, 3.7))  # the deltas above


def test_step_gae_envs_are_independent():
    # Column 0: the no-end window; column 1: the termination window. Each equals its single-env result.
    rewards = torch.cat([col(*R), col(*R)], 1)
    values = torch.cat([col(*V), col(*V)], 1)
    next_values = torch.cat([col(*NV), col(2.0, 100.0, 3.0)], 1)
    ends = torch.cat([flags(*NO), flags(False, True, False)], 1)
    adv, ret = step_gae(rewards, values, next_values, ends, ends, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, 0:1], col(2.92608, 1.564, 3.7))
    torch.testing.assert_close(adv[:, 1:2], col(0.36, -2.0, 3.7))
    torch.testing.assert_close(ret, adv + values)


@pytest.mark.parametrize(
    "shapes",
    [
        [(3, 2)] * 4 + [(3, 1)],  # one tensor differs
        [(3,)] * 5,  # not (T, N)
        [(3, 2, 1)] * 5,
    ],
)
def test_step_gae_shape_errors(shapes):
    tensors = [torch.zeros(s) for s in shapes]
    with pytest.raises(ValueError, match="step_gae"):
        step_gae(*tensors)


def reference_gae(rewards, values, next_values, terminated, done, gamma, lam):
    """Episode by episode, with plain Python numbers."""
    t_len, n = rewards.shape
    adv = [[0.0] * n for _ in range(t_len)]
    for j in range(n):
        following = 0.0
        for t in reversed(range(t_len)):
            bootstrap = 0.0 if terminated[t, j] else gamma * float(next_values[t, j])
            delta = float(rewards[t, j]) + bootstrap - float(values[t, j])
            if done[t, j]:
                following = 0.0
            following = delta + gamma * lam * following
            adv[t][j] = following
    return torch.tensor(adv, dtype=torch.float64)


@FAST
@given(
    t_len=st.integers(1, 8),
    n=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_step_gae_matches_reference(t_len, n, seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    rewards, values, next_values = (torch.randn(t_len, n, generator=g, dtype=torch.float64) for _ in range(3))
    done = torch.rand(t_len, n, generator=g) < 0.3
    terminated = done & (torch.rand(t_len, n, generator=g) < 0.5)  # terminated implies done
    adv, ret = step_gae(rewards, values, next_values, terminated, done, gamma=gamma, lam=lam)
    expected = reference_gae(rewards, values, next_values, terminated, done, gamma, lam)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)


# ---------------------------------------------------------------- discounted_returns


def test_discounted_returns_pinned():
    rewards, done = col(1.0, 2.0, 3.0, 4.0), flags(False, True, False, False)
    # G_3 = 4; G_2 = 3 + 0.9*4 = 6.6; G_1 = 2 (the episode ends); G_0 = 1 + 0.9*2 = 2.8
    torch.testing.assert_close(discounted_returns(rewards, done, gamma=0.9), col(2.8, 2.0, 6.6, 4.0))
    # bootstrap G_4 = 10: G_3 = 4 + 0.9*10 = 13; G_2 = 3 + 0.9*13 = 14.7; the first episode is unchanged
    boot = torch.tensor([10.0], dtype=torch.float64)
    torch.testing.assert_close(discounted_returns(rewards, done, gamma=0.9, bootstrap=boot), col(2.8, 2.0, 14.7, 13.0))


def test_discounted_returns_bootstrap_cut_by_done_at_window_end():
    # done at the last step: the bootstrap belongs to the next episode. G_1 = 1; G_0 = 1 + 0.9*1 = 1.9
    out = discounted_returns(col(1.0, 1.0), flags(False, True), gamma=0.9, bootstrap=torch.tensor([10.0]))
    torch.testing.assert_close(out, col(1.9, 1.0))


def test_discounted_returns_two_envs():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    done = torch.tensor([[False, True], [False, False]])
    # env 0: G_1 = 1, G_0 = 1 + 0.5*1 = 1.5; env 1: G_1 = 1, G_0 = 0 (its episode ended at t=0)
    out = discounted_returns(rewards, done, gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([[1.5, 0.0], [1.0, 1.0]]))


def test_discounted_returns_integer_rewards():
    # G_1 = 1; G_0 = 1 + 0.9*1 = 1.9
    out = discounted_returns(torch.tensor([[1], [1]]), torch.zeros(2, 1, dtype=torch.bool), gamma=0.9)
    torch.testing.assert_close(out.double(), col(1.9, 1.0))


def test_discounted_returns_shape_errors():
    with pytest.raises(ValueError, match="discounted_returns"):
        discounted_returns(torch.zeros(3, 2), torch.zeros(3, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="discounted_returns"):
        discounted_returns(torch.zeros(3), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"bootstrap must have shape \(2,\)"):
        discounted_returns(torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.bool), bootstrap=torch.zeros(3))


# ---------------------------------------------------------------- td_targets


def test_td_targets_dqn_pinned():
    rewards = torch.tensor([1.0, 0.5, 2.0])
    next_q = torch.tensor([[1.0, 3.0], [2.0, 0.0], [7.0, 9.0]])
    terminated = torch.tensor([False, False, True])
    # 1 + 0.9*max(1, 3) = 3.7; 0.5 + 0.9*max(2, 0) = 2.3; terminated: the reward 2 alone
    torch.testing.assert_close(td_targets(rewards, next_q, terminated, gamma=0.9), torch.tensor([3.7, 2.3, 2.0]))


def test_td_targets_double_dqn_pinned():
    rewards = torch.tensor([1.0, 0.5, 2.0])
    next_q_target = torch.tensor([[1.0, 3.0], [2.0, 0.0], [7.0, 9.0]])
    next_q_online = torch.tensor([[5.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    terminated = torch.tensor([False, False, True])
    # online argmax = [0, 1, 0]; target values there = [1, 0, 7]
    # 1 + 0.9*1 = 1.9 (DQN: 3.7); 0.5 + 0.9*0 = 0.5 (DQN: 2.3); terminated: 2
    out = td_targets(rewards, next_q_target, terminated, gamma=0.9, next_q_online=next_q_online)
    torch.testing.assert_close(out, torch.tensor([1.9, 0.5, 2.0]))


def test_td_targets_integer_flags_and_rewards():
    out = td_targets(torch.tensor([1, 0]), torch.tensor([[0.0, 2.0], [4.0, 1.0]]), torch.tensor([0, 1]), gamma=0.5)
    # 1 + 0.5*2 = 2; terminated: 0
    torch.testing.assert_close(out, torch.tensor([2.0, 0.0]))


@pytest.mark.parametrize(
    "args",
    [
        (torch.zeros(2), torch.zeros(2), torch.zeros(2)),  # next_q not (B, A)
        (torch.zeros(3), torch.zeros(2, 4), torch.zeros(3)),  # B differs
        (torch.zeros(2), torch.zeros(2, 4), torch.zeros(3)),  # terminated differs
        (torch.zeros(2, 1), torch.zeros(2, 4), torch.zeros(2, 1)),  # rewards not (B,)
    ],
)
def test_td_targets_shape_errors(args):
    with pytest.raises(ValueError, match="td_targets"):
        td_targets(*args)


def test_td_targets_online_shape_error():
    with pytest.raises(ValueError, match="next_q_online"):
        td_targets(torch.zeros(2), torch.zeros(2, 4), torch.zeros(2), next_q_online=torch.zeros(2, 3))
