"""What PPO and TRPO share: a value model, and the rollout -> scores -> KL-shaped per-token rewards -> values -> GAE
batch they both update on (:class:`ActorCriticModule`). The two algorithms are siblings over it; each adds only its
policy step (PPO: clipped optimizer steps on policy and value loss together; TRPO: a natural-gradient step in a KL
trust region, then value-only steps).

Building a batch (:meth:`ActorCriticModule.make_batch`), from a scored rollout of the module's source:

1. **Scores.** The weighted total of the rewards (a reward model's score ``rm`` and any reward callables;
   ``eval_rewards`` weigh 0), then ``scores`` (:class:`~align.modules.options.ScoreShaping`), in this order and
   each off by default: a penalty for responses truncated without EOS (``missing_eos_penalty``), whitening over the
   rollout (``whiten``, mean and std over every rank), a constant factor (``scale``) and clipping to
   ``[-clip, clip]``. A multi-turn episode's environment rewards stay on the tokens of their turns; the score
   options then apply to the other rewards only.
2. **Values** ``V(s_t)`` of the value model at rollout time (:func:`~align.modules.critic_pass.critic_values`, which
   keeps the graph of the update's first micro-batch for a separate critic on one process).
3. **Advantages**: the ``gae`` row of :data:`align.core.estimators.ADVANTAGE_ESTIMATORS`: ``-kl.coef * KL_t`` on
   every response token (``kl.estimator``, ``k1`` by default, against the reference) and the score on the last valid
   token (docs/algorithms.md, "Response mask"), then GAE (``gae.gamma``, ``gae.lam``): advantages and returns =
   unwhitened advantages + values. Advantages (only) are whitened over the valid tokens of every rank
   (``gae.whiten_advantages``).

The value model is the policy's ``critic`` block (:class:`~align.models.critic.Critic`): ``critic: {kind: shared}``
puts a scalar head on the policy backbone; ``{kind: separate}`` gives a critic with its own backbone loaded from
``critic.model`` (for example the reward model, whose head then starts the critic's, ``head_from_reward_model``). During
the first ``value.warmup_rollouts`` rollouts only the value loss is optimised (:meth:`ActorCriticModule.update_value`);
a shared value head then trains alone, so the policy does not move.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from align.core import stats
from align.core.estimators import ADVANTAGE_ESTIMATORS, AdvantageInputs
from align.core.kl import kl_estimate
from align.core.losses import value_loss
from align.core.masks import masked_mean, masked_sum
from align.data.prompts import PromptBatch
from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.modules.critic_pass import KeptValues, critic_values
from align.modules.learner import Plan, RLBatch, as_token_mean, corrected
from align.modules.options import GAE, KLPenalty, ScoreShaping, ValueTraining
from align.modules.rl import RLModule
from align.observability.timing import Timer
from align.rollout.types import Scored

__all__ = ["ActorCriticModule", "GAEBatch"]


@dataclass
class GAEBatch(RLBatch):
    """A rollout ready for PPO or TRPO updates. ``N`` rows, ``T = P + R`` tokens, ``R`` response tokens.

    Inherited: ``input_ids`` (N, T), ``attention_mask`` (N, T), ``response_mask`` (N, R) bool,
    ``old_logprobs`` (N, R), ``advantages`` (N, R) (whitened when ``gae.whiten_advantages``), ``ref_logprobs``
    (N, R) or None when no KL term is used. Every (N, R) tensor is 0 at masked positions.
    """

    values: torch.Tensor | None = None  # (N, R) V(s_t) at rollout time
    returns: torch.Tensor | None = None  # (N, R) value targets: unwhitened GAE advantages + values
    rewards: torch.Tensor | None = None  # (N, R) per-token rewards: -kl coef * kl, score at the last valid token
    kl: torch.Tensor | None = None  # (N, R) per-token KL estimate to the reference (0 without a reference)
    scores: torch.Tensor | None = None  # (N,) sequence scores after penalty / whitening / scaling / clipping
    metrics: dict = field(default_factory=dict)  # rollout/* and train/* floats of the rollout that built it
    plan: Plan | None = None  # the first epoch's minibatches, drawn when the values were computed
    kept: KeptValues | None = None  # the values of plan[0][0] with their graph (critic_pass)


class ActorCriticModule(RLModule):
    """Base of PPO and TRPO: the value model, the GAE batch and the value updates (module docstring)."""

    keeps_critic_pass = True
    """Whether the critic's rollout pass may keep its graph for the update's first micro-batch
    (:mod:`align.modules.critic_pass`)."""

    def __init__(
        self,
        policy: PolicyModel,
        kl: KLPenalty = KLPenalty(coef=0.05, placement="reward"),
        gae: GAE = GAE(),
        scores: ScoreShaping = ScoreShaping(),
        value: ValueTraining = ValueTraining(),
        **kwargs,
    ):
        if policy.critic is None:
            raise AlignConfigError(
                "model.policy.critic: this algorithm needs a value model; set {kind: shared} (a head "
                "on the policy backbone) or {kind: separate} (a critic, e.g. with model: <reward "
                "model>)"
            )
        if kl.placement != "reward":
            raise AlignConfigError(
                "model.kl.placement: PPO and TRPO shape the KL into the per-token rewards; expected 'reward'"
            )
        super().__init__(policy, kl=kl, **kwargs)
        self.gae, self.scores, self.value = gae, scores, value
        self.headline_metrics = (
            "val/reward_mean",
            *(f"val/reward/{n}" for n in self.sampler.reward.names),
            "val/accuracy",
            "val/kl",
        )

    def value_parameters(self) -> list[torch.nn.Parameter]:
        """The value model's parameters: the separate critic and its head, or the shared head."""
        assert self.policy.critic is not None  # checked by __init__
        return list(self.policy.critic.parameters())

    @property
    def warming_up(self) -> bool:
        """Whether the current rollout (the latest one sampled) trains the value model only."""
        return self.sampler.rollouts <= self.value.warmup_rollouts

    def keeps_first_values(self) -> bool:
        """Whether the rollout's critic pass keeps its graph for the update's first micro-batch: a separate critic
        (a shared head's values come with the policy pass) on one process (:mod:`align.modules.critic_pass`)."""
        from lightning.pytorch.strategies import SingleDeviceStrategy

        critic = self.policy.critic
        one_process = self._trainer is None or isinstance(self.trainer.strategy, SingleDeviceStrategy)
        return self.keeps_critic_pass and critic is not None and critic.separate and one_process

    def transform_scores(self, scores: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """The score options (:func:`align.core.stats.transform_scores`), whitening over every rank. ``(N,) -> (N,)``;
        ``truncated`` (N,) marks responses cut without EOS."""
        s = self.scores
        return stats.transform_scores(
            scores, truncated, s.missing_eos_penalty, s.whiten, s.scale, s.clip, all_reduce=self.all_reduce_sum
        )

    # ------------------------------------------------------------------ scored rollout -> GAEBatch
    @torch.no_grad()
    def make_batch(self, scored: Scored) -> GAEBatch:
        """Scores -> reference log-probs -> values -> KL-shaped rewards -> GAE -> returns (module docstring); timed
        into the rollout's ``time/scoring_s``."""
        rollout, total, parts = scored.rollout, scored.rewards, scored.parts  # (N,), {name: (N,)}
        with Timer(scored.timings, "time/scoring_s"):
            turn_rewards = None
            if rollout.token_rewards is not None:  # multi-turn: each turn's environment reward on its last token
                assert self.sampler.environment is not None  # only an environment's episodes have turn rewards
                weight = self.sampler.environment.spec.weight
                turn_rewards = weight * rollout.token_rewards  # (N, R)
                scores = self.transform_scores(total - weight * parts["env"], rollout.truncated)
            else:
                scores = self.transform_scores(total, rollout.truncated)
            mask, old_logprobs = rollout.response_mask, rollout.old_logprobs
            ref_logprobs = self.reference_logprobs(rollout)
            plan = None
            if self.keeps_first_values():
                widths = (
                    RLBatch.row_widths(rollout.attention_mask, mask.shape[1])
                    if self.updates.max_tokens_per_microbatch is not None
                    else None
                )
                plan = self.learner.plan(len(rollout), widths)
            values, kept = critic_values(self.scorer, rollout, plan[0][0] if plan else None)  # (N, R)
            values = torch.where(mask, values, torch.zeros_like(values))
            zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
            reference = old_logprobs if ref_logprobs is None else ref_logprobs
            kl = torch.where(mask, kl_estimate(old_logprobs, reference, kind=self.kl.kind), zero)  # (N, R)
            g = self.gae
            out = ADVANTAGE_ESTIMATORS["gae"](
                AdvantageInputs(
                    scores,
                    mask,
                    kl=kl,
                    kl_coef=self.kl_controller.value,
                    token_rewards=turn_rewards,
                    values=values,
                    gamma=g.gamma,
                    lam=g.lam,
                    whiten=g.whiten_advantages,
                    all_reduce=self.all_reduce_sum,
                )
            )
        returns, raw = out.returns, out.raw  # (N, R) each
        assert returns is not None and raw is not None  # the gae estimator computes both
        metrics = self.sampler.rollout_metrics(scored)
        sums = self.all_reduce_sum(
            torch.stack(
                [
                    masked_sum(kl, mask, dim=1).sum(),
                    kl.sum(),
                    mask.sum().float(),
                    torch.tensor(float(len(rollout)), device=kl.device),
                ]
            )
        )
        metrics["train/kl"] = float(sums[0] / sums[3].clamp(min=1))
        metrics["train/kl_per_token"] = float(sums[1] / sums[2].clamp(min=1))
        metrics["train/kl_coef"] = float(self.kl_controller.value)
        metrics["train/explained_variance"] = float(
            stats.explained_variance(values, returns, mask, all_reduce=self.all_reduce_sum)
        )
        metrics["train/returns_mean"] = float(masked_mean(returns, mask))
        metrics["train/values_mean"] = float(masked_mean(values, mask))
        metrics["train/advantages_mean"] = float(masked_mean(raw, mask))
        metrics["train/score_mean"] = float(scores.mean())
        metrics["rollout/truncated_frac"] = float(rollout.truncated.float().mean())
        return GAEBatch(
            rollout.input_ids,
            rollout.attention_mask,
            mask,
            old_logprobs,
            corrected(out.advantages, rollout),
            ref_logprobs,
            values=values,
            returns=returns,
            rewards=out.token_rewards,
            kl=kl,
            scores=scores,
            metrics=metrics,
            plan=plan,
            kept=kept,
        )

    # ------------------------------------------------------------------ the value model
    def value_loss(
        self, micro: GAEBatch, normaliser: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Squared error to the returns, clipped around the rollout values: ``(loss share, metrics)``."""
        mask = micro.response_mask
        assert micro.values is not None and micro.returns is not None  # set by make_batch
        loss, clipfrac = value_loss(
            values,
            micro.values,
            micro.returns,
            mask,
            self.value.clip,
            agg=self.updates.loss_aggregation,
            normaliser=normaliser,
        )
        return loss, {"train/value_loss": as_token_mean(loss, normaliser, mask), "train/value_clipfrac": clipfrac}

    def _value_only_loss(
        self,
        micro: GAEBatch,
        normaliser: torch.Tensor,
        kept: KeptValues | None = None,
    ) -> tuple[torch.Tensor, dict]:
        # During warm-up a shared head trains alone: the policy backbone must not move before its first update.
        values = kept.take(micro.rows) if kept is not None else None
        if values is None:
            values = self.scorer.values(micro, detach_backbone=self.warming_up)
        return self.value_loss(micro, normaliser, values)

    def update_value(self, data: GAEBatch) -> dict[str, float]:
        """``updates.epochs`` x ``updates.minibatches`` optimizer steps on the value loss alone."""
        return self.update(data, partial(self._value_only_loss, kept=data.kept), data.plan)

    def update_policy(self, data: GAEBatch) -> dict[str, float]:
        """The algorithm's own step on ``data`` (the policy, and the value model with it or after it)."""
        raise NotImplementedError

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        scored = self.next_scored(batch)
        if scored is None:  # a filtered source: the next batch adds to this update's groups
            return
        data = self.make_batch(scored)  # adds its passes to the rollout's time/scoring_s
        self.timings = dict(scored.timings)
        warmup = self.warming_up
        with Timer(self.timings, "time/update_s"):
            updates = self.update_value(data) if warmup else self.update_policy(data)
        assert data.kl is not None  # set by make_batch
        self.update_kl_controller(data.kl, data.response_mask)
        self.log_metrics({**data.metrics, **updates, **self.timings, "train/critic_warmup": float(warmup)})

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        if not self.kl.enabled:
            return
        rollout = self.sampler.rollout(batch, 1, version=self.learner.steps)
        kl = kl_estimate(rollout.old_logprobs, self.scorer.reference_logprobs(rollout), self.kl.kind)
        self.held_out.add_sum("kl", masked_sum(kl, rollout.response_mask, dim=1))
