"""Small networks for classic RL on Gymnasium spaces: an actor-critic (:class:`ActorCritic`), a Q-network
(:class:`QNetwork`) and a Q-table (:class:`QTable`), with observation encoding and running normalisation.

Action log-probs and entropies come from the same functions as a language model's tokens:
:func:`~align.core.logprobs.selective_log_softmax` and :func:`~align.core.logprobs.entropy_from_logits` for discrete
actions,
:func:`~align.gym.networks.gaussian_log_prob` for continuous ones.

Initialisation follows Stable-Baselines3: the actor-critic networks as arXiv 2005.12729 ("implementation
matters") recommends, orthogonal weights with gain sqrt(2) in hidden layers, 0.01 on the policy output and 1 on the
value output, zero biases; the Q-network with torch's default ``nn.Linear`` initialisation, as SB3's (and
CleanRL's) DQN, whose tuned hyperparameters assume it (``init: orthogonal`` gives it the orthogonal one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Literal, NamedTuple, cast

import gymnasium as gym
import torch
from torch import nn

from align.core.logprobs import entropy_from_logits, selective_log_softmax
from align.errors import AlignConfigError

Activation = Literal["tanh", "relu"]


def gaussian_log_prob(mean: torch.Tensor, log_std: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Log-density of ``actions`` under a diagonal Gaussian, summed over the last (action) dim: ``(..., A) -> (...)``.

    ``-sum((a - mu)^2 / (2 sigma^2) + log sigma + log(2 pi) / 2)``: a continuous-action policy's log-prob, used in
    the PPO ratio exactly as a token's log-prob is. ``log_std`` broadcasts against ``mean`` (a state-independent
    ``(A,)`` parameter, as in arXiv 1707.06347's continuous-control experiments).
    """
    log_std = log_std.expand_as(mean)
    z = (actions - mean) * torch.exp(-log_std)
    return -(0.5 * z.square() + log_std + 0.5 * math.log(2 * math.pi)).sum(dim=-1)


def gaussian_entropy(log_std: torch.Tensor) -> torch.Tensor:
    """Entropy of a diagonal Gaussian, summed over the last dim: ``sum(log sigma + (1 + log(2 pi)) / 2)``."""
    return (log_std + 0.5 * (1.0 + math.log(2 * math.pi))).sum(dim=-1)


_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


def _space_name(space: gym.Space) -> str:
    return f"Box(shape={tuple(space.shape)})" if isinstance(space, gym.spaces.Box) else repr(space)


def observation_size(space: gym.Space, env_id: str = "environment") -> int:
    """Input width of a flat network on ``space``: a ``Box`` flattened, a ``Discrete`` one-hot."""
    if isinstance(space, gym.spaces.Box):
        return int(math.prod(space.shape)) if space.shape else 1
    if isinstance(space, gym.spaces.Discrete):
        return int(space.n)
    raise AlignConfigError(
        f"environment '{env_id}': observation space {_space_name(space)} is not supported; "
        "expected Box or Discrete (flatten others with a gymnasium wrapper)"
    )


@torch.no_grad()
def _fold_moments(stats: ObservationEncoder | RewardScaler, x: torch.Tensor) -> None:
    """Fold a batch ``x`` (reduced over its first dim) into ``stats``' running ``mean``, ``var`` and ``count``
    buffers, in place (Chan et al.'s parallel update)."""
    batch_mean, batch_var, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
    delta, total = batch_mean - stats.mean, stats.count + n
    stats.mean += delta * n / total
    stats.var.copy_((stats.var * stats.count + batch_var * n + delta.square() * stats.count * n / total) / total)
    stats.count.fill_(total)


