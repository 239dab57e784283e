"""``align.trainer.strategies.fsdp``: the FSDP2 strategy, which blocks get sharded, and the private torch and Lightning
names it relies on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from align.errors import AlignConfigError
from align.hub.tiny import build_tiny_model
from align.models.policy import PolicyModel
from align.trainer.strategies import FSDP2Strategy, apply_fsdp2, decoder_layers
from align.trainer.strategies.fsdp import FORWARD_METHODS


def test_decoder_layers_are_the_repeated_blocks(private_api):
    model = build_tiny_model(seed=0)
    private_api.require(
        model, "_no_split_modules", used_by="align.trainer.strategies.fsdp.decoder_layers (transformers)"
    )
    layers = decoder_layers(model)
    assert layers and layers == list(model.model.layers)


@pytest.fixture
def one_process_mesh():
    """A 1-process gloo group and its data-parallel mesh, torn down after the test."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


def test_the_policys_other_forward_methods_exist():
    # apply_fsdp2 registers whichever of them the module has: a renamed method would silently lose its gather.
    missing = [name for name in FORWARD_METHODS if not callable(getattr(PolicyModel, name, None))]
    assert not missing, f"align.trainer.strategies.fsdp.FORWARD_METHODS names methods PolicyModel lacks: {missing}"


class Block(nn.Module):
    def forward(self, x):
        return x + 1


class Root(nn.Module):
    """Two blocks that ``decoder_layers`` finds by class name, and a method other than ``forward`` that runs them."""

    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def token_logprobs(self, x):
        return 2 * self(x)


def test_fsdp_root_is_fixed_before_the_first_forward(private_api, one_process_mesh):
    from torch.distributed.fsdp import FSDPModule

    used_by = "align.trainer.strategies.fsdp.apply_fsdp2 (fixing the policy as the FSDP root)"
    private_api.require(FSDPModule, "_get_fsdp_state", ("self",), used_by=used_by)
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    private_api.require(FSDPState, "_lazy_init", ("self",), used_by=used_by)
    root = Root()
    apply_fsdp2(root, SimpleNamespace(device_mesh={"data_parallel": one_process_mesh}))
    assert root._get_fsdp_state()._is_root is True, f"FSDPState._is_root: {used_by}"
    assert [layer._get_fsdp_state()._is_root for layer in root.layers] == [False, False]
    # A first call that enters through an inner layer (as a rollout or a reward pass may) leaves the root intact.
    x = torch.zeros(1)
    assert root.layers[0](x).item() == 1 and root(x).item() == 2 and root.token_logprobs(x).item() == 4


def test_fsdp2_strategy_sizes_its_mesh_from_the_processes(private_api, monkeypatch):
    used_by = "align.trainer.strategies.fsdp.FSDP2Strategy.setup_environment (one shard per process)"
    assert private_api.require(FSDP2Strategy(), "_data_parallel_size", used_by=used_by) == "auto"
    assert ModelParallelStrategy(data_parallel_size=3)._data_parallel_size == 3, f"_data_parallel_size: {used_by}"
    private_api.called_by(ModelParallelStrategy.setup_environment, "_data_parallel_size", used_by=used_by)
    seen = []
    monkeypatch.setattr(ModelParallelStrategy, "setup_environment", lambda self: seen.append(self._data_parallel_size))
    strategy = FSDP2Strategy()
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.setup_environment()
    assert seen == [2]  # 1 node x 2 processes, where Lightning's "auto" would give 1 (the number of nodes)


@pytest.mark.parametrize("name", ["param_dtype", "reduce_dtype"])
def test_a_bad_dtype_fails_on_one_line_naming_the_setting(name):
    with pytest.raises(
        AlignConfigError,
        match=rf"^trainer\.strategy\.{name}: expected float32, bfloat16, float16 or "
        r"null, got 'fp8'$",
    ):
        FSDP2Strategy(**{name: "fp8"})
