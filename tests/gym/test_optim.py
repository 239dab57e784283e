"""The classic-RL schedules and optimizer steps (align.gym.optim): the linear schedule, gradient-norm clipping, the
fused Adam step and Polyak averaging. Pinned values are worked out by hand in the comments."""

import copy

import pytest
import torch
from torch import nn

from align.gym.optim import clip_grad_norm, fused_adam_step, linear_schedule, polyak_update

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


@pytest.mark.parametrize(
    "make",
    [
        lambda params: torch.optim.Adam(params, lr=1e-2, eps=1e-5, fused=True),
        lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.1, fused=True),
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, betas=(0.8, 0.95), fused=True),
        lambda params: torch.optim.Adam(
            [{"params": params[:2], "lr": 3e-3}, {"params": params[2:]}], lr=1e-2, fused=True
        ),
    ],
)
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


@pytest.mark.parametrize(
    "case", ["not fused", "amsgrad", "maximize", "tensor lr", "rmsprop", "hook", "scheduler", "two dtypes"]
)
def test_fused_adam_step_leaves_what_it_does_not_cover_to_step(case):
    net, _ = _twin_networks()
    params = list(net.parameters())
    options = {
        "not fused": {"fused": False},
        "amsgrad": {"amsgrad": True},
        "maximize": {"maximize": True},
        "tensor lr": {"lr": torch.tensor(1e-2)},
    }.get(case, {})
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