class ObservationEncoder(nn.Module):
    """``(N, *obs)`` environment observations to ``(N, D)`` float features, normalised by running statistics when
    ``normalize`` (Stable-Baselines3's ``VecNormalize``: clipped to +-``clip`` standard deviations)."""

    # Buffers, registered only when ``normalize``: the running statistics of the features.
    mean: torch.Tensor  # (D,) float64
    var: torch.Tensor  # (D,) float64
    count: torch.Tensor  # () float64

    def __init__(self, space: gym.Space, normalize: bool = False, clip: float = 10.0, env_id: str = "environment"):
        super().__init__()
        self.size = observation_size(space, env_id)
        self.discrete = isinstance(space, gym.spaces.Discrete)
        self.normalize, self.clip = normalize and not self.discrete, clip
        if self.normalize:
            self.register_buffer("mean", torch.zeros(self.size, dtype=torch.float64))
            self.register_buffer("var", torch.ones(self.size, dtype=torch.float64))
            self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        if self.discrete:
            return nn.functional.one_hot(obs.long().view(-1), self.size).float()
        x = obs.reshape(obs.shape[0], -1).float()
        if self.normalize:
            x = ((x - self.mean.float()) / torch.sqrt(self.var.float() + 1e-8)).clamp(-self.clip, self.clip)
        return x

    @torch.no_grad()
    def update(self, obs: torch.Tensor) -> None:
        """Fold a batch of raw observations into the running mean and variance (Chan et al.'s parallel update)."""
        if not self.normalize:
            return
        _fold_moments(self, obs.reshape(obs.shape[0], -1).double())


