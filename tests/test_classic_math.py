"""The classic-RL arithmetic: step-wise GAE, discounted returns, TD targets, the linear schedule, Polyak averaging
and the diagonal Gaussian's log-density and entropy. Pinned values are worked out by hand in the comments."""

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from align.gym.returns import discounted_returns, step_gae, td_targets
from align.gym.networks import gaussian_entropy, gaussian_log_prob
from align.trainer.optim import clip_grad_norm, fused_adam_step, linear_schedule, polyak_update

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
    adv, ret = step_gae(col(*R), col(*V), col(2.0, 100.0, 3.0), flags(False, True, False),
                        flags(False, True, False), gamma=0.9, lam=0.8)
    # delta_0 = 1.8, delta_1 = 0 + 0.9*0*100 - 2 = -2, delta_2 = 3.7
    # A_2 = 3.7
    # A_1 = -2 (done: A_2 does not flow back across the episode boundary)
    # A_0 = 1.8 + 0.72*(-2) = 0.36
    torch.testing.assert_close(adv, col(0.36, -2.0, 3.7))
    torch.testing.assert_close(ret, col(1.36, 0.0, 4.7))


def test_step_gae_truncation_bootstraps_but_cuts_pinned():
    # Truncated at t=1 (done, not terminated): the cut-off state's value 5 is bootstrapped.
    adv, _ = step_gae(col(*R), col(*V), col(2.0, 5.0, 3.0), flags(*NO), flags(False, True, False),
                      gamma=0.9, lam=0.8)
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


@pytest.mark.parametrize("shapes", [
    [(3, 2)] * 4 + [(3, 1)],  # one tensor differs
    [(3,)] * 5,  # not (T, N)
    [(3, 2, 1)] * 5,
])
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
@given(t_len=st.integers(1, 8), n=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0))
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


@pytest.mark.parametrize("args", [
    (torch.zeros(2), torch.zeros(2), torch.zeros(2)),  # next_q not (B, A)
    (torch.zeros(3), torch.zeros(2, 4), torch.zeros(3)),  # B differs
    (torch.zeros(2), torch.zeros(2, 4), torch.zeros(3)),  # terminated differs
    (torch.zeros(2, 1), torch.zeros(2, 4), torch.zeros(2, 1)),  # rewards not (B,)
])
def test_td_targets_shape_errors(args):
    with pytest.raises(ValueError, match="td_targets"):
        td_targets(*args)


def test_td_targets_online_shape_error():
    with pytest.raises(ValueError, match="next_q_online"):
        td_targets(torch.zeros(2), torch.zeros(2, 4), torch.zeros(2), next_q_online=torch.zeros(2, 3))


# ---------------------------------------------------------------- linear_schedule


def test_linear_schedule():
    # 1.0 -> 0.1 over 100 steps
    assert linear_schedule(0, 1.0, 0.1, 100) == pytest.approx(1.0)
    assert linear_schedule(50, 1.0, 0.1, 100) == pytest.approx(0.55)  # 1 + 0.5*(0.1 - 1)
    assert linear_schedule(25, 0.0, 4.0, 100) == pytest.approx(1.0)  # increasing: 0 + 0.25*4
    assert linear_schedule(100, 1.0, 0.1, 100) == pytest.approx(0.1)
    assert linear_schedule(1000, 1.0, 0.1, 100) == pytest.approx(0.1)
    assert linear_schedule(-5, 1.0, 0.1, 100) == pytest.approx(1.0)
    assert linear_schedule(0, 1.0, 0.1, 0) == 0.1
    assert linear_schedule(0, 1.0, 0.1, -3) == 0.1
    assert isinstance(linear_schedule(3, 1, 0, 10), float)


# ---------------------------------------------------------------- clip_grad_norm


