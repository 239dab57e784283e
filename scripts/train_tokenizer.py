"""Train the embedded default's tokenizer into ``align/hub/assets/tokenizer/``.

    python scripts/train_tokenizer.py [--out-dir DIR]

A byte-level BPE with 512 entries: 6 special tokens, the 256-byte alphabet
and 250 merges, trained on a corpus built here with no downloads: the
bundled sorting task plus a few hundred template-generated English lines, so
that ordinary text tokenizes into something better than single bytes. Digits
are always split into single-digit tokens. Every run writes identical files.

Special tokens: ``<|pad|>`` = 0, ``<|bos|>`` = 1, ``<|eos|>`` = 2, then
``<|system|>``, ``<|user|>``, ``<|assistant|>``. The tokenizer adds no BOS on
its own; the chat template emits it, so a rendered conversation has exactly one
BOS whatever ``add_special_tokens`` says. Plain text that needs a BOS gets it
from the caller.

Chat template (one turn)::

    <|bos|><|user|>\\nsort: d a c\\n<|assistant|>\\na c d<|eos|>

An assistant turn ends in EOS, every other turn in a newline, and the
generation prompt is ``<|assistant|>\\n``. Because special tokens split the
text and the generation prompt ends in a lone newline, the tokens of
"conversation so far + generation prompt" are an exact prefix of the tokens of
the conversation with the answer appended, for any answer that does not start
with whitespace.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from align.data.sort_task import LETTERS, sample_problem

SEED = 4099
VOCAB_SIZE = 512
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]  # order fixes ids: pad 0, bos 1, eos 2
MODEL_MAX_LENGTH = 512
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "align" / "hub" / "assets" / "tokenizer"

# Written with explicit '\n' expressions: transformers renders templates with
# trim_blocks/lstrip_blocks, which would eat literal newlines after block tags.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('role must be system, user or assistant; got ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' and not loop.first -%}"
    "{{- raise_exception('a system message may only come first') -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- else -%}{{- '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# Vocabulary for the English half of the corpus. Varied on purpose: function
# words, plurals, past tenses, numbers and punctuation all show up.
_SUBJECTS = [
    "The model",
    "A small dog",
    "My neighbour",
    "The old library",
    "Our team",
    "The teacher",
    "Every student",
    "The weather",
    "This function",
    "The river",
    "A careful reader",
    "The train",
    "Her brother",
    "The city council",
    "Most people",
    "The computer",
    "The garden",
    "Your answer",
    "The first step",
    "A good plan",
]
_VERBS = [
    "is",
    "was",
    "looks",
    "seems",
    "became",
    "will be",
    "has been",
    "can be",
    "should be",
    "might be",
]
_ADJECTIVES = [
    "quiet",
    "ready",
    "correct",
    "simple",
    "useful",
    "bright",
    "late",
    "important",
    "different",
    "clear",
    "happy",
    "small",
    "large",
    "strange",
    "better",
    "open",
    "early",
    "careful",
    "warm",
    "short",
]
_ACTIONS = [
    "reads the book",
    "walks to the station",
    "writes a short letter",
    "answers the question",
    "sorts the list",
    "opens the window",
    "learns a new word",
    "fixes the problem",
    "counts the apples",
    "cooks dinner",
    "checks the result",
    "plays in the park",
    "finds the key",
    "explains the idea",
    "builds a table",
    "sends a message",
    "cleans the kitchen",
    "follows the instructions",
    "draws a map",
    "tells a story",
]
_TIMES = [
    "every morning",
    "after lunch",
    "on Monday",
    "in the evening",
    "before the meeting",
    "last week",
    "tomorrow",
    "at night",
    "during the summer",
    "once a year",
    "right now",
    "in 2024",
]
_PLACES = [
    "in the house",
    "at school",
    "near the river",
    "in the city",
    "on the table",
    "at the office",
    "in the garden",
    "on the train",
    "by the sea",
    "in the kitchen",
]
_TOPICS = [
    "the history of bread",
    "how rain forms",
    "why the sky is blue",
    "a trip to the mountains",
    "learning to swim",
    "the rules of chess",
    "a day at the market",
    "how plants grow",
    "the moon",
    "writing clean code",
    "saving money",
    "a friendly robot",
]
_QUESTIONS = [
    "What is {n} plus {m}?",
    "How many {things} are there?",
    "Where did you put the {thing}?",
    "Can you explain {topic}?",
    "Why does {subject} look so {adj}?",
    "Which {thing} is the {adj} one?",
    "When will the {thing} be {adj}?",
    "Who wrote the letter about {topic}?",
]
_INSTRUCTIONS = [
    "Write a short poem about {topic}.",
    "Summarize the text in one sentence.",
    "List three facts about {topic}.",
    "Translate the sentence into simple English.",
    "Give an example of a {adj} {thing}.",
    "Answer with yes or no.",
    "Sort the words in order.",
    "Explain {topic} to a child.",
]
_THINGS = ["apple", "book", "chair", "letter", "window", "key", "question", "answer", "list", "number", "word", "cup"]


def english_lines(rng: random.Random, n: int) -> list[str]:
    lines = []
    for _ in range(n):
        kind = rng.randrange(6)
        subject, adj = rng.choice(_SUBJECTS), rng.choice(_ADJECTIVES)
        thing, topic = rng.choice(_THINGS), rng.choice(_TOPICS)
        if kind == 0:
            line = f"{subject} {rng.choice(_VERBS)} {adj} {rng.choice(_TIMES)}."
        elif kind == 1:
            line = f"{subject} {rng.choice(_ACTIONS)} {rng.choice(_PLACES)}, and it is {adj}."
        elif kind == 2:
            line = rng.choice(_QUESTIONS).format(
                n=rng.randrange(100),
                m=rng.randrange(100),
                things=thing + "s",
                thing=thing,
                topic=topic,
                subject=subject.lower(),
                adj=adj,
            )
        elif kind == 3:
            line = rng.choice(_INSTRUCTIONS).format(topic=topic, adj=adj, thing=thing)
        elif kind == 4:
            line = (
                f"I think {subject.lower()} {rng.choice(_ACTIONS)} {rng.choice(_TIMES)}; "
                f"it costs {rng.randrange(1, 1000)} dollars and takes {rng.randrange(2, 60)} minutes."
            )
        else:
            verb, other = rng.choice(_VERBS), rng.choice(_ADJECTIVES)
            line = f'"{subject} {verb} {adj}," she said. "Really? I thought it was {other}!"'
        lines.append(line)
    return lines


def corpus(seed: int = SEED) -> list[str]:
    """The training text: sorting prompts and answers, then generic English."""
    rng = random.Random(seed)
    lines = []
    for _ in range(1500):
        problem = sample_problem(rng)
        lines.append(problem["prompt"] + "\n")
        lines.append(problem["answer"])
    # Guarantee every letter, with and without a leading space, and every digit appears often.
    lines.append(" ".join(LETTERS) + " " + "".join(LETTERS) + " 0 1 2 3 4 5 6 7 8 9")
    lines.extend(english_lines(rng, 600))
    return lines


def train(seed: int = SEED) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    """``tokenizer_config.json``, written by hand so that transformers 4.x and 5.x both load it."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": ROLE_TOKENS,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "right",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def check(hf: PreTrainedTokenizerFast) -> None:
    """Fail loudly if the trained tokenizer lost a property the rest of the package relies on."""
    for i, token in enumerate(SPECIAL_TOKENS[:3]):
        assert hf.convert_tokens_to_ids(token) == i, (token, i)
    for ch in [*LETTERS, *(" " + x for x in LETTERS), *"0123456789"]:
        ids = hf.encode(ch, add_special_tokens=False)
        assert len(ids) == 1, f"{ch!r} is not a single token: {ids}"
    assert len(hf) == VOCAB_SIZE, len(hf)
    text = "Hello, world! 42 apples."
    assert hf.decode(hf.encode(text, add_special_tokens=False)) == text


def save(out_dir: Path, seed: int = SEED) -> PreTrainedTokenizerFast:
    out_dir.mkdir(parents=True, exist_ok=True)
    # A chat_template.jinja beside the config would take precedence over the config's template.
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    train(seed).save(str(out_dir / "tokenizer.json"), pretty=True)
    with (out_dir / "tokenizer_config.json").open("w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n")
    hf = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    check(hf)
    return hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="tokenizer directory to write")
    args = parser.parse_args()
    save(args.out_dir)
    for path in sorted(args.out_dir.iterdir()):
        print(path)


if __name__ == "__main__":
    main()
