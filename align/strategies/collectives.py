"""Collectives the strategies need that Lightning does not offer as a one-liner."""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_all(flag: bool, device: torch.device | str = "cpu") -> bool:
    """``flag`` and-ed over every rank (one all-reduce; the flag itself on a single process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() > 0.5)
