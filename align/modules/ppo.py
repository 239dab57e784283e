"""PPO-RLHF: a policy, a value model and a reward model (Ouyang et al. 2022, arXiv 2203.02155; Ziegler et al.
2019, arXiv 1909.08593), with the clipped surrogate of Schulman et al. 2017 (arXiv 1707.06347).

One training step is one rollout, turned into a :class:`PPOBatch` by :meth:`PPOModule.make_batch`:

1. **Rollout.** ``group_size`` completions per prompt from the rollout engine, with the sampling
   log-probs recorded (computed as in training, same temperature).
2. **Scores.** The weighted total of the reward model's score (``reward_model``, a
   :class:`~align.models.reward.RewardModelScorer` loaded at setup and logged as ``rm``) and any reward
   callables (``rewards``); ``eval_rewards`` are logged but weigh 0. Then ``scores``
   (:class:`~align.modules.options.ScoreShaping`), in this order and each off by default: a penalty for
   responses truncated without EOS (``missing_eos_penalty``), whitening over the rollout (``whiten``, mean
   and std over every rank), a constant factor (``scale``) and clipping to ``[-clip, clip]``.
3. **Per-token rewards.** :func:`align.core.advantages.shape_rewards`: ``-kl.coef * KL_t`` on every response
   token (``kl.estimator``, ``k1`` by default, against the reference policy) and the score on the last valid
   token: the first EOS, or the last token of a response truncated at ``max_new_tokens`` (docs/algorithms.md, "Response mask").
   A multi-turn episode (``environment``) gets each turn's environment reward on that turn's last token; the score
   options of step 2 then apply to the other rewards only (reward functions, reward model), at the episode's end.
4. **Values** ``V(s_t)`` from the value model at rollout time, then :func:`align.core.advantages.gae` (``gae.gamma``,
   ``gae.lam``): advantages and returns = unwhitened advantages + values. Advantages (only) are whitened over
   the valid tokens of the rollout on every rank (:func:`align.core.stats.whiten`, ``gae.whiten_advantages``).

The update (:meth:`PPOModule.update_policy`) runs ``updates.epochs`` passes over ``updates.minibatches``
minibatches (one optimizer step each, micro-batches accumulated, gradients clipped; :meth:`align.modules.rl.
RLModule.update`) of ``policy_loss + value.coef * value_loss``: the clipped surrogate minus ``entropy_coef``
times the entropy, and the squared-error value loss, clipped around the rollout values when ``value.clip`` is
set. During the first ``value.warmup_rollouts`` rollouts only the value loss is optimised
(:meth:`PPOModule.update_value`); a shared value head then trains alone, so the policy does not move.

KL coefficient: fixed (``kl.coef``), or adaptive when ``kl.target`` is set (:class:`align.core.kl.
AdaptiveKLController`, Ziegler et al.), updated after every rollout with the mean per-sequence KL averaged
over all ranks, ``n_steps`` = sequences on all ranks (:meth:`align.modules.rl.RLModule.update_kl_controller`).
Its state is saved in checkpoints.

Value model: the policy's ``critic`` block. ``critic: {kind: shared}`` puts a scalar head on the policy backbone;
``critic: {kind: separate}`` gives a critic with its own backbone loaded from ``critic.model`` (for example the
reward model; the policy when unset). When the critic backbone is a reward-model export, the critic's head
starts from the reward head (``policy.critic.head_from_reward_model``), so the critic starts by predicting the
reward model's score of the prefix instead of 0.

Subclassing (TRPO and friends): :meth:`make_batch` (rollout to advantages and returns), :meth:`policy_loss`,
:meth:`value_loss`, :meth:`update_value` and :meth:`update_policy` are separate; a subclass that replaces the
policy step overrides :meth:`update_policy` and calls :meth:`update_value` for the critic.
"""


from __future__ import annotations

from dataclasses import dataclass, field

import torch

