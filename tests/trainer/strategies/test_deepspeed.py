"""``align.trainer.strategies.deepspeed``: the ZeRO strategy's configuration, and the private Lightning hooks and
DeepSpeed engine methods it relies on (its CPU path runs in ``test_multiprocess.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from torch import nn

from align.errors import AlignConfigError
from align.trainer.strategies import DeepSpeedZeROStrategy, accumulation_boundary

USED_BY = "align.trainer.strategies.deepspeed.DeepSpeedZeROStrategy"


def test_deepspeed_needs_no_training_dataloader_for_its_batch_size():
    # The automatic choice builds the training dataloader, which does not exist while validating before fit.
    assert DeepSpeedZeROStrategy(stage=2).config["train_micro_batch_size_per_gpu"] == 1


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(stage=4), r"^trainer\.strategy\.stage: expected 1, 2 or 3, got 4$"),
        (
            dict(stage=3, param_persistence_threshold=-1),
            r"^trainer\.strategy\.param_persistence_threshold: expected an integer >= 0 or null, got -1$",
        ),
    ],
)
def test_bad_settings_fail_on_one_line_naming_the_setting(settings, message):
    with pytest.raises(AlignConfigError, match=message):
        DeepSpeedZeROStrategy(**settings)


class Manual(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.updates = SimpleNamespace(max_grad_norm=0.5)


def test_manual_optimization_hands_its_clip_to_the_engine(private_api):
    hook = "_format_batch_size_and_grad_accum_config"
    private_api.require(DeepSpeedStrategy, hook, ("self",), used_by=USED_BY)
    private_api.called_by(DeepSpeedStrategy._format_config, hook, used_by=USED_BY)
    strategy, module = DeepSpeedZeROStrategy(stage=2), Manual()
    module.trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    strategy.connect(module)
    strategy._format_batch_size_and_grad_accum_config()
    assert strategy.config["gradient_clipping"] == 0.5 and strategy.config["gradient_accumulation_steps"] == 1


def test_the_cpu_path_overrides_hooks_lightning_still_calls(private_api):
    hooks = {
        "_init_deepspeed_distributed": ("self",),
        "_initialize_deepspeed_train": ("self", "model"),
        "_initialize_deepspeed_inference": ("self", "model"),
        "_setup_model_and_optimizer": ("self", "model", "optimizer", "lr_scheduler"),
    }
    for name, params in hooks.items():
        private_api.require(DeepSpeedStrategy, name, params, used_by=USED_BY)
    private_api.called_by(DeepSpeedStrategy.setup_distributed, "_init_deepspeed_distributed", used_by=USED_BY)
    private_api.called_by(DeepSpeedStrategy.init_deepspeed, "_initialize_deepspeed_train", used_by=USED_BY)
    private_api.called_by(DeepSpeedStrategy.init_deepspeed, "_initialize_deepspeed_inference", used_by=USED_BY)
    private_api.called_by(DeepSpeedStrategy._initialize_deepspeed_train, "_setup_model_and_optimizer", used_by=USED_BY)
    # The CPU path of setup_distributed repeats Lightning's own steps around the device check.
    import lightning.fabric.utilities.seed as seed

    private_api.require(seed, "reset_seed", (), used_by=f"{USED_BY}.setup_distributed")


def test_remove_module_hooks_clears_an_earlier_engines_hooks(private_api):
    import lightning.pytorch.strategies.deepspeed as lightning_deepspeed

    remove = private_api.require(
        lightning_deepspeed,
        "remove_module_hooks",
        ("model",),
        used_by=f"{USED_BY}._initialize_deepspeed_train (ZeRO-3 after validate)",
    )
    layer, calls = nn.Linear(2, 2), []
    layer.register_forward_hook(lambda *args: calls.append(1))
    remove(layer)
    layer(torch.zeros(1, 2))
    assert calls == []


def test_engine_methods_called_only_when_present_exist(private_api):
    # accumulation_boundary and generation_context skip these when absent: an upgrade that renames them would
    # silently break the summed gradient of a manual-optimization step, or ZeRO-3 training after a rollout.
    from deepspeed.runtime.engine import DeepSpeedEngine

    private_api.require(
        DeepSpeedEngine,
        "set_gradient_accumulation_boundary",
        ("self", "is_boundary"),
        used_by="align.trainer.strategies.accumulation_boundary",
    )
    private_api.require(
        DeepSpeedEngine, "empty_partition_cache", ("self",), used_by="align.trainer.strategies.generation_context"
    )


def test_accumulation_boundary_reaches_the_engine(private_api):
    private_api.require(L.LightningModule(), "_trainer", used_by="align.trainer.strategies.accumulation_boundary")
    marks = []
    strategy = DeepSpeedZeROStrategy(stage=2)
    strategy.model = type("Engine", (), {"set_gradient_accumulation_boundary": lambda self, b: marks.append(b)})()
    module = Manual()
    module.trainer = type("Trainer", (), {"strategy": strategy})()
    accumulation_boundary(module, False)
    accumulation_boundary(module, True)
    assert marks == [False, True]
    accumulation_boundary(Manual(), True)  # no trainer: nothing to tell
