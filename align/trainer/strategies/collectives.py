"""Collectives the strategies need that Lightning does not offer as a one-liner."""

from __future__ import annotations

import sys

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
    # An in-process vLLM engine holds groups of its own over the default one: its shutdown must come first (it then
    # ends the default group itself). Looked up, not imported: only a run that started one has the module loaded.
    engines = sys.modules.get("align.rollout.vllm_engine")
    if engines is not None:
        engines.close_engines()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
