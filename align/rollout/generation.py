"""Generating with a trained policy: what ``align generate`` and ``align chat`` run, and the policy and prompts
``align evaluate`` reads (its scoring is :mod:`align.rollout.evaluation`; docs/generation.md).

Everything goes through the parts training uses, so a number printed is the number training would print:

* the model is a :class:`~align.models.PolicyModel` rebuilt from an align checkpoint (as ``align export`` does,
  :func:`align.models.checkpoints.policy_from_checkpoint`), or built from an exported folder or a model id;
* prompts are read and encoded by the training reader (:func:`align.data.io.read_rows`,
  :func:`align.data.prompts.encode_prompt_rows`), so they get the same chat template and the same one-line errors;
* completions are sampled by the training generation engine (:mod:`align.rollout.engine`, ``sampling.engine``);
* ``align evaluate`` samples and scores through a :class:`~align.rollout.sampler.Sampler` and sums with the
  :class:`~align.rollout.evaluation.Evaluator` of training's held-out passes: with one greedy completion per prompt,
  its accuracy is what an RL run logs as ``val/accuracy``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from align.data.chat import ChatEncoder
from align.data.io import Rows, read_rows
from align.data.prompts import PromptBatch, PromptExample, collate_prompts, encode_prompt_rows
from align.errors import AlignConfigError, AlignDataError
from align.models.loading import DType
from align.models.policy import PolicyModel
from align.rollout.engine import GenerationEngine, SamplingConfig, make_engine
from align.rollout.types import Rollout

__all__ = [
    "PromptFile",
    "check_completion_field",
    "chat_reply",
    "completion_rows",
    "device_of",
    "generate_batches",
    "load_policy",
    "read_prompts",
    "reference_policy",
    "sampling_config",
    "seeded_generator",
]

REFERENCE = "reference"
"""``--baseline reference``: the model the checkpoint's run started from."""


# ---------------------------------------------------------------------------- the model
def _is_checkpoint(source: str) -> bool:
    path = Path(source).expanduser()
    return path.suffix == ".ckpt" or (path.is_file() and path.suffix != ".gguf")


def _checkpoint(source: str, what: str) -> dict:
    from align.models.checkpoints import is_reward_checkpoint, load_checkpoint

    path = Path(source).expanduser()
    if not path.exists():
        raise AlignConfigError(f"{what}: checkpoint '{source}' does not exist")
    try:
        checkpoint = load_checkpoint(path)
    except Exception as err:  # noqa: BLE001 - torch.load raises many types for a file that is not a checkpoint
        raise AlignConfigError(
            f"{what}: '{source}' is not a readable checkpoint ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:200]})"
        ) from None
    if is_reward_checkpoint(checkpoint):
        raise AlignConfigError(
            f"{what}: '{source}' is a reward-model checkpoint; it scores completions (pass it "
            "as --reward_model) but does not generate them"
        )
    return checkpoint


def _ready(policy: PolicyModel, device: str | None) -> PolicyModel:
    policy.requires_grad_(False).eval()
    return policy.to(device) if device else policy


def load_policy(
    source: str, device: str | None = None, dtype: DType | None = None, what: str = "--model"
) -> PolicyModel:
    """The policy in ``source``, in eval mode without gradients, on ``device`` (default: CPU).

    ``source`` is an align checkpoint (a ``.ckpt`` file written by any align run: the policy is rebuilt from the
    spec stored in it, LoRA included), an exported Hugging Face folder (``align export``), or a model id
    :class:`~align.models.PolicyModel` accepts (``tiny-sort``, ``smollm2-135m-instruct``, a ``.gguf`` file, a hub
    id). ``dtype`` overrides the weight dtype (default: the run's for a checkpoint, float32 otherwise)."""
    from align.models.checkpoints import policy_from_checkpoint

    if _is_checkpoint(source):
        checkpoint = _checkpoint(source, what)
        return _ready(policy_from_checkpoint(source, checkpoint=checkpoint, dtype=dtype), device)
    options: dict[str, Any] = {"dtype": dtype} if dtype else {}
    return _ready(PolicyModel(model=source, **options), device)


def reference_policy(source: str, device: str | None = None, dtype: DType | None = None) -> PolicyModel:
    """The model the run of checkpoint ``source`` started from: its ``reference_model`` when it had one, else
    its base ``model`` (for a LoRA run, the model without the adapter), with the run's tokenizer."""
    if not _is_checkpoint(source):
        raise AlignConfigError(
            f"--baseline {REFERENCE}: only an align checkpoint records the model its run started "
            f"from, and '{source}' is not one; give the baseline's path or model id instead"
        )
    spec = _checkpoint(source, "--model")["align"]["policy"]
    keep = ("tokenizer", "trust_remote_code", "revision", "pad_equals_eos", "seed", "attn_implementation")
    settings = {k: spec[k] for k in keep if k in spec}
    settings["dtype"] = dtype or spec.get("dtype", "float32")
    return _ready(PolicyModel(model=spec.get("reference_model") or spec["model"], **settings), device)


