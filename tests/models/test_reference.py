"""The reference model: the adapter-disabled policy with LoRA, a frozen copy, or a loaded model."""

import pytest
import torch

from align.errors import AlignConfigError
from align.hub.tiny import build_tiny_model
from align.models import LoraSettings, PolicyModel

from ._tiny_batches import batch, naive_logprobs


def test_lora_reference_is_the_adapter_disabled_base():
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8))
    policy.setup_reference()
    assert policy.ref_model is None  # no second copy
    ids, mask = batch(policy)
    base = build_tiny_model(seed=0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)  # move the adapter away from its zero init
        ref = policy.token_logprobs(ids, mask, response_length=3, reference=True).logprobs
        pol = policy.token_logprobs(ids, mask, response_length=3).logprobs
    torch.testing.assert_close(ref, naive_logprobs(base, ids, mask, 3))
    assert not torch.allclose(ref, pol)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.parametrize(
    "settings",
    [
        dict(target_modules=["q_proj", "v_proj"]),
        dict(modules_to_save=["lm_head"]),
        dict(modules_to_save=["embed_tokens", "lm_head"], use_rslora=True),
        dict(use_dora=True),
        dict(
            target_modules=["q_proj", "down_proj"],
            extra={"layers_to_transform": [1], "trainable_token_indices": [3, 5]},
        ),
    ],
    ids=["some-targets", "modules_to_save", "embed+head+rslora", "dora", "layers+trainable-tokens"],
)
def test_lora_reference_equals_the_base_model_for_every_option(settings):
    # Every trainable tensor moved: LoRA factors, modules trained in full beside them, trainable token rows.
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8, **settings))
    policy.setup_reference()
    ids, mask = batch(policy)
    trained = [p for p in policy.model.parameters() if p.requires_grad]
    assert trained
    with torch.no_grad():
        for p in trained:
            p.add_(0.3 * torch.randn_like(p))
        ref = policy.token_logprobs(ids, mask, response_length=3, reference=True).logprobs
        pol = policy.token_logprobs(ids, mask, response_length=3).logprobs
    torch.testing.assert_close(ref, naive_logprobs(build_tiny_model(seed=0), ids, mask, 3))
    assert not torch.allclose(ref, pol, atol=1e-3)
    torch.testing.assert_close(policy.token_logprobs(ids, mask, response_length=3).logprobs, pol)  # switched back on
    # With gradients on, peft's own switch runs (it also toggles requires_grad); both ways leave every flag as it was.
    flags = {n: p.requires_grad for n, p in policy.named_parameters()}
    torch.testing.assert_close(
        policy.token_logprobs(ids, mask, response_length=3, reference=True).logprobs.detach(), ref
    )
    assert {n: p.requires_grad for n, p in policy.named_parameters()} == flags
    assert not any(layer.disable_adapters for layer in policy.adapter_switch.layers)
    torch.testing.assert_close(policy.token_logprobs(ids, mask, response_length=3).logprobs.detach(), pol)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_trained_biases_refuse_the_adapter_disabled_reference(bias, tiny_model_dir):
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8, bias=bias))
    with pytest.raises(AlignConfigError, match=r"^model\.policy\.lora\.bias: .* set model\.policy\.reference_model"):
        policy.setup_reference()
    separate = PolicyModel(lora=LoraSettings(r=4, alpha=8, bias=bias), reference_model=tiny_model_dir)
    separate.setup_reference()
    assert separate.ref_model is not None


def test_frozen_copy_reference_stays_at_initial_weights():
    policy = PolicyModel()
    policy.setup_reference()
    ids, mask = batch(policy)
    before = policy.token_logprobs(ids, mask, response_length=3, reference=True).logprobs
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.1)
    torch.testing.assert_close(policy.token_logprobs(ids, mask, response_length=3, reference=True).logprobs, before)
    assert all(not p.requires_grad for p in policy.ref_model.parameters())
    policy.train()
    assert not policy.ref_model.training
