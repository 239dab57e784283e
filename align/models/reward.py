"""Reward models: scoring the last token, the export format, and :class:`RewardModelScorer` (a reward callable).

A reward model is trained as a :class:`~align.models.policy.PolicyModel` with a shared critic (``critic: {kind:
shared}``): the causal LM's decoder (LoRA / QLoRA and every loading option of the policy wrapper apply) and the
critic's scalar linear head, read at the last real token of each sequence (:func:`sequence_scores`). The LM head
is never run.

Export format (a directory, written by :func:`save_reward_model`): a standard Hugging Face sequence-classification
checkpoint, as TRL's ``RewardTrainer`` and the hub's reward models write it::

    config.json, model.safetensors   ``*ForSequenceClassification``, ``num_labels=1``, LoRA merged, the trained head
                                     as ``score.weight``, ``pad_token_id`` set
    tokenizer files                  the training tokenizer; its pad token is never the EOS (see below)
    reward_model.json                align's own sidecar: format version and how text was encoded in training

``AutoModelForSequenceClassification.from_pretrained(export)`` loads it and scores exactly as align does.

Where the score is read. transformers' sequence classifiers take the rightmost token that is not
``config.pad_token_id``; align reads the last real token of the attention mask, which is the response's EOS.
When ``pad == eos`` (SmolLM2, many chat models) the two differ: transformers skips a final EOS as if it were
padding, and so cannot tell a finished answer from one cut off at the same token. The export therefore names a
pad token that is not the EOS (the tokenizer's own pad when distinct, else its unk, a ``pad``/``reserved``
special token, or BOS), so the two rules pick the same token. Loading any sequence-classification checkpoint
(a peer's included), align reads the score where transformers does: the last real token that is not the
model's pad id. For align's exports that is the mask's last token; for a model trained by TRL with
``pad == eos`` it is the token before the final EOS, as in its training.

The head's bias: a sequence classifier's ``score`` has none. Bradley-Terry training cannot move a constant
offset, so :class:`~align.modules.reward.RewardModule` keeps the bias frozen at 0; a non-zero bias (a head
brought from elsewhere) is dropped at export with a notice (every score shifts by it; pair rankings do not).

Also loaded, read-only: a training checkpoint (``.ckpt``) of the reward-model module. The PPO critic can start
from a reward model (``critic: {kind: separate, model: <reward model>}``, :class:`~align.models.critic.CriticSettings`).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from align.errors import AlignConfigError
from align.hub import check_model_source
from align.hub.tiny import is_tiny_sort_rm
from align.core.masks import last_valid_index
from align.models.checkpoints import load_checkpoint, policy_from_checkpoint
from align.models.critic import ValueHead
from align.models.loading import DType, is_sequence_classifier, torch_dtype
from align.models.policy import PolicyModel
from align.models.scoring import position_ids_from_mask
from align.core.packing import pack_scored_rows

log = logging.getLogger(__name__)

FORMAT = "align-reward-model"
FORMAT_VERSION = 2
META_FILE = "reward_model.json"
"""align's sidecar in an export: the format, its version and how text was encoded in training."""
DEFAULT_ENCODING = {"use_chat_template": None, "system_prompt": None, "max_length": 512, "max_prompt_length": None}


def last_scored_index(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      skip_token_id: int | None = None) -> torch.Tensor:
    """``(N,)`` index of the token a sequence's score is read at: the last real token (attention mask) that is
    not ``skip_token_id``. With ``skip_token_id`` = a model's ``config.pad_token_id`` this is the token
    transformers' ``*ForSequenceClassification`` pools on real-token inputs; a row made only of that token
    falls back to its last real token."""
    real = attention_mask.bool()  # (N, T)
    last = last_valid_index(real)
    if skip_token_id is not None:
        kept = last_valid_index(real & (input_ids != skip_token_id))
        last = torch.where(kept >= 0, kept, last)
    if bool((last < 0).any()):
        raise ValueError("sequence_scores: a row has no real token")
    return last


