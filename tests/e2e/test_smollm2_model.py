"""SmolLM2-135M-Instruct through align's model layer: loading, ChatML masks, the LoRA reference, the fast
decoder and export."""

import json
from pathlib import Path

import pytest
import torch

from align.core.masks import response_mask
from align.data.chat import IGNORE_INDEX, ChatEncoder
from align.hub.gguf import COMPLETE, SMOLLM2
from align.models import LoraSettings, PolicyModel
from align.models.decoding import FastDecoder, fast_decoder_unsupported
from align.rollout.engine import SamplingConfig, make_engine

pytestmark = pytest.mark.slow
QUESTIONS = ["What is 7 + 12? Reply with just the number.", "Compute 6 * 7. Answer with the number only."]


def prompt_ids(tokenizer, questions=QUESTIONS):
    encoder = ChatEncoder(tokenizer)
    return [encoder.prompt_ids([{"role": "user", "content": q}]) for q in questions]


def left_padded(tokenizer, questions=QUESTIONS):
    from align.rollout.sampling import left_pad

    return left_pad(prompt_ids(tokenizer, questions), tokenizer.pad_token_id)


def test_the_converted_folder_is_an_ordinary_hugging_face_model(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(smollm2_dir)
    meta = json.loads((folder / COMPLETE).read_text())
    assert meta["architecture"] == "llama" and len(meta["sha256"]) == 64
    config = AutoConfig.from_pretrained(folder)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama",
        30,
        576,
        49152,
    )
    assert getattr(config, "quantization_config", None) is None, "a converted model is not marked as quantized"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_a_chatml_response_ends_at_the_first_im_end_with_pad_equal_to_eos(smollm2_policy):
    tok = smollm2_policy.tokenizer
    eos = tok.eos_token_id
    assert tok.pad_token_id == eos
    # Sampled: greedy answers stop at <|im_end|>; the mask covers it and nothing of the padding after it.
    rollout = make_engine(SamplingConfig(max_new_tokens=24, temperature=0.0)).generate(smollm2_policy, prompt_ids(tok))
    # A truncated answer (the second question's greedy reply rambles past 24 tokens) gets no EOS appended.
    stopped = 0
    for ids, mask, cut in zip(rollout.response_ids, rollout.response_mask, rollout.truncated):
        if eos in ids.tolist():
            first = ids.tolist().index(eos)
            assert mask[: first + 1].all() and not mask[first + 1 :].any() and not cut
            stopped += 1
        else:
            assert mask.all() and cut
    assert stopped >= 1
    # Built by hand: EOS tokens after the first one are padding, not response.
    ids = torch.tensor([[37, 38, eos, eos, eos], [37, eos, 38, eos, eos]])
    assert response_mask(ids, eos).tolist() == [[True] * 3 + [False] * 2, [True] * 2 + [False] * 3]
    # Encoded for SFT/DPO/RM: the assistant turn ends at <|im_end|>; ChatML's newline after it is not trained
    # on, and after the last turn it is not there at all, as in a sampled response.
    encoder = ChatEncoder(tok)
    turns = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 2 + 4?"},
        {"role": "assistant", "content": "6"},
    ]
    input_ids, labels = encoder.encode(turns)
    assert input_ids[-1] == eos and labels[-2:] == input_ids[-2:]
    trained = [tok.convert_ids_to_tokens(t) for t, line in zip(input_ids, labels) if line != IGNORE_INDEX]
    assert trained == ["5", "<|im_end|>", "6", "<|im_end|>"]


