"""Classic-RL networks (align.gym.networks): the diagonal Gaussian's log-density and entropy, observation encoding
and running normalisation, the actor-critic, the Q-network and the Q-table."""

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from align.errors import AlignConfigError
from align.gym.networks import (
    ActorCritic,
    ObservationEncoder,
    QNetwork,
    QTable,
    gaussian_entropy,
    gaussian_log_prob,
    mlp,
    observation_size,
)

BOX4 = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
FAST = settings(max_examples=50, deadline=None)


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


# ---------------------------------------------------------------- ObservationEncoder


def test_discrete_observations_are_one_hot():
    encoder = ObservationEncoder(gym.spaces.Discrete(5), normalize=True)  # normalize is ignored for Discrete
    out = encoder(torch.tensor([0, 3, 4]))
    expected = torch.zeros(3, 5)
    expected[0, 0] = expected[1, 3] = expected[2, 4] = 1.0
    assert torch.equal(out, expected) and out.dtype == torch.float32
    assert encoder.size == 5 and not encoder.normalize


def test_box_observations_are_flattened():
    encoder = ObservationEncoder(gym.spaces.Box(0, 1, (2, 3), np.float64))
    obs = torch.arange(12, dtype=torch.float64).view(2, 2, 3)
    out = encoder(obs)
    assert out.shape == (2, 6) and out.dtype == torch.float32
    torch.testing.assert_close(out, obs.view(2, 6).float())
    assert observation_size(gym.spaces.Box(0, 1, (), np.float32)) == 1


def test_running_normalisation_matches_concatenated_data():
    encoder = ObservationEncoder(gym.spaces.Box(-np.inf, np.inf, (3,), np.float32), normalize=True)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 3, generator=g, dtype=torch.float64) * 2 + 1
    b = torch.randn(11, 3, generator=g, dtype=torch.float64) * 0.5 - 3
    encoder.update(a)
    encoder.update(b)
    data = torch.cat([a, b])
    # Exact: the running statistics start as a pseudo-sample of weight 1e-4 with mean 0 and variance 1, so they are
    # those of the data plus that pseudo-sample.
    w, n = 1e-4, data.shape[0]
    total = w + n
    mean = data.sum(0) / total
    var = (w * (1.0 + mean.square()) + (data - mean).square().sum(0)) / total
    torch.testing.assert_close(encoder.count, torch.tensor(total, dtype=torch.float64))
    torch.testing.assert_close(encoder.mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(encoder.var, var, rtol=1e-12, atol=1e-12)
    # ... and within the pseudo-sample's weight of the concatenated data's own (biased) statistics.
    torch.testing.assert_close(encoder.mean, data.mean(0), rtol=0, atol=1e-4)
    torch.testing.assert_close(encoder.var, data.var(0, unbiased=False), rtol=0, atol=1e-3)
    # forward normalises with them
    out = encoder(data.float())
    torch.testing.assert_close(out, ((data - mean) / torch.sqrt(var + 1e-8)).float(), rtol=1e-5, atol=1e-5)


def test_normalisation_clips():
    encoder = ObservationEncoder(gym.spaces.Box(-np.inf, np.inf, (2,), np.float32), normalize=True, clip=2.0)
    encoder.update(torch.tensor([[0.0, 0.0], [1.0, -1.0]]))  # mean about (0.5, -0.5), std about 0.5
    out = encoder(torch.tensor([[1e6, -1e6], [0.5, -0.5], [-1e6, 1e6]]))
    assert out[0].tolist() == [2.0, -2.0]
    assert out[2].tolist() == [-2.0, 2.0]
    assert out[1].abs().max() < 1e-3


def test_update_without_normalize_is_a_no_op():
    encoder = ObservationEncoder(BOX4)
    encoder.update(torch.ones(3, 4))
    assert not hasattr(encoder, "mean")
    assert torch.equal(encoder(torch.ones(2, 4) * 7), torch.ones(2, 4) * 7)


# ---------------------------------------------------------------- ActorCritic


def test_discrete_act_and_evaluate():
    torch.manual_seed(0)
    model = ActorCritic(BOX4, gym.spaces.Discrete(3), hidden=(16,))
    obs = torch.randn(5, 4)
    greedy = model.act(obs, deterministic=True)
    logits = model.policy_head(obs)
    assert torch.equal(greedy.actions, logits.argmax(-1))
    sampled = model.act(obs)
    assert sampled.actions.shape == (5,) and sampled.logprobs.shape == (5,) and sampled.values.shape == (5,)
    logprobs, entropy, values = model.evaluate(obs, sampled.actions)
    torch.testing.assert_close(logprobs, sampled.logprobs)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, sampled.actions[:, None])[:, 0])
    torch.testing.assert_close(values, sampled.values)
    torch.testing.assert_close(values, model.value(obs))
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy, -(probs * probs.log()).sum(-1))
    logprobs.sum().backward()  # evaluate is differentiable
    assert model.nets.weights[0].grad is not None


