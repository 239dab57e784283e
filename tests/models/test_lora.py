"""The fused LoRA linear layer (align.models.lora) against peft's own forward."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch import nn

from align.models import LoraSettings, PolicyModel
from align.models.lora import LoraLinearFunction, fuse_lora_layers, fused_class, unfuse_lora_layers

peft = pytest.importorskip("peft")


class TwoLayers(nn.Module):
    def __init__(self, bias: bool = True):
        super().__init__()
        self.up = nn.Linear(12, 10, bias=bias)
        self.down = nn.Linear(10, 7, bias=False)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def lora_model(dropout: float = 0.0, bias: bool = True, **config) -> nn.Module:
    torch.manual_seed(0)
    model = peft.get_peft_model(
        TwoLayers(bias).double(),
        peft.LoraConfig(r=4, lora_alpha=6, lora_dropout=dropout, target_modules=["up", "down"], **config),
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would hide A's gradient
            nn.init.normal_(p, std=0.5)
    return model


def run(model: nn.Module, x: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and every gradient (the input's and each trainable parameter's) of ``sum(out * weights)``."""
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = {"x": x.grad, **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def assert_same(a, b, atol=1e-12):
    torch.testing.assert_close(a[0], b[0], atol=atol, rtol=0)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=atol, rtol=0, msg=name)


def fused_and_plain(model: nn.Module, x: torch.Tensor, expect_fused_calls: int | None = None):
    plain = run(model, x)
    assert fuse_lora_layers(model) == 2
    with mock.patch.object(LoraLinearFunction, "apply", wraps=LoraLinearFunction.apply) as apply:
        fused = run(model, x)
    if expect_fused_calls is not None:
        assert apply.call_count == expect_fused_calls
    assert unfuse_lora_layers(model) == 2
    return plain, fused


@pytest.mark.parametrize("shape", [(5, 12), (3, 4, 12)])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_layer_equals_peft_values_and_gradients(shape, bias):
    plain, fused = fused_and_plain(
        lora_model(bias=bias), torch.randn(*shape, dtype=torch.float64), expect_fused_calls=2
    )
    assert {"x", "base_model.model.up.lora_A.default.weight", "base_model.model.down.lora_B.default.weight"} <= set(
        plain[1]
    )
    assert_same(plain, fused)


def test_fused_layer_draws_peft_dropout_mask():
    # peft drops out the adapter's input only; the same random stream gives the same mask, so the same numbers.
    model = lora_model(dropout=0.4)
    model.train()
    plain, fused = fused_and_plain(model, torch.randn(6, 12, dtype=torch.float64), expect_fused_calls=2)
    assert_same(plain, fused)
    model.eval()  # dropout off: the adapter reads x itself
    plain, fused = fused_and_plain(model, torch.randn(6, 12, dtype=torch.float64), expect_fused_calls=2)
    assert_same(plain, fused)


def test_function_second_derivatives():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 5, dtype=torch.float64, requires_grad=True)
    d = torch.randn(3, 2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64)
    b = torch.randn(4, dtype=torch.float64)
    a = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)

    def same(x, a, up):
        return LoraLinearFunction.apply(x, x, w, b, a, up, 0.7)

    def apart(x, d, a, up):
        return LoraLinearFunction.apply(x, d, w, b, a, up, 0.7)

    assert torch.autograd.gradcheck(same, (x, a, up))
    assert torch.autograd.gradgradcheck(same, (x, a, up))
    assert torch.autograd.gradcheck(apart, (x, d, a, up))
    assert torch.autograd.gradgradcheck(apart, (x, d, a, up))
    # By hand: y = x W^T + b + s (d A^T) B^T.
    expected = x @ w.T + b + 0.7 * (d @ a.T) @ up.T
    torch.testing.assert_close(apart(x, d, a, up), expected)


def test_where_the_function_does_not_apply_the_layer_is_peft():
    x = torch.randn(5, 12, dtype=torch.float64)
    model = lora_model()
    with model.disable_adapter():  # the reference: the base layers alone
        plain, fused = fused_and_plain(model, x, expect_fused_calls=0)
        assert_same(plain, fused)
    model.merge_adapter()
    plain, fused = fused_and_plain(model, x, expect_fused_calls=0)
    assert_same(plain, fused)
    model.unmerge_adapter()
    # A trainable base weight: its gradient is peft's to compute.
    model.base_model.model.up.base_layer.weight.requires_grad_(True)
    plain, fused = fused_and_plain(model, x, expect_fused_calls=1)
    assert_same(plain, fused)
    # DoRA is a variant the function does not compute.
    plain, fused = fused_and_plain(lora_model(use_dora=True), x, expect_fused_calls=0)
    assert_same(plain, fused)
    # Adapter weights of another dtype than the input, which peft casts the input to.
    model = lora_model()
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    plain, fused = fused_and_plain(model, x, expect_fused_calls=0)
    assert_same(plain, fused)


def test_fused_layer_under_autocast_is_peft():
    model = lora_model().float()
    x = torch.randn(5, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, fused = fused_and_plain(model, x, expect_fused_calls=0)
    assert_same(plain, fused, atol=0)


def test_fused_layers_copy_and_keep_their_parameters():
    model = lora_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fuse_lora_layers(model)
    assert type(model.base_model.model.up) is fused_class()
    assert isinstance(model.base_model.model.up, peft.tuners.lora.Linear)
    assert model.state_dict().keys() == before.keys()
    clone = copy.deepcopy(model)
    assert type(clone.base_model.model.down) is fused_class()
    x = torch.randn(4, 12, dtype=torch.float64)
    torch.testing.assert_close(clone(x), model(x))
    merged = clone.merge_and_unload()  # peft replaces each layer by its base layer
    assert type(merged.up) is nn.Linear
    torch.testing.assert_close(merged(x), model(x))


def test_policy_fuses_its_adapter_and_scores_as_peft(tiny_batch):
    """Token log-probs and every adapter gradient of a tiny policy, fused against ``fused: false``."""
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        policy = PolicyModel("tiny", dtype="float32", lora=LoraSettings(r=4, alpha=8, fused=fused))
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(p, std=0.05)
        layers = [m for m in policy.model.modules() if type(m) is fused_class()]
        assert bool(layers) == fused
        input_ids, attention_mask = tiny_batch
        out = policy.token_logprobs(input_ids, attention_mask, response_length=5)
        with torch.no_grad():
            ref = policy.token_logprobs(input_ids, attention_mask, response_length=5, reference=True)
        out.logprobs.sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        results.append((out.logprobs.detach(), ref.logprobs, grads))
    (lp, ref, grads), (lp0, ref0, grads0) = results
    torch.testing.assert_close(lp, lp0, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ref, ref0, atol=1e-6, rtol=1e-5)
    assert grads.keys() == grads0.keys() and any("lora_A" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(grads[name], grads0[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.fixture
def tiny_batch():
    torch.manual_seed(3)
    input_ids = torch.randint(3, 60, (3, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0  # a left-padded prompt
    attention_mask[2, -2:] = 0  # a response that ended early
    return input_ids, attention_mask
