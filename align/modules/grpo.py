"""GRPO: group relative policy optimization (Shao et al. 2024, arXiv 2402.03300).

Each training step samples ``group_size`` completions for every prompt of the batch, scores them with the
reward functions, and turns rewards into advantages relative to their group
(:func:`align.core.advantages.group_advantages`). The policy is updated with the clipped surrogate
(:func:`align.core.policy_losses.ppo_policy_loss`) for ``updates.epochs`` passes (the paper's mu) over ``updates.minibatches``
minibatches, using the sampling log-probs as the old policy.

Departures and options (nested YAML blocks, :mod:`align.modules.options`):

* ``advantages.estimator`` (docs/algorithms.md): ``grpo`` (the paper); ``rloo``, the leave-one-out baseline (RLOO,
  Ahmadian et al. 2024, arXiv 2402.14740); ``reinforce_pp`` (REINFORCE++, Hu 2025, arXiv 2501.03262): per-token
  returns with the per-token KL in the reward, whitened over every valid token of the global batch;
  ``reinforce_pp_baseline``: the group mean subtracted first. The REINFORCE++ estimators give per-token advantages.
* ``advantages.std_scale`` (``grpo`` only): ``group`` (the paper, and null), ``batch`` or ``none`` (Dr. GRPO, Liu et al.
  2025, arXiv 2503.20783).
* ``updates.loss_aggregation``: ``token_mean`` over the whole step (default, as in DAPO, Yu et al. 2025,
  arXiv 2503.14476) instead of the paper's per-sequence mean (``seq_mean``); ``constant`` is Dr. GRPO's.
* ``clip.high``: DAPO's decoupled upper clip range. ``clip.level: sequence``: GSPO's sequence-level importance ratio
  (Zheng et al. 2025, arXiv 2507.18071; :func:`align.core.policy_losses.importance_ratio`); the paper's aggregation is
  ``updates.loss_aggregation: seq_mean``.
* KL to the reference: ``kl.placement: loss`` adds ``kl.coef * k3`` per token to the loss (the paper);
  ``reward`` subtracts ``kl.coef`` times the summed per-token estimate (``k1`` by default there) from each
  completion's reward before the group baseline (REINFORCE++: per token, before the returns-to-go).
  ``kl.coef: 0`` loads no reference at all; ``kl.target`` makes the coefficient adaptive.
* ``dynamic_sampling``: DAPO's dynamic sampling. Groups whose rewards all match are dropped and prompt batches
  are sampled on the following training steps until a full batch of informative groups is buffered
  (:mod:`align.rollout.filter`); a training step that only samples takes no optimizer step.
* ``overlong`` (every RL module): DAPO's soft overlong punishment in the reward.
* With one epoch and one minibatch the update is exactly on-policy: the importance ratio is taken against
  the current log-probs (detached), so it is 1 and no separate old-policy pass is needed. Otherwise the
  log-probs recorded while sampling serve as the old policy; they are computed exactly as in training.
"""

from __future__ import annotations

import logging

import torch

from align.core.advantages import group_advantages, reinforce_pp_advantages, rloo_advantages
from align.trainer.checkpointing import gather_objects
from align.data.prompts import PromptBatch
from align.errors import AlignConfigError
from align.core.kl import kl_estimate
from align.core.masks import masked_mean, masked_sum
from align.core.losses import aggregate
from align.core.policy_losses import ppo_policy_loss
from align.models.policy import PolicyModel
from align.modules.options import ClipRange, DynamicSampling, GroupAdvantages
from align.modules.rl import RLBatch, RLModule, Timer
from align.rollout.rewards import RewardModelSpec, RewardSpec
from align.rollout.filter import GroupFilter

log = logging.getLogger(__name__)


