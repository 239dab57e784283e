"""The sampler: prompts -> scored rollouts for one policy, with no optimizer.

A :class:`Sampler` is what every RL module samples and scores through (docs/architecture.md): it asks a generation
engine (:mod:`align.rollout.engine`) for ``group_size`` completions per prompt, or plays multi-turn episodes with an
environment (:func:`align.rollout.episodes.play_episodes`), scores them with the reward stack
(:class:`align.rollout.rewards.CombinedReward`, DAPO's overlong shaping, the environment's rewards), and, for rows
whose log-probs are not the trainer's (another engine's, an older policy's), recomputes them with the module's
:class:`~align.models.scorer.Scorer` and weighs them (:meth:`Sampler.correct`). It does not score rows for the
learner: the module asks its scorer. A rollout source (:mod:`align.rollout.source`) decides when and how often to
call it; the module's learner updates on what comes out.

The module that owns a sampler tells it two things it cannot know alone: the ``generation_context`` of its strategy
(parameters gathered from FSDP2/ZeRO-3 shards while decoding, and the cross-rank stop decision) and the data-parallel
``ranks``. Each rollout records the ``version`` of the policy that sampled it (its optimizer steps), which the
caller passes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import replace
from typing import NamedTuple

import torch

from align.core.mismatch import correction_weights
from align.core.shaping import overlong_penalty
from align.core.stats import Ranks
from align.data.prompts import PromptBatch
from align.errors import AlignError
from align.models.scorer import Scorer
from align.observability.timing import Timer, record_span
from align.rollout.engine import GenerationEngine, HeldOutSampling, SamplingConfig, engine_of, make_engine
from align.rollout.envs.chat import EnvironmentPool
from align.rollout.episodes import play_episodes
from align.rollout.rewards import CombinedReward, LazyRewardModel, RewardCounts, RewardError, reward_inputs
from align.rollout.types import Rollout, Scored

__all__ = ["OverlongShaping", "Sampler", "stop_together"]

MESSAGE_BYTES = 1024
"""Longest failure message (UTF-8 bytes) that :func:`stop_together` hands to the other ranks."""


def stop_together(error: BaseException | None, ranks: Ranks, device: torch.device | str = "cpu") -> None:
    """Raise on every rank when ``error`` (what scoring raised on this rank, or None) is set on any rank, so that a
    reward failing on one rank stops them all at the same point instead of leaving the others waiting at their next
    collective. Every rank raises the same line, the first failing rank's message with its rank; a failing rank
    keeps its own error as the cause. One all-reduce of ``ranks.size`` numbers per call (a second, of the message,
    only when something failed); on one process ``error`` is simply raised."""
    if ranks.size <= 1:
        if error is not None:
            raise error
        return
    failed = torch.zeros(ranks.size, device=device)
    failed[ranks.rank] = float(error is not None)
    failed = ranks.all_reduce(failed)
    ranks_failed = [r for r in range(ranks.size) if float(failed[r]) > 0]
    if not ranks_failed:
        return
    first = ranks_failed[0]
    message = torch.zeros(MESSAGE_BYTES, device=device)
    if ranks.rank == first:
        text = (str(error) if isinstance(error, RewardError) else f"{type(error).__name__}: {error}").encode()
        raw = text[:MESSAGE_BYTES]
        message[: len(raw)] = torch.tensor(list(raw), dtype=torch.float32, device=device)
    raw = bytes(int(b) for b in ranks.all_reduce(message).round().clamp(0, 255).tolist() if b)
    if error is not None and not isinstance(error, AlignError):
        raise error  # not a reward's failure but a bug: its own traceback (the other ranks name it on one line)
    where = f"rank {first}" + (f" (and {len(ranks_failed) - 1} more)" if len(ranks_failed) > 1 else "")
    raise RewardError(
        f"{raw.decode(errors='ignore')} [scoring failed on {where} of {ranks.size}; every rank stops]"
    ) from error


class OverlongShaping(NamedTuple):
    """DAPO's soft overlong punishment as the sampler applies it: ``coef`` times
    :func:`~align.core.shaping.overlong_penalty` of each completion's length with ``buffer`` and ``max_length``."""

    coef: float
    buffer: int
    max_length: int


