import importlib.resources
import json

import pytest
import torch

from align.data.sort_task import LETTERS, data_file
from align.hub.tiny import (
    TINY,
    TOKENIZER_DIR,
    build_tiny_model,
    has_tiny_sort_weights,
    is_tiny,
    load_tiny_tokenizer,
    tiny_config,
)

PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


def render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# --- tokenizer --------------------------------------------------------------------------------


def test_special_token_ids(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD, BOS, EOS)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert {"<|system|>", "<|user|>", "<|assistant|>"} <= set(tok.all_special_tokens)
    assert tok.padding_side == "right"
    assert tok.model_max_length == 512
    assert len(tok) == 512


def test_pad_equals_eos_variant_is_a_fresh_copy():
    shared = load_tiny_tokenizer(pad_equals_eos=True)
    assert shared.pad_token_id == shared.eos_token_id == EOS
    assert shared.pad_token == "<|eos|>"
    assert load_tiny_tokenizer().pad_token_id == PAD


def test_loads_offline_with_auto_tokenizer():
    from transformers import AutoTokenizer

    root = importlib.resources.files("align.hub") / "assets" / "tokenizer"
    assert (root / "tokenizer.json").is_file() and (root / "tokenizer_config.json").is_file()
    auto = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    assert auto.eos_token_id == EOS and auto.chat_template


def test_no_implicit_bos(tok):
    # The chat template emits the BOS; the tokenizer never adds one itself.
    assert tok("sort: a b")["input_ids"] == ids(tok, "sort: a b")
    assert BOS not in tok("sort: a b")["input_ids"]


@pytest.mark.parametrize("text", [*LETTERS, *(" " + x for x in LETTERS), *"0123456789"])
def test_letters_and_digits_are_single_tokens(tok, text):
    assert len(ids(tok, text)) == 1


def test_numbers_split_into_digits(tok):
    assert tok.convert_ids_to_tokens(ids(tok, "2024")) == ["2", "0", "2", "4"]


@pytest.mark.parametrize("text", ["Hello, world! It costs 42 dollars.", "sort: d a c b", "naïve café ✓\n\ttabs"])
def test_decode_round_trips(tok, text):
    assert tok.decode(ids(tok, text)) == text


def test_english_is_compressed(tok):
    text = "The teacher reads the book every morning, and it is important."
    assert len(ids(tok, text)) < 0.6 * len(text.encode())


# --- chat template ----------------------------------------------------------------------------


def test_chat_template_one_turn(tok):
    messages = [{"role": "user", "content": "sort: d a c"}, {"role": "assistant", "content": "a c d"}]
    assert render(tok, messages) == "<|bos|><|user|>\nsort: d a c\n<|assistant|>\na c d<|eos|>"
    assert render(tok, messages[:1], add_generation_prompt=True) == "<|bos|><|user|>\nsort: d a c\n<|assistant|>\n"
    assert render(tok, messages[:1]) == "<|bos|><|user|>\nsort: d a c\n"


TWO_TURNS = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "sort: d a c"},
    {"role": "assistant", "content": "a c d"},
    {"role": "user", "content": "sort: b a"},
    {"role": "assistant", "content": "a b"},
]


def test_chat_template_two_turns_with_system(tok):
    assert render(tok, TWO_TURNS) == (
        "<|bos|><|system|>\nAnswer briefly.\n"
        "<|user|>\nsort: d a c\n<|assistant|>\na c d<|eos|>"
        "<|user|>\nsort: b a\n<|assistant|>\na b<|eos|>"
    )


def test_rendered_conversation_has_exactly_one_bos(tok):
    text = render(tok, TWO_TURNS)
    for add_special_tokens in (False, True):
        tokens = tok(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert tokens.count(BOS) == 1 and tokens[0] == BOS
    encoded = tok.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=True)["input_ids"]
    assert encoded == ids(tok, text)
    assert encoded.count(EOS) == 2 and encoded[-1] == EOS