class GRPOModule(RLModule):
    """GRPO on prompt data (:class:`align.data.prompts.PromptDataModule`), manual optimization.

    ``trainer.max_steps`` counts optimizer steps: ``updates.epochs * updates.minibatches`` per rollout. With
    ``dynamic_sampling.enabled`` an update may consume several data-loader batches, so an epoch yields fewer.

    Logged per rollout: ``train/loss``, ``train/policy_loss``, ``train/kl``, ``train/kl_coef``, ``train/clipfrac``,
    ``train/approx_kl``, ``train/entropy``, ``rollout/reward_mean``, ``rollout/reward_std``,
    ``rollout/reward/<name>``, ``rollout/response_length``, ``rollout/tokens_per_s``, ``rollout/completion_tokens``,
    ``rollout/truncated_frac``, ``rollout/zero_std_frac`` (groups with no learning signal), and
    ``time/generation_s`` / ``time/scoring_s`` / ``time/update_s``. With ``overlong.buffer``:
    ``rollout/reward/overlong``. With ``dynamic_sampling.enabled``, logged once per update:
    ``rollout/sampling_batches``, ``rollout/kept_groups``, ``rollout/kept_frac``
    (:class:`align.rollout.filter.GroupFilter`); the reward metrics and ``rollout/zero_std_frac`` are then over
    the groups trained on, the timings summed over the batches sampled for the update. Validation: see :class:`~align.modules.rl.RLModule`.
    """

    def __init__(
        self,
        policy: PolicyModel | None = None,
        rewards: list[RewardSpec | str] | None = None,
        reward_model: RewardModelSpec | str | None = None,
        group_size: int = 8,
        clip: ClipRange = ClipRange(),
        advantages: GroupAdvantages = GroupAdvantages(),
        dynamic_sampling: DynamicSampling = DynamicSampling(),
        **kwargs,
    ):
        """
        Args:
            policy: The model to train; null means the shipped SFT-warmed tiny model (``tiny-sort``).
            rewards: Reward functions with weights (see docs/rewards.md); null with no ``reward_model``: exact
                match on the sort task.
            reward_model: A trained reward model, scored as the training reward named ``rm``: a path, or
                ``{path, weight, batch_size}``.
            group_size: Completions sampled per prompt (G); advantages are relative to the group.
            clip: Clip range of the importance ratio (``low``, and DAPO's ``high``) and its ``level`` (GSPO).
            advantages: How rewards become advantages (``estimator``, and ``std_scale`` for ``grpo``).
            dynamic_sampling: DAPO's dynamic sampling: drop groups whose rewards all match and sample further
                prompt batches (at most ``max_batches`` per update) until the update has a full batch.
        """
        if group_size < advantages.min_group_size:
            raise AlignConfigError(f"model.group_size: expected >= 2 for the group baseline of advantages.estimator "
                                   f"{advantages.estimator}, got {group_size}")
        if rewards is None and reward_model is None and kwargs.get("environment") is None:
            rewards = [RewardSpec("align.rewards.sort_exact_match")]
        super().__init__(policy if policy is not None else PolicyModel("tiny-sort"), rewards=rewards,
                         reward_model=reward_model, group_size=group_size, **kwargs)
        self.clip, self.advantages = clip, advantages
        self.group_filter = self._group_filter(dynamic_sampling)
        if self.group_filter is not None:  # a fill takes up to max_batches batches without an update by design
            self.max_batches_without_update = max(self.max_batches_without_update, 2 * dynamic_sampling.max_batches)

    def _group_filter(self, options: DynamicSampling) -> GroupFilter | None:
        if not options.enabled:
            return None
        names = self.reward.names + (["overlong"] if self.overlong.enabled else [])
        if options.reward is not None and options.reward not in names:
            raise AlignConfigError(f"model.dynamic_sampling.reward: expected one of the rewards {names} or null, "
                                   f"got {options.reward!r}")
        return GroupFilter(self.group_size, options.max_batches, options.reward)

    def fill(self, batch: PromptBatch, rollout, rewards: torch.Tensor, parts: dict):
        """Dynamic sampling: ``(rollout, rewards, parts)`` to update on, or None while the batch fills."""
        if self.group_filter is None:
            return rollout, rewards, parts
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self._trainer is not None else (1, 0)
        filled = self.group_filter.add(rollout, rewards, parts, len(batch), self.tokenizer.pad_token_id,
                                       self.all_reduce_sum, rank, world)
        return None if filled is None else (filled.rollout, filled.rewards, filled.parts)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.group_filter is not None:  # every rank's fill in progress (empty when saved at an update)
            checkpoint["align"]["dynamic_sampling"] = gather_objects(self.group_filter.state_dict())

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self._saved_fill = (checkpoint.get("align") or {}).get("dynamic_sampling")

    def on_train_start(self) -> None:
        saved, self._saved_fill = getattr(self, "_saved_fill", None), None
        if self.group_filter is None or not saved:
            return
        if len(saved) != self.trainer.world_size:  # resharded data: a fill of other ranks' prompts cannot continue
            log.warning("dynamic sampling: the checkpoint holds the fills of %d ranks, this run has %d; the "
                        "buffered groups are dropped", len(saved), self.trainer.world_size)
            return
        self.group_filter.load_state_dict(saved[self.trainer.global_rank], self.device)

    def _loss(self, micro: RLBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict]:
        out = self.token_logprobs(micro, return_entropy=self.log_entropy)
        mask, agg = micro.response_mask, self.updates.loss_aggregation
        old = out.logprobs.detach() if self.on_policy else micro.old_logprobs
        policy_loss, stats = ppo_policy_loss(out.logprobs, old, micro.advantages, mask, self.clip.low,
                                             self.clip.high, agg=agg, normaliser=normaliser, level=self.clip.level)
        loss = policy_loss
        metrics = {"train/policy_loss": self.as_token_mean(policy_loss, normaliser, mask), "train/clipfrac": stats.clipfrac,
                   "train/approx_kl": stats.approx_kl}
        if self.kl.enabled:
            kl = kl_estimate(out.logprobs, micro.ref_logprobs, self.kl.kind)  # (n, r)
            if self.kl.placement == "loss":
                loss = loss + self.kl_controller.value * aggregate(kl, mask, agg, normaliser)
            metrics["train/kl"] = masked_mean(kl.detach(), mask)
        if out.entropy is not None:
            metrics["train/entropy"] = masked_mean(out.entropy.detach(), mask)
        metrics["train/loss"] = self.as_token_mean(loss, normaliser, mask)
        return loss, metrics

    def estimate_advantages(self, rewards: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """``advantages.estimator`` applied to the rewards ``(N,)``, the KL estimate of the sampled tokens ``(N, R)``
        (None without a reference) and the response mask ``(N, R)``: ``(N,)`` for ``grpo`` and ``rloo``, ``(N, R)``
        for the REINFORCE++ estimators. ``kl.placement: reward`` puts ``kl_coef * kl`` into the rewards."""
        estimator, coef = self.advantages.estimator, self.kl_controller.value
        kl = kl if self.kl.placement == "reward" else None
        if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
            group = self.group_size if estimator == "reinforce_pp_baseline" else None
            return reinforce_pp_advantages(rewards, mask, kl, coef, group, all_reduce=self.all_reduce_sum)
        if kl is not None:
            rewards = rewards - coef * masked_sum(kl, mask, dim=1)
        if estimator == "rloo":
            return rloo_advantages(rewards, self.group_size)
        return group_advantages(rewards, self.group_size, self.advantages.scale)

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        filling = self.group_filter is not None and self.group_filter.filling
        rollout, rewards, parts = self.sample_and_score(batch, fresh_timings=not filling)  # rewards (N,)
        filled = self.fill(batch, rollout, rewards, parts)
        if filled is None:  # dynamic sampling: the next batch adds to this update's groups
            self.no_update("dynamic sampling: no update could be filled with groups whose rewards differ")
            return self.log_nothing()
        rollout, rewards, parts = filled
        with Timer(self.timings, "time/update_s"):
            ref_logprobs = self.reference_logprobs(rollout)
            kl = None if ref_logprobs is None else kl_estimate(rollout.old_logprobs, ref_logprobs,
                                                               self.kl.kind)  # (N, R)
            advantages = self.estimate_advantages(rewards, kl, rollout.response_mask)  # (N,) or (N, R)
            stats = self.update(RLBatch.from_rollout(rollout, advantages, ref_logprobs), self._loss)
        grouped = rewards.view(-1, self.group_size)
        metrics = self.rollout_metrics(rollout, rewards, parts)
        metrics["rollout/zero_std_frac"] = float((grouped.std(dim=1) <= 1e-6).float().mean())
        if ref_logprobs is not None:
            metrics["train/kl_coef"] = float(self.kl_controller.value)
            self.update_kl_controller(kl, rollout.response_mask)
        self.log_metrics({**metrics, **stats, **self.timings})
