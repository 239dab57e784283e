"""GRPO: group relative policy optimization (Shao et al. 2024, arXiv 2402.03300).

Each training step takes a scored rollout from the module's rollout source (``group_size`` completions for every
prompt of the batch, scored by the reward functions), turns rewards into advantages relative to their group (a row
of :data:`align.core.estimators.ADVANTAGE_ESTIMATORS`), and updates the policy with a policy loss (a row of
:data:`align.core.policy_losses.POLICY_LOSSES`, the clipped surrogate by default) for ``updates.epochs`` passes (the
paper's mu) over ``updates.minibatches`` minibatches, using the sampling log-probs as the old policy.

Departures and options (nested YAML blocks, :mod:`align.modules.options`):

* ``advantages.estimator`` (docs/algorithms.md): ``grpo`` (the paper); ``rloo``, the leave-one-out baseline (RLOO,
  Ahmadian et al. 2024, arXiv 2402.14740); ``reinforce_pp`` (REINFORCE++, Hu 2025, arXiv 2501.03262): per-token
  returns with the per-token KL in the reward, whitened over every valid token of the global batch;
  ``reinforce_pp_baseline``: the group mean subtracted first. The REINFORCE++ estimators give per-token advantages.
* ``advantages.std_scale`` (``grpo`` only): ``group`` (the paper, and null), ``batch`` or ``none`` (Dr. GRPO, Liu et al.
  2025, arXiv 2503.20783).
* ``updates.loss_aggregation``: ``token_mean`` over the whole step (default, as in DAPO, Yu et al. 2025,
  arXiv 2503.14476) instead of the paper's per-sequence mean (``seq_mean``); ``constant`` is Dr. GRPO's.
* ``clip.high``: DAPO's decoupled upper clip range. ``policy_loss.name: gspo``: GSPO's sequence-level importance
  ratio (Zheng et al. 2025, arXiv 2507.18071); the paper's aggregation is ``updates.loss_aggregation: seq_mean``.
* KL to the reference: ``kl.placement: loss`` adds ``kl.coef * k3`` per token to the loss (the paper);
  ``reward`` subtracts ``kl.coef`` times the summed per-token estimate (``k1`` by default there) from each
  completion's reward before the group baseline (REINFORCE++: per token, before the returns-to-go).
  ``kl.coef: 0`` loads no reference at all; ``kl.target`` makes the coefficient adaptive.
* ``source: align.rollout.source.FilteredSource``: DAPO's dynamic sampling. Groups whose rewards all match are
  dropped and prompt batches are sampled on the following training steps until a full batch of informative groups
  is buffered; a training step that only samples takes no optimizer step.
* ``overlong`` (every RL module): DAPO's soft overlong punishment in the reward.
* With one epoch and one minibatch the update is exactly on-policy: the importance ratio is taken against
  the current log-probs (detached), so it is 1 and no separate old-policy pass is needed. Otherwise the
  log-probs recorded while sampling serve as the old policy; they are computed exactly as in training.
"""

from __future__ import annotations

import torch

from align.core.advantages import has_signal
from align.core.estimators import ADVANTAGE_ESTIMATORS, AdvantageInputs
from align.core.kl import kl_estimate
from align.core.losses import aggregate
from align.core.masks import masked_mean
from align.data.prompts import PromptBatch
from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.modules.learner import RLBatch, as_token_mean, policy_loss_terms
from align.modules.options import ClipRange, GroupAdvantages, PolicyLoss
from align.modules.rl import RLModule
from align.observability.timing import Timer
from align.rollout.rewards import RewardModelSpec, RewardSpec


