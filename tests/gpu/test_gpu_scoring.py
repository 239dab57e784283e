"""Scoring on the device: the log-probs the sampler records are those the trainer computes for the same tokens
(float32, and both under bf16 autocast as in bf16-mixed training), and a GRPO batch's shared prompts, run once
(laid out in one call, or as a prompt pass whose cache the continuations read), score as one pass over every row."""

import contextlib

import pytest
import torch

from align.data.chat import ChatEncoder
from align.models import CriticSettings, LoraSettings, PolicyModel
from align.rollout.engine import NativeEngine, SamplingConfig

pytestmark = pytest.mark.gpu

PROMPTS = ("sort: d a c b", "sort: a b", "sort: j e f g h")


@pytest.fixture(scope="module")
def policy(device):
    return PolicyModel("tiny-sort").to(device)


def autocast(device, on: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if on else contextlib.nullcontext()


@pytest.mark.parametrize("fast_decoder", [True, False], ids=["fast-decoder", "model-forward"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_samplers_logprobs_are_the_trainers(policy, device, bf16, fast_decoder):
    enc = ChatEncoder(policy.tokenizer)
    prompt_ids = [enc.prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    torch.manual_seed(0)
    engine = NativeEngine(fast_decoder=fast_decoder).bound(SamplingConfig(max_new_tokens=12, temperature=0.7))
    with autocast(device, bf16):
        rollout = engine.generate(policy, prompt_ids, 4)
        with torch.no_grad():
            scores = policy.token_logprobs(
                rollout.input_ids,
                rollout.attention_mask,
                response_length=rollout.response_ids.shape[1],
                temperature=0.7,
            )
    assert rollout.input_ids.device.type == device.type
    m = rollout.response_mask
    assert m.sum() > 0
    # bf16: products rounded to 8 bits of mantissa on both sides, in different orders (one token at a time
    # against the whole row); the log-ratio of the first update stays within a few hundredths.
    tolerance = dict(atol=5e-2, rtol=5e-2) if bf16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rollout.old_logprobs[m], scores.logprobs[m], **tolerance)
    if bf16:
        assert float((rollout.old_logprobs[m] - scores.logprobs[m]).abs().mean()) < 1e-2


def groups(policy, device, group=3):
    """Two prompts of different lengths (left-padded), each with ``group`` different right-padded responses."""
    tok = policy.tokenizer
    tok.padding_side = "left"
    enc = tok(["sort: b a", "sort: d c b a"], return_tensors="pt", padding=True)
    tok.padding_side = "right"
    prompts = enc["input_ids"].repeat_interleave(group, 0)
    prompt_mask = enc["attention_mask"].repeat_interleave(group, 0)
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(5, policy.config.vocab_size, (prompts.shape[0], 5), generator=g)
    response_mask = torch.ones_like(responses)
    response_mask[1, 3:] = 0  # a response that ended early, then padding
    response_mask[4, 1:] = 0
    return torch.cat([prompts, responses], 1).to(device), torch.cat([prompt_mask, response_mask], 1).to(device)


@pytest.mark.parametrize("path", ["one call", "prompt cache"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_shared_prompts_score_as_one_pass_over_every_row(device, path, lora, monkeypatch):
    from align.models import scoring, shared_pass

    if path == "prompt cache":
        monkeypatch.setattr(shared_pass, "layout_mask_kind", lambda decoder: None)
        monkeypatch.setattr(shared_pass, "_MIN_SHARED_PREFIX_WORK", 0)  # the tiny model is below the threshold
    torch.manual_seed(0)
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8) if lora else None, critic=CriticSettings()).to(device)
    ids, mask = groups(policy, device)
    weights = torch.linspace(-1, 1, ids.shape[0] * 5, device=device).view(ids.shape[0], 5)
    decoder = policy.base_model.get_decoder() if lora else policy.model.get_decoder()
    calls = []
    decoder.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[0]), with_kwargs=True)
    results = []
    for shared in (True, False):  # the shared path, then the model's own forward over every row
        if not shared:
            monkeypatch.setattr(scoring, "chunked_head_unsupported", lambda model: "forced for the test")
        policy.zero_grad(set_to_none=True)
        calls.clear()
        out = policy.token_logprobs(
            ids, mask, response_length=5, temperature=0.9, return_entropy=True, return_values=True
        )
        ((out.logprobs * weights).sum() + out.entropy.mean() + out.values.sum()).backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append(([out.logprobs.detach(), out.entropy.detach(), out.values.detach()], grads, list(calls)))
    (shared_out, shared_grads, shared_calls), (full_out, full_grads, full_calls) = results
    assert shared_calls[0] == 2 and full_calls == [6]  # the 2 prompts' rows first, against the 6 rows at once
    for a, b in zip(shared_out, full_out):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert shared_grads.keys() == full_grads.keys() and shared_grads
    for name in full_grads:
        torch.testing.assert_close(shared_grads[name], full_grads[name], atol=1e-4, rtol=1e-3, msg=name)
