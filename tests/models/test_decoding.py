"""FastDecoder is an exact re-expression of the Hugging Face forward for the architectures it covers."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import align.models.decoding as decoding
from align.hub.tiny import build_tiny_model
from align.models.decoding import FastDecoder, _copy_bytes, decoder_for, fast_decoder_unsupported, prepack_available
from align.rollout.sampling import sample

SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _llama(**kw):
    return build_tiny_model(seed=0, **{**SMALL, **kw}).eval()


def _qwen2():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True)).eval()  # q/k/v projections have a bias


def _mistral(sliding_window=None):
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**SMALL, sliding_window=sliding_window)).eval()


def _lora(model):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)  # a non-zero adapter, so merging it matters
    return peft_model.eval()


def _left_padded(batch=4, width=7, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, width), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 2, 5, 1][:batch]):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


def _reference_steps(model, ids, mask, new_tokens):
    """Logits of the model's own full forward at the last position after appending each token of ``new_tokens``."""
    out = []
    for step in range(new_tokens.shape[1] + 1):
        full_ids = torch.cat([ids, new_tokens[:, :step]], dim=1)
        full_mask = torch.cat([mask, torch.ones_like(new_tokens[:, :step])], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits[:, -1]
        out.append(logits)
    return out


def _decoder_steps(model, ids, mask, new_tokens, prepack=None):
    decoder = FastDecoder(model, capacity=ids.shape[1] + new_tokens.shape[1], prepack=prepack)
    full_mask = torch.cat([mask, torch.ones_like(new_tokens)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = decoder(ids, mask, positions)
    logits = [out.logits[:, -1]]
    for step in range(new_tokens.shape[1]):
        positions = positions[:, -1:] + 1
        out = decoder(
            new_tokens[:, step : step + 1],
            full_mask[:, : ids.shape[1] + step + 1],
            positions,
            past_key_values=out.past_key_values,
        )
        logits.append(out.logits[:, -1])
    return logits


PREPACK = [False] + ([True] if prepack_available(torch.ones(1)) else [])


@pytest.mark.parametrize("prepack", PREPACK, ids=lambda p: "prepacked" if p else "plain")
@pytest.mark.parametrize(
    "build", [_llama, _qwen2, _mistral, lambda: _lora(_llama())], ids=["llama", "qwen2-bias", "mistral", "llama-lora"]
)
def test_prefill_and_every_step_match_the_model_forward(build, prepack, monkeypatch):
    monkeypatch.setattr(decoding, "_MIN_PREPACK_ELEMENTS", 0)  # the test models' weights are all small
    model = build()
    assert fast_decoder_unsupported(model) is None
    ids, mask = _left_padded()
    new_tokens = torch.randint(3, 97, (ids.shape[0], 5), generator=torch.Generator().manual_seed(1))
    expected = _reference_steps(model, ids, mask, new_tokens)
    got = _decoder_steps(model, ids, mask, new_tokens, prepack=prepack)
    for step, (e, g) in enumerate(zip(expected, got)):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5, msg=f"step {step}")


def test_lora_with_adapters_disabled_matches_the_base_model():
    model = _lora(_llama())
    ids, mask = _left_padded()
    new_tokens = torch.randint(3, 97, (ids.shape[0], 2), generator=torch.Generator().manual_seed(2))
    with model.disable_adapter():
        got = _decoder_steps(model, ids, mask, new_tokens)
        expected = _reference_steps(model.get_base_model(), ids, mask, new_tokens)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=2e-5, rtol=1e-5)


def test_decoder_snapshot_leaves_the_trainable_weights_untouched():
    model = _lora(_llama())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    FastDecoder(model, capacity=8)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bfloat16_model_matches_within_bf16_rounding():
    model = _llama().to(torch.bfloat16)
    ids, mask = _left_padded()
    new_tokens = torch.randint(3, 97, (ids.shape[0], 3), generator=torch.Generator().manual_seed(3))
    for e, g in zip(_reference_steps(model, ids, mask, new_tokens), _decoder_steps(model, ids, mask, new_tokens)):
        torch.testing.assert_close(g.float(), e.float(), atol=3e-2, rtol=3e-2)


def test_sampling_through_the_decoder_draws_the_same_tokens_and_logprobs():
    model = _llama()
    ids, mask = _left_padded()
    kwargs = dict(eos_token_id=2, pad_token_id=0, max_new_tokens=12, temperature=0.9, top_k=40)
    ref = sample(model, ids, mask, generator=torch.Generator().manual_seed(5), **kwargs)
    fast = sample(
        FastDecoder(model, ids.shape[1] + 12), ids, mask, generator=torch.Generator().manual_seed(5), **kwargs
    )
    assert torch.equal(ref.response_ids, fast.response_ids)
    torch.testing.assert_close(fast.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)


def test_prepacked_weights_are_used_where_they_run_and_counted_in_the_copy_budget(monkeypatch):
    model = _lora(_llama())
    assert _copy_bytes(model, prepacked=True) == _copy_bytes(model)  # no weight reaches the size worth packing
    if prepack_available(torch.ones(1)):
        assert not FastDecoder(model, 8, prepack=True).prepacked
        assert decoding._prepack(torch.randn(512, 512)).is_mkldnn
    monkeypatch.setattr(decoding, "_MIN_PREPACK_ELEMENTS", 0)
    plain, packed = _copy_bytes(model), _copy_bytes(model, prepacked=True)
    lm = model.get_base_model()
    every_projection = sum(
        m.weight.numel() * 4
        for name, m in lm.model.named_modules()
        if name.endswith(("_proj.base_layer", "_proj")) and hasattr(m, "weight") and not hasattr(m, "base_layer")
    )
    assert packed == every_projection + lm.lm_head.weight.numel() * 4 and plain < packed
    if not prepack_available(torch.ones(1)):
        pytest.skip("this torch has no oneDNN prepacked linear")
    assert decoder_for(model, capacity=8).prepacked  # float32 on a CPU: prepacked by default
    fallback = decoder_for(model, capacity=8, max_copy_bytes=plain)  # only the fused copy fits
    assert isinstance(fallback, FastDecoder) and not fallback.prepacked
    with pytest.raises(ValueError, match="float32 CPU weights"):
        FastDecoder(_llama().to(torch.bfloat16), capacity=8, prepack=True)


def test_cache_capacity_is_enforced():
    model = _llama()
    ids, mask = _left_padded()
    decoder = FastDecoder(model, capacity=ids.shape[1])
    out = decoder(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
    with pytest.raises(ValueError, match="capacity"):
        decoder(ids[:, :1], torch.cat([mask, mask[:, :1]], 1), torch.zeros_like(ids[:, :1]), out.past_key_values)


def test_unsupported_models_are_named_and_fall_back_to_their_own_forward():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in fast_decoder_unsupported(gpt2)
    assert decoder_for(gpt2, capacity=8) is gpt2
    assert "sliding" in fast_decoder_unsupported(_mistral(sliding_window=4))
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(_llama(), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    assert "DoRA" in fast_decoder_unsupported(dora)
    llama = _llama()
    assert isinstance(decoder_for(llama, capacity=8), FastDecoder)
    assert decoder_for(llama, capacity=8, max_copy_bytes=0) is llama  # the weight copy would not fit
    # ZeRO-3 partitions: its mark decides, even while prefetching has gathered the first weight at full size.
    partitioned = _llama()
    for weight in partitioned.parameters():
        weight.ds_id = 0
    assert "ZeRO-3" in fast_decoder_unsupported(partitioned)


def test_rollout_engine_gives_the_same_rollout_with_and_without_the_decoder():
    from align.models.policy import PolicyModel
    from align.rollout.engine import NativeEngine, SamplingConfig

    policy = PolicyModel("tiny")
    prompts = [[1, 40, 41, 42], [1, 50, 51], [1, 60]]
    rollouts = []
    for fast in (True, False):
        engine = NativeEngine(fast_decoder=fast).bound(SamplingConfig(max_new_tokens=10, temperature=1.0))
        rollouts.append(engine.generate(policy, prompts, group_size=2, generator=torch.Generator().manual_seed(7)))
    fast, slow = rollouts
    assert torch.equal(fast.response_ids, slow.response_ids) and fast.texts == slow.texts
    torch.testing.assert_close(fast.old_logprobs, slow.old_logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-decoder", "model-forward"])
def test_a_group_shares_one_prefill_and_samples_as_if_each_copy_were_encoded(fast):
    from align.models.policy import PolicyModel
    from align.rollout.engine import NativeEngine, SamplingConfig

    policy = PolicyModel("tiny")
    prompts = [[1, 40, 41, 42], [1, 50, 51], [1, 60]]
    rollouts = []
    for shared in (True, False):
        engine = NativeEngine(fast_decoder=fast, shared_prefill=shared).bound(
            SamplingConfig(max_new_tokens=10, temperature=1.0)
        )
        rollouts.append(engine.generate(policy, prompts, group_size=3, generator=torch.Generator().manual_seed(7)))
    shared, each = rollouts
    assert torch.equal(shared.response_ids, each.response_ids) and shared.texts == each.texts
    torch.testing.assert_close(shared.old_logprobs, each.old_logprobs, atol=1e-5, rtol=1e-5)
    assert len(set(map(tuple, shared.response_ids[:3].tolist()))) > 1, "the copies of a prompt are sampled apart"
