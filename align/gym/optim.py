"""Schedules and optimizer steps of the classic-RL modules: a linear schedule of any value (DQN's exploration
rate), Polyak averaging of a target network, and the gradient-norm clipping and lean fused Adam step that keep a
small network's optimizer step at the cost of its arithmetic."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim import Optimizer


def linear_schedule(step: int | float, start: float, end: float, duration: int | float) -> float:
    """``start`` moving linearly to ``end`` over ``duration`` steps, then ``end``: DQN's epsilon (arXiv 1312.5602
    anneals 1.0 to 0.1 over its first million frames). ``duration <= 0`` is ``end`` from the start."""
    if duration <= 0:
        return float(end)
    fraction = min(max(float(step) / float(duration), 0.0), 1.0)
    return float(start + fraction * (end - start))


@torch.no_grad()
def polyak_update(target: torch.nn.Module, online: torch.nn.Module, tau: float) -> None:
    """``target <- tau * online + (1 - tau) * target`` for every parameter and floating buffer (Lillicrap et al.
    2015, arXiv 1509.02971); ``tau = 1`` is the hard copy of DQN's target network (arXiv 1312.5602)."""
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"polyak_update: tau must be in (0, 1], got {tau}")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = list(zip(target.parameters(), online.parameters()))
    pairs += [(t, o) for t, o in zip(target.buffers(), online.buffers()) if t.is_floating_point()]
    targets, sources = [t for t, _ in pairs], [o for _, o in pairs]
    if tau == 1.0:
        torch._foreach_copy_(targets, sources)
    else:
        torch._foreach_lerp_(targets, sources, tau)


@torch.no_grad()
def clip_grad_norm(parameters: Sequence[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that their global L2 norm is at most ``max_norm`` (``None``: leave
    them); returns the norm before scaling, a 0-dim tensor.

    The arithmetic of ``torch.nn.utils.clip_grad_norm_`` (the coefficient ``max_norm / (norm + 1e-6)``, capped at
    1), without its per-call grouping of the gradients by device and dtype when they share one: a classic-RL
    network's optimizer step takes a few hundred microseconds, and that grouping was a fifth of it. Gradients on
    several devices or dtypes go to torch's function."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if any(g.device != grads[0].device or g.dtype != grads[0].dtype for g in grads):
        return torch.nn.utils.clip_grad_norm_(parameters, float("inf") if max_norm is None else max_norm)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if max_norm is not None:
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        # A factor of exactly 1 changes nothing: on the CPU, where reading it costs no device sync, the pass over
        # every gradient is skipped then (most steps of a classic-RL run are not clipped).
        if grads[0].device.type != "cpu" or float(coefficient) < 1.0:
            torch._foreach_mul_(grads, coefficient)
    return total


_ADAM_OPTIONS_NOT_COVERED = ("amsgrad", "maximize", "capturable", "differentiable")


def fused_adam_step(optimizer: Optimizer) -> bool:
    """Take one step of a ``torch.optim.Adam`` or ``AdamW`` built with ``fused=True`` as its ``step()`` takes it, and
    return True; or return False having done nothing, where this does not apply.

    ``step()`` wraps the fused kernel in per-call machinery: a profiler record, hook dispatch, the lazy state set-up
    and a grouping of the tensors by device and dtype. On a small network that costs more than the kernel itself
    (about 90 against 46 us per step for DQN's 256x256 Q-network on one CPU thread, which takes 128 steps per
    iteration). Here the step counts and the kernel are called directly on the optimizer's own state, so its
    ``state_dict`` and checkpoints are those of ``step()``; pinned equal to ``step()`` bit for bit.

    It does not apply (False) to other optimizers, to options the call here does not cover (``amsgrad``,
    ``maximize``, ``capturable``, ``differentiable``, a tensor learning rate), before the first step (``step()``
    creates the state), to parameters on several devices or dtypes, or when hooks are registered on the optimizer
    or globally, or a learning-rate scheduler tracks its calls: call ``optimizer.step()`` then."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    from torch.optim import optimizer as optimizer_module

    if (
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or optimizer_module._global_optimizer_pre_hooks
        or optimizer_module._global_optimizer_post_hooks
        or hasattr(optimizer.step, "_wrapped_by_lr_sched")
    ):
        return False
    calls = []
    for group in optimizer.param_groups:
        if not group.get("fused") or any(group.get(k) for k in _ADAM_OPTIONS_NOT_COVERED):
            return False
        if isinstance(group["lr"], torch.Tensor):
            return False
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state.get(p)
            if not state:
                return False
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            calls.append((group, params, grads, exp_avgs, exp_avg_sqs, steps))
    tensors = [t for call in calls for t in call[1]]
    if tensors and any(t.device != tensors[0].device or t.dtype != tensors[0].dtype for t in tensors):
        return False
    for group, params, grads, exp_avgs, exp_avg_sqs, steps in calls:
        beta1, beta2 = (float(b) for b in group["betas"])
        decoupled = group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW)
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        with torch.no_grad():
            torch._foreach_add_(steps, 1)
            kernel(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                amsgrad=False,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
                grad_scale=None,
                found_inf=None,
            )
    return True
