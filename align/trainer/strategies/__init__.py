"""Data-parallel strategies: DDP, FSDP2 and DeepSpeed ZeRO 1-3, on GPUs (NCCL) or CPU (gloo, for tests).

Select one in YAML with ``trainer.strategy``::

    trainer:
      strategy:
        class_path: align.strategies.FSDP2Strategy
        init_args: {param_dtype: bfloat16}

- ``ddp``: Lightning's own ``DDPStrategy`` works unchanged on CPU and GPU.
- :class:`FSDP2Strategy`: Lightning's ``ModelParallelStrategy`` with a pure data-parallel mesh; every
  algorithm module applies ``fully_shard`` per decoder layer, then to the policy, in ``configure_model``
  (see :func:`apply_fsdp2`), with a mixed-precision policy and optional CPU offload.
- :class:`DeepSpeedZeROStrategy`: Lightning's ``DeepSpeedStrategy`` for ZeRO stage 1, 2 or 3 (optionally with
  optimizer/parameter offload), which also runs on CPU: the stock strategy refuses anything but CUDA.

Importing this package registers short names for ``trainer.strategy`` (``--trainer.strategy zero3``):
``fsdp2``, ``fsdp2_offload``, ``zero1``, ``zero2``, ``zero2_offload``, ``zero3``, ``zero3_offload``
(``align.cli.lightning_cli`` imports it, so the recipes and the ``align`` command know them).

Generation from sharded weights (:func:`generation_context`): under FSDP2 the policy's parameters are gathered
once for the whole rollout (every decoding step then runs on full weights, with no collective per token);
under ZeRO-3 DeepSpeed gathers each layer on use, so every rank must run the same number of decoding steps and
the sampler's stop decision is made across ranks (:func:`global_all`). See docs/distributed.md.

One module per concern: :mod:`~align.trainer.strategies.fsdp` (the FSDP2 strategy and sharding),
:mod:`~align.trainer.strategies.deepspeed` (ZeRO, including its CPU path, and the accumulation boundary),
:mod:`~align.trainer.strategies.gather` (whole parameters around code outside ``forward``: rollouts, inner calls) and
:mod:`~align.trainer.strategies.collectives`. Import the names from ``align.trainer.strategies``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from align.trainer.strategies.collectives import before_process_group_release, global_all, release_process_group_at_exit
from align.trainer.strategies.deepspeed import DeepSpeedZeROStrategy, accumulation_boundary
from align.trainer.strategies.fsdp import FSDP2Strategy, apply_fsdp2, decoder_layers
from align.trainer.strategies.gather import fsdp2_full_parameters, generation_context, parameters_sharded, unshard_root

__all__ = [
    "DeepSpeedZeROStrategy",
    "FSDP2Strategy",
    "accumulation_boundary",
    "apply_fsdp2",
    "before_process_group_release",
    "decoder_layers",
    "fsdp2_full_parameters",
    "generation_context",
    "global_all",
    "parameters_sharded",
    "release_process_group_at_exit",
    "unshard_root",
]


def _register_names() -> None:
    names: dict[str, tuple[type[Strategy], str, dict[str, Any]]] = {
        "fsdp2": (FSDP2Strategy, "FSDP2: per-decoder-layer fully_shard, pure data parallel", {}),
        "fsdp2_offload": (
            FSDP2Strategy,
            "FSDP2 with parameters and optimizer state in CPU memory",
            {"cpu_offload": True},
        ),
        "zero1": (DeepSpeedZeROStrategy, "DeepSpeed ZeRO stage 1 (CPU-capable)", {"stage": 1}),
        "zero2": (DeepSpeedZeROStrategy, "DeepSpeed ZeRO stage 2 (CPU-capable)", {"stage": 2}),
        "zero2_offload": (
            DeepSpeedZeROStrategy,
            "DeepSpeed ZeRO stage 2, optimizer state in CPU memory",
            {"stage": 2, "offload_optimizer": True},
        ),
        "zero3": (DeepSpeedZeROStrategy, "DeepSpeed ZeRO stage 3 (CPU-capable)", {"stage": 3}),
        "zero3_offload": (
            DeepSpeedZeROStrategy,
            "DeepSpeed ZeRO stage 3, parameters and optimizer state in CPU memory",
            {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
        ),
    }
    for name, (cls, description, params) in names.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description, **params)


_register_names()
