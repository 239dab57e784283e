"""The fast decoder on the device: its logits equal the model's own forward at prefill and at every decoding step,
in float32 and in bfloat16, with and without a LoRA adapter merged into its copy; the sampler's shared prefill
(one prompt encoded once for its group) samples what encoding every row does."""

import pytest
import torch

from align.hub.tiny import build_tiny_model
from align.models.decoding import FastDecoder, fast_decoder_unsupported
from align.rollout.sampling import sample

pytestmark = pytest.mark.gpu

SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


def llama(device, dtype, lora: bool = False):
    model = build_tiny_model(seed=0, **SMALL)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.2)  # a non-zero adapter, so merging it matters
    return model.to(device=device, dtype=dtype).eval()


def left_padded(device, batch=4, width=7):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SMALL["vocab_size"], (batch, width), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([0, 2, 5, 1][:batch]):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids.to(device), mask.to(device)


@torch.no_grad()
def forward_steps(model, ids, mask, new_tokens) -> list[torch.Tensor]:
    """The last position's logits of the model's full forward after each prefix of ``new_tokens``."""
    out = []
    for step in range(new_tokens.shape[1] + 1):
        full_ids = torch.cat([ids, new_tokens[:, :step]], dim=1)
        full_mask = torch.cat([mask, torch.ones_like(new_tokens[:, :step])], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        out.append(model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits[:, -1].float())
    return out


def decoder_steps(model, ids, mask, new_tokens) -> list[torch.Tensor]:
    decoder = FastDecoder(model, capacity=ids.shape[1] + new_tokens.shape[1])
    full_mask = torch.cat([mask, torch.ones_like(new_tokens)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = decoder(ids, mask, positions)
    logits = [out.logits[:, -1].float()]
    for step in range(new_tokens.shape[1]):
        positions = positions[:, -1:] + 1
        out = decoder(
            new_tokens[:, step : step + 1],
            full_mask[:, : ids.shape[1] + step + 1],
            positions,
            past_key_values=out.past_key_values,
        )
        logits.append(out.logits[:, -1].float())
    return logits


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_and_every_step_match_the_model_forward(device, dtype, lora):
    model = llama(device, dtype, lora)
    assert fast_decoder_unsupported(model) is None
    ids, mask = left_padded(device)
    new_tokens = torch.randint(
        3, SMALL["vocab_size"], (ids.shape[0], 5), generator=torch.Generator().manual_seed(1)
    ).to(device)
    expected, got = forward_steps(model, ids, mask, new_tokens), decoder_steps(model, ids, mask, new_tokens)
    assert got[0].device.type == device.type
    for step, (e, g) in enumerate(zip(expected, got)):
        torch.testing.assert_close(g, e, **TOLERANCE[dtype], msg=f"step {step}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_decoder_under_autocast_matches_the_forward_under_autocast(device, dtype):
    # bf16-mixed training samples inside the trainer's autocast: float32 weights, bfloat16 products.
    model = llama(device, torch.float32)
    ids, mask = left_padded(device)
    new_tokens = torch.randint(
        3, SMALL["vocab_size"], (ids.shape[0], 3), generator=torch.Generator().manual_seed(2)
    ).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        expected, got = forward_steps(model, ids, mask, new_tokens), decoder_steps(model, ids, mask, new_tokens)
    for step, (e, g) in enumerate(zip(expected, got)):
        torch.testing.assert_close(g, e, **TOLERANCE[torch.bfloat16], msg=f"step {step}")


@pytest.mark.parametrize("fast", [True, False], ids=["fast-decoder", "model-forward"])
def test_shared_prefill_samples_what_encoding_every_row_does(device, fast):
    # Greedy decoding: the same tokens whether a group's prompt is encoded once and its cache repeated, or every
    # row is encoded; log-probs equal to float rounding.
    model = llama(device, torch.float32)
    ids, mask = left_padded(device, batch=2)
    ids, mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)  # 2 prompts x 3 rows
    outs, prefill_rows = [], []
    for shared in (3, 1):
        lm = FastDecoder(model, capacity=ids.shape[1] + 8) if fast else model

        def recorded(**kw):
            prefill_rows.append(kw["input_ids"].shape[0]) if kw["past_key_values"] is None else None
            return lm(**kw)  # noqa: B023

        outs.append(
            sample(
                recorded,
                ids,
                mask,
                eos_token_id=1,
                pad_token_id=0,
                max_new_tokens=8,
                temperature=0.0,
                shared_prefix=shared,
            )
        )
    (shared, unshared) = outs
    assert prefill_rows == [2, 6]  # one row per group, then every row
    assert torch.equal(shared.response_ids, unshared.response_ids)
    torch.testing.assert_close(shared.logprobs, unshared.logprobs, atol=1e-5, rtol=1e-5)