def _no_context():
    return nullcontext(None)


class Sampler:
    """Samples and scores rollouts of ``policy``: ``group_size`` completions per prompt drawn with ``sampling``
    (held-out prompts: one each with ``eval_sampling``), rewarded by ``reward``, or episodes played in
    ``environment``."""

    def __init__(
        self,
        policy,
        reward: CombinedReward,
        group_size: int = 1,
        sampling: SamplingConfig | None = None,
        eval_sampling: SamplingConfig | None = None,
        environment: EnvironmentPool | None = None,
        overlong: OverlongShaping | None = None,
        scorer: Scorer | None = None,
    ):
        """
        Args:
            policy: The :class:`~align.models.PolicyModel` that samples.
            reward: The training rewards (weighted total and parts).
            group_size: Completions (or episodes) per prompt.
            sampling: The training engine's settings; ``eval_sampling``: the held-out engine's (greedy by default).
            environment: Multi-turn episodes instead of single completions; its rewards are the part ``env``.
            overlong: DAPO's overlong shaping (the reward part ``overlong``); None: off.
            scorer: What recomputes the trainer's log-probs of rows whose log-probs are not the trainer's (the
                module's scorer); default: one of ``policy`` at the sampling temperature (1 for greedy).
        """
        self.policy, self.reward, self.group_size = policy, reward, group_size
        self.engine: GenerationEngine = make_engine(sampling or SamplingConfig())
        train = self.engine.sampling
        if eval_sampling is None:
            eval_sampling = HeldOutSampling(max_new_tokens=train.max_new_tokens, temperature=0.0)
        # The held-out engine is the training one (one object, drawing with the held-out settings) unless named.
        eval_engine = self.engine if eval_sampling.engine is None else engine_of(eval_sampling.engine)
        self.eval_engine: GenerationEngine = eval_engine.bound(replace(eval_sampling, engine=eval_engine))
        self.environment, self.overlong = environment, overlong
        self.scorer = scorer if scorer is not None else Scorer(policy, temperature=train.temperature or 1.0)
        self.generation_context: Callable[[], ContextManager] = _no_context
        """Entered around every rollout; yields ``sync_stop`` (or None): set by the module from its strategy."""
        self.ranks: Callable[[], Ranks] = Ranks
        """The data-parallel ranks, read when needed (the module's trainer may attach after construction)."""
        self.rollouts = 0
        """Training rollouts sampled (:meth:`sample`), saved in checkpoints by the module."""
        self.reward_counts = self._no_counts()
        """Rows the rewards did not apply to, or scored by default after a failed call, over the training rollouts
        since :meth:`rollout_metrics` last logged them."""

    @property
    def max_response_tokens(self) -> int:
        """Longest response a rollout can hold: ``sampling.max_new_tokens``, or an episode's token budget
        (``environment.max_tokens``, assistant and environment tokens)."""
        return self.environment.spec.max_tokens if self.environment is not None else self.engine.sampling.max_new_tokens

    def setup(self, device: str | None = None) -> None:
        """Load what waits for the process's device: reward models."""
        for reward in self.reward.rewards:
            if isinstance(reward.fn, LazyRewardModel):
                reward.fn.load(device)

    # ------------------------------------------------------------------ rollouts
    def rollout(
        self,
        batch: PromptBatch,
        group_size: int | None = None,
        engine: GenerationEngine | None = None,
        policy=None,
        version: int = 0,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        """``group_size`` (default: the sampler's) completions or episodes per prompt, by ``engine`` (default: the
        training engine), from ``policy`` (default: the sampler's; another model with ``model`` and ``tokenizer``,
        such as a distillation teacher whose weights are whole on every rank), recorded as sampled by the policy
        ``version`` (its optimizer steps); ``generator``: the random stream of single-turn sampling (default: the
        global one)."""
        self.reward.check_inputs(list(batch.columns))  # a reward's missing argument fails before generating
        engine = engine or self.engine
        group_size = group_size or self.group_size
        policy = self.policy if policy is None else policy
        with self.generation_context() as sync_stop:
            if self.environment is None:
                rollout = engine.generate(
                    policy, batch.prompt_ids, group_size, generator=generator, sync_stop=sync_stop
                )
            else:
                rollout = play_episodes(
                    policy, engine, batch, group_size, self.environment, generator=generator, sync_stop=sync_stop
                )
                self.trace_environment(rollout)
        rollout.policy_version = version
        return rollout

    def trace_environment(self, rollout: Rollout) -> None:
        """An ``env_step`` span per environment call of a multi-turn rollout, under the span open here (the step's
        ``generation``), while tracing is on."""
        # Called for the rollouts of play_episodes: with an environment, and episodes on the rollout.
        assert self.environment is not None and rollout.episodes is not None
        name = self.environment.name
        for index, episode in enumerate(rollout.episodes):
            for turn, start, end, reward, done in episode["calls"]:
                record_span(
                    "env_step",
                    start,
                    end,
                    {
                        "align.env.name": name,
                        "align.env.episode": index,
                        "align.env.turn": turn,
                        "align.env.reward": reward,
                        "align.env.done": done,
                    },
                )

    def score(self, batch: PromptBatch, rollout: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(rewards (N,), {name: (N,)})``: the weighted total and each reward's values, on the device.

        Every reward is called with keyword arguments (:class:`align.rollout.rewards.RewardFunction`) and receives,
        besides the prompt texts, the completions and the data's columns, the whole prompt conversation
        (``prompt_messages``), the sampled token ids through the first stop token (``completion_ids``) and whether a
        completion was cut off at ``max_new_tokens`` (``completion_truncated``).

        With overlong shaping, the part ``overlong`` holds each completion's penalty in ``[-1, 0]`` (of its length,
        stop token included), and the total adds ``overlong.coef`` times it. A multi-turn rollout adds the part
        ``env``, each episode's summed environment rewards, with weight ``environment.weight``.
        """
        device = rollout.response_ids.device
        failure = None
        try:
            totals, by_name = self.reward(**reward_inputs(batch, rollout))
        except Exception as err:  # noqa: BLE001 - every rank learns of it and stops (stop_together)
            failure = err
        stop_together(failure, self.ranks(), device)
        to_tensor = lambda values: torch.tensor(values, dtype=torch.float32, device=device)  # noqa: E731
        total, parts = to_tensor(totals), {name: to_tensor(v) for name, v in by_name.items()}
        if rollout.episodes is not None:
            assert self.environment is not None  # episodes are played in an environment
            parts["env"] = to_tensor([e["env_reward"] for e in rollout.episodes])
            total = total + self.environment.spec.weight * parts["env"]
        if self.overlong is not None:
            o = self.overlong
            parts["overlong"] = overlong_penalty(rollout.response_lengths, o.max_length, o.buffer)  # (N,)
            total = total + o.coef * parts["overlong"]
        return total, parts

    def sample(self, batch: PromptBatch, version: int = 0) -> Scored:
        """A training rollout of ``batch`` by the policy ``version`` with its rewards, timed (``time/generation_s``,
        ``time/scoring_s``) and counted in :attr:`rollouts`."""
        timings: dict[str, float] = {}
        with Timer(timings, "time/generation_s"):
            rollout = self.rollout(batch, version=version)
        return self.finish(batch, rollout, timings)

    def finish(
        self, batch: PromptBatch, rollout: Rollout, timings: dict[str, float], exact: bool | None = None
    ) -> Scored:
        """The training rollout ``rollout`` of ``batch``, sampled here or elsewhere, scored (``time/scoring_s``)
        and, when its log-probs are not the trainer's, corrected (:meth:`correct`); counted in :attr:`rollouts`.
        ``exact``: whether its log-probs are the trainer's (default: the training engine's
        :attr:`~align.rollout.engine.GenerationEngine.exact_logprobs`; a rollout of an older policy's are not)."""
        self.rollouts += 1
        with Timer(timings, "time/scoring_s"):
            rewards, parts = self.score(batch, rollout)
        self.reward_counts.add(self.reward.last_counts)
        exact = self.engine.exact_logprobs if exact is None else exact
        if self.corrects_logprobs(exact):
            with Timer(timings, "time/correction_s"):
                self.correct(rollout, exact)
        return Scored(rollout, rewards, parts, timings)

    def _no_counts(self) -> RewardCounts:
        """Zero counts with every name present, so that every rank logs the same metrics."""
        return RewardCounts(
            0, {r.name: 0 for r in self.reward.rewards}, {r.name: 0 for r in self.reward.rewards if r.counts_errors}
        )

    def corrects_logprobs(self, exact: bool) -> bool:
        """Whether a training rollout whose log-probs are (``exact``) or are not the trainer's is corrected."""
        return not exact or self.engine.sampling.correction.resolve(True) != "none"

    @torch.no_grad()
    def correct(self, rollout: Rollout, exact: bool | None = None) -> None:
        """For an engine whose log-probs are not the trainer's (or with ``sampling.correction`` set): recompute the
        trainer's log-probs of the sampled tokens into ``old_logprobs`` (the update's behaviour policy is then the
        trainer's view of the sampling weights), keep the engine's in ``engine_logprobs``, put the importance weights
        of ``sampling.correction`` in ``correction_weights`` (:func:`align.core.mismatch.correction_weights`) and log
        ``rollout/engine_logprob_diff``, ``rollout/engine_kl``, ``rollout/correction_clipped_frac`` and
        ``rollout/correction_masked_frac``. The native engine's log-probs are the trainer's: nothing to do. A rollout
        sampled by an older policy (``exact`` false: an asynchronous source's) is corrected the same way: the
        update's ratio is then to the current policy, and the weights carry the step from the sampling policy."""
        correction = self.engine.sampling.correction
        exact = self.engine.exact_logprobs if exact is None else exact
        mode = correction.resolve(exact)
        if not self.corrects_logprobs(exact):
            return
        mask = rollout.response_mask
        trainer = self.scorer.logprobs(rollout).logprobs.float()  # (N, R)
        trainer = torch.where(mask, trainer, torch.zeros_like(trainer))
        weights, stats = correction_weights(
            trainer,
            rollout.old_logprobs,
            mask,
            mode=mode,
            level=correction.level,
            cap=correction.cap,
            low=correction.low,
            high=correction.high,
        )
        rollout.engine_logprobs, rollout.old_logprobs = rollout.old_logprobs, trainer
        rollout.correction_weights = None if mode == "none" else weights
        rollout.metrics.update(
            {
                "rollout/engine_logprob_diff": float(stats.logprob_diff),
                "rollout/engine_kl": float(stats.kl),
                "rollout/correction_clipped_frac": float(stats.clipped_frac),
                "rollout/correction_masked_frac": float(stats.masked_frac),
            }
        )

    # ------------------------------------------------------------------ metrics
    def rollout_metrics(self, scored: Scored) -> dict[str, float]:
        """The rollout's own metrics (lengths, throughput, ...), the reward means of ``scored``, and the shares of
        the rows sampled since the last call that each reward did not apply to (``rollout/reward_na/<name>``) or
        scored by default after a failed call (``rollout/reward_errors/<name>``, judge and remote rewards)."""
        rollout, rewards = scored.rollout, scored.rewards
        metrics = dict(rollout.metrics)
        metrics["rollout/reward_mean"] = float(rewards.mean())
        metrics["rollout/reward_std"] = float(rewards.std()) if rewards.numel() > 1 else 0.0
        for name, values in scored.parts.items():
            metrics[f"rollout/reward/{name}"] = float(values.mean())
        metrics.update(self.reward_counts.metrics())
        self.reward_counts = self._no_counts()
        return metrics