from align.core import stats
from align.core.advantages import gae, shape_rewards
from align.data.prompts import PromptBatch
from align.errors import AlignConfigError
from align.core.kl import kl_estimate
from align.core.masks import masked_mean, masked_sum
from align.core.losses import aggregate, value_loss
from align.core.policy_losses import ppo_policy_loss
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel, TokenLogprobs
from align.modules.base import param_groups
from align.modules.critic_pass import KeptCriticPass
from align.modules.options import GAE, ClipRange, KLPenalty, ScoreShaping, Updates, ValueTraining
from align.modules.rl import RLBatch, RLModule, Timer
from align.rollout.rewards import RewardModelSpec, RewardSpec
from align.rollout.engine import Rollout


@dataclass
class PPOBatch(RLBatch):
    """A rollout ready for PPO updates. ``N`` rows, ``T = P + R`` tokens, ``R`` response tokens.

    Inherited: ``input_ids`` (N, T), ``attention_mask`` (N, T), ``response_mask`` (N, R) bool,
    ``old_logprobs`` (N, R), ``advantages`` (N, R) (whitened when ``gae.whiten_advantages``), ``ref_logprobs``
    (N, R) or None when no KL term is used. Every (N, R) tensor is 0 at masked positions.
    """

    values: torch.Tensor | None = None  # (N, R) V(s_t) at rollout time
    returns: torch.Tensor | None = None  # (N, R) value targets: unwhitened GAE advantages + values
    rewards: torch.Tensor | None = None  # (N, R) per-token rewards: -kl coef * kl, score at the last valid token
    kl: torch.Tensor | None = None  # (N, R) per-token KL estimate to the reference (0 without a reference)
    scores: torch.Tensor | None = None  # (N,) sequence scores after penalty / whitening / scaling / clipping
    metrics: dict = field(default_factory=dict)  # rollout/* and time/* floats of the step that built it