def test_clip_grad_norm_pinned():
    # gradients (3, 4) and (12,): global norm sqrt(9 + 16 + 144) = 13; limit 6.5 halves them (up to the 1e-6)
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    norm = clip_grad_norm([a, b], 6.5)
    assert norm.item() == pytest.approx(13.0)
    torch.testing.assert_close(a.grad, torch.tensor([1.5, 2.0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(b.grad, torch.tensor([6.0]), rtol=1e-6, atol=0)
    assert clip_grad_norm([a, b], 100.0).item() == pytest.approx(6.5, rel=1e-6)  # under the limit: unchanged
    torch.testing.assert_close(a.grad, torch.tensor([1.5, 2.0]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("max_norm", [0.5, 1e3, None])
def test_clip_grad_norm_equals_torch(max_norm):
    g = torch.Generator().manual_seed(1)
    shapes = [(2, 4, 64), (2, 1, 64), (64,), (3,)]
    ours = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    theirs = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p, q in zip(ours, theirs):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    no_grad = torch.nn.Parameter(torch.ones(2))  # skipped, as torch skips it
    norm = clip_grad_norm([*ours, no_grad], max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, float("inf") if max_norm is None else max_norm)
    torch.testing.assert_close(norm, expected)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad)
    mixed = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    for p in mixed:
        p.grad = torch.full_like(p, 3.0)
    assert clip_grad_norm(mixed, 1.0).item() == pytest.approx(6.0)  # two dtypes: torch's function
    assert clip_grad_norm([no_grad], 1.0).item() == 0.0


# ---------------------------------------------------------------- fused_adam_step


def _twin_networks(seed: int = 0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    twin = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    twin.load_state_dict(net.state_dict())
    return net, twin


def _backward(net: nn.Module, x: torch.Tensor, frozen_bias: bool = False) -> None:
    for p in net.parameters():
        p.grad = None
    net(x).pow(2).sum().backward()
    if frozen_bias:  # a parameter without a gradient this step is left alone, as step() leaves it
        net[2].bias.grad = None


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.Adam(params, lr=1e-2, eps=1e-5, fused=True),
    lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.1, fused=True),
    lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, betas=(0.8, 0.95), fused=True),
    lambda params: torch.optim.Adam([{"params": params[:2], "lr": 3e-3}, {"params": params[2:]}], lr=1e-2,
                                    fused=True),
])
def test_fused_adam_step_equals_the_optimizers_step_bit_for_bit(make):
    net, twin = _twin_networks()
    ours, theirs = make(list(twin.parameters())), make(list(net.parameters()))
    g = torch.Generator().manual_seed(1)
    taken = []
    for step in range(8):
        x = torch.randn(32, 4, generator=g)
        _backward(net, x, frozen_bias=step == 5)
        _backward(twin, x, frozen_bias=step == 5)
        theirs.step()
        applied = fused_adam_step(ours)
        if not applied:
            ours.step()
        taken.append(applied)
        if step == 3:  # a learning rate set between steps (DQN's and PPO's linear schedules do this)
            for opt in (ours, theirs):
                opt.param_groups[-1]["lr"] = 4e-3
    assert taken == [False] + [True] * 7  # the first step creates the state
    for p, q in zip(twin.parameters(), net.parameters()):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[p][key], theirs.state[q][key]), key
    assert str(ours.state_dict()) == str(theirs.state_dict())


def test_fused_adam_step_continues_from_a_loaded_state():
    # A resumed run loads the optimizer's state (new tensors); the next step reads them, as step() does.
    net, twin = _twin_networks()
    theirs = torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)
    x = torch.randn(16, 4)
    for _ in range(3):
        _backward(net, x)
        theirs.step()
    twin.load_state_dict(net.state_dict())
    ours = torch.optim.Adam(twin.parameters(), lr=1e-2, fused=True)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))  # (a loaded checkpoint shares no tensor with theirs)
    for _ in range(2):
        _backward(net, x)
        _backward(twin, x)
        theirs.step()
        assert fused_adam_step(ours)
    assert all(torch.equal(p, q) for p, q in zip(twin.parameters(), net.parameters()))


@pytest.mark.parametrize("case", ["not fused", "amsgrad", "maximize", "tensor lr", "rmsprop", "hook", "scheduler",
                                  "two dtypes"])