def pooled_scores(decoder: nn.Module, head: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  skip_token_id: int | None = None, padding_free: bool = False) -> torch.Tensor:
    """Run ``decoder`` and ``head`` at each row's scored token (:func:`last_scored_index`). ``(N, T) -> (N,)``.

    Padding may sit on either side: positions come from the mask. ``padding_free`` runs the decoder over the rows'
    real tokens laid end to end (:func:`align.core.packing.pack_scored_rows`) instead of the padded rows: the same
    scores to float rounding, without the arithmetic of the padding.
    """
    last = last_scored_index(input_ids, attention_mask, skip_token_id)  # (N,)
    if padding_free:
        packed = pack_scored_rows(input_ids, attention_mask, torch.zeros_like(attention_mask))
        hidden = decoder(input_ids=packed.input_ids, position_ids=packed.position_ids,  # (K, C, H)
                         use_cache=False).last_hidden_state
        return head(hidden.reshape(-1, hidden.shape[-1])[packed.locate(last)])  # (N,)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask,  # (N, T, H)
                     position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state
    return head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])  # (N,)


def score_head(policy: PolicyModel, what: str = "reward model") -> ValueHead:
    """The reward model's scalar head: the head of ``policy``'s shared critic."""
    if policy.critic is None or policy.critic.separate:
        raise AlignConfigError(f"{what}: the policy needs a shared critic (critic: {{kind: shared}}, the scalar head)")
    return policy.critic.head


def sequence_scores(policy: PolicyModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    padding_free: bool = False) -> torch.Tensor:
    """Scalar score of each sequence, read at its last real token. ``(N, T) -> (N,)`` float32.

    Only the decoder and the head run; ``padding_free`` as in :func:`pooled_scores`.
    """
    return pooled_scores(policy.model.get_decoder(), score_head(policy), input_ids, attention_mask,
                         padding_free=padding_free)


class ScalarHead(nn.Module):
    """A sequence classifier's ``score`` layer (``Linear(H, 1)``) as a head giving ``(..., H) -> (...)`` float32."""

    def __init__(self, score: nn.Linear):
        super().__init__()
        self.score = score

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden.to(self.score.weight.dtype)).squeeze(-1).float()


class RewardModel(nn.Module):
    """What scoring needs, whatever the source: a decoder, a scalar head, the tokenizer and the pooling rule.

    ``skip_token_id``: the pad id a sequence classifier skips when it pools (see the module docstring);
    None for a model trained by align from a checkpoint, which reads the mask's last token.
    """

    def __init__(self, decoder: nn.Module, head: nn.Module, tokenizer, skip_token_id: int | None = None):
        super().__init__()
        self.decoder, self.head = decoder, head
        self.tokenizer = tokenizer
        self.skip_token_id = skip_token_id

    @classmethod
    def from_policy(cls, policy: PolicyModel) -> "RewardModel":
        return cls(policy.model.get_decoder(), score_head(policy), policy.tokenizer)

    @classmethod
    def from_sequence_classifier(cls, model: nn.Module, tokenizer) -> "RewardModel":
        return cls(getattr(model, model.base_model_prefix), ScalarHead(model.score), tokenizer,
                   model.config.get_text_config().pad_token_id)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return pooled_scores(self.decoder, self.head, input_ids, attention_mask, self.skip_token_id)


def init_reward_head(policy: PolicyModel, generator: torch.Generator | None = None) -> None:
    """Small random head weights, so an untrained model ranks pairs at chance instead of tying every pair at 0."""
    head = score_head(policy).proj
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / (head.in_features + 1) ** 0.5, generator=generator)
        head.bias.zero_()


def scoring_pad_token(tokenizer) -> str | None:
    """A pad token for the export that is not the EOS, so transformers pools on the EOS as align does; None when
    the tokenizer has no other special token."""
    eos = tokenizer.eos_token_id
    specials = [t for t in tokenizer.all_special_tokens if t not in (tokenizer.eos_token, tokenizer.bos_token)]
    candidates = [tokenizer.pad_token, tokenizer.unk_token,
                  *(t for t in specials if "pad" in t.lower()), *(t for t in specials if "reserved" in t.lower()),
                  tokenizer.bos_token]
    for token in candidates:
        if token is not None and tokenizer.convert_tokens_to_ids(token) not in (None, eos):
            return token
    return None