def test_chat_template_rejects_bad_roles(tok):
    with pytest.raises(Exception, match="role must be"):
        render(tok, [{"role": "tool", "content": "x"}])
    with pytest.raises(Exception, match="system message may only come first"):
        render(tok, [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])


def test_generation_prompt_is_a_token_prefix_in_multi_turn(tok):
    for end in (3, 5):  # the two assistant turns
        prompt = ids(tok, render(tok, TWO_TURNS[: end - 1], add_generation_prompt=True))
        full = ids(tok, render(tok, TWO_TURNS[:end]))
        assert full[: len(prompt)] == prompt
        assert full[len(prompt) :] == ids(tok, TWO_TURNS[end - 1]["content"]) + [EOS]


@pytest.mark.parametrize("split", ["train", "validation"])
def test_generation_prompt_is_a_token_prefix_for_every_sft_row(tok, split):
    with data_file("sft", split).open() as f:
        rows = [json.loads(line) for line in f]
    prompts = [render(tok, [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True) for r in rows]
    fulls = [
        render(tok, [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}])
        for r in rows
    ]
    prompt_ids = tok(prompts, add_special_tokens=False)["input_ids"]
    full_ids = tok(fulls, add_special_tokens=False)["input_ids"]
    for row, p, f in zip(rows, prompt_ids, full_ids):
        assert f[: len(p)] == p, row
        assert f[len(p) :] == ids(tok, row["completion"]) + [EOS], row
        assert len(f) <= 32  # the whole task fits comfortably in the tiny context


# --- model ------------------------------------------------------------------------------------


def test_is_tiny():
    assert TINY == "tiny"
    assert is_tiny("tiny") and is_tiny(" Tiny ")
    assert not is_tiny("gpt2") and not is_tiny("./tiny-model") and not is_tiny(None)


def test_tiny_config(tok):
    config = tiny_config()
    assert config.vocab_size >= len(tok) and config.vocab_size % 8 == 0
    assert (config.hidden_size, config.intermediate_size) == (128, 384)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (4, 4, 2)
    assert config.max_position_embeddings == 256 and config.tie_word_embeddings
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (PAD, BOS, EOS)
    wide = tiny_config(hidden_size=512, intermediate_size=1536)
    assert wide.hidden_size == 512 and wide.num_hidden_layers == 4


def test_build_tiny_model_is_deterministic():
    before = torch.random.get_rng_state()
    a, b, c = build_tiny_model(0), build_tiny_model(0), build_tiny_model(1)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is untouched
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert all(p.dtype == torch.float32 for p in a.parameters())
    assert a.get_input_embeddings().weight is a.get_output_embeddings().weight


def test_build_tiny_model_forward_and_backward(tok):
    model = build_tiny_model()
    text = render(tok, [{"role": "user", "content": "sort: d a c"}, {"role": "assistant", "content": "a c d"}])
    batch = tok([text, text[:-7]], add_special_tokens=False, padding=True, return_tensors="pt")
    out = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))
    assert out.logits.shape == (2, batch["input_ids"].shape[1], model.config.vocab_size)  # (B, T, V)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_build_tiny_model_accepts_overrides():
    model = build_tiny_model(hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    assert model.config.hidden_size == 256 and len(model.model.layers) == 2
    out = model(input_ids=torch.tensor([[BOS, 4, 204]]))
    assert out.logits.shape == (1, 3, model.config.vocab_size)


def test_sft_warmed_weights_ship_with_the_package():
    assert has_tiny_sort_weights()


def test_tokenizer_script_reproduces_the_shipped_files(tmp_path, load_script):
    load_script("train_tokenizer").save(tmp_path)
    shipped = sorted(p.name for p in TOKENIZER_DIR.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == shipped
    for name in shipped:
        assert (tmp_path / name).read_bytes() == (TOKENIZER_DIR / name).read_bytes(), f"{name} is stale"
