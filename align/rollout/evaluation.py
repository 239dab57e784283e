"""Held-out evaluation: one definition of what a policy's completions score, for ``val/*`` during training and for
``align evaluate``.

An :class:`Evaluator` sums a held-out pass's per-completion values over its batches (and, in training, over the
data-parallel ranks) and returns their means:

* ``reward_mean``: the weighted total of the rewards; ``reward/<name>``: each reward part;
* ``accuracy``: the share of completions whose ``accuracy_reward`` is at least ``accuracy_threshold``;
* ``response_length``: tokens per completion, its stop token included; ``truncated_frac``: the share cut off at
  ``max_new_tokens`` without a stop token; ``turns``: turns per episode (multi-turn rollouts);
* any other per-completion sum a caller adds (:meth:`Evaluator.add_sum`: PPO's ``kl``), as a mean over completions.

It also keeps the highest value of the accuracy reward: below the threshold, ``accuracy`` is 0 by construction, and
the command line then reports the reward's mean instead. Completions come from :meth:`Sampler.rollout
<align.rollout.sampler.Sampler.rollout>` and are scored by :meth:`Sampler.score <align.rollout.sampler.Sampler.score>`
in both uses, so a number ``align evaluate`` prints is the number training logs for the same policy, prompts and
sampling settings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from align.core.masks import masked_sum
from align.core.stats import pass_at_k
from align.data.prompts import PromptBatch, collate_prompts
from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.models.scorer import Scorer
from align.rollout.engine import SamplingConfig
from align.rollout.generation import PromptFile, device_of, seeded_generator
from align.rollout.rewards import CombinedReward, RewardModelSpec, RewardSpec, reward_inputs, training_rewards
from align.rollout.sampler import Sampler
from align.rollout.types import Rollout, rollout_to

__all__ = ["EvalReport", "Evaluator", "evaluate", "parse_reward"]


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class Evaluator:
    """Sums of one held-out pass (module docstring); ``device``: where the sums are kept (the rollouts')."""

    def __init__(self, accuracy_reward: str, accuracy_threshold: float = 1.0, device: torch.device | str = "cpu"):
        self.accuracy_reward, self.accuracy_threshold = accuracy_reward, accuracy_threshold
        self.device = torch.device(device)
        self.sums: dict[str, torch.Tensor] = {}
        self.highest = torch.tensor(-torch.inf, device=self.device)
        """The highest value of the accuracy reward over the completions added."""

    @property
    def count(self) -> int:
        """Completions added (on this rank)."""
        return int(self.sums["count"]) if "count" in self.sums else 0

    def add_sum(self, name: str, values: torch.Tensor) -> None:
        """Add the per-completion ``values`` ``(N,)`` (or their sum) to the sum ``name``."""
        total = values.detach().float().sum().to(self.device)
        self.sums[name] = self.sums[name] + total if name in self.sums else torch.zeros((), device=self.device) + total

    def add(self, rollout: Rollout, rewards: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Add the completions of ``rollout`` with their total ``rewards`` ``(N,)`` and reward ``parts``
        ``{name: (N,)}``."""
        accuracy = parts[self.accuracy_reward]
        self.add_sum("count", torch.tensor(float(len(rollout))))
        self.add_sum("reward_mean", rewards)
        self.add_sum("accuracy", (accuracy >= self.accuracy_threshold).float())
        self.highest = torch.maximum(self.highest, accuracy.detach().float().max().to(self.device))
        self.add_sum("response_length", rollout.response_lengths)
        self.add_sum("truncated_frac", rollout.truncated)
        if rollout.episodes is not None:
            self.add_sum("turns", torch.tensor([float(e["turns"]) for e in rollout.episodes]))
        for name, values in parts.items():
            self.add_sum(f"reward/{name}", values)

    def means(
        self,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] = _same,
        all_max: Callable[[torch.Tensor], torch.Tensor] = _same,
    ) -> dict[str, float]:
        """Every sum's mean over the completions of every rank (``all_reduce`` sums a tensor over the ranks,
        ``all_max`` takes its maximum; every rank must call this, with completions or without); empty when no
        completion was added anywhere. :attr:`highest` becomes the maximum over the ranks."""
        self.highest = all_max(self.highest)
        if not self.sums:
            return {}
        totals = {name: all_reduce(value) for name, value in self.sums.items()}
        count = totals.pop("count").clamp(min=1.0)
        return {name: float(value / count) for name, value in totals.items()}


# ---------------------------------------------------------------------------- align evaluate
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
            raise AlignConfigError(
                f"--k: pass@{k} needs at least {k} samples per prompt, but --n is {n}; set --n {k} or more"
            )
    return sorted(set(ks))


def _accuracy_reward(reward: CombinedReward, name: str | None) -> str:
    if name is None:
        return reward.names[0]
    if name not in reward.names:
        raise AlignConfigError(f"--accuracy_reward: {name!r} is not one of the rewards {reward.names}")
    return name


def _sequence_log_ratio(policy: PolicyModel, baseline: PolicyModel, rollout: Rollout) -> torch.Tensor:
    """``(N,)`` summed token log-ratio ``log pi(y|x) - log pi_base(y|x)`` of each completion, at temperature 1."""
    with torch.no_grad():
        logp = Scorer(policy).logprobs(rollout).logprobs
        base = Scorer(baseline).logprobs(rollout_to(rollout, device_of(baseline))).logprobs
    return masked_sum(logp - base.to(logp.device), rollout.response_mask, dim=1)  # (N,)


def _same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()


def _compare(ours: Sequence[float], theirs: Sequence[float]) -> torch.Tensor:
    """``(N,)`` 1 where ours is higher, 0.5 on a tie, 0 where theirs is."""
    a, b = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    return (a > b).double() + 0.5 * (a == b).double()


def evaluate(
    policy: PolicyModel,
    prompts: PromptFile,
    rewards: Sequence[RewardSpec | str],
    sampling: SamplingConfig,
    *,
    n: int = 1,
    ks: Sequence[int] = (),
    batch_size: int = 8,
    seed: int = 0,
    accuracy_reward: str | None = None,
    accuracy_threshold: float = 1.0,
    baseline: PolicyModel | None = None,
    reward_model: str | None = None,
    baseline_prompts: PromptFile | None = None,
    model_name: str = "",
    on_batch=None,
) -> EvalReport:
    """Score ``n`` completions of each prompt with ``rewards`` (resolved as in a training config), sampled and scored
    by a :class:`~align.rollout.sampler.Sampler` and summed by an :class:`Evaluator`, as training's held-out passes
    are: ``reward_mean``, each reward's mean, ``accuracy`` (the share of completions whose ``accuracy_reward``,
    default the first reward, is at least ``accuracy_threshold``: training's ``val/accuracy``), the response length
    and the share truncated; and for each ``k`` in ``ks`` the unbiased pass@k (:func:`align.core.stats.pass_at_k`) of
    the accuracy test. Completions are drawn ``batch_size`` prompts at a time with a generator seeded by ``seed``.

    With a ``baseline`` policy, its completions for the same prompts (same sampling and seed) are scored too; the
    report adds the win rate of ours over its completion of the same prompt and sample index (ties count one half),
    judged by ``reward_model`` when given (a reward-model path, as for training's ``reward_model``) and otherwise by
    the weighted total reward, and the KL of the policy to the baseline on the policy's completions (the
    sequence-level k1 estimator: the mean over completions of the summed token log-ratio at temperature 1; an
    unbiased estimate of KL(policy || baseline) when the completions are sampled at temperature 1 without
    top-k/top-p, and a plain log-ratio on greedy ones). ``baseline_prompts``: the same rows encoded with the
    baseline's tokenizer and chat template (default: ``prompts``). ``on_batch(done, total)`` reports progress.
    """
    if batch_size < 1:
        raise AlignConfigError(f"--batch_size: expected >= 1 prompts per batch, got {batch_size}")
    reward, _ = training_rewards(list(rewards), None, None, where=None)
    reward.check_inputs(list(prompts.examples[0].columns))
    acc_name = _accuracy_reward(reward, accuracy_reward)
    ks = _check_ks(ks, n)
    judge = training_rewards(None, RewardModelSpec(reward_model), None, where=None)[0] if reward_model else None
    kl_ok = baseline is not None and _same_tokenizer(policy.tokenizer, baseline.tokenizer)
    ours = _Completions(policy, prompts, reward, sampling, n, batch_size, seed)
    theirs = (
        _Completions(baseline, baseline_prompts or prompts, reward, sampling, n, batch_size, seed)
        if baseline is not None
        else None
    )
    evaluator, sums = Evaluator(acc_name, accuracy_threshold, device_of(policy)), _Sums()
    base_evaluator = Evaluator(acc_name, accuracy_threshold, device_of(policy))
    seconds = tokens = 0.0
    for batch, rollout, total, parts in ours:
        evaluator.add(rollout, total, parts)
        seconds += rollout.generation_seconds
        tokens += rollout.metrics["rollout/completion_tokens"]
        correct = parts[acc_name] >= accuracy_threshold  # (B*n,)
        for c in correct.view(-1, n).sum(dim=1).tolist():
            for k in ks:
                sums.add(f"pass@{k}", [pass_at_k(n, int(c), k)])
        if theirs is not None:
            _, base_rollout, base_total, base_parts = next(theirs)
            base_evaluator.add(base_rollout, base_total, base_parts)
            _compare_with_baseline(sums, judge, batch, rollout, base_rollout, total.tolist(), base_total.tolist())
            if kl_ok:
                assert baseline is not None  # kl_ok is only set with a baseline
                sums.add("kl", _sequence_log_ratio(policy, baseline, rollout))
        sums.count += len(rollout)
        if on_batch is not None:
            on_batch(evaluator.count // n, len(prompts.examples))
    report = _report(
        evaluator.means(),
        base_evaluator.means(),
        sums,
        reward,
        prompts,
        n,
        ks,
        sampling,
        acc_name,
        accuracy_threshold,
        model_name,
        kl_ok,
        judge is not None,
        tokens / max(seconds, 1e-9),
    )
    report.accuracy_reward_highest = float(evaluator.highest) if evaluator.count else None
    return report


class _Completions:
    """``n`` completions of each prompt of ``prompts`` by ``policy``, ``batch_size`` prompts at a time, with their
    rewards: ``(batch, rollout, total (N,), parts {name: (N,)})`` per batch, as training's held-out passes sample and
    score them (:class:`~align.rollout.sampler.Sampler`), with a generator seeded by ``seed``."""

    def __init__(
        self,
        policy: PolicyModel,
        prompts: PromptFile,
        reward: CombinedReward,
        sampling: SamplingConfig,
        n: int,
        batch_size: int,
        seed: int,
    ):
        self.sampler = Sampler(policy, reward, n, sampling)
        self.examples, self.batch_size = prompts.examples, batch_size
        self.generator = seeded_generator(seed, policy)
        self._batches = self._generate()

    def _generate(self) -> Iterator[tuple[PromptBatch, Rollout, torch.Tensor, dict[str, torch.Tensor]]]:
        for start in range(0, len(self.examples), self.batch_size):
            batch = collate_prompts(list(self.examples[start : start + self.batch_size]))
            rollout = self.sampler.rollout(batch, generator=self.generator)
            yield (batch, rollout, *self.sampler.score(batch, rollout))

    def __iter__(self):
        return self._batches

    def __next__(self):
        return next(self._batches)


def _compare_with_baseline(
    sums: _Sums,
    judge: CombinedReward | None,
    batch: PromptBatch,
    rollout: Rollout,
    base_rollout: Rollout,
    total: Sequence[float],
    base_total: Sequence[float],
) -> None:
    ours: Sequence[float]
    theirs: Sequence[float]
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


def _report(
    means: dict[str, float],
    base_means: dict[str, float],
    sums: _Sums,
    reward: CombinedReward,
    prompts: PromptFile,
    n: int,
    ks: Sequence[int],
    sampling: SamplingConfig,
    acc_name: str,
    threshold: float,
    model_name: str,
    kl_ok: bool,
    judged: bool,
    tokens_per_s: float,
) -> EvalReport:
    num_prompts = len(prompts.examples)
    baseline = None
    if base_means:
        baseline = {
            "judge": "reward_model" if judged else "rewards",
            "win_rate": sums.mean("baseline/win_rate"),
            "wins": sums.mean("baseline/wins"),
            "ties": sums.mean("baseline/ties"),
            "losses": 1.0 - sums.mean("baseline/wins") - sums.mean("baseline/ties"),
            "reward_mean": base_means["reward_mean"],
            "kl": sums.mean("kl") if kl_ok else None,
            "kl_estimator": _kl_estimator(sampling),
        }
        if judged:
            baseline["rm_score"] = sums.mean("baseline/rm_score")
            baseline["baseline_rm_score"] = sums.mean("baseline/baseline_rm_score")
    return EvalReport(
        model=model_name,
        prompts=prompts.source,
        num_prompts=num_prompts,
        samples_per_prompt=n,
        sampling={k: getattr(sampling, k) for k in ("max_new_tokens", "temperature", "top_p", "top_k")},
        reward_mean=means.get("reward_mean", 0.0),
        rewards={name: means.get(f"reward/{name}", 0.0) for name in reward.names},
        accuracy=means.get("accuracy", 0.0),
        accuracy_reward=acc_name,
        accuracy_threshold=threshold,
        response_length=means.get("response_length", 0.0),
        truncated_frac=means.get("truncated_frac", 0.0),
        pass_at_k={k: sums.mean(f"pass@{k}", num_prompts) for k in ks},
        baseline=baseline,
        tokens_per_s=tokens_per_s,
    )