class PPOModule(RLModule):
    """PPO-RLHF on prompt data (:class:`align.data.prompts.PromptDataModule`), manual optimization.

    ``trainer.max_steps`` counts optimizer steps: ``updates.epochs * updates.minibatches`` per rollout, critic
    warm-up rollouts included.

    Logged per rollout: ``train/loss``, ``train/policy_loss``, ``train/value_loss``, ``train/entropy``,
    ``train/kl`` (mean per-sequence KL estimate to the reference, summed over tokens), ``train/kl_per_token``,
    ``train/kl_coef``, ``train/clipfrac``, ``train/approx_kl``, ``train/value_clipfrac``,
    ``train/explained_variance`` (of the rollout values for the returns, over valid tokens and all ranks),
    ``train/returns_mean``, ``train/values_mean``, ``train/advantages_mean`` (before whitening),
    ``train/score_mean`` (after the score options), ``train/critic_warmup`` (1 while warming up),
    ``rollout/reward_mean``, ``rollout/reward_std``, ``rollout/reward/<name>`` (every reward, eval rewards
    included), ``rollout/response_length``, ``rollout/tokens_per_s``, ``rollout/completion_tokens``,
    ``rollout/truncated_frac`` and
    ``time/generation_s``, ``time/scoring_s``, ``time/update_s``.

    Held out (greedy by default, see :class:`~align.modules.rl.RLModule`): ``val/reward_mean`` (the training
    reward, e.g. the reward-model score), ``val/reward/<name>`` for every reward and eval reward (e.g. the
    true task reward next to the reward-model score, so reward hacking shows), ``val/accuracy`` and
    ``val/kl``: the mean per-sequence KL estimate to the reference of completions sampled with the training
    ``sampling`` settings (one per held-out prompt).
    """

    keeps_critic_pass = True
    """Whether the critic's rollout pass keeps its graph for the update's first micro-batch
    (:mod:`align.modules.critic_pass`)."""

    def __init__(
        self,
        policy: PolicyModel | None = None,
        rewards: list[RewardSpec | str] | None = None,
        reward_model: RewardModelSpec | str | None = None,
        eval_rewards: list[RewardSpec | str] | None = None,
        updates: Updates = Updates(epochs=4),
        kl: KLPenalty = KLPenalty(coef=0.05, placement="reward"),
        clip: ClipRange = ClipRange(),
        gae: GAE = GAE(),
        scores: ScoreShaping = ScoreShaping(),
        value: ValueTraining = ValueTraining(),
        entropy_coef: float = 0.0,
        **kwargs,
    ):
        """
        Args:
            policy: The model to train, with ``critic`` set; null means the shipped SFT-warmed tiny model
                (``tiny-sort``) with a separate critic started from the shipped reward model (``tiny-sort-rm``).
            rewards: Further training rewards, functions or classes with weights (docs/rewards.md), added to the
                reward-model score.
            reward_model: A trained reward model (an export directory, a reward-model ``.ckpt``, or
                ``tiny-sort-rm``), scored as the reward named ``rm``: a path, or ``{path, weight, batch_size}``.
                With neither this nor ``rewards`` set: ``tiny-sort-rm``.
            eval_rewards: Rewards that are only logged, never trained on; null: exact match on the sort task when
                the default reward model is used, else none.
            updates: Passes over each rollout (default 4), optimizer steps per pass, micro-batches, clipping.
            kl: KL penalty to the reference, shaped into the per-token rewards (``placement: reward``); a
                ``target`` makes the coefficient adaptive.
            clip: Clip range of the importance ratio (``low``; ``high``: null for symmetric).
            gae: Discount, lambda and advantage whitening.
            scores: Penalty, whitening, scaling and clipping of the sequence scores.
            value: Value loss weight and clipping, the value learning-rate scale and critic warm-up.
            entropy_coef: Weight of the entropy bonus (subtracted from the loss); 0: none.
        """
        if clip.level != "token":
            raise AlignConfigError(f"model.clip.level: expected 'token' (GAE gives each token its own advantage), "
                                   f"got {clip.level!r}")
        default_rm = reward_model is None and rewards is None and kwargs.get("environment") is None
        if default_rm:
            reward_model = "tiny-sort-rm"
        if eval_rewards is None:
            eval_rewards = [RewardSpec("align.rewards.sort_exact_match")] if default_rm else []
        if policy is None:
            policy = PolicyModel("tiny-sort", critic=CriticSettings(kind="separate", model="tiny-sort-rm"))
        if policy.critic is None:
            raise AlignConfigError("model.policy.critic: PPO needs a value model; set {kind: shared} (a head on the "
                                   "policy backbone) or {kind: separate} (a critic, e.g. with model: <reward model>)")
        if kl.placement != "reward":
            raise AlignConfigError("model.kl.placement: PPO shapes the KL into the per-token rewards; expected 'reward'")
        if entropy_coef < 0:
            raise AlignConfigError(f"model.entropy_coef: expected >= 0, got {entropy_coef}")
        super().__init__(policy, rewards=rewards, reward_model=reward_model, eval_rewards=eval_rewards,
                         updates=updates, kl=kl, **kwargs)
        self.clip, self.gae, self.scores, self.value = clip, gae, scores, value
        self.entropy_coef = entropy_coef
        self.critic_pass = KeptCriticPass()
        self.log_entropy = self.log_entropy or entropy_coef > 0
        names = self.reward.names
        self.headline_metrics = ("val/reward_mean", *(f"val/reward/{n}" for n in names), "val/accuracy", "val/kl")

    def configure_optimizers(self):
        """One optimizer; the value head / critic parameters get ``value.lr_scale`` times the learning rate."""
        if self.value.lr_scale == 1.0:
            return super().configure_optimizers()
        value_ids = {id(p) for p in self.policy.critic.parameters()}
        groups = []
        for group in param_groups(self):  # each weight-decay group split into policy and value parameters
            options = {k: v for k, v in group.items() if k != "params"}
            for is_value in (False, True):
                params = [p for p in group["params"] if (id(p) in value_ids) == is_value]
                if params:
                    groups.append({"params": params, **options, "value_params": is_value})
        optimizer = self.optimizer(groups)
        for group in optimizer.param_groups:
            if group["value_params"]:
                group["lr"] *= self.value.lr_scale
        return self.with_scheduler(optimizer)

    # ------------------------------------------------------------------ rollout -> PPOBatch
    @property
    def warming_up(self) -> bool:
        """Whether the current rollout (the latest one sampled) trains the value model only."""
        return self.rl_counters["rollouts"] <= self.value.warmup_rollouts

    def transform_scores(self, scores: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        """The score options (:func:`align.core.stats.transform_scores`), whitening over every rank. ``(N,) -> (N,)``."""
        s = self.scores
        return stats.transform_scores(scores, rollout.truncated, s.missing_eos_penalty, s.whiten, s.scale, s.clip,
                                      all_reduce=self.all_reduce_sum)

    @torch.no_grad()
    def make_batch(self, batch: PromptBatch) -> PPOBatch:
        """Rollout -> scores -> KL-shaped per-token rewards -> values -> GAE -> returns (module docstring)."""
        timings: dict[str, float] = {}
        with Timer(timings, "time/generation_s"):
            rollout = self.rollout(batch)
        with Timer(timings, "time/scoring_s"):
            total, parts = self.score_rewards(batch, rollout)  # (N,), {name: (N,)}
            turn_rewards = None
            if rollout.token_rewards is not None:  # multi-turn: each turn's environment reward on its last token
                weight = self.environment.spec.weight
                turn_rewards = weight * rollout.token_rewards  # (N, R)
                scores = self.transform_scores(total - weight * parts["env"], rollout)
            else:
                scores = self.transform_scores(total, rollout)
            mask, old_logprobs = rollout.response_mask, rollout.old_logprobs
            ref_logprobs = self.reference_logprobs(rollout)
            values = self.critic_pass.values(self, rollout, keep=self.keeps_critic_pass)  # (N, R)
            values = torch.where(mask, values, torch.zeros_like(values))
            rewards, kl = shape_rewards(scores, old_logprobs, old_logprobs if ref_logprobs is None else ref_logprobs,
                                        mask, self.kl_controller.value, kind=self.kl.kind, token_rewards=turn_rewards)
            raw_advantages, returns = gae(rewards, values, mask, self.gae.gamma, self.gae.lam)
            advantages = (stats.whiten(raw_advantages, mask, all_reduce=self.all_reduce_sum)
                          if self.gae.whiten_advantages else raw_advantages)
        metrics = self.rollout_metrics(rollout, total, parts)
        seq_kl = masked_sum(kl, mask, dim=1)  # (N,)
        sums = self.all_reduce_sum(torch.stack([seq_kl.sum(), kl.sum(), mask.sum().float(),
                                                torch.tensor(float(len(rollout)), device=kl.device)]))
        metrics["train/kl"] = float(sums[0] / sums[3].clamp(min=1))
        metrics["train/kl_per_token"] = float(sums[1] / sums[2].clamp(min=1))
        metrics["train/kl_coef"] = float(self.kl_controller.value)
        metrics["train/explained_variance"] = float(stats.explained_variance(values, returns, mask,
                                                                             all_reduce=self.all_reduce_sum))
        metrics["train/returns_mean"] = float(masked_mean(returns, mask))
        metrics["train/values_mean"] = float(masked_mean(values, mask))
        metrics["train/advantages_mean"] = float(masked_mean(raw_advantages, mask))
        metrics["train/score_mean"] = float(scores.mean())
        metrics["rollout/truncated_frac"] = float(rollout.truncated.float().mean())
        metrics.update(timings)
        return PPOBatch(rollout.input_ids, rollout.attention_mask, mask, old_logprobs, advantages, ref_logprobs,
                        values=values, returns=returns, rewards=rewards, kl=kl, scores=scores, metrics=metrics)

    # ------------------------------------------------------------------ losses
    def policy_loss(self, micro: PPOBatch, normaliser: torch.Tensor, out: TokenLogprobs
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped surrogate minus ``entropy_coef`` times the entropy: ``(loss share, metrics)``."""
        mask, agg = micro.response_mask, self.updates.loss_aggregation
        old = out.logprobs.detach() if self.on_policy else micro.old_logprobs
        loss, surrogate = ppo_policy_loss(out.logprobs, old, micro.advantages, mask, self.clip.low, self.clip.high,
                                          agg=agg, normaliser=normaliser)
        metrics = {"train/policy_loss": self.as_token_mean(loss, normaliser, mask), "train/clipfrac": surrogate.clipfrac,
                   "train/approx_kl": surrogate.approx_kl}
        if out.entropy is not None:
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * aggregate(out.entropy, mask, agg, normaliser)
            metrics["train/entropy"] = masked_mean(out.entropy.detach(), mask)
        return loss, metrics

    def value_loss(self, micro: PPOBatch, normaliser: torch.Tensor, values: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Squared error to the returns, clipped around the rollout values: ``(loss share, metrics)``."""
        mask = micro.response_mask
        loss, clipfrac = value_loss(values, micro.values, micro.returns, mask, self.value.clip,
                                    agg=self.updates.loss_aggregation, normaliser=normaliser)
        return loss, {"train/value_loss": self.as_token_mean(loss, normaliser, mask), "train/value_clipfrac": clipfrac}

    def _joint_loss(self, micro: PPOBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict]:
        kept = self.critic_pass.take(self.current_rows)
        out = self.token_logprobs(micro, return_entropy=self.log_entropy, return_values=kept is None)
        p_loss, p_metrics = self.policy_loss(micro, normaliser, out)
        v_loss, v_metrics = self.value_loss(micro, normaliser, out.values if kept is None else kept)
        loss = p_loss + self.value.coef * v_loss
        return loss, {**p_metrics, **v_metrics, "train/loss": self.as_token_mean(loss, normaliser, micro.response_mask)}

    def _value_only_loss(self, micro: PPOBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict]:
        # During warm-up a shared head trains alone: the policy backbone must not move before its first update.
        values = self.critic_pass.take(self.current_rows)
        if values is None:
            values = self.policy.values(micro.input_ids, micro.attention_mask, response_length=micro.response_length,
                                        detach_backbone=self.warming_up, padding_free=self.updates.padding_free)
        return self.value_loss(micro, normaliser, values)

    # ------------------------------------------------------------------ updates
    def update_value(self, data: PPOBatch) -> dict[str, float]:
        """``updates.epochs`` x ``updates.minibatches`` optimizer steps on the value loss alone."""
        return self.update(data, self._value_only_loss)

    def update_policy(self, data: PPOBatch) -> dict[str, float]:
        """The PPO step: ``updates.epochs`` x ``updates.minibatches`` optimizer steps on policy + value loss."""
        return self.update(data, self._joint_loss)

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        data = self.make_batch(batch)
        warmup = self.warming_up
        timings: dict[str, float] = {}
        with Timer(timings, "time/update_s"):
            updates = self.update_value(data) if warmup else self.update_policy(data)
        self.critic_pass.clear()  # an update that did not read them leaves no graph behind
        self.update_kl_controller(data.kl, data.response_mask)
        self.timings = {k: v for k, v in {**data.metrics, **timings}.items() if k.startswith("time/")}
        self.log_metrics({**data.metrics, **updates, **timings, "train/critic_warmup": float(warmup)})

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        if not self.kl.enabled:
            return
        rollout = self.rollout(batch, 1)
        kl = kl_estimate(rollout.old_logprobs, self.reference_logprobs(rollout), self.kl.kind)
        self._val_add("kl", masked_sum(kl, rollout.response_mask, dim=1))
