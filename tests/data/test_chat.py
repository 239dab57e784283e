"""ChatEncoder.reply_ids: the ids an environment's reply adds after a sampled assistant turn, rendered by the chat
template and tokenized once, so a multi-turn conversation built turn by turn has the ids of the whole conversation
encoded at once (when the assistant's text tokenizes as it was sampled), and never re-tokenizes a sampled turn."""

import copy

import pytest

from align.data.chat import ChatEncoder
from align.errors import AlignConfigError
from align.hub.tiny import load_tiny_tokenizer

# ChatML's shape (any role; a newline after the EOS that closes a turn), with the tiny tokenizer's EOS.
CHATML = (
    "{%- for m in messages -%}{{- '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
# Drops the content of an assistant turn once a later message follows it (as templates that strip old reasoning do).
REWRITING = (
    "{%- for m in messages -%}{{- '<|' + m['role'] + '|>\\n' -}}"
    "{%- if m['role'] == 'assistant' and not loop.last -%}...{%- else -%}{{- m['content'] -}}{%- endif -%}"
    "{{- eos_token + '\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
# Writes the EOS after the user's turns only: the last EOS of a rendering then comes before the assistant's text.
EOS_ON_USER = (
    "{%- for m in messages -%}{{- '<|' + m['role'] + '|>\\n' + m['content'] -}}"
    "{%- if m['role'] == 'user' -%}{{- eos_token -}}{%- endif -%}{{- '\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)
NO_EOS = (
    "{%- for m in messages -%}{{- '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

CONVERSATION = [
    {"role": "user", "content": "sort: d a c"},
    {"role": "assistant", "content": "a c d"},
    {"role": "user", "content": "sort: b a"},
    {"role": "assistant", "content": "a b"},
]


def encoder(template=None) -> ChatEncoder:
    tok = load_tiny_tokenizer()
    if template is not None:
        tok = copy.deepcopy(tok)
        tok.chat_template = template
    return ChatEncoder(tok)


@pytest.mark.parametrize("template", [None, CHATML], ids=["tiny", "chatml"])
def test_a_conversation_built_turn_by_turn_has_the_ids_of_the_whole_conversation(template):
    enc = encoder(template)
    eos = enc.tokenizer.eos_token_id
    ids = enc.prompt_ids(CONVERSATION[:1])
    ids += enc._ids(CONVERSATION[1]["content"]) + [eos]  # a sampled turn, through its stop token
    ids += enc.reply_ids(CONVERSATION[:2], CONVERSATION[2:3])
    ids += enc._ids(CONVERSATION[3]["content"]) + [eos]
    whole, _ = enc.encode(CONVERSATION)
    assert ids == whole


def test_a_turn_whose_text_occurs_in_the_eos_token_is_continued():
    # "e" occurs in the tiny tokenizer's "<|eos|>": the check that the EOS closes the turn must not look for text.
    enc = encoder()
    turn = [{"role": "user", "content": "sort: e"}, {"role": "assistant", "content": "e"}]
    assert enc.tokenizer.decode(enc.reply_ids(turn, CONVERSATION[2:3])) == "<|user|>\nsort: b a\n<|assistant|>\n"


def test_the_reply_starts_with_what_the_template_writes_after_the_turns_eos():
    enc = encoder(CHATML)
    reply = enc.tokenizer.decode(enc.reply_ids(CONVERSATION[:2], CONVERSATION[2:3]))
    assert reply == "\n<|user|>\nsort: b a<|eos|>\n<|assistant|>\n"
    tiny = encoder()
    assert (
        tiny.tokenizer.decode(tiny.reply_ids(CONVERSATION[:2], CONVERSATION[2:3]))
        == "<|user|>\nsort: b a\n<|assistant|>\n"
    )


def test_several_reply_messages_and_the_sampled_text_is_never_tokenized():
    enc = encoder(CHATML)
    replies = [{"role": "tool", "content": "42"}, {"role": "tool", "content": "7"}]
    assistant = {"role": "assistant", "content": "<tool_call>calc(6*7)</tool_call>"}
    text = enc.tokenizer.decode(enc.reply_ids([CONVERSATION[0], assistant], replies))
    assert text == "\n<|tool|>\n42<|eos|>\n<|tool|>\n7<|eos|>\n<|assistant|>\n"
    assert "calc" not in text


def test_templates_that_cannot_continue_a_sampled_turn_are_refused_on_one_line():
    with pytest.raises(AlignConfigError, match="renders a conversation differently once a reply follows"):
        encoder(REWRITING).reply_ids(CONVERSATION[:2], CONVERSATION[2:3])
    for template in (NO_EOS, EOS_ON_USER):
        with pytest.raises(AlignConfigError, match="does not end an assistant turn with the EOS token"):
            encoder(template).reply_ids(CONVERSATION[:2], CONVERSATION[2:3])
    plain = ChatEncoder(load_tiny_tokenizer(), use_chat_template=False)
    with pytest.raises(AlignConfigError, match="multi-turn episodes need a tokenizer with a chat_template"):
        plain.reply_ids(CONVERSATION[:2], CONVERSATION[2:3])


def test_a_chat_template_asked_of_a_tokenizer_without_one_fails_naming_the_setting():
    tok = copy.deepcopy(load_tiny_tokenizer())
    tok.chat_template = None
    with pytest.raises(
        AlignConfigError,
        match=r"^data\.use_chat_template: expected false or null for a tokenizer "
        r"without a chat_template, got True$",
    ):
        ChatEncoder(tok, use_chat_template=True)