# ---------------------------------------------------------------------------- prompts
@dataclass
class PromptFile:
    """A prompt file read as training reads it: its rows as written and their encoded examples, in order."""

    source: str
    rows: Rows  # the rows as written (every column), numbered as in the file
    examples: list[PromptExample]  # one per row: token ids with the chat template applied, text, columns
    prompt_field: str


def _prompt_field(rows: Sequence[dict], prompt_field: str | None) -> str:
    """``prompt_field`` when given; else ``prompt``, or ``messages`` for rows that have that and no ``prompt``."""
    if prompt_field:
        return prompt_field
    return "messages" if "prompt" not in rows[0] and "messages" in rows[0] else "prompt"


def read_prompts(
    source: str,
    tokenizer,
    prompt_field: str | None = None,
    system_prompt: str | None = None,
    split: str | None = None,
    use_chat_template: bool | None = None,
) -> PromptFile:
    """Read and encode a prompt file (any source the data modules read: jsonl, json, parquet, csv, a
    ``save_to_disk`` folder, ``align:...`` or a hub dataset) with the training reader and its row errors.

    ``split``: null takes the held-out split a run validates on (``train`` for a file, ``validation`` for a hub
    dataset). ``use_chat_template``: null applies the tokenizer's template when it has one, as training does."""
    rows = read_rows(source, split, "--split")
    field_name = _prompt_field(rows, prompt_field)
    examples = encode_prompt_rows(
        rows,
        source,
        ChatEncoder(tokenizer, use_chat_template),
        prompt_field=field_name,
        max_prompt_length=None,
        system_prompt=system_prompt,
    )
    return PromptFile(source, rows, examples, field_name)


# ---------------------------------------------------------------------------- sampling
def sampling_config(
    max_new_tokens: int = 64, temperature: float | None = None, top_p: float = 1.0, top_k: int = 0, n: int = 1
) -> SamplingConfig:
    """The rollout engine's settings; ``temperature`` null is greedy (0) for one sample per prompt and 1 for
    several (``n`` greedy samples would be ``n`` copies of one). Bad values fail with one line."""
    if n < 1:
        raise AlignConfigError(f"--n: expected >= 1 samples per prompt, got {n}")
    if temperature is None:
        temperature = 0.0 if n == 1 else 1.0
    try:
        return SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    except AlignConfigError as err:
        raise AlignConfigError(str(err).replace(f"{SamplingConfig.where}.", "--")) from None


def device_of(policy: PolicyModel) -> torch.device:
    """The device of the policy's weights."""
    return next(policy.parameters()).device


def seeded_generator(seed: int, policy: PolicyModel) -> torch.Generator:
    """A sampling generator on the policy's device, seeded with ``seed``."""
    return torch.Generator(device=device_of(policy)).manual_seed(seed)


def generate_batches(
    policy: PolicyModel,
    examples: Sequence[PromptExample],
    sampling: SamplingConfig,
    n: int = 1,
    batch_size: int = 8,
    seed: int = 0,
) -> Iterator[tuple[PromptBatch, Rollout]]:
    """``n`` completions of each prompt, ``batch_size`` prompts per rollout, sampled by the training rollout
    engine with a generator seeded by ``seed`` (the same seed gives the same completions). Yields each batch of
    prompts with its rollout, in the order of ``examples``."""
    if batch_size < 1:
        raise AlignConfigError(f"--batch_size: expected >= 1 prompts per batch, got {batch_size}")
    engine = make_engine(sampling)
    generator = seeded_generator(seed, policy)
    for start in range(0, len(examples), batch_size):
        batch = collate_prompts(list(examples[start : start + batch_size]))
        yield batch, engine.generate(policy, batch.prompt_ids, n, generator=generator)


def completion_rows(
    prompts: PromptFile,
    start: int,
    rollout: Rollout,
    completion_field: str = "completion",
) -> list[dict]:
    """One output row per completion of ``rollout`` (prompts ``start, start+1, ...`` of ``prompts``): the input
    row as written, every column kept, with the completion under ``completion_field`` and, for several samples
    per prompt, the sample's index under ``sample``."""
    out = []
    for i, text in enumerate(rollout.texts):
        row = dict(prompts.rows[start + int(rollout.prompt_index[i])])
        row[completion_field] = text
        if rollout.group_size > 1:
            row["sample"] = i % rollout.group_size
        out.append(row)
    return out


def check_completion_field(prompts: PromptFile, completion_field: str) -> None:
    """Fail before generating when an input row already has a column named ``completion_field``: the output
    would overwrite it."""
    for number, row in zip(prompts.rows.numbers, prompts.rows):
        if completion_field in row:
            raise AlignDataError(
                prompts.source,
                number,
                completion_field,
                "no column with the name of the output's "
                "completion field, which would overwrite it (set --completion_field to another name)",
            )


# ---------------------------------------------------------------------------- chat
def chat_reply(
    policy: PolicyModel,
    encoder: ChatEncoder,
    history: list[dict],
    engine: GenerationEngine,
    generator: torch.Generator | None = None,
) -> tuple[str, Rollout]:
    """The assistant's next message after the conversation ``history`` (chat template applied as in training)."""
    rollout = engine.generate(policy, [encoder.prompt_ids(history)], 1, generator=generator)
    return rollout.texts[0], rollout
