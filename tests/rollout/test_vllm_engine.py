"""The vLLM engine (``sampling.engine: vllm``) on the tiny model, in float32: the same tokens and log-probs as align's
own decoder and the trainer, before and after full-weight and LoRA updates, seeded sampling, and what it refuses.

The tests of this file share the process's engines (one per model shape and settings) and close them at the end, so
that the one-process group vLLM sets up does not outlive them."""

import pytest
import torch

from align.errors import AlignConfigError
from align.models import LoraSettings, PolicyModel
from align.rollout.engine import SamplingConfig, make_engine
from align.rollout.vllm_engine import VLLMEngine

pytestmark = pytest.mark.slow  # vLLM: its import and an engine start take seconds per test

pytest.importorskip("vllm", exc_type=ImportError)
vllm_engine = pytest.importorskip("align.rollout.vllm_engine")

PROMPTS = ["c a b", "d b a c", "b a", "e d c b a"]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    vllm_engine.close_engines()


def prompt_ids(policy, texts=PROMPTS):
    from align.data.chat import ChatEncoder

    encoder = ChatEncoder(policy.tokenizer)
    return [encoder.prompt_ids([{"role": "user", "content": t}]) for t in texts]


def greedy(engine="vllm", max_new_tokens=10, **kw):
    return make_engine(SamplingConfig(engine=engine, temperature=0.0, max_new_tokens=max_new_tokens, **kw))


def trainer_logprobs(policy, rollout):
    out = policy.token_logprobs(
        rollout.input_ids, rollout.attention_mask, response_length=rollout.response_ids.shape[1]
    )
    return torch.where(rollout.response_mask, out.logprobs, torch.zeros_like(out.logprobs))


def assert_same_as_native(policy, group_size=1, **vllm):
    ids = prompt_ids(policy)
    engine = greedy(VLLMEngine(**vllm)) if vllm else greedy()
    a, b = engine.generate(policy, ids, group_size), greedy("native").generate(policy, ids, group_size)
    assert torch.equal(a.response_ids, b.response_ids) and a.texts == b.texts
    assert torch.equal(a.response_mask, b.response_mask)
    assert (a.old_logprobs - trainer_logprobs(policy, a)).abs().max() < 1e-4
    return a


@torch.no_grad()
def perturb(policy, names=lambda name: True, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    for name, p in policy.named_parameters():
        if names(name):
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_greedy_tokens_and_logprobs_equal_the_native_decoder_and_the_trainer():
    policy = PolicyModel("tiny-sort")
    rollout = assert_same_as_native(policy, group_size=2)
    assert rollout.response_mask.any(dim=1).all() and "time/engine_sync_s" in rollout.metrics


def test_full_weights_follow_the_policy_and_are_sent_only_when_changed():
    policy = PolicyModel("tiny-sort")
    assert_same_as_native(policy)  # the engine may hold another policy's weights: this one is sent first
    perturb(policy, scale=0.03)
    after = assert_same_as_native(policy)
    assert after.metrics.get("rollout/engine_weight_sync") == 1.0
    again = greedy().generate(policy, prompt_ids(policy), 1)
    assert "rollout/engine_weight_sync" not in again.metrics  # nothing changed since


def test_a_lora_adapter_is_sent_as_a_new_version_and_the_base_stays():
    policy = PolicyModel("tiny-sort", lora=LoraSettings(r=8, alpha=16))
    assert_same_as_native(policy, lora="adapter")
    for step in range(2):
        perturb(policy, lambda name: "lora_B" in name, scale=0.3, seed=step)
        rollout = assert_same_as_native(policy, lora="adapter")
        assert rollout.metrics.get("rollout/engine_adapter_sync") == 1.0
        assert "rollout/engine_weight_sync" not in rollout.metrics


def test_a_merged_lora_adapter_is_sent_inside_the_weights():
    policy = PolicyModel("tiny-sort", lora=LoraSettings(r=8, alpha=16))
    assert_same_as_native(policy, lora="merged")
    perturb(policy, lambda name: "lora_B" in name, scale=0.3)
    rollout = assert_same_as_native(policy, lora="merged")
    assert rollout.metrics.get("rollout/engine_weight_sync") == 1.0
    assert "rollout/engine_adapter_sync" not in rollout.metrics


def test_seeded_sampling_repeats_and_each_row_draws_its_own_completion():
    policy = PolicyModel("tiny-sort")
    engine = make_engine(SamplingConfig(engine="vllm", temperature=1.0, max_new_tokens=8))
    ids = prompt_ids(policy)[:1]
    a = engine.generate(policy, ids, 8, generator=torch.Generator().manual_seed(1))
    b = engine.generate(policy, ids, 8, generator=torch.Generator().manual_seed(1))
    c = engine.generate(policy, ids, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.response_ids, b.response_ids) and not torch.equal(a.response_ids, c.response_ids)
    assert len(set(a.texts)) > 1  # the group's rows are not copies of one draw
    # Sampled log-probs at temperature 1 (no top-k/top-p) are the trainer's.
    assert (a.old_logprobs - trainer_logprobs(policy, a)).abs().max() < 1e-4


def test_without_request_seeds_the_engine_draws_from_its_own_generator():
    policy = PolicyModel("tiny-sort")
    engine = make_engine(SamplingConfig(engine=VLLMEngine(request_seeds=False), temperature=1.0, max_new_tokens=8))
    ids = prompt_ids(policy)[:1]
    a = engine.generate(policy, ids, 8, generator=torch.Generator().manual_seed(1))
    b = engine.generate(policy, ids, 8, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(a.response_ids, b.response_ids)  # the same seed, other completions
    assert (a.old_logprobs - trainer_logprobs(policy, a)).abs().max() < 1e-4


def test_stop_tokens_are_kept_and_long_responses_are_truncated_without_one():
    policy = PolicyModel("tiny-sort")
    rollout = greedy(max_new_tokens=2).generate(policy, prompt_ids(policy), 1)
    native = greedy("native", max_new_tokens=2).generate(policy, prompt_ids(policy), 1)
    assert torch.equal(rollout.truncated, native.truncated) and rollout.truncated.any()
    full = greedy(max_new_tokens=12).generate(policy, prompt_ids(policy), 1)
    eos = policy.tokenizer.eos_token_id
    ended = ~full.truncated
    last = full.response_mask.sum(dim=1) - 1
    assert ended.any() and (full.response_ids[ended, last[ended]] == eos).all()


def test_a_context_longer_than_the_engine_allows_fails_naming_the_setting():
    policy = PolicyModel("tiny-sort")
    engine = make_engine(SamplingConfig(engine=VLLMEngine(max_model_len=16), max_new_tokens=8))
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.sampling\.engine\.max_model_len: expected at least the \d+ "
        r"tokens of a rollout's contexts, got 16; ",
    ):
        engine.generate(policy, prompt_ids(policy)[:1], 1)


def test_settings_are_checked_when_read():
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.sampling\.engine\.dtype: expected auto, float32, bfloat16 or "
        r"float16, got 'fp8'$",
    ):
        VLLMEngine(dtype="fp8")
    from align.rollout.engine import EngineCorrection

    with pytest.raises(AlignConfigError, match=r"^model\.sampling\.correction\.mode: expected auto, none, tis or mis"):
        EngineCorrection(mode="clip")
    with pytest.raises(AlignConfigError, match=r"^model\.sampling\.correction\.low: expected a value in \[0, 1\]"):
        EngineCorrection(low=1.5)
    assert EngineCorrection().resolve(exact_logprobs=False) == "tis"
    assert EngineCorrection().resolve(exact_logprobs=True) == "none"