def test_fused_adam_step_leaves_what_it_does_not_cover_to_step(case):
    net, _ = _twin_networks()
    params = list(net.parameters())
    options = {"not fused": {"fused": False}, "amsgrad": {"amsgrad": True}, "maximize": {"maximize": True},
               "tensor lr": {"lr": torch.tensor(1e-2)}}.get(case, {})
    if case == "rmsprop":
        optimizer = torch.optim.RMSprop(params, lr=1e-2)
    else:
        optimizer = torch.optim.Adam(params, **{"lr": 1e-2, "fused": True, **options})
    if case == "hook":
        optimizer.register_step_post_hook(lambda *args: None)
    if case == "scheduler":
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if case == "two dtypes":
        net[0].double()
    x = torch.randn(8, 4)
    for _ in range(2):
        if case == "two dtypes":
            for p in net.parameters():
                p.grad = None
            net[1:](net[0](x.double()).float()).pow(2).sum().backward()
        else:
            _backward(net, x)
        if _ == 0:
            optimizer.step()
    before = [p.detach().clone() for p in net.parameters()]
    assert not fused_adam_step(optimizer)
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


# ---------------------------------------------------------------- polyak_update


class Tiny(nn.Module):
    def __init__(self, w: float, b: float, stat: float, counter: int):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w]))
        self.register_buffer("b", torch.tensor([b]))
        self.register_buffer("stat", torch.tensor([stat], dtype=torch.float64))
        self.register_buffer("counter", torch.tensor([counter]))
        self.register_buffer("flag", torch.tensor([counter % 2 == 0]))


def test_polyak_hard_copy():
    target, online = Tiny(4.0, 1.0, 8.0, 7), Tiny(0.0, 5.0, 0.0, 2)
    polyak_update(target, online, 1.0)
    assert target.w.item() == 0.0 and target.b.item() == 5.0 and target.stat.item() == 0.0
    assert target.counter.item() == 7 and target.flag.item() is False  # non-float buffers untouched


def test_polyak_soft_pinned():
    target, online = Tiny(4.0, 1.0, 8.0, 7), Tiny(0.0, 5.0, 0.0, 2)
    polyak_update(target, online, 0.25)
    # w: 0.25*0 + 0.75*4 = 3; b: 0.25*5 + 0.75*1 = 2; stat: 0.75*8 = 6
    assert target.w.item() == pytest.approx(3.0)
    assert target.b.item() == pytest.approx(2.0)
    assert target.stat.item() == pytest.approx(6.0)
    assert target.counter.item() == 7 and target.flag.item() is False
    assert online.w.item() == 0.0 and online.b.item() == 5.0  # the source is not modified
    assert target.w.grad is None


@pytest.mark.parametrize("tau", [0.0, -0.1, 1.5, float("nan")])
def test_polyak_invalid_tau(tau):
    with pytest.raises(ValueError, match="tau"):
        polyak_update(Tiny(0.0, 0.0, 0.0, 0), Tiny(1.0, 1.0, 1.0, 1), tau)


# ---------------------------------------------------------------- Gaussian log-prob and entropy


def test_gaussian_pinned():
    # mean 0, sigma 1, action 0: -0.5*log(2 pi) per dim, two dims
    out = gaussian_log_prob(torch.zeros(2), torch.zeros(2), torch.zeros(2))
    assert out.item() == pytest.approx(-math.log(2 * math.pi))
    # mean 1, sigma 2, action 3: z = (3 - 1)/2 = 1 -> -(0.5*1 + log 2 + 0.5*log(2 pi))
    out = gaussian_log_prob(torch.tensor([1.0]), torch.tensor([math.log(2.0)]), torch.tensor([3.0]))
    assert out.item() == pytest.approx(-(0.5 + math.log(2.0) + 0.5 * math.log(2 * math.pi)))
    # entropy per dim: log sigma + (1 + log 2 pi)/2; sigma = 1 in three dims
    assert gaussian_entropy(torch.zeros(3)).item() == pytest.approx(1.5 * (1 + math.log(2 * math.pi)))


@FAST
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), dims=st.integers(1, 3))
def test_gaussian_matches_torch_normal(seed, batch, dims):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(batch, dims, generator=g, dtype=torch.float64)
    log_std = torch.randn(dims, generator=g, dtype=torch.float64)  # state-independent, broadcast
    actions = torch.randn(batch, dims, generator=g, dtype=torch.float64) * 3
    normal = torch.distributions.Normal(mean, log_std.exp())
    torch.testing.assert_close(gaussian_log_prob(mean, log_std, actions), normal.log_prob(actions).sum(-1))
    torch.testing.assert_close(gaussian_entropy(log_std.expand(batch, dims)), normal.entropy().sum(-1))
    torch.testing.assert_close(gaussian_entropy(log_std), normal.entropy()[0].sum())