class RewardScaler(nn.Module):
    """Rewards divided by the running standard deviation of the discounted return, clipped to +-``clip``
    (Stable-Baselines3's ``VecNormalize(norm_reward=True)``; Engstrom et al. 2020, arXiv 2005.12729, "reward
    scaling"). The mean is not subtracted, so the sign of every reward is kept. Each environment's running return is
    a buffer, so a checkpoint resumes it."""

    returns: torch.Tensor  # (N,) float64, each environment's running discounted return
    mean: torch.Tensor  # () float64
    var: torch.Tensor  # () float64
    count: torch.Tensor  # () float64

    def __init__(self, num_envs: int, gamma: float, clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.gamma, self.clip, self.eps = gamma, clip, eps
        self.register_buffer("returns", torch.zeros(num_envs, dtype=torch.float64))
        self.register_buffer("mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("var", torch.ones((), dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    @torch.no_grad()
    def forward(self, rewards: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
        """Scale a window of rewards ``(T, N)`` (``done`` ``(T, N)`` ends each environment's return), updating the
        statistics with the window's returns first."""
        seen = torch.empty_like(rewards, dtype=torch.float64)  # (T, N)
        running = self.returns.clone()
        for t in range(rewards.shape[0]):
            running = running * self.gamma + rewards[t].double()
            seen[t] = running
            running = torch.where(done[t], torch.zeros_like(running), running)
        self.returns.copy_(running)
        _fold_moments(self, seen.flatten())
        return (rewards.double() / torch.sqrt(self.var + self.eps)).clamp(-self.clip, self.clip).to(rewards.dtype)


def mlp(sizes: Sequence[int], activation: Activation, out_gain: float | None) -> nn.Sequential:
    """Linear layers of ``sizes`` with ``activation`` between them, orthogonally initialised (gain sqrt(2), then
    ``out_gain`` on the last layer; zero biases). ``out_gain=None`` keeps torch's own initialisation of
    ``nn.Linear`` in every layer."""
    if activation not in _ACTIVATIONS:
        raise AlignConfigError(f"model.network.activation: expected one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        linear = nn.Linear(a, b)
        last = i == len(sizes) - 2
        if out_gain is not None:
            nn.init.orthogonal_(linear.weight, gain=out_gain if last else math.sqrt(2))
            nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(_ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


class StackedMLP(nn.Module):
    """``K`` MLPs of the same shape on one input, evaluated together: each layer is one batched matmul
    (``baddbmm``) over the ``K`` stacked weights, so a policy and a value network cost the kernel launches and
    autograd nodes of one. ``(N, D) -> (K, N, O)``. Each head is initialised as :func:`mlp` initialises one
    network, with its own output gain."""

    def __init__(self, sizes: Sequence[int], activation: Activation, out_gains: Sequence[float]):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise AlignConfigError(
                f"model.network.activation: expected one of {sorted(_ACTIVATIONS)}, got {activation!r}"
            )
        self.activation = {"tanh": torch.tanh, "relu": torch.relu}[activation]
        k = len(out_gains)
        self.weights, self.biases = nn.ParameterList(), nn.ParameterList()
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            last = i == len(sizes) - 2
            weight = torch.empty(k, a, b)
            for head in range(k):
                nn.init.orthogonal_(weight[head], gain=out_gains[head] if last else math.sqrt(2))
            self.weights.append(nn.Parameter(weight))
            self.biases.append(nn.Parameter(torch.zeros(k, 1, b)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The lists' parameter dicts, read directly: indexing a ParameterList costs more than a small layer. They
        # hold no None entries.
        weights = cast("Collection[nn.Parameter]", self.weights._parameters.values())
        biases = cast("Collection[nn.Parameter]", self.biases._parameters.values())
        last = len(weights) - 1
        h = x
        for i, (weight, bias) in enumerate(zip(weights, biases)):
            h = torch.baddbmm(bias, h.expand(weight.shape[0], *h.shape) if i == 0 else h, weight)  # (K, N, width)
            if i < last:
                h = self.activation(h)
        return h


class PolicyOutput(NamedTuple):
    actions: torch.Tensor  # (N,) discrete or (N, A) continuous, as sampled (before clipping to the bounds)
    logprobs: torch.Tensor | None  # (N,); None when not asked for
    values: torch.Tensor  # (N,)


class ActorCritic(nn.Module):
    """A policy and a state-value function on one observation encoder. ``shared``: one hidden trunk with two heads
    (A2C's original form); otherwise two separate networks (Stable-Baselines3's default for PPO and A2C).
    Discrete actions: a categorical over logits. Box actions: a diagonal Gaussian with a learned, state-independent
    ``log_std``; sampled actions are clipped to the bounds only when sent to the environment."""

    low: torch.Tensor  # (A,) Box actions only: the action space's bounds (buffers)
    high: torch.Tensor  # (A,)

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        hidden: Sequence[int] = (64, 64),
        activation: Activation = "tanh",
        shared: bool = False,
        normalize_observations: bool = False,
        log_std_init: float = 0.0,
        env_id: str = "environment",
    ):
        super().__init__()
        self.encoder = ObservationEncoder(observation_space, normalize_observations, env_id=env_id)
        if isinstance(action_space, gym.spaces.Discrete):
            self.continuous, out = False, int(action_space.n)
        elif isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
            self.continuous, out = True, int(action_space.shape[0])
            self.log_std = nn.Parameter(torch.full((out,), float(log_std_init)))
            self.register_buffer("low", torch.as_tensor(action_space.low, dtype=torch.float32))
            self.register_buffer("high", torch.as_tensor(action_space.high, dtype=torch.float32))
        else:
            raise AlignConfigError(
                f"environment '{env_id}': action space {_space_name(action_space)} is not "
                "supported; expected Discrete or a one-dimensional Box"
            )
        d, hidden = self.encoder.size, list(hidden)
        self.shared, self.out = shared, out
        if shared:
            self.trunk = nn.Sequential(mlp([d, *hidden], activation, math.sqrt(2)), _ACTIVATIONS[activation]())
            width = hidden[-1] if hidden else d
            self.pi, self.vf = mlp([width, out], activation, 0.01), mlp([width, 1], activation, 1.0)
        else:
            # The policy and the value network, stacked: the value head's output is padded to the policy's width
            # and its first column read.
            self.nets = StackedMLP([d, *hidden, out], activation, (0.01, 1.0))

    def _heads(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.encoder(obs)
        if self.shared:
            x = self.trunk(x)
            return self.pi(x), self.vf(x).squeeze(-1)
        out = self.nets(x)  # (2, N, out)
        return out[0], out[1, :, 0]

    def policy_head(self, obs: torch.Tensor) -> torch.Tensor:
        """The policy's logits (discrete) or mean action (continuous), ``(N, A)``."""
        return self._heads(obs)[0]

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """``V(s)``, ``(N,)``."""
        return self._heads(obs)[1]

    def act(self, obs: torch.Tensor, deterministic: bool = False, logprobs: bool = True) -> PolicyOutput:
        """Sample (or, ``deterministic``, take the mode of) the policy at ``obs``, with values and, unless
        ``logprobs`` is false (an update that recomputes them), the actions' log-probs."""
        out, values = self._heads(obs)
        if self.continuous:
            actions = out if deterministic else out + torch.randn_like(out) * self.log_std.exp()
            return PolicyOutput(actions, gaussian_log_prob(out, self.log_std, actions) if logprobs else None, values)
        if deterministic:
            actions = out.argmax(-1)
        else:  # Gumbel-max: argmax(logits + Gumbel noise) is an exact categorical sample, cheaper than multinomial
            actions = (out.float() - torch.empty_like(out, dtype=torch.float32).exponential_().log()).argmax(-1)
        return PolicyOutput(actions, selective_log_softmax(out, actions) if logprobs else None, values)

    def evaluate(
        self, obs: torch.Tensor, actions: torch.Tensor, entropy_grad: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logprobs, entropy, values)`` of taken ``actions``, each ``(N,)``, differentiable; the entropy only with
        ``entropy_grad`` (a loss without an entropy bonus only logs it, and saves its backward)."""
        out, values = self._heads(obs)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            if self.continuous:
                entropy = gaussian_entropy(self.log_std).expand(out.shape[0])
            else:
                entropy = entropy_from_logits(out)
        logprobs = (
            gaussian_log_prob(out, self.log_std, actions) if self.continuous else selective_log_softmax(out, actions)
        )
        return logprobs, entropy, values

    def env_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """Actions as the environment takes them: continuous ones clipped to the action space's bounds."""
        return torch.maximum(torch.minimum(actions, self.high), self.low) if self.continuous else actions


_LayerOp = tuple[Callable[[torch.Tensor], torch.Tensor] | None, torch.Tensor | None, torch.Tensor | None]
"""One step of :meth:`QNetwork.greedy`: ``(op, None, None)`` for an activation, ``(None, weight, bias)`` for a linear
layer."""


class QNetwork(nn.Module):
    """``Q(s, .)``: one value per discrete action, ``(N, *obs) -> (N, A)``."""

    def __init__(
        self,
        observation_space: gym.Space,
        num_actions: int,
        hidden: Sequence[int] = (64, 64),
        activation: Activation = "relu",
        env_id: str = "environment",
        init: Literal["torch", "orthogonal"] = "torch",
    ):
        super().__init__()
        if init not in ("torch", "orthogonal"):
            raise AlignConfigError(f"model.init: expected 'torch' or 'orthogonal', got {init!r}")
        self.encoder = ObservationEncoder(observation_space, env_id=env_id)
        self.net = mlp([self.encoder.size, *hidden, num_actions], activation, 1.0 if init == "orthogonal" else None)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(self.encoder(obs))

    @torch.no_grad()
    def greedy(self, obs: torch.Tensor) -> torch.Tensor:
        """``argmax_a Q(obs, a)``, ``(N,)``: the values of :meth:`forward`, computed without autograd and without
        a module call per layer. DQN acts on one observation per environment step, where each ``nn.Module`` call
        cost about as much as its layer's arithmetic."""
        x = self.encoder(obs)
        for op, weight, bias in self._layer_ops():
            x = op(x) if weight is None else nn.functional.linear(x, weight, bias)
        return x.argmax(dim=1)

    def _layer_ops(self) -> list[tuple]:
        """``(op, weight, bias)`` per layer of ``net``: a linear layer's parameters (they are updated in place, so
        the list stays current), or an activation applied in place to the fresh output before it."""
        first = self.net[0].weight
        cached = getattr(self, "_ops", None)
        if cached is None or cached[0] is not first:  # rebuilt after anything replaced the parameters
            ops: list[_LayerOp] = []
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    ops.append((None, layer.weight, layer.bias))
                elif isinstance(layer, nn.ReLU):
                    ops.append((torch.relu_, None, None))
                elif isinstance(layer, nn.Tanh):
                    ops.append((torch.tanh_, None, None))
                else:
                    ops.append((layer, None, None))
            cached = self._ops = (first, ops)
        return cached[1]


class QTable(nn.Module):
    """A table of action values for a ``Discrete`` observation space, ``(N,) -> (N, A)``."""

    def __init__(self, observation_space: gym.Space, num_actions: int, init: float = 0.0, env_id: str = "environment"):
        super().__init__()
        if not isinstance(observation_space, gym.spaces.Discrete):
            raise AlignConfigError(
                f"environment '{env_id}': tabular Q-learning needs a Discrete observation space, "
                f"got {_space_name(observation_space)}; use DQN"
            )
        self.table = nn.Parameter(torch.full((int(observation_space.n), num_actions), float(init)))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.table[obs.long().view(-1)]

    @torch.no_grad()
    def greedy(self, obs: torch.Tensor) -> torch.Tensor:
        """``argmax_a Q(obs, a)``, ``(N,)``."""
        return self.forward(obs).argmax(dim=1)


__all__ = [
    "ActorCritic",
    "ObservationEncoder",
    "PolicyOutput",
    "QNetwork",
    "QTable",
    "RewardScaler",
    "StackedMLP",
    "mlp",
    "observation_size",
]
