"""``align.trainer.strategies`` as a package: the short names it registers, and the names it re-exports."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

import align.trainer.strategies
from align.trainer.strategies import DeepSpeedZeROStrategy, FSDP2Strategy


def test_short_names_select_the_cpu_capable_strategies():
    zero3 = StrategyRegistry.get("zero3_offload")
    assert isinstance(zero3, DeepSpeedZeROStrategy) and zero3.zero_stage_3
    assert zero3.config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert zero3.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # A torch optimizer (the modules' AdamW) may run on offloaded state.
    assert zero3.config["zero_force_ds_cpu_optimizer"] is False
    assert StrategyRegistry.get("zero1").config["zero_optimization"]["stage"] == 1
    fsdp = StrategyRegistry.get("fsdp2_offload")
    assert isinstance(fsdp, FSDP2Strategy) and fsdp.cpu_offload


def test_yaml_class_paths_stay_at_the_package():
    # Configs name ``align.strategies.FSDP2Strategy``; a printed or saved config keeps that path, not the module
    # the class lives in (jsonargparse writes the shortest path that imports it).
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Strategy)
    for name in ("FSDP2Strategy", "DeepSpeedZeROStrategy"):
        assert name in align.trainer.strategies.__all__
        config = parser.parse_args(["--strategy", f"align.trainer.strategies.{name}"])
        assert f"class_path: align.trainer.strategies.{name}\n" in parser.dump(config)
