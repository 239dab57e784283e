"""PolicyModel: loading (local folders, QLoRA), export, and the private torch name its dropout switch relies on."""

import pytest
import torch
from torch import nn

from align.errors import AlignConfigError
from align.hub.tiny import build_tiny_model
from align.models import LoraSettings, PolicyModel

from ._tiny_batches import batch, naive_logprobs


def test_local_directory_and_bad_paths(tiny_model_dir, tmp_path):
    policy = PolicyModel(model=tiny_model_dir)
    ref = build_tiny_model(seed=3)
    ids, mask = batch(policy)
    torch.testing.assert_close(
        policy.token_logprobs(ids, mask, response_length=2).logprobs, naive_logprobs(ref, ids, mask, 2)
    )
    with pytest.raises(AlignConfigError, match="does not exist"):
        PolicyModel(model=str(tmp_path / "nope"))
    with pytest.raises(AlignConfigError, match="without config.json"):
        PolicyModel(model=str(tmp_path))
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.policy\.quantization: expected null without "
        r"model\.policy\.lora \(a quantized base cannot be trained in full\), "
        r"got '4bit'; also set model\.policy\.lora$",
    ):
        PolicyModel(model=tiny_model_dir, quantization="4bit")


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(dtype="float64"), r"^model\.policy\.dtype: expected auto, float32, bfloat16 or float16, got 'float64'$"),
        (
            dict(quantization="2bit", lora=LoraSettings()),
            r"^model\.policy\.quantization: expected '4bit', '8bit' or null, got '2bit'$",
        ),
        (
            dict(quantization="4bit", lora=LoraSettings()),
            r"^model\.policy\.quantization: expected null for the embedded tiny model \(it is not quantizable; use a "
            r"real model path\), got '4bit'$",
        ),
    ],
)
def test_bad_policy_settings_fail_on_one_line_naming_the_setting(settings, message):
    with pytest.raises(AlignConfigError, match=message):
        PolicyModel("tiny", **settings)


def test_qlora_forward_and_backward_on_cpu(tiny_model_dir):
    pytest.importorskip("bitsandbytes")
    policy = PolicyModel(model=tiny_model_dir, quantization="4bit", lora=LoraSettings(r=4, alpha=8))
    ids, mask = batch(policy)
    out = policy.token_logprobs(ids, mask, response_length=3)
    assert torch.isfinite(out.logprobs).all()
    out.logprobs.sum().backward()
    grads = [p.grad for n, p in policy.named_parameters() if "lora_" in n and p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("use_lora", [False, True])
def test_export_loads_with_plain_transformers_and_generates(tmp_path, use_lora):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8) if use_lora else None)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name or not use_lora:
                p.add_(0.01 * torch.randn_like(p))
    out = policy.save_pretrained(tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids, mask = batch(policy)
    torch.testing.assert_close(
        naive_logprobs(model, ids, mask, 3),
        policy.token_logprobs(ids, mask, response_length=3).logprobs,
        atol=1e-5,
        rtol=1e-4,
    )
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "sort: b a"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    gen = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] > prompt["input_ids"].shape[1]
    assert policy.has_adapter == use_lora  # exporting did not merge the training model in place


def test_every_dropout_class_shares_the_private_base(private_api):
    used_by = "align.models.policy.PolicyModel.disable_dropout"
    base = private_api.require(nn.modules.dropout, "_DropoutNd", used_by=used_by)
    assert all(isinstance(m, base) for m in (nn.Dropout(), nn.Dropout1d(), nn.Dropout2d(), nn.AlphaDropout()))
    policy = PolicyModel("tiny", seed=0)
    policy.add_module("extra_dropout", nn.Dropout(0.5))
    policy.disable_dropout()
    assert policy.extra_dropout.p == 0.0