def test_continuous_act_evaluate_and_env_actions():
    torch.manual_seed(0)
    space = gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.array([1.0, 2.0], np.float32))
    model = ActorCritic(BOX4, space, hidden=(16, 16), log_std_init=-0.5)
    obs = torch.randn(6, 4)
    mean = model.policy_head(obs)
    greedy = model.act(obs, deterministic=True)
    assert torch.equal(greedy.actions, mean)
    # the mode's log-density: -(log sigma + 0.5 log 2 pi) per dim, with sigma = exp(-0.5)
    torch.testing.assert_close(greedy.logprobs, torch.full((6,), -2 * (-0.5 + 0.5 * math.log(2 * math.pi))))
    sampled = model.act(obs)
    assert sampled.actions.shape == (6, 2)
    logprobs, entropy, values = model.evaluate(obs, sampled.actions)
    torch.testing.assert_close(logprobs, sampled.logprobs)
    torch.testing.assert_close(logprobs, gaussian_log_prob(mean, model.log_std, sampled.actions))
    torch.testing.assert_close(entropy, torch.full((6,), 2 * (-0.5 + 0.5 * (1 + math.log(2 * math.pi)))))
    torch.testing.assert_close(values, model.value(obs))
    actions = torch.tensor([[-3.0, 5.0], [0.5, 1.0], [2.0, -1.0]])
    assert model.env_actions(actions).tolist() == [[-1.0, 2.0], [0.5, 1.0], [1.0, 0.0]]


@pytest.mark.parametrize("action_space", [gym.spaces.Discrete(3), gym.spaces.Box(-1.0, 1.0, (2,), np.float32)])
def test_act_without_logprobs_samples_the_same_actions_and_values(action_space):
    model = ActorCritic(BOX4, action_space, hidden=(16,))
    obs = torch.randn(5, 4)
    torch.manual_seed(3)
    full = model.act(obs)
    torch.manual_seed(3)
    lean = model.act(obs, logprobs=False)
    assert lean.logprobs is None
    assert torch.equal(lean.actions, full.actions) and torch.equal(lean.values, full.values)


def test_discrete_env_actions_unchanged():
    model = ActorCritic(BOX4, gym.spaces.Discrete(2))
    actions = torch.tensor([0, 1, 1])
    assert model.env_actions(actions) is actions


def test_shared_trunk():
    torch.manual_seed(0)
    model = ActorCritic(gym.spaces.Discrete(6), gym.spaces.Discrete(4), hidden=(8, 8), shared=True)
    assert model.shared and hasattr(model, "trunk")
    obs = torch.tensor([0, 5, 2])
    out = model.act(obs)
    assert out.actions.shape == (3,) and out.values.shape == (3,)
    torch.testing.assert_close(model.evaluate(obs, out.actions)[0], out.logprobs)
    torch.testing.assert_close(model.value(obs), out.values)
    # Both heads read the one trunk: the policy loss reaches the trunk's weights, as does the value loss.
    model.evaluate(obs, out.actions)[0].sum().backward()
    first = model.trunk[0][0].weight
    assert first.grad is not None and first.grad.abs().sum() > 0
    assert model.vf[0].weight.grad is None
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert names == {"trunk", "pi", "vf"}


