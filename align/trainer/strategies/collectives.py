"""Collectives the strategies need that Lightning does not offer as a one-liner."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def global_all(flag: bool, device: torch.device | str = "cpu") -> bool:
    """``flag`` and-ed over every rank (one all-reduce; the flag itself on a single process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() > 0.5)


_release_registered = False
_before_release: list[Callable[[], None]] = []


def before_process_group_release(callback: Callable[[], None]) -> None:
    """Run ``callback`` at exit before the default process group is released (once, however often it is given):
    for whatever holds groups of its own over the default one, such as an in-process vLLM engine
    (:meth:`align.rollout.engine.GenerationEngine.shutdown`), whose shutdown needs them and ends the default group
    itself."""
    if callback not in _before_release:
        _before_release.append(callback)


def release_process_group_at_exit() -> bool:
    """Destroy the default process group when the interpreter exits, whatever its backend; returns whether one
    is initialized (and so will be released).

    Lightning registers this only for NCCL. A gloo group (data parallelism on CPU) left to the interpreter's
    teardown has its C++ threads destroyed while still joinable, and the process sometimes aborts after the run
    has finished ("terminate called without an active exception", SIGABRT), which ``torch.distributed.run``
    reports as a failed job. Registered once per process; harmless if the group is already gone by then."""
    global _release_registered
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if not _release_registered:
        import atexit

        atexit.register(_destroy_default_group)
        _release_registered = True
    return True


def _destroy_default_group() -> None:
    for callback in _before_release:
        callback()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
