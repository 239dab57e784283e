"""Reward models: scoring the last token, the export format, and :class:`RewardModelScorer` (a reward callable).

A reward model here is a :class:`~align.models.policy.PolicyModel` with ``value_head="shared"``: the causal LM's
decoder (LoRA / QLoRA and every loading option of the policy wrapper apply) and a scalar linear head read at the
last real token of each sequence (:func:`sequence_scores`). The LM head is never run.

Export format (a directory, written by :func:`save_reward_model`)::

    config.json, model.safetensors, tokenizer files   a merged Hugging Face causal LM (LoRA folded in)
    reward_head.safetensors                           the head: ``proj.weight`` (1, H), ``proj.bias`` (1,)
    reward_model.json                                 format version and how text was encoded in training

The backbone directory is an ordinary causal LM, so it also serves as a PPO critic's starting point
(``PolicyModel(value_head="separate", critic_model=<export>)``). A training checkpoint (``.ckpt``) loads too.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from align.errors import AlignConfigError
from align.logprobs import last_valid_index
from align.models.loading import DType, LoraSettings, check_model_source, torch_dtype
from align.models.tiny import is_tiny_sort_rm
from align.models.policy import PolicyModel, position_ids_from_mask

log = logging.getLogger(__name__)

FORMAT = "align-reward-model"
FORMAT_VERSION = 1
META_FILE = "reward_model.json"
HEAD_FILE = "reward_head.safetensors"
DEFAULT_ENCODING = {"use_chat_template": None, "system_prompt": None, "max_length": 512, "max_prompt_length": None}


def sequence_scores(policy: PolicyModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar score of each sequence, read at its last real token. ``(N, T) -> (N,)`` float32.

    Padding may sit on either side (positions come from the mask). Only the decoder and the head run.
    """
    if policy.value_head is None:
        raise AlignConfigError("reward model: the policy needs value_head='shared' (the scalar head)")
    decoder = policy.model.get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids_from_mask(attention_mask), use_cache=False).last_hidden_state  # (N, T, H)
    last = last_valid_index(attention_mask)  # (N,)
    if bool((last < 0).any()):
        raise ValueError("sequence_scores: a row has no real token")
    picked = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (N, H)
    return policy.value_head(picked)  # (N,)


def init_reward_head(policy: PolicyModel, generator: torch.Generator | None = None) -> None:
    """Small random head weights, so an untrained model ranks pairs at chance instead of tying every pair at 0."""
    head = policy.value_head.proj
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / (head.in_features + 1) ** 0.5, generator=generator)
        head.bias.zero_()


def save_reward_model(policy: PolicyModel, output_dir: str | Path, encoding: dict | None = None,
                      dtype: DType | None = None) -> Path:
    """Write the export format above; ``encoding`` is :meth:`PreferenceDataModule.encoding_spec`."""
    from safetensors.torch import save_file

    output_dir = Path(output_dir)
    policy.save_pretrained(output_dir, dtype=dtype)
    head = {k: v.detach().float().cpu().contiguous() for k, v in policy.value_head.state_dict().items()}
    save_file(head, str(output_dir / HEAD_FILE))
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "encoding": dict(DEFAULT_ENCODING, **(encoding or {})),
            "base_model": policy.spec["model"]}
    tmp = output_dir / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(output_dir / META_FILE)
    return output_dir


def load_reward_model(path: str | Path, dtype: DType = "float32") -> tuple[PolicyModel, dict]:
    """``(policy with its head, encoding spec)`` from an export directory or an align ``.ckpt``."""
    if is_tiny_sort_rm(path):
        path = check_model_source(str(path), what="reward model path")
    path = Path(path).expanduser()
    if not path.exists():
        raise AlignConfigError(f"reward model path: '{path}' does not exist; expected an export directory "
                               f"(with {META_FILE}) or a .ckpt written by the reward-model recipe")
    if path.is_dir():
        return _load_export(path, dtype)
    return _load_checkpoint(path, dtype)


def _load_export(path: Path, dtype: DType) -> tuple[PolicyModel, dict]:
    from safetensors.torch import load_file

    meta_path = path / META_FILE
    if not meta_path.exists() or not (path / HEAD_FILE).exists():
        raise AlignConfigError(f"reward model path: '{path}' has no {META_FILE} / {HEAD_FILE}; it is not a reward-"
                               "model export (a trained RM run writes one to <run dir>/export)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise AlignConfigError(f"reward model path: '{path}': unsupported format {meta.get('format')!r} version "
                               f"{meta.get('version')!r}; expected {FORMAT!r} version {FORMAT_VERSION}")
    policy = PolicyModel(model=str(path), dtype=dtype, value_head="shared")
    policy.value_head.load_state_dict(load_file(str(path / HEAD_FILE)))
    return policy, dict(DEFAULT_ENCODING, **meta.get("encoding", {}))


def _load_checkpoint(path: Path, dtype: DType) -> tuple[PolicyModel, dict]:
    from align.models.export import load_checkpoint

    checkpoint = load_checkpoint(path)
    meta = checkpoint.get("align") or {}
    if "policy" not in meta or "reward" not in meta:
        raise AlignConfigError(f"reward model path: '{path}' is not a reward-model checkpoint (no align reward "
                               "metadata); expected a .ckpt written by align.modules.reward.RewardModule")
    spec = dict(meta["policy"], value_head="shared", reference_model=None, critic_model=None, dtype=dtype)
    if spec.get("lora"):
        spec["lora"] = LoraSettings(**spec["lora"])
    policy = PolicyModel(**spec)
    state = {k[len("policy."):]: v for k, v in checkpoint["state_dict"].items()
             if k.startswith(("policy.model.", "policy.value_head."))}
    missing, unexpected = policy.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.startswith(("model.", "value_head."))]
    if missing or unexpected:
        raise AlignConfigError(f"reward model path: '{path}' does not match its policy spec (missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]})")
    return policy, dict(DEFAULT_ENCODING, **meta["reward"].get("encoding", {}))


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
            path: A reward-model export directory (``<run dir>/export``), a reward-model ``.ckpt``, or
                ``tiny-sort-rm`` (the shipped sort-task reward model).
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
        policy, self.encoding = load_reward_model(path, dtype)
        if max_length is not None:
            self.encoding["max_length"] = max_length
        if system_prompt is not None:
            self.encoding["system_prompt"] = system_prompt
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        td = torch_dtype(dtype)
        self.policy = policy.to(self.device, td if isinstance(td, torch.dtype) else None).eval()
        self.policy.requires_grad_(False)
        self.encoder = ChatEncoder(policy.tokenizer, self.encoding["use_chat_template"])
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
            if truncated and response and response[-1] == self.policy.tokenizer.eos_token_id:
                response = response[:-1]  # the policy never ended its turn: neither does the scored text
        max_length = self.encoding["max_length"]
        if len(response) >= max_length:
            log.warning("RewardModelScorer: a completion of %d tokens is cut to max_length - 1 = %d", len(response),
                        max_length - 1)
            response = response[: max_length - 1]
        keep = fit_prompt(prompt_ids, len(response), max_length, self.encoding.get("max_prompt_length"))
        return prompt_ids[len(prompt_ids) - keep:], response

    def _shares_tokenizer(self, ids: list[int], text: str) -> bool:
        tokenizer = self.policy.tokenizer
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
        pad = self.policy.tokenizer.pad_token_id
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
            out = sequence_scores(self.policy, input_ids.to(self.device), attention_mask.to(self.device))
            scores += out.float().cpu().tolist()
        return scores