def test_initial_policy_is_near_uniform():
    torch.manual_seed(0)
    model = ActorCritic(BOX4, gym.spaces.Discrete(4))
    probs = torch.softmax(model.policy_head(torch.randn(64, 4)), -1)
    assert (probs - 0.25).abs().max() < 0.02
    # the policy's output layer: orthogonal with gain 0.01 (its columns orthonormal up to that gain), zero bias
    weight, bias = model.nets.weights[-1][0], model.nets.biases[-1][0]  # (64, 4), (1, 4)
    torch.testing.assert_close(weight.T @ weight, 1e-4 * torch.eye(4), atol=1e-7, rtol=0)
    assert torch.equal(bias, torch.zeros(1, 4))


def test_stacked_heads_equal_two_separate_networks():
    """The policy and value networks computed together by batched matmuls give what two plain MLPs with the same
    weights give, values and gradients."""
    from align.gym.networks import StackedMLP

    torch.manual_seed(0)
    stacked = StackedMLP([4, 8, 8, 3], "tanh", (0.01, 1.0))
    x = torch.randn(5, 4)
    out = stacked(x)  # (2, 5, 3)
    for head in range(2):
        h = x
        for i, (w, b) in enumerate(zip(stacked.weights, stacked.biases)):
            h = h @ w[head] + b[head]
            h = torch.tanh(h) if i < 2 else h
        torch.testing.assert_close(out[head], h)
    out[1, :, 0].sum().backward()  # the value head's loss does not reach the policy's weights
    assert stacked.weights[0].grad[0].abs().sum() == 0 and stacked.weights[0].grad[1].abs().sum() > 0


def test_mlp_structure_and_bad_activation():
    net = mlp([3, 5, 2], "relu", 1.0)
    assert [type(m).__name__ for m in net] == ["Linear", "ReLU", "Linear"]
    with pytest.raises(AlignConfigError, match="activation"):
        mlp([3, 2], "gelu", 1.0)


@pytest.mark.parametrize(
    "space, text",
    [
        (gym.spaces.MultiBinary(3), r"MultiBinary\(3\)"),
        (gym.spaces.Box(-1, 1, (2, 2), np.float32), r"Box\(shape=\(2, 2\)\)"),
        (gym.spaces.MultiDiscrete([2, 3]), "MultiDiscrete"),
    ],
)
def test_unsupported_action_space(space, text):
    with pytest.raises(AlignConfigError, match=rf"environment 'Grid-v0': action space {text}.*not supported"):
        ActorCritic(BOX4, space, env_id="Grid-v0")


def test_unsupported_observation_space():
    space = gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3)))
    with pytest.raises(AlignConfigError, match="environment 'Grid-v0': observation space Tuple.*not supported"):
        ActorCritic(space, gym.spaces.Discrete(2), env_id="Grid-v0")


# ---------------------------------------------------------------- Q-network and Q-table


def test_qnetwork_output_shape():
    assert QNetwork(BOX4, 3, hidden=(8,))(torch.randn(5, 4)).shape == (5, 3)
    assert QNetwork(gym.spaces.Discrete(7), 2)(torch.tensor([0, 6])).shape == (2, 2)