def test_the_lora_reference_equals_the_base_model(smollm2_policy):
    policy = PolicyModel(SMOLLM2, lora=LoraSettings(r=8, alpha=16))
    policy.setup_reference()
    assert policy.ref_model is None, "the LoRA reference is the adapter-disabled policy, not a copy"
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    ids, mask = left_padded(policy.tokenizer)
    with torch.no_grad():
        ref = policy.token_logprobs(ids, mask, response_length=6, reference=True).logprobs
        base = smollm2_policy.token_logprobs(ids, mask, response_length=6).logprobs
        moved = policy.token_logprobs(ids, mask, response_length=6).logprobs
    torch.testing.assert_close(ref, base, atol=1e-5, rtol=1e-5)
    assert (moved - base).abs().max() > 1e-3, "the adapter changes the policy, not the reference"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_fast_decoder_matches_the_model_forward(smollm2_policy, lora):
    policy = smollm2_policy
    if lora:
        policy = PolicyModel(SMOLLM2, lora=LoraSettings(r=8, alpha=16))
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.02)
        policy.eval()
    model = policy.model
    assert fast_decoder_unsupported(model) is None
    ids, mask = left_padded(policy.tokenizer)
    steps = torch.tensor([[33, 34, 35], [36, 37, 2]])  # digits, then <|im_end|>
    full_ids, full_mask = torch.cat([ids, steps], 1), torch.cat([mask, torch.ones_like(steps)], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits
        decoder = FastDecoder(model, capacity=full_ids.shape[1])
        out = decoder(ids, mask, positions[:, : ids.shape[1]])
        got = [out.logits[:, -1]]
        for k in range(steps.shape[1]):
            width = ids.shape[1] + k + 1
            out = decoder(
                steps[:, k : k + 1],
                full_mask[:, :width],
                positions[:, width - 1 : width],
                past_key_values=out.past_key_values,
            )
            got.append(out.logits[:, -1])
    for k, logits in enumerate(got):
        torch.testing.assert_close(logits, expected[:, ids.shape[1] - 1 + k], atol=1e-4, rtol=1e-4, msg=f"step {k}")


class AlwaysTool:
    """Answers every turn with a ``tool`` message (ChatML renders any role) and ends after the second turn."""

    def reset(self, row):
        self.turns = 0
        return row["messages"]

    def step(self, message):
        from align.rollout.envs.chat import EnvStep

        self.turns += 1
        return EnvStep([] if self.turns == 2 else [{"role": "tool", "content": "19"}], 0.0, self.turns == 2)


def test_a_chatml_episode_with_a_tool_reply_is_trained_on_the_tokens_it_sampled(smollm2_policy):
    """Two turns on SmolLM2 with a tool reply between them: the reply's tokens are exactly ChatML's text after
    the turn's <|im_end|>, and a training pass over the conversation gives the sampled log-probs."""
    from align.data.prompts import PromptBatch
    from align.rollout.envs.chat import EnvironmentPool, EnvironmentSpec
    from align.rollout.episodes import play_episodes

    tok = smollm2_policy.tokenizer
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    batch = PromptBatch(prompt_ids(tok), list(QUESTIONS), {}, messages)
    torch.manual_seed(0)
    rollout = play_episodes(
        smollm2_policy,
        make_engine(SamplingConfig(max_new_tokens=12, temperature=1.0)),
        batch,
        1,
        EnvironmentPool(EnvironmentSpec(AlwaysTool, max_tokens=80)),
    )
    for row, episode in enumerate(rollout.episodes):
        mask, context = rollout.response_mask[row], rollout.context_mask[row].bool()
        replies = context & ~mask
        if episode["turns"] == 2:  # the first turn stopped: the reply sits between the two turns
            assert (
                tok.decode(rollout.response_ids[row][replies])
                == "\n<|im_start|>tool\n19<|im_end|>\n<|im_start|>assistant\n"
            )
        else:
            assert episode["end"] == "turn_length" and not replies.any()
    trained = smollm2_policy.token_logprobs(
        rollout.input_ids, rollout.attention_mask, response_length=rollout.response_ids.shape[1]
    ).logprobs
    mask = rollout.response_mask
    torch.testing.assert_close(trained[mask], rollout.old_logprobs[mask], atol=1e-4, rtol=0)


def test_export_round_trips_through_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = PolicyModel(SMOLLM2, lora=LoraSettings(r=8, alpha=16))
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    out = policy.save_pretrained(tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == policy.tokenizer.chat_template and tok.eos_token == "<|im_end|>"
    ids, mask = left_padded(tok)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        exported = torch.log_softmax(
            model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1], -1
        )
        exported = exported.gather(-1, ids[:, 1:, None]).squeeze(-1)[:, -6:]
        trained = policy.eval().token_logprobs(ids, mask, response_length=6).logprobs
    torch.testing.assert_close(exported, trained, atol=1e-4, rtol=1e-4)
