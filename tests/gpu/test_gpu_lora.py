"""The fused LoRA layers on the device: a tiny policy's token log-probs, its reference's and every adapter gradient
equal peft's own layers (``lora.fused: false``), with float32 and with bfloat16 weights, and under autocast (where
the fused function steps aside for peft's)."""

import contextlib

import pytest
import torch
from torch import nn

from align.models import LoraSettings, PolicyModel
from align.models.lora import fused_class

pytestmark = pytest.mark.gpu


def close(a: torch.Tensor, b: torch.Tensor, dtype, msg: str = "") -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=msg)
    else:  # bf16 rounding, relative to the tensor's scale
        scale = float(b.float().abs().max())
        torch.testing.assert_close(a.float(), b.float(), atol=0.05 * scale, rtol=0.05, msg=msg)


def scored(device, dtype, fused: bool, autocast: bool):
    torch.manual_seed(0)
    policy = PolicyModel("tiny", dtype="float32", lora=LoraSettings(r=4, alpha=8, fused=fused))
    for name, p in policy.model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05)
    policy = policy.to(device=device, dtype=dtype)
    assert bool([m for m in policy.model.modules() if type(m) is fused_class()]) == fused
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, 60, (3, 12), generator=g).to(device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0  # a left-padded prompt
    attention_mask[2, -2:] = 0  # a response that ended early
    context = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        out = policy.token_logprobs(input_ids, attention_mask, response_length=5)
        with torch.no_grad():
            ref = policy.token_logprobs(input_ids, attention_mask, response_length=5, reference=True)
        out.logprobs.sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    return out.logprobs.detach(), ref.logprobs, grads


@pytest.mark.parametrize(
    "dtype, autocast",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16-weights", "bf16-autocast"],
)
def test_the_fused_adapter_scores_and_trains_as_peft(device, dtype, autocast):
    (lp, ref, grads), (lp0, ref0, grads0) = (scored(device, dtype, fused, autocast) for fused in (True, False))
    assert lp.device.type == device.type
    compare = torch.bfloat16 if dtype == torch.bfloat16 or autocast else torch.float32
    close(lp, lp0, compare, "log-probs")
    close(ref, ref0, compare, "reference log-probs")
    assert grads.keys() == grads0.keys() and any("lora_A" in n for n in grads)
    for name in grads:
        close(grads[name], grads0[name], compare, name)
