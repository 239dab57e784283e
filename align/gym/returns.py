"""Returns over a window of environment steps: ``(T, N)`` tensors, time first, ``N`` parallel environments whose
episodes end anywhere inside the window.

* :func:`step_gae`: GAE across episode boundaries, with a time-limit truncation bootstrapped from the value of the
  state it cut off (Pardo et al. 2018, arXiv 1712.00378) and a termination not. ``lam = 1`` gives the n-step returns
  of A2C (Mnih et al. 2016, arXiv 1602.01783).
* :func:`discounted_returns`: Monte-Carlo returns of REINFORCE (Williams 1992), optionally bootstrapped at the
  window's end.
* :func:`td_targets`: one-step Q-learning and DQN targets (Mnih et al. 2015), and Double DQN's (van Hasselt et al.
  2016, arXiv 1509.06461).

Like :mod:`align.core.advantages`, every function returns detached tensors: returns are targets.
"""

from __future__ import annotations

import torch

__all__ = ["step_gae", "discounted_returns", "td_targets"]


def _check_steps(fn: str, **tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(shape != first for shape in shapes.values()):
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"{fn}: every per-step tensor must share one (T, N) shape, got {listed}")


@torch.no_grad()
def step_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    done: torch.Tensor,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a window of environment steps (arXiv 1506.02438), time first.

    ``delta_t = r_t + gamma * (1 - terminated_t) * V(s_{t+1}) - V(s_t)`` and
    ``A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}``, with ``A_T = 0``
    after the window (its tail is bootstrapped through ``next_values``).

    An episode that the environment *terminated* has no future value. One that
    was *truncated* (a time limit, or the window's end, which needs no flag)
    still has one: ``next_values`` holds ``V`` of the state it was cut off in,
    so truncation is not mistaken for failure (arXiv 1712.00378). ``done`` (terminated
    or truncated) stops the advantage from flowing into the next episode.

    Args:
        rewards: ``(T, N)`` reward of step ``t`` in environment ``n``.
        values: ``(T, N)`` ``V(s_t)``.
        next_values: ``(T, N)`` ``V(s_{t+1})``: the value of the observation the step returned, or of the final
            observation when the episode ended there (the reset's observation is the next episode's).
        terminated: ``(T, N)`` the episode reached a terminal state at step ``t``.
        done: ``(T, N)`` the episode ended at step ``t`` (terminated or truncated).

    Returns:
        ``(advantages, returns)``, both ``(T, N)``, with ``returns = advantages + values`` (unwhitened).
    """
    _check_steps("step_gae", rewards=rewards, values=values, next_values=next_values, terminated=terminated, done=done)
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    rewards, values, next_values = rewards.to(dtype), values.to(dtype), next_values.to(dtype)
    # One fused multiply-add per step of the recursion: a short window (A2C's 5 steps) is a handful of small ops.
    deltas = torch.addcmul(rewards - values, terminated.logical_not().to(dtype), next_values, value=gamma)  # (T, N)
    carry = done.logical_not().to(dtype).mul_(gamma * lam)  # (T, N)
    advantages = torch.empty_like(deltas)
    running = advantages[-1] = deltas[-1]  # (N,)
    for t in range(deltas.shape[0] - 2, -1, -1):
        running = torch.addcmul(deltas[t], carry[t], running)
        advantages[t] = running
    return advantages, advantages + values


@torch.no_grad()
def discounted_returns(
    rewards: torch.Tensor,
    done: torch.Tensor,
    gamma: float = 0.99,
    bootstrap: torch.Tensor | None = None,
) -> torch.Tensor:
    """``G_t = r_t + gamma * (1 - done_t) * G_{t+1}`` over a window of environment steps, ``(T, N) -> (T, N)``.

    Episodes end at ``done``; REINFORCE (Williams 1992) uses the returns of complete episodes. ``bootstrap``
    ``(N,)`` is ``G_T``, the value of each environment's state after the window (0 when omitted), which gives
    n-step returns.
    """
    _check_steps("discounted_returns", rewards=rewards, done=done)
    if not rewards.is_floating_point():
        rewards = rewards.float()
    carry = 1.0 - done.to(rewards.dtype)
    out = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[0]) if bootstrap is None else bootstrap.to(rewards.dtype).clone()
    if running.shape != rewards[0].shape:
        raise ValueError(
            f"discounted_returns: bootstrap must have shape ({rewards.shape[1]},), got {tuple(running.shape)}"
        )
    for t in reversed(range(rewards.shape[0])):
        running = rewards[t] + gamma * carry[t] * running
        out[t] = running
    return out


@torch.no_grad()
def td_targets(
    rewards: torch.Tensor,
    next_q_target: torch.Tensor,
    terminated: torch.Tensor,
    gamma: float = 0.99,
    next_q_online: torch.Tensor | None = None,
) -> torch.Tensor:
    """One-step Q targets ``r + gamma * (1 - terminated) * Q_target(s', a*)``, ``(B,)``.

    ``a* = argmax_a Q_target(s', a)`` (Q-learning, DQN: arXiv 1312.5602), or ``argmax_a Q_online(s', a)`` when
    ``next_q_online`` is given (Double DQN, arXiv 1509.06461: the online network picks the action, the target
    network values it).

    Args:
        rewards: ``(B,)``.
        next_q_target: ``(B, A)`` action values of the next state under the target network (the table itself in
            tabular Q-learning). For a truncated episode this is the state it was cut off in.
        terminated: ``(B,)`` the next state is terminal: no future value.
        next_q_online: ``(B, A)`` the online network's values of the next state, for Double DQN.
    """
    if next_q_target.dim() != 2 or rewards.shape != next_q_target.shape[:1] or terminated.shape != rewards.shape:
        raise ValueError(
            f"td_targets: expected rewards (B,), next_q_target (B, A), terminated (B,), got "
            f"{tuple(rewards.shape)}, {tuple(next_q_target.shape)}, {tuple(terminated.shape)}"
        )
    if next_q_online is None:
        next_value = next_q_target.max(dim=1).values  # (B,)
    else:
        if next_q_online.shape != next_q_target.shape:
            raise ValueError(
                f"td_targets: next_q_online must match next_q_target {tuple(next_q_target.shape)}, "
                f"got {tuple(next_q_online.shape)}"
            )
        best = next_q_online.argmax(dim=1, keepdim=True)  # (B, 1)
        next_value = next_q_target.gather(1, best).squeeze(1)  # (B,)
    alive = 1.0 - terminated.to(next_value.dtype)
    return rewards.to(next_value.dtype) + gamma * alive * next_value
