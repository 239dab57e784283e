"""Turning conversations into token ids and loss labels, with the chat template applied exactly once.

The template is rendered to text and split at message boundaries; each piece is tokenized with
``add_special_tokens=False`` (the template already emits BOS and turn markers, so nothing is doubled) and the
pieces are concatenated. The prompt ids used here are therefore exactly the ids an RL rollout generates
from, and no BPE merge can cross the prompt/response boundary.

Without a chat template (or with ``use_chat_template=False``) a single-turn conversation is encoded as
``tokenizer(prompt)`` followed by the completion and an EOS.

An assistant turn ends at its first EOS, as a sampled response does (``align.core.masks.response_mask``):
text that a template adds after it (ChatML's newline after ``<|im_end|>``) is never trained on, and after the
last turn it is dropped, so a trained or scored sequence ends exactly where a generated one stops.
"""

from __future__ import annotations

import logging

from align.errors import AlignConfigError, AlignDataError

log = logging.getLogger(__name__)
IGNORE_INDEX = -100


class ChatEncoder:
    def __init__(self, tokenizer, use_chat_template: bool | None = None):
        """``use_chat_template=None`` uses the template when the tokenizer has one."""
        self.tokenizer = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if use_chat_template and not has_template:
            raise AlignConfigError(
                "data.use_chat_template: expected false or null for a tokenizer without a chat_template, got True"
            )
        self.use_chat_template = has_template if use_chat_template is None else use_chat_template
        self._warned_no_eos = False

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def until_eos(self, ids: list[int]) -> int:
        """Length of ``ids`` up to and including its first EOS (all of it when there is none)."""
        eos = self.tokenizer.eos_token_id
        return ids.index(eos) + 1 if eos in ids else len(ids)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """Ids of a prompt ready for generation (template with the generation prompt)."""
        if self.use_chat_template:
            return self._ids(self._render(messages, add_generation_prompt=True))
        return self.tokenizer(self._plain_prompt(messages))["input_ids"]

    def reply_ids(self, conversation: list[dict], replies: list[dict]) -> list[int]:
        """Ids that follow the stop token of the assistant turn closing ``conversation`` when ``replies`` (an
        environment's messages) answer it, through the next generation prompt.

        Only the new text is tokenized: what the template writes after the turn's EOS (ChatML's newline), the
        replies, and the generation prompt. The assistant's own tokens are never re-tokenized, so the ids a policy
        is trained on are the ids it sampled. The template must render a conversation as an extension of the
        rendering of its prefix, and end assistant turns with the EOS token."""
        if not self.use_chat_template:
            raise AlignConfigError(
                "multi-turn episodes need a tokenizer with a chat_template (data.use_chat_template must not be false)"
            )
        before = self._render(conversation, add_generation_prompt=False)
        after = self._render(conversation + replies, add_generation_prompt=True)
        eos = self.tokenizer.eos_token or ""
        cut = before.rfind(eos) if eos else -1
        turn_start = len(self._render(conversation[:-1], add_generation_prompt=True))
        if cut < turn_start:  # no EOS, or none after the last (assistant) turn began
            raise AlignConfigError(
                f"the chat template does not end an assistant turn with the EOS token {eos!r}, so a "
                "sampled turn (which stops there) cannot be continued"
            )
        if not after.startswith(before):
            raise AlignConfigError(
                "the chat template renders a conversation differently once a reply follows its last "
                "assistant turn (it rewrites earlier turns), so earlier sampled tokens would change"
            )
        return self._ids(before[cut + len(eos) :] + after[len(before) :])

    def _plain_prompt(self, messages: list[dict]) -> str:
        if len(messages) != 1 or messages[0]["role"] != "user":
            raise AlignConfigError("multi-message conversations need a tokenizer with a chat_template")
        return messages[0]["content"]

    def encode(
        self, messages: list[dict], source: str = "<data>", row: int | None = None
    ) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` with labels on assistant turns only (their closing EOS included)."""
        if not self.use_chat_template:
            prompt = self.tokenizer(self._plain_prompt(messages[:-1]))["input_ids"]
            completion = self._ids(messages[-1]["content"]) + [self.tokenizer.eos_token_id]
            return prompt + completion, [IGNORE_INDEX] * len(prompt) + completion
        full = self._render(messages, add_generation_prompt=False)
        cuts = [0]  # alternating boundaries: [untrained, trained, untrained, ...]
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = self._render(messages[:k], add_generation_prompt=True) if k else ""
            end = self._render(messages[: k + 1], add_generation_prompt=False)
            if not (full.startswith(start) and full.startswith(end) and cuts[-1] <= len(start) <= len(end)):
                raise AlignDataError(
                    source,
                    row,
                    "messages",
                    "a chat template whose rendering of a conversation extends the rendering of each of its prefixes",
                )
            cuts += [len(start), len(end)]
        cuts.append(len(full))
        input_ids: list[int] = []
        labels: list[int] = []
        turn_end = 0
        for i in range(len(cuts) - 1):
            ids = self._ids(full[cuts[i] : cuts[i + 1]])
            trained = self.until_eos(ids) if i % 2 == 1 else 0
            if i % 2 == 1:
                turn_end = len(input_ids) + trained
            input_ids += ids
            labels += ids[:trained] + [IGNORE_INDEX] * (len(ids) - trained)
        if messages and messages[-1]["role"] == "assistant":
            input_ids, labels = input_ids[:turn_end], labels[:turn_end]
        if not self._warned_no_eos and self.tokenizer.eos_token_id not in [t for t in labels if t != IGNORE_INDEX]:
            self._warned_no_eos = True
            log.warning(
                "the chat template does not end assistant turns with the EOS token %r; a trained model "
                "may not learn to stop",
                self.tokenizer.eos_token,
            )
        return input_ids, labels

    def encode_text(self, text: str) -> tuple[list[int], list[int]]:
        """Raw text trained in full: ``tokenizer(text)`` plus EOS."""
        ids = self.tokenizer(text)["input_ids"] + [self.tokenizer.eos_token_id]
        return ids, list(ids)