def test_qnetwork_initialisation_is_torchs_by_default_or_orthogonal():
    # torch's nn.Linear init (as SB3's DQN): weights and biases uniform in +-1/sqrt(fan_in). Orthogonal: gain
    # sqrt(2) in the hidden layers (rows of norm sqrt(2) where out <= in), 1 on the output, zero biases.
    torch.manual_seed(0)
    plain = QNetwork(BOX4, 3, hidden=(64, 32))
    for layer in (m for m in plain.net if isinstance(m, torch.nn.Linear)):
        bound = 1 / layer.in_features**0.5
        assert layer.weight.abs().max() <= bound and layer.bias.abs().max() <= bound and layer.bias.abs().sum() > 0
    ortho = QNetwork(BOX4, 3, hidden=(64, 32), init="orthogonal")
    first, second, last = (m for m in ortho.net if isinstance(m, torch.nn.Linear))
    torch.testing.assert_close(first.weight.T @ first.weight, 2 * torch.eye(4), atol=1e-5, rtol=0)  # out > in
    torch.testing.assert_close(second.weight @ second.weight.T, 2 * torch.eye(32), atol=1e-5, rtol=0)
    torch.testing.assert_close(last.weight @ last.weight.T, torch.eye(3), atol=1e-5, rtol=0)
    assert all(layer.bias.abs().sum() == 0 for layer in (first, second, last))
    with pytest.raises(AlignConfigError, match="model.init: expected 'torch' or 'orthogonal', got 'xavier'"):
        QNetwork(BOX4, 3, init="xavier")


def test_qtable():
    table = QTable(gym.spaces.Discrete(4), 2, init=0.5)
    assert table.table.shape == (4, 2)
    with torch.no_grad():
        table.table[3, 1] = 9.0
    assert table(torch.tensor([3, 0])).tolist() == [[0.5, 9.0], [0.5, 0.5]]


def test_qtable_rejects_box_observations():
    with pytest.raises(
        AlignConfigError,
        match=r"environment 'CartPole-v1': tabular Q-learning needs a Discrete "
        r"observation space, got Box\(shape=\(4,\)\); use DQN",
    ):
        QTable(BOX4, 2, env_id="CartPole-v1")


def test_reward_scaler_divides_by_the_running_std_of_the_discounted_return():
    from align.gym.networks import RewardScaler

    scaler = RewardScaler(num_envs=1, gamma=0.5, clip=10.0)
    rewards = torch.tensor([[1.0], [1.0], [1.0]])
    done = torch.tensor([[False], [True], [False]])
    out = scaler(rewards, done)
    # Returns seen: 1, 1 * 0.5 + 1 = 1.5, then (reset after the done) 1. Their mean 7/6 and variance 1/18 are
    # folded into the prior (mean 0, variance 1, count 1e-4).
    n, prior = 3, 1e-4
    mean, var = 7 / 6, 1 / 18
    total = prior + n
    expected_var = (1.0 * prior + var * n + mean**2 * prior * n / total) / total
    assert float(scaler.var) == pytest.approx(expected_var, rel=1e-9)
    torch.testing.assert_close(out, rewards / expected_var**0.5)
    assert float(scaler.returns[0]) == 1.0  # the running return carries into the next window
    tight = RewardScaler(num_envs=1, gamma=0.5, clip=0.5)
    assert float(tight(torch.tensor([[1.0]]), torch.tensor([[False]]))) == 0.5  # 1 / std of about 1e2, clipped
    assert float(scaler(torch.tensor([[-1.0]]), torch.tensor([[True]]))) < 0  # the sign is kept


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_q_network_greedy_is_the_argmax_of_its_forward_after_updates_and_loads(activation):
    import gymnasium as gym

    from align.gym.networks import QNetwork

    torch.manual_seed(0)
    space = gym.spaces.Box(-1, 1, (3,))
    q = QNetwork(space, 5, (16, 16), activation)
    obs = torch.randn(64, 3)
    assert torch.equal(q.greedy(obs), q(obs).argmax(dim=1))
    optimizer = torch.optim.SGD(q.parameters(), lr=1.0)
    q(obs).square().sum().backward()
    optimizer.step()  # in place: the cached layers see it
    assert torch.equal(q.greedy(obs), q(obs).argmax(dim=1))
    other = QNetwork(space, 5, (16, 16), activation)
    q.load_state_dict(other.state_dict())
    assert torch.equal(q.greedy(obs), other(obs).argmax(dim=1))
    q.net[0].weight = torch.nn.Parameter(torch.randn(16, 3))  # replaced, not updated: the cache is rebuilt
    assert torch.equal(q.greedy(obs), q(obs).argmax(dim=1))
    assert not torch.is_grad_enabled() or q.greedy(obs).grad_fn is None