class GRPOModule(RLModule):
    """GRPO on prompt data (:class:`align.data.prompts.PromptDataModule`), manual optimization.

    ``trainer.max_steps`` counts optimizer steps: ``updates.epochs * updates.minibatches`` per rollout. With a
    filtered source an update may consume several data-loader batches, so an epoch yields fewer.

    Logged per rollout: ``train/loss``, ``train/policy_loss``, ``train/kl``, ``train/kl_coef``, ``train/clipfrac``,
    ``train/approx_kl``, ``train/entropy``, ``rollout/reward_mean``, ``rollout/reward_std``,
    ``rollout/reward/<name>``, ``rollout/response_length``, ``rollout/tokens_per_s``, ``rollout/completion_tokens``,
    ``rollout/truncated_frac``, ``rollout/zero_std_frac`` (groups with no learning signal), and
    ``time/generation_s`` / ``time/scoring_s`` / ``time/update_s``. With ``overlong.buffer``:
    ``rollout/reward/overlong``. With :class:`~align.rollout.source.FilteredSource`, logged once per update:
    ``rollout/sampling_batches``, ``rollout/kept_groups``, ``rollout/kept_frac``; the reward metrics and
    ``rollout/zero_std_frac`` are then over the groups trained on, the timings summed over the batches sampled for the
    update. Validation: see :class:`~align.modules.rl.RLModule`.
    """

    def __init__(
        self,
        policy: PolicyModel | None = None,
        rewards: list[RewardSpec | str] | None = None,
        reward_model: RewardModelSpec | str | None = None,
        group_size: int = 8,
        clip: ClipRange = ClipRange(),
        policy_loss: PolicyLoss = PolicyLoss(),
        advantages: GroupAdvantages = GroupAdvantages(),
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
            clip: Clip range of the policy loss (``low``, and DAPO's ``high``); null: the loss's own.
            policy_loss: The policy loss (``name``: ``clip``, ``gspo``, ``cispo``, ``sapo`` or ``gmpo``; SAPO's
                ``tau_pos``, ``tau_neg``).
            advantages: How rewards become advantages (``estimator``, and ``std_scale`` for ``grpo``).
        """
        policy_loss.clip_bounds(clip)  # a clip range set for a loss without one fails here
        if group_size < advantages.min_group_size:
            raise AlignConfigError(
                f"model.group_size: expected >= 2 for the group baseline of advantages.estimator "
                f"{advantages.estimator}, got {group_size}"
            )
        if rewards is None and reward_model is None and kwargs.get("environment") is None:
            rewards = [RewardSpec("align.rewards.sort_exact_match")]
        super().__init__(
            policy if policy is not None else PolicyModel("tiny-sort"),
            rewards=rewards,
            reward_model=reward_model,
            group_size=group_size,
            **kwargs,
        )
        self.clip, self.policy_loss, self.advantages = clip, policy_loss, advantages
        policy_loss.check_correction(self.sampler.engine)

    def _loss(self, micro: RLBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict]:
        out = self.scorer.logprobs(micro, entropy=self.log_entropy)
        loss, metrics = policy_loss_terms(micro, normaliser, out, self.policy_loss, self.clip, self.updates)
        mask = micro.response_mask
        if self.kl.enabled:
            assert micro.ref_logprobs is not None  # the KL term scores the reference (needs_reference)
            kl = kl_estimate(out.logprobs, micro.ref_logprobs, self.kl.kind)  # (n, r)
            if self.kl.placement == "loss":
                loss = loss + self.kl_controller.value * aggregate(kl, mask, self.updates.loss_aggregation, normaliser)
            metrics["train/kl"] = masked_mean(kl.detach(), mask)
        metrics["train/loss"] = as_token_mean(loss, normaliser, mask)
        return loss, metrics

    def estimate_advantages(self, rewards: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """``advantages.estimator`` applied to the rewards ``(N,)``, the KL estimate of the sampled tokens ``(N, R)``
        (None without a reference) and the response mask ``(N, R)``: ``(N,)`` for ``grpo`` and ``rloo``, ``(N, R)``
        for the REINFORCE++ estimators. ``kl.placement: reward`` puts ``kl_coef * kl`` into the rewards."""
        inputs = AdvantageInputs(
            rewards,
            mask,
            self.group_size,
            kl if self.kl.placement == "reward" else None,
            self.kl_controller.value,
            self.advantages.scale,
            all_reduce=self.all_reduce_sum,
        )
        return ADVANTAGE_ESTIMATORS[self.advantages.estimator](inputs).advantages

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        scored = self.next_scored(batch)
        if scored is None:  # a filtered source: the next batch adds to this update's groups
            return
        rollout, rewards = scored.rollout, scored.rewards  # rewards (N,)
        with Timer(self.timings, "time/update_s"):
            ref_logprobs = self.reference_logprobs(rollout)
            kl = (
                None if ref_logprobs is None else kl_estimate(rollout.old_logprobs, ref_logprobs, self.kl.kind)
            )  # (N, R)
            advantages = self.estimate_advantages(rewards, kl, rollout.response_mask)  # (N,) or (N, R)
            stats = self.update(RLBatch.from_rollout(rollout, advantages, ref_logprobs), self._loss)
        metrics = self.sampler.rollout_metrics(scored)
        metrics["rollout/zero_std_frac"] = float((~has_signal(rewards, self.group_size)).float().mean())
        if kl is not None:  # a reference was scored
            metrics["train/kl_coef"] = float(self.kl_controller.value)
            self.update_kl_controller(kl, rollout.response_mask)
        self.log_metrics({**metrics, **stats, **self.timings})
