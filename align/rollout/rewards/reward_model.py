"""A trained reward model as a reward: :class:`RewardModelScorer` encodes each prompt and completion as the model's
training data was encoded and scores them (the model, its export and loading: :mod:`align.models.reward`,
:mod:`align.models.reward_export`); an RL module's ``reward_model`` block (:class:`RewardModelSpec`) names one, loaded
at setup or on first call (:class:`LazyRewardModel`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from align.data.prompts import REWARD_INPUTS
from align.errors import INIT_KWARGS, AlignConfigError
from align.models.loading import DType, torch_dtype
from align.models.reward_export import load_reward_model

log = logging.getLogger(__name__)


class RewardModelScorer:
    """A trained reward model as a reward callable: ``fn(prompts, completions, **columns) -> list[float]``.

    What it scores (docs/rewards.md, "What a reward model sees"):

    * the whole prompt conversation when the caller gives it (``prompt_messages``, as every RL module does):
      system prompt and earlier turns included; otherwise the prompt text as one user message. The saved
      ``system_prompt`` is added only to a conversation that has none.
    * the exact token ids the policy sampled (``completion_ids``), when its tokenizer decodes them to the
      completion's text (the reward model shares the policy's tokenizer). A completion cut off at
      ``max_new_tokens`` is then scored as it is, without an end of turn, as are its re-encoded text
      (``completion_truncated``). Otherwise the completion's text is encoded as the assistant's reply.

    Encoding follows the chat template and settings the model was trained with (saved in the export or
    checkpoint). Scoring runs in batches, in eval mode and without gradients, so the same inputs always give the
    same scores. Too-long prompts keep their last tokens, as in training.

    In a GRPO config's reward list::

        rewards:
          - fn: align.rewards.RewardModelScorer
            init_kwargs: {path: runs/rm/version_0/export, batch_size: 32}
            name: rm
    """

    def __init__(
        self,
        path: str,
        batch_size: int = 16,
        device: str | None = None,
        dtype: DType = "float32",
        max_length: int | None = None,
        system_prompt: str | None = None,
    ):
        """
        Args:
            path: A reward-model export directory (``<run dir>/export``), any Hugging Face sequence-classification
                checkpoint with one label (e.g. one written by TRL's ``RewardTrainer``), a reward-model ``.ckpt``,
                or ``tiny-sort-rm`` (the shipped sort-task reward model).
            batch_size: Sequences scored per forward pass.
            device: ``cpu``, ``cuda``, ``cuda:1``...; null picks CUDA when available.
            dtype: Weight dtype for scoring.
            max_length: Longest prompt + completion in tokens; null uses the training setting.
            system_prompt: System message for every prompt; null uses the training setting.
        """
        from align.data.chat import ChatEncoder

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise AlignConfigError(f"{INIT_KWARGS}.batch_size: expected an integer >= 1, got {batch_size!r}")
        try:
            torch_dtype(dtype)
        except AlignConfigError:
            raise AlignConfigError(
                f"{INIT_KWARGS}.dtype: expected auto, float32, bfloat16 or float16, got {dtype!r}"
            ) from None
        self.path = str(path)
        self.batch_size = batch_size
        model, self.encoding = load_reward_model(path, dtype)
        if max_length is not None:
            self.encoding["max_length"] = max_length
        if system_prompt is not None:
            self.encoding["system_prompt"] = system_prompt
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        td = torch_dtype(dtype)
        self.model = model.to(self.device, td if isinstance(td, torch.dtype) else None).eval()
        self.model.requires_grad_(False)
        self.tokenizer = model.tokenizer
        self.encoder = ChatEncoder(self.tokenizer, self.encoding["use_chat_template"])
        self.__name__ = f"RewardModelScorer({self.path})"

    def encode(
        self,
        prompt: str | list[dict],
        completion: str,
        completion_ids: list[int] | None = None,
        truncated: bool = False,
    ) -> tuple[list[int], list[int]]:
        """``(prompt_ids, completion_ids)`` as the training data layer builds them, after truncation.

        ``prompt``: the prompt text (one user message) or the whole conversation. ``completion_ids``: the ids the
        policy sampled, used as they are when this tokenizer decodes them to ``completion``. ``truncated``: the
        completion was cut off, so no end of turn follows it.
        """
        from align.data.preference import encode_prompt, encode_response, fit_prompt

        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.encoding.get("system_prompt") and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": self.encoding["system_prompt"]}] + messages
        prompt_ids, prompt_text = encode_prompt(self.encoder, messages)
        if completion_ids is not None and self._shares_tokenizer(completion_ids, completion):
            response = list(completion_ids)
        else:
            response = encode_response(
                self.encoder, prompt_ids, messages, completion, "<reward input>", None, "completion", prompt_text
            )
            if truncated and response and response[-1] == self.tokenizer.eos_token_id:
                response = response[:-1]  # the policy never ended its turn: neither does the scored text
        max_length = self.encoding["max_length"]
        if len(response) >= max_length:
            log.warning(
                "RewardModelScorer: a completion of %d tokens is cut to max_length - 1 = %d",
                len(response),
                max_length - 1,
            )
            response = response[: max_length - 1]
        keep = fit_prompt(prompt_ids, len(response), max_length, self.encoding.get("max_prompt_length"))
        return prompt_ids[len(prompt_ids) - keep :], response

    def _shares_tokenizer(self, ids: list[int], text: str) -> bool:
        tokenizer = self.tokenizer
        if not ids or max(ids) >= len(tokenizer):
            return False
        return tokenizer.decode(ids, skip_special_tokens=True) == text

    @torch.inference_mode()
    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        prompt_messages: Sequence[list] | None = None,
        completion_ids: Sequence[list[int]] | None = None,
        completion_truncated: Sequence[bool] | None = None,
        **columns: Any,
    ) -> list[float]:
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"RewardModelScorer: {len(prompts)} prompts but {n} completions")
        for name, given in (
            ("prompt_messages", prompt_messages),
            ("completion_ids", completion_ids),
            ("completion_truncated", completion_truncated),
        ):
            if given is not None and len(given) != n:
                raise ValueError(f"RewardModelScorer: {len(given)} {name} for {n} completions")
        pad = self.tokenizer.pad_token_id
        scores: list[float] = []
        for start in range(0, n, self.batch_size):
            rows = range(start, min(start + self.batch_size, n))
            pairs = [
                self.encode(
                    prompt_messages[i] if prompt_messages is not None else prompts[i],
                    completions[i],
                    completion_ids[i] if completion_ids is not None else None,
                    bool(completion_truncated[i]) if completion_truncated is not None else False,
                )
                for i in rows
            ]
            T = max(len(p) + len(c) for p, c in pairs)
            input_ids = torch.full((len(pairs), T), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(pairs), T), dtype=torch.long)
            for i, (p, c) in enumerate(pairs):
                input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
                attention_mask[i, : len(p) + len(c)] = 1
            out = self.model(input_ids.to(self.device), attention_mask.to(self.device))
            scores += out.float().cpu().tolist()
        return scores


@dataclass(frozen=True)
class RewardModelSpec:
    """A trained reward model used as the training reward named ``rm``."""

    path: str
    """An export directory (any ``*ForSequenceClassification`` checkpoint), a reward-model ``.ckpt``, or
    ``tiny-sort-rm``; loaded at setup, so a config instantiates without its weights."""
    weight: float = 1.0
    """Weight of the reward-model score in the training reward."""
    batch_size: int = 32
    """Sequences per reward-model forward pass."""

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise AlignConfigError(f"model.reward_model.batch_size: expected an integer >= 1, got {self.batch_size!r}")
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight)):
            raise AlignConfigError(f"model.reward_model.weight: expected a finite number, got {self.weight!r}")


class LazyRewardModel:
    """A :class:`RewardModelScorer` built by :meth:`load` (at setup) or on first call, so that building a module
    from a config does not need the reward model's weights."""

    def __init__(self, path: str, batch_size: int = 32):
        self.path, self.batch_size = path, batch_size
        self.scorer: RewardModelScorer | None = None

    def load(self, device: str | None = None) -> RewardModelScorer:
        if self.scorer is None:
            self.scorer = RewardModelScorer(self.path, batch_size=self.batch_size, device=device)
        return self.scorer

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        inputs = {k: columns[k] for k in REWARD_INPUTS if k in columns}  # the data's own columns are not used
        return self.load()(prompts, completions, **inputs)