def sequence_classifier(policy: PolicyModel, dtype: DType | None = None) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)``: the reward model as a transformers ``*ForSequenceClassification`` with ``num_labels=1``,
    LoRA merged, the trained head as ``score``, and a tokenizer whose pad token is not the EOS."""
    from transformers import AutoModelForSequenceClassification

    head = score_head(policy, "reward model export").proj
    tokenizer = copy.deepcopy(policy.tokenizer)
    pad = scoring_pad_token(tokenizer)
    if pad is None:
        log.warning("reward model export: the tokenizer has no special token besides EOS to pad with; transformers "
                    "will score the token before a final EOS, align the EOS itself")
    else:
        tokenizer.pad_token = pad
    merged = policy.merged_model(dtype)
    config = copy.deepcopy(merged.config)
    config.num_labels, config.architectures = 1, None
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForSequenceClassification.from_config(config, dtype=next(merged.parameters()).dtype)
    getattr(model, model.base_model_prefix).load_state_dict(merged.get_decoder().state_dict())
    bias = float(head.bias.detach().float().item()) if head.bias is not None else 0.0
    if bias != 0.0:
        log.warning("reward model export: the head's bias %.3g is dropped (a sequence classifier has none); every "
                    "score shifts by it, pair rankings do not", bias)
    with torch.no_grad():
        model.score.weight.copy_(head.weight.detach().to(model.score.weight.dtype))
    return model.eval(), tokenizer


def save_reward_model(policy: PolicyModel, output_dir: str | Path, encoding: dict | None = None,
                      dtype: DType | None = None) -> Path:
    """Write the export format above; ``encoding`` is :meth:`PreferenceDataModule.encoding_spec`."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = sequence_classifier(policy, dtype)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "encoding": dict(DEFAULT_ENCODING, **(encoding or {})),
            "base_model": policy.spec["model"]}
    tmp = output_dir / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(output_dir / META_FILE)
    return output_dir


def load_reward_model(path: str | Path, dtype: DType = "float32") -> tuple[RewardModel, dict]:
    """``(reward model, encoding spec)`` from a sequence-classification checkpoint (align's export or a peer's) or
    an align ``.ckpt``."""
    if is_tiny_sort_rm(path):
        path = check_model_source(str(path), what="reward model path")
    path = Path(path).expanduser()
    if not path.exists():
        raise AlignConfigError(f"reward model path: '{path}' does not exist; expected a sequence-classification "
                               "checkpoint directory (a reward-model export) or a .ckpt written by the reward-model "
                               "recipe")
    if not path.is_dir():
        return _load_checkpoint(path, dtype)
    if is_sequence_classifier(path):
        return _load_sequence_classifier(path, dtype)
    raise AlignConfigError(f"reward model path: '{path}' is not a reward-model export: its config.json names no "
                           "*ForSequenceClassification architecture (a trained RM run writes one to <run dir>/export)")


def _encoding(path: Path) -> dict:
    meta_path = path / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta and (meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION):
        raise AlignConfigError(f"reward model path: '{path}': unsupported {META_FILE} format {meta.get('format')!r} "
                               f"version {meta.get('version')!r}; expected {FORMAT!r} version {FORMAT_VERSION}")
    return dict(DEFAULT_ENCODING, **meta.get("encoding", {}))


def _load_sequence_classifier(path: Path, dtype: DType) -> tuple[RewardModel, dict]:
    from transformers import AutoModelForSequenceClassification

    from align.hub import load_tokenizer

    encoding = _encoding(path)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch_dtype(dtype))
    except (OSError, ValueError) as err:
        raise AlignConfigError(f"reward model path: could not load '{path}': {err}") from err
    if model.config.num_labels != 1 or not isinstance(getattr(model, "score", None), nn.Linear):
        raise AlignConfigError(f"reward model path: '{path}' has {model.config.num_labels} labels; a reward model "
                               "has one (num_labels=1) and a linear 'score' head")
    return RewardModel.from_sequence_classifier(model, load_tokenizer(str(path))), encoding


