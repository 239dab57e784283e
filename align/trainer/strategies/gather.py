"""Whole parameters where a strategy keeps only shards: around code that runs the model outside the root's
``forward`` (:func:`unshard_root`), and around sampling (:func:`generation_context`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy
from torch import nn

from align.trainer.strategies.collectives import global_all
from align.trainer.strategies.fsdp import FSDP2Strategy


def unshard_root(module: nn.Module) -> None:
    """Gather the root unit's own parameters of an FSDP2-sharded ``module`` (no-op otherwise).

    For code that calls an inner part of the model directly (``policy.model.get_decoder()(...)``), bypassing
    the root's hooks: the root keeps its parameters gathered from forward to backward anyway (FSDP2 does not
    reshard the root after forward), and the post-backward hook reshards them as usual.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module.unshard()


@contextmanager
def fsdp2_full_parameters(root: nn.Module, within: nn.Module, reshard_after_forward: bool = True) -> Iterator[None]:
    """Gather every FSDP2 unit of ``within`` (and the root unit ``root``) once, keep them gathered, and reshard
    on exit: the forwards inside run on full weights with no collective, whatever their number per rank.

    Args:
        root: The FSDP root module (it holds the parameters outside the decoder layers).
        within: The part to gather (the policy's language model; the reference and critic are left sharded).
        reshard_after_forward: The layers' setting to restore on exit.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in within.modules() if isinstance(m, FSDPModule) and m is not root]
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        for part in [root, *units]:
            if isinstance(part, FSDPModule):
                part.unshard()
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)
            unit.reshard()
        if isinstance(root, FSDPModule):
            root.reshard()


def parameters_sharded(strategy) -> bool:
    """Whether ``strategy`` keeps only a shard of each parameter on a rank (FSDP2, ZeRO-3)."""
    return isinstance(strategy, ModelParallelStrategy) or (
        isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3
    )


@contextmanager
def generation_context(module) -> Iterator[Callable[[bool], bool] | None]:
    """Around sampling from ``module.policy``: yields the ``sync_stop`` hook the sampler needs, or ``None``.

    - DDP, ZeRO-1/2, one process: parameters are whole on every rank; nothing to do (``None``).
    - FSDP2: the policy's language model is gathered once for the rollout (:func:`fsdp2_full_parameters`);
      decoding then needs no collective, so ranks may stop at different steps (``None``). Memory: one full
      copy of the policy during generation, as any forward would hold layer by layer.
    - ZeRO-3: DeepSpeed gathers each layer on use and releases it after, so every rank must run the same
      number of decoding steps: the hook and-s the "all rows finished" flag across ranks (one all-reduce of
      a scalar per step), and a rank whose rows are done keeps decoding padding until all ranks are done.
    """
    trainer = getattr(module, "_trainer", None)
    strategy = trainer.strategy if trainer is not None else None
    if strategy is None or trainer is None or trainer.world_size == 1 or not parameters_sharded(strategy):
        yield None
    elif isinstance(strategy, ModelParallelStrategy):
        policy = module.policy
        reshard = strategy.reshard_after_forward if isinstance(strategy, FSDP2Strategy) else True
        with fsdp2_full_parameters(policy, policy.model, reshard):
            yield None
    else:
        device = module.device
        try:
            yield lambda done: global_all(done, device)
        finally:
            # The sampler runs in inference mode, so parameters DeepSpeed gathered there (and may keep cached for
            # reuse) are inference tensors that autograd refuses; release them all, and training gathers anew.
            engine = strategy.model
            if hasattr(engine, "empty_partition_cache"):
                engine.empty_partition_cache()
            # DeepSpeed also released each module's gathered weights after its forward inside inference mode, so the
            # empty placeholder each parameter now holds is an inference tensor too. A parameter that the next
            # backward does not use (the policy during PPO's value-only update with a separate critic) keeps it,
            # and DeepSpeed's count of the parameters in that backward fails on it: give each an ordinary one.
            for param in module.parameters():
                if param.is_inference():
                    param.data = param.data.clone()
