"""Generation and evaluation with a trained policy: what ``align generate``, ``align evaluate`` and ``align chat``
run (docs/generation.md).

Everything goes through the parts training uses, so a number printed here is the number training would print:

* the model is a :class:`~align.models.PolicyModel` rebuilt from an align checkpoint (as ``align export`` does,
  :func:`align.models.checkpoints.policy_from_checkpoint`), or built from an exported folder or a model id;
* prompts are read and encoded by the training reader (:func:`align.data.io.read_rows`,
  :func:`align.data.prompts.encode_prompt_rows`), so they get the same chat template and the same one-line errors;
* completions are sampled by the training generation engine (:mod:`align.rollout.engine`, ``sampling.engine``);
* rewards are resolved and called as in training (:func:`align.rollout.rewards.training_rewards`,
  :func:`align.rollout.rewards.reward_inputs`), and accuracy is the share of completions whose accuracy reward is at
  least a threshold: with one greedy completion per prompt, exactly what an RL run logs as ``val/accuracy``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from align.data.chat import ChatEncoder
from align.data.io import Rows, read_rows
from align.data.prompts import PromptBatch, PromptExample, collate_prompts, encode_prompt_rows
from align.errors import AlignConfigError, AlignDataError
from align.core.masks import masked_sum
from align.models.policy import PolicyModel
from align.rollout.rewards import CombinedReward, RewardModelSpec, RewardSpec, reward_inputs, training_rewards
from align.rollout.engine import GenerationEngine, make_engine
from align.rollout.sampling import SamplingConfig
from align.rollout.types import Rollout
from align.core.stats import pass_at_k

__all__ = ["PromptFile", "load_policy", "reference_policy", "read_prompts", "sampling_config", "seeded_generator", "generate_batches",
           "completion_rows", "check_completion_field", "parse_reward", "EvalReport", "evaluate", "chat_reply"]

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
        raise AlignConfigError(f"{what}: '{source}' is not a readable checkpoint ({type(err).__name__}: "
                               f"{' '.join(str(err).split())[:200]})") from None
    if is_reward_checkpoint(checkpoint):
        raise AlignConfigError(f"{what}: '{source}' is a reward-model checkpoint; it scores completions (pass it "
                               "as --reward_model) but does not generate them")
    return checkpoint


def _ready(policy: PolicyModel, device: str | None) -> PolicyModel:
    policy.requires_grad_(False).eval()
    return policy.to(device) if device else policy


def load_policy(source: str, device: str | None = None, dtype: str | None = None,
                what: str = "--model") -> PolicyModel:
    """The policy in ``source``, in eval mode without gradients, on ``device`` (default: CPU).

    ``source`` is an align checkpoint (a ``.ckpt`` file written by any align run: the policy is rebuilt from the
    spec stored in it, LoRA included), an exported Hugging Face folder (``align export``), or a model id
    :class:`~align.models.PolicyModel` accepts (``tiny-sort``, ``smollm2-135m-instruct``, a ``.gguf`` file, a hub
    id). ``dtype`` overrides the weight dtype (default: the run's for a checkpoint, float32 otherwise)."""
    from align.models.checkpoints import policy_from_checkpoint

    if _is_checkpoint(source):
        checkpoint = _checkpoint(source, what)
        return _ready(policy_from_checkpoint(source, checkpoint=checkpoint, dtype=dtype), device)
    return _ready(PolicyModel(model=source, **({"dtype": dtype} if dtype else {})), device)


def reference_policy(source: str, device: str | None = None, dtype: str | None = None) -> PolicyModel:
    """The model the run of checkpoint ``source`` started from: its ``reference_model`` when it had one, else
    its base ``model`` (for a LoRA run, the model without the adapter), with the run's tokenizer."""
    if not _is_checkpoint(source):
        raise AlignConfigError(f"--baseline {REFERENCE}: only an align checkpoint records the model its run started "
                               f"from, and '{source}' is not one; give the baseline's path or model id instead")
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


def read_prompts(source: str, tokenizer, prompt_field: str | None = None, system_prompt: str | None = None,
                 split: str | None = None, use_chat_template: bool | None = None) -> PromptFile:
    """Read and encode a prompt file (any source the data modules read: jsonl, json, parquet, csv, a
    ``save_to_disk`` folder, ``align:...`` or a hub dataset) with the training reader and its row errors.

    ``split``: null takes the held-out split a run validates on (``train`` for a file, ``validation`` for a hub
    dataset). ``use_chat_template``: null applies the tokenizer's template when it has one, as training does."""
    rows = read_rows(source, split, "--split")
    field_name = _prompt_field(rows, prompt_field)
    examples = encode_prompt_rows(rows, source, ChatEncoder(tokenizer, use_chat_template), prompt_field=field_name,
                                  max_prompt_length=None, system_prompt=system_prompt)
    return PromptFile(source, rows, examples, field_name)


# ---------------------------------------------------------------------------- sampling
def sampling_config(max_new_tokens: int = 64, temperature: float | None = None, top_p: float = 1.0, top_k: int = 0,
                    n: int = 1) -> SamplingConfig:
    """The rollout engine's settings; ``temperature`` null is greedy (0) for one sample per prompt and 1 for
    several (``n`` greedy samples would be ``n`` copies of one). Bad values fail with one line."""
    if n < 1:
        raise AlignConfigError(f"--n: expected >= 1 samples per prompt, got {n}")
    if temperature is None:
        temperature = 0.0 if n == 1 else 1.0
    try:
        return SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
    except ValueError as err:
        raise AlignConfigError(str(err).replace("sampling.", "--")) from None


def seeded_generator(seed: int, policy: PolicyModel) -> torch.Generator:
    """A sampling generator on the policy's device, seeded with ``seed``."""
    return torch.Generator(device=_device(policy)).manual_seed(seed)


def generate_batches(policy: PolicyModel, examples: Sequence[PromptExample], sampling: SamplingConfig, n: int = 1,
                     batch_size: int = 8, seed: int = 0) -> Iterator[tuple[PromptBatch, Rollout]]:
    """``n`` completions of each prompt, ``batch_size`` prompts per rollout, sampled by the training rollout
    engine with a generator seeded by ``seed`` (the same seed gives the same completions). Yields each batch of
    prompts with its rollout, in the order of ``examples``."""
    if batch_size < 1:
        raise AlignConfigError(f"--batch_size: expected >= 1 prompts per batch, got {batch_size}")
    engine = make_engine(sampling)
    generator = seeded_generator(seed, policy)
    for start in range(0, len(examples), batch_size):
        batch = collate_prompts(list(examples[start:start + batch_size]))
        yield batch, engine.generate(policy, batch.prompt_ids, n, generator=generator)


def completion_rows(prompts: PromptFile, start: int, rollout: Rollout, completion_field: str = "completion",
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
            raise AlignDataError(prompts.source, number, completion_field, "no column with the name of the output's "
                                 "completion field, which would overwrite it (set --completion_field to another name)")


# ---------------------------------------------------------------------------- evaluation
def parse_reward(text: str) -> RewardSpec:
    """``--rewards`` item: an import path as in a config (``align.rewards.math_answer``, ``my.py:fn``), optionally
    with a weight: ``align.rewards.sort_format=0.5``."""
    fn, eq, weight = text.rpartition("=") if "=" in text else (text, "", "")
    if not eq:
        return RewardSpec(fn=text)
    try:
        return RewardSpec(fn=fn, weight=float(weight))
    except ValueError:
        raise AlignConfigError(f"--rewards: '{text}': expected PATH or PATH=WEIGHT with a number as weight") from None


@dataclass
class EvalReport:
    """What ``align evaluate`` prints and writes (``--output``). Means are over completions; pass@k over prompts."""

    model: str
    prompts: str
    num_prompts: int
    samples_per_prompt: int
    sampling: dict
    reward_mean: float  # weighted total, as val/reward_mean
    rewards: dict[str, float]  # each reward's mean, as val/reward/<name>
    accuracy: float  # as val/accuracy
    accuracy_reward: str
    accuracy_threshold: float
    response_length: float  # mean tokens, stop token included
    truncated_frac: float
    pass_at_k: dict[int, float] = field(default_factory=dict)
    baseline: dict | None = None
    tokens_per_s: float = 0.0
    accuracy_reward_highest: float | None = None  # the accuracy reward's highest value over the completions

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return out


class _Sums:
    """Running sums of per-completion values (and of per-prompt pass@k) over an evaluation."""

    def __init__(self):
        self.values: dict[str, float] = {}
        self.count = 0

    def add(self, name: str, values: torch.Tensor | Sequence[float]) -> None:
        self.values[name] = self.values.get(name, 0.0) + float(torch.as_tensor(values, dtype=torch.float64).sum())

    def mean(self, name: str, count: int | None = None) -> float:
        return self.values.get(name, 0.0) / max(count or self.count, 1)


def _check_ks(ks: Sequence[int], n: int) -> list[int]:
    for k in ks:
        if not 1 <= k <= n:
            raise AlignConfigError(f"--k: pass@{k} needs at least {k} samples per prompt, but --n is {n}; "
                                   f"set --n {k} or more")
    return sorted(set(ks))


def _accuracy_reward(reward: CombinedReward, name: str | None) -> str:
    if name is None:
        return reward.names[0]
    if name not in reward.names:
        raise AlignConfigError(f"--accuracy_reward: {name!r} is not one of the rewards {reward.names}")
    return name


def _sequence_log_ratio(policy: PolicyModel, baseline: PolicyModel, rollout: Rollout) -> torch.Tensor:
    """``(N,)`` summed token log-ratio ``log pi(y|x) - log pi_base(y|x)`` of each completion, at temperature 1."""
    kwargs = dict(response_length=rollout.response_mask.shape[1])
    with torch.no_grad():
        logp = policy.token_logprobs(rollout.input_ids, rollout.attention_mask, **kwargs).logprobs
        base = baseline.token_logprobs(rollout.input_ids.to(_device(baseline)),
                                       rollout.attention_mask.to(_device(baseline)), **kwargs).logprobs
    return masked_sum(logp - base.to(logp.device), rollout.response_mask, dim=1)  # (N,)


def _device(policy: PolicyModel) -> torch.device:
    return next(policy.parameters()).device


def _same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()


def _compare(ours: Sequence[float], theirs: Sequence[float]) -> torch.Tensor:
    """``(N,)`` 1 where ours is higher, 0.5 on a tie, 0 where theirs is."""
    a, b = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    return (a > b).double() + 0.5 * (a == b).double()


def evaluate(policy: PolicyModel, prompts: PromptFile, rewards: Sequence[RewardSpec | str], sampling: SamplingConfig,
             *, n: int = 1, ks: Sequence[int] = (), batch_size: int = 8, seed: int = 0,
             accuracy_reward: str | None = None, accuracy_threshold: float = 1.0, baseline: PolicyModel | None = None,
             reward_model: str | None = None, baseline_prompts: PromptFile | None = None, model_name: str = "",
             on_batch=None) -> EvalReport:
    """Score ``n`` completions of each prompt with ``rewards`` (resolved as in a training config).

    Reports the mean of each reward and of their weighted total, the accuracy (share of completions whose
    ``accuracy_reward``, default the first reward, is at least ``accuracy_threshold``: training's
    ``val/accuracy``), and for each ``k`` in ``ks`` the unbiased pass@k (:func:`align.core.stats.pass_at_k`) of the
    accuracy test. With a ``baseline`` policy, its completions for the same prompts (same sampling and seed)
    are scored too; the report adds the win rate of ours over its completion of the same prompt and sample
    index (ties count one half), judged by ``reward_model`` when given (a reward-model path, as for training's
    ``reward_model``) and otherwise by the weighted total reward, and the KL of the policy to the baseline on the
    policy's completions (the sequence-level k1 estimator: the mean over completions of the summed token
    log-ratio at temperature 1; an unbiased estimate of KL(policy || baseline) when the completions are sampled
    at temperature 1 without top-k/top-p, and a plain log-ratio on greedy ones). ``baseline_prompts``: the same
    rows encoded with the baseline's tokenizer and chat template (default: ``prompts``). ``on_batch(done, total)``
    reports progress.
    """
    reward, _ = training_rewards(list(rewards), None, None)
    reward.check_inputs([k for k in prompts.examples[0].columns])
    acc_name = _accuracy_reward(reward, accuracy_reward)
    ks = _check_ks(ks, n)
    judge = training_rewards(None, RewardModelSpec(reward_model), None)[0] if reward_model else None
    kl_ok = baseline is not None and _same_tokenizer(policy.tokenizer, baseline.tokenizer)
    sums, seconds, tokens = _Sums(), 0.0, 0.0
    base_batches = (generate_batches(baseline, (baseline_prompts or prompts).examples, sampling, n, batch_size, seed)
                    if baseline is not None else None)
    highest = -float("inf")
    for batch, rollout in generate_batches(policy, prompts.examples, sampling, n, batch_size, seed):
        total, parts = reward(**reward_inputs(batch, rollout))
        sums.count += len(rollout)
        seconds += rollout.generation_seconds
        tokens += rollout.metrics["rollout/completion_tokens"]
        sums.add("reward_mean", total)
        for name, values in parts.items():
            sums.add(f"reward/{name}", values)
        correct = torch.tensor(parts[acc_name]) >= accuracy_threshold  # (B*n,)
        highest = max(highest, max(map(float, parts[acc_name]), default=highest))
        sums.add("accuracy", correct)
        sums.add("response_length", rollout.response_lengths)
        sums.add("truncated", rollout.truncated)
        for c in correct.view(-1, n).sum(dim=1).tolist():
            for k in ks:
                sums.add(f"pass@{k}", [pass_at_k(n, int(c), k)])
        if base_batches is not None:
            _, base_rollout = next(base_batches)
            _compare_with_baseline(sums, reward, judge, batch, rollout, base_rollout, total)
            if kl_ok:
                sums.add("kl", _sequence_log_ratio(policy, baseline, rollout))
        if on_batch is not None:
            on_batch(sums.count // n, len(prompts.examples))
    report = _report(sums, reward, prompts, n, ks, sampling, acc_name, accuracy_threshold, model_name,
                     baseline is not None, kl_ok, judge is not None, tokens / max(seconds, 1e-9))
    report.accuracy_reward_highest = highest if sums.count else None
    return report


def _compare_with_baseline(sums: _Sums, reward: CombinedReward, judge: CombinedReward | None, batch: PromptBatch,
                           rollout: Rollout, base_rollout: Rollout, total: Sequence[float]) -> None:
    base_total, _ = reward(**reward_inputs(batch, base_rollout))
    sums.add("baseline/reward_mean", base_total)
    if judge is not None:
        ours = judge(**reward_inputs(batch, rollout))[0]
        theirs = judge(**reward_inputs(batch, base_rollout))[0]
        sums.add("baseline/rm_score", ours)
        sums.add("baseline/baseline_rm_score", theirs)
    else:
        ours, theirs = total, base_total
    outcome = _compare(ours, theirs)
    sums.add("baseline/win_rate", outcome)
    sums.add("baseline/wins", outcome == 1)
    sums.add("baseline/ties", outcome == 0.5)


def _kl_estimator(sampling: SamplingConfig) -> str:
    """What the ``kl`` of a report estimates: KL(policy || baseline) only for completions drawn from the policy
    itself (temperature 1, no top-k or top-p); otherwise the mean log-ratio of the completions drawn."""
    if sampling.temperature == 1 and sampling.top_k == 0 and sampling.top_p == 1:
        return "k1, sequence-level"
    return "log-ratio only: the completions are not samples of the policy at temperature 1"


def _report(sums: _Sums, reward: CombinedReward, prompts: PromptFile, n: int, ks: Sequence[int],
            sampling: SamplingConfig, acc_name: str, threshold: float, model_name: str, has_baseline: bool,
            kl_ok: bool, judged: bool, tokens_per_s: float) -> EvalReport:
    num_prompts = len(prompts.examples)
    baseline = None
    if has_baseline:
        baseline = {"judge": "reward_model" if judged else "rewards",
                    "win_rate": sums.mean("baseline/win_rate"), "wins": sums.mean("baseline/wins"),
                    "ties": sums.mean("baseline/ties"),
                    "losses": 1.0 - sums.mean("baseline/wins") - sums.mean("baseline/ties"),
                    "reward_mean": sums.mean("baseline/reward_mean"),
                    "kl": sums.mean("kl") if kl_ok else None, "kl_estimator": _kl_estimator(sampling)}
        if judged:
            baseline["rm_score"] = sums.mean("baseline/rm_score")
            baseline["baseline_rm_score"] = sums.mean("baseline/baseline_rm_score")
    return EvalReport(
        model=model_name, prompts=prompts.source, num_prompts=num_prompts, samples_per_prompt=n,
        sampling={k: v for k, v in asdict(sampling).items() if k in ("max_new_tokens", "temperature", "top_p", "top_k")},
        reward_mean=sums.mean("reward_mean"), rewards={name: sums.mean(f"reward/{name}") for name in reward.names},
        accuracy=sums.mean("accuracy"), accuracy_reward=acc_name, accuracy_threshold=threshold,
        response_length=sums.mean("response_length"), truncated_frac=sums.mean("truncated"),
        pass_at_k={k: sums.mean(f"pass@{k}", num_prompts) for k in ks}, baseline=baseline, tokens_per_s=tokens_per_s)


# ---------------------------------------------------------------------------- chat
def chat_reply(policy: PolicyModel, encoder: ChatEncoder, history: list[dict], engine: GenerationEngine,
               generator: torch.Generator | None = None) -> tuple[str, Rollout]:
    """The assistant's next message after the conversation ``history`` (chat template applied as in training)."""
    rollout = engine.generate(policy, [encoder.prompt_ids(history)], 1, generator=generator)
    return rollout.texts[0], rollout
