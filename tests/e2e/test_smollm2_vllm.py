"""SmolLM2-135M-Instruct on the vLLM engine, in float32: greedy tokens equal to align's own decoder, sampled tokens'
log-probs equal to the trainer's, before and after a full-weight update and a LoRA adapter update (the tied output
layer is re-packed after a reload)."""

import pytest
import torch
from test_smollm2_model import prompt_ids

from align.models import LoraSettings, PolicyModel
from align.rollout.engine import SamplingConfig, make_engine
from align.rollout.vllm_engine import VLLMEngine

pytestmark = pytest.mark.slow
pytest.importorskip("vllm", exc_type=ImportError)
vllm_engine = pytest.importorskip("align.rollout.vllm_engine")


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    vllm_engine.close_engines()


def compare(policy, **vllm):
    ids = prompt_ids(policy.tokenizer)
    sampling = dict(temperature=0.0, max_new_tokens=12)
    a = make_engine(SamplingConfig(engine=VLLMEngine(**vllm), **sampling)).generate(policy, ids, 1)
    b = make_engine(SamplingConfig(engine="native", **sampling)).generate(policy, ids, 1)
    assert a.texts == b.texts and torch.equal(a.response_ids, b.response_ids)
    trainer = policy.token_logprobs(a.input_ids, a.attention_mask, response_length=a.response_ids.shape[1]).logprobs
    diff = (trainer - a.old_logprobs)[a.response_mask].abs()
    assert diff.max() < 5e-4 and diff.mean() < 5e-5, (diff.max(), diff.mean())
    return a


@torch.no_grad()
def nudge(policy, select, scale):
    g = torch.Generator().manual_seed(0)
    for name, p in policy.named_parameters():
        if select(name):
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean().clamp(min=1e-3))


def test_full_weights_and_their_update_give_the_trainers_tokens_and_logprobs(smollm2_dir):
    policy = PolicyModel(smollm2_dir).eval()
    compare(policy)
    nudge(policy, lambda name: "embed_tokens" in name or "layers.29." in name, 0.2)  # the tied head moves too
    after = compare(policy)
    assert after.metrics.get("rollout/engine_weight_sync") == 1.0


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_a_lora_adapter_update_gives_the_trainers_tokens_and_logprobs(smollm2_dir, mode):
    policy = PolicyModel(smollm2_dir, lora=LoraSettings(r=8, alpha=16, target_modules=["q_proj", "v_proj"])).eval()
    compare(policy, lora=mode)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    after = compare(policy, lora=mode)
    sent = "rollout/engine_adapter_sync" if mode == "adapter" else "rollout/engine_weight_sync"
    assert after.metrics.get(sent) == 1.0