def _load_checkpoint(path: Path, dtype: DType) -> tuple[RewardModel, dict]:
    checkpoint = load_checkpoint(path)
    if "reward" not in (checkpoint.get("align") or {}):
        raise AlignConfigError(f"reward model path: '{path}' is not a reward-model checkpoint (no align reward "
                               "metadata); expected a .ckpt written by align.modules.reward.RewardModule")
    policy = policy_from_checkpoint(path, checkpoint=checkpoint, reward_head=True, dtype=dtype)
    return RewardModel.from_policy(policy), dict(DEFAULT_ENCODING, **checkpoint["align"]["reward"].get("encoding", {}))


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

    def __init__(self, path: str, batch_size: int = 16, device: str | None = None, dtype: DType = "float32",
                 max_length: int | None = None, system_prompt: str | None = None):
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

        if batch_size < 1:
            raise AlignConfigError(f"RewardModelScorer.batch_size: expected >= 1, got {batch_size}")
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

    def encode(self, prompt: str | list[dict], completion: str, completion_ids: list[int] | None = None,
               truncated: bool = False) -> tuple[list[int], list[int]]:
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
            response = encode_response(self.encoder, prompt_ids, messages, completion, "<reward input>", None,
                                       "completion", prompt_text)
            if truncated and response and response[-1] == self.tokenizer.eos_token_id:
                response = response[:-1]  # the policy never ended its turn: neither does the scored text
        max_length = self.encoding["max_length"]
        if len(response) >= max_length:
            log.warning("RewardModelScorer: a completion of %d tokens is cut to max_length - 1 = %d", len(response),
                        max_length - 1)
            response = response[: max_length - 1]
        keep = fit_prompt(prompt_ids, len(response), max_length, self.encoding.get("max_prompt_length"))
        return prompt_ids[len(prompt_ids) - keep:], response

    def _shares_tokenizer(self, ids: list[int], text: str) -> bool:
        tokenizer = self.tokenizer
        if not ids or max(ids) >= len(tokenizer):
            return False
        return tokenizer.decode(ids, skip_special_tokens=True) == text

    @torch.inference_mode()
    def __call__(self, prompts: Sequence[str], completions: Sequence[str], prompt_messages: Sequence[list] | None = None,
                 completion_ids: Sequence[list[int]] | None = None, completion_truncated: Sequence[bool] | None = None,
                 **columns: Any) -> list[float]:
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"RewardModelScorer: {len(prompts)} prompts but {n} completions")
        for name, given in (("prompt_messages", prompt_messages), ("completion_ids", completion_ids),
                            ("completion_truncated", completion_truncated)):
            if given is not None and len(given) != n:
                raise ValueError(f"RewardModelScorer: {len(given)} {name} for {n} completions")
        pad = self.tokenizer.pad_token_id
        scores: list[float] = []
        for start in range(0, n, self.batch_size):
            rows = range(start, min(start + self.batch_size, n))
            pairs = [self.encode(prompt_messages[i] if prompt_messages is not None else prompts[i], completions[i],
                                 completion_ids[i] if completion_ids is not None else None,
                                 bool(completion_truncated[i]) if completion_truncated is not None else False)
                     for i in rows]
            T = max(len(p) + len(c) for p, c in pairs)
            input_ids = torch.full((len(pairs), T), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(pairs), T), dtype=torch.long)
            for i, (p, c) in enumerate(pairs):
                input_ids[i, : len(p) + len(c)] = torch.tensor(p + c)
                attention_mask[i, : len(p) + len(c)] = 1
            out = self.model(input_ids.to(self.device), attention_mask.to(self.device))
            scores += out.float().cpu().tolist()
        return scores
