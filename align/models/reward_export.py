"""The reward-model export format: writing it (:func:`save_reward_model`) and loading it, or any other reward model
align reads (:func:`load_reward_model`).

Export format (a directory): a standard Hugging Face sequence-classification checkpoint, as TRL's
``RewardTrainer`` and the hub's reward models write it::

    config.json, model.safetensors   ``*ForSequenceClassification``, ``num_labels=1``, LoRA merged, the trained head
                                     as ``score.weight``, ``pad_token_id`` set
    tokenizer files                  the training tokenizer; its pad token is never the EOS (see below)
    reward_model.json                align's own sidecar: format version and how text was encoded in training

``AutoModelForSequenceClassification.from_pretrained(export)`` loads it and scores exactly as align does: the
export names a pad token that is not the EOS (:func:`scoring_pad_token`: the tokenizer's own pad when distinct,
else its unk, a ``pad``/``reserved`` special token, or BOS), so transformers' pooling (the rightmost token that is
not the pad id) picks the EOS that align's pooling reads (see :mod:`align.models.reward`). The head's bias, which a
sequence classifier's ``score`` does not have, is dropped at export with a notice (a non-zero bias is a head brought
from elsewhere: every score shifts by it; pair rankings do not).

Also loaded, read-only: any sequence-classification checkpoint with one label (a peer's) and a training checkpoint
(``.ckpt``) of the reward-model module. The PPO critic can start from a reward model (``critic: {kind: separate,
model: <reward model>}``, :class:`~align.models.critic.CriticSettings`).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from align.errors import AlignConfigError
from align.hub import check_model_source
from align.hub.tiny import is_tiny_sort_rm
from align.models.checkpoints import load_checkpoint, policy_from_checkpoint
from align.models.loading import DType, is_sequence_classifier, torch_dtype
from align.models.policy import PolicyModel
from align.models.reward import RewardModel, score_head

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

FORMAT = "align-reward-model"
FORMAT_VERSION = 2
META_FILE = "reward_model.json"
"""align's sidecar in an export: the format, its version and the encoding of the training data."""
DEFAULT_ENCODING = {"use_chat_template": None, "system_prompt": None, "max_length": 512, "max_prompt_length": None}


def scoring_pad_token(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """A pad token for the export that is not the EOS, so transformers pools on the EOS as align does; None when
    the tokenizer has no other special token."""
    eos = tokenizer.eos_token_id
    specials = [t for t in tokenizer.all_special_tokens if t not in (tokenizer.eos_token, tokenizer.bos_token)]
    candidates: list[str | None] = [
        tokenizer.pad_token,
        tokenizer.unk_token,
        *(t for t in specials if "pad" in t.lower()),
        *(t for t in specials if "reserved" in t.lower()),
        tokenizer.bos_token,
    ]
    for token in candidates:
        if token is not None and tokenizer.convert_tokens_to_ids(token) not in (None, eos):
            return token
    return None


def sequence_classifier(
    policy: PolicyModel, dtype: DType | str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)``: the reward model as a transformers ``*ForSequenceClassification`` with ``num_labels=1``,
    LoRA merged, the trained head as ``score``, and a tokenizer whose pad token is not the EOS."""
    from transformers import AutoModelForSequenceClassification

    head = score_head(policy, "reward model export").proj
    tokenizer = copy.deepcopy(policy.tokenizer)
    pad = scoring_pad_token(tokenizer)
    if pad is None:
        log.warning(
            "reward model export: the tokenizer has no special token besides EOS to pad with; transformers "
            "will score the token before a final EOS, align the EOS itself"
        )
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
        log.warning(
            "reward model export: the head's bias %.3g is dropped (a sequence classifier has none); every "
            "score shifts by it, pair rankings do not",
            bias,
        )
    with torch.no_grad():
        model.score.weight.copy_(head.weight.detach().to(model.score.weight.dtype))
    return model.eval(), tokenizer


def save_reward_model(
    policy: PolicyModel,
    output_dir: str | Path,
    encoding: dict[str, Any] | None = None,
    dtype: DType | str | None = None,
) -> Path:
    """Write the export format above; ``encoding`` is :meth:`PreferenceDataModule.encoding_spec`."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = sequence_classifier(policy, dtype)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "encoding": dict(DEFAULT_ENCODING, **(encoding or {})),
        "base_model": policy.spec["model"],
    }
    tmp = output_dir / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(output_dir / META_FILE)
    return output_dir


def load_reward_model(path: str | Path, dtype: DType = "float32") -> tuple[RewardModel, dict[str, Any]]:
    """``(reward model, encoding spec)`` from a sequence-classification checkpoint (align's export or a peer's) or
    an align ``.ckpt``."""
    if is_tiny_sort_rm(path):
        path = check_model_source(str(path), what="reward model path")
    path = Path(path).expanduser()
    if not path.exists():
        raise AlignConfigError(
            f"reward model path: '{path}' does not exist; expected a sequence-classification "
            "checkpoint directory (a reward-model export) or a .ckpt written by the reward-model "
            "recipe"
        )
    if not path.is_dir():
        return _load_checkpoint(path, dtype)
    if is_sequence_classifier(path):
        return _load_sequence_classifier(path, dtype)
    raise AlignConfigError(
        f"reward model path: '{path}' is not a reward-model export: its config.json names no "
        "*ForSequenceClassification architecture (a trained RM run writes one to <run dir>/export)"
    )


def _encoding(path: Path) -> dict[str, Any]:
    meta_path = path / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta and (meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION):
        raise AlignConfigError(
            f"reward model path: '{path}': unsupported {META_FILE} format {meta.get('format')!r} "
            f"version {meta.get('version')!r}; expected {FORMAT!r} version {FORMAT_VERSION}"
        )
    return dict(DEFAULT_ENCODING, **meta.get("encoding", {}))


def _load_sequence_classifier(path: Path, dtype: DType) -> tuple[RewardModel, dict[str, Any]]:
    from transformers import AutoModelForSequenceClassification

    from align.hub import load_tokenizer

    encoding = _encoding(path)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch_dtype(dtype))
    except (OSError, ValueError) as err:
        raise AlignConfigError(f"reward model path: could not load '{path}': {err}") from err
    if model.config.num_labels != 1 or not isinstance(getattr(model, "score", None), nn.Linear):
        raise AlignConfigError(
            f"reward model path: '{path}' has {model.config.num_labels} labels; a reward model "
            "has one (num_labels=1) and a linear 'score' head"
        )
    return RewardModel.from_sequence_classifier(model, load_tokenizer(str(path))), encoding


def _load_checkpoint(path: Path, dtype: DType) -> tuple[RewardModel, dict[str, Any]]:
    checkpoint = load_checkpoint(path)
    if "reward" not in (checkpoint.get("align") or {}):
        raise AlignConfigError(
            f"reward model path: '{path}' is not a reward-model checkpoint (no align reward "
            "metadata); expected a .ckpt written by align.modules.reward.RewardModule"
        )
    policy = policy_from_checkpoint(path, checkpoint=checkpoint, reward_head=True, dtype=dtype)
    return RewardModel.from_policy(policy), dict(DEFAULT_ENCODING, **checkpoint["align"]["reward"].get("encoding", {}))
