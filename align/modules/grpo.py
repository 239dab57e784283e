"""GRPO: group relative policy optimization (Shao et al. 2024, arXiv 2402.03300).

Each training step samples ``group_size`` completions for every prompt of the batch, scores them with the
reward functions, and turns rewards into advantages relative to their group
(:func:`align.advantages.group_advantages`). The policy is updated with the clipped surrogate
(:func:`align.losses.ppo_policy_loss`) for ``ppo_epochs`` passes (the paper's mu) over ``num_minibatches``
minibatches, using the sampling log-probs as the old policy.

Departures and options:

* ``std_scale``: ``group`` (the paper), ``batch`` or ``none`` (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783).
* ``loss_aggregation``: ``token_mean`` over the whole step (default, as in DAPO, Yu et al. 2025,
  arXiv 2503.14476) instead of the paper's per-sequence mean (``seq_mean``); ``constant`` is Dr. GRPO's.
* ``clip_high``: DAPO's decoupled upper clip range.
* KL to the reference: ``kl_placement="loss"`` adds ``beta * k3`` per token to the loss (the paper);
  ``"reward"`` subtracts ``beta`` times the summed per-token estimate (``k1`` by default there) from each
  completion's reward before the group baseline. ``beta = 0`` loads no reference at all.
* With one epoch and one minibatch the update is exactly on-policy: the importance ratio is taken against
  the current log-probs (detached), so it is 1 and no separate old-policy pass is needed. Otherwise the
  log-probs recorded while sampling serve as the old policy; they are computed exactly as in training.
"""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.advantages import group_advantages
from align.data.prompts import PromptBatch
from align.kl import kl_estimate
from align.logprobs import masked_mean, masked_sum
from align.losses import aggregate, ppo_policy_loss
from align.models.policy import PolicyModel
from align.modules.rl import Aggregation, RLBatch, RLModule, Timer
from align.rewards import RewardSpec
from align.rollout import SamplingConfig

KLKind = Literal["k1", "k2", "k3"]


class GRPOModule(RLModule):
    """GRPO on prompt data (:class:`align.data.prompts.PromptDataModule`), manual optimization.

    ``trainer.max_steps`` counts optimizer steps: ``ppo_epochs * num_minibatches`` per rollout.

    Logged per rollout: ``train/loss``, ``train/policy_loss``, ``train/kl``, ``train/clipfrac``,
    ``train/approx_kl``, ``train/entropy``, ``rollout/reward_mean``, ``rollout/reward_std``,
    ``rollout/reward/<name>``, ``rollout/response_length``, ``rollout/tokens_per_s``,
    ``rollout/truncated_frac``, ``rollout/zero_std_frac`` (groups with no learning signal), and
    ``time/generation_s`` / ``time/update_s``. Validation: see :class:`~align.modules.rl.RLModule`.
    """

    def __init__(
        self,
        policy: PolicyModel | None = None,
        rewards: list[RewardSpec | str] | None = None,
        group_size: int = 8,
        sampling: SamplingConfig | None = None,
        eval_sampling: SamplingConfig | None = None,
        beta: float = 0.0,
        kl_estimator: KLKind | None = None,
        kl_placement: Literal["loss", "reward"] = "loss",
        clip_low: float = 0.2,
        clip_high: float | None = None,
        std_scale: Literal["group", "batch", "none"] = "group",
        loss_aggregation: Aggregation = "token_mean",
        ppo_epochs: int = 1,
        num_minibatches: int = 1,
        micro_batch_size: int | None = None,
        max_grad_norm: float | None = 1.0,
        log_entropy: bool = True,
        accuracy_reward: str | None = None,
        accuracy_threshold: float = 1.0,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        disable_dropout: bool = True,
    ):
        """
        Args:
            policy: The model to train; null means the shipped SFT-warmed tiny model (``tiny-sort``).
            rewards: Reward functions with weights (see docs/rewards.md); null: exact match on the sort task.
            group_size: Completions sampled per prompt (G); advantages are relative to the group.
            sampling: How training completions are drawn (temperature, top_p, top_k, max_new_tokens, min_new_tokens).
            eval_sampling: How held-out completions are drawn; null: greedy with the same max_new_tokens.
            beta: KL coefficient to the reference policy; 0 disables the KL term and the reference.
            kl_estimator: ``k1``, ``k2`` or ``k3``; null: ``k3`` in the loss, ``k1`` in the reward.
            kl_placement: ``loss`` (per-token term in the loss) or ``reward`` (subtracted from each reward).
            clip_low: Lower clip range of the importance ratio (1 - clip_low).
            clip_high: Upper clip range (1 + clip_high); null: equal to ``clip_low``. DAPO uses 0.28.
            std_scale: Divide advantages by the std of the ``group``, of the whole ``batch``, or ``none``.
            loss_aggregation: ``token_mean`` over the step, ``seq_mean`` (per-sequence means) or Dr. GRPO's ``constant``.
            ppo_epochs: Policy iterations per rollout (mu in the paper).
            num_minibatches: Optimizer steps per epoch; the rollout's rows are split evenly between them.
            micro_batch_size: Rows per forward/backward pass (gradient accumulation); null: a whole minibatch.
            max_grad_norm: Clip the gradient norm of every optimizer step; null: no clipping.
            log_entropy: Compute ``train/entropy`` (a full-vocabulary softmax per token).
            accuracy_reward: Reward whose value counts for ``val/accuracy``; null: the first reward.
            accuracy_threshold: A held-out completion is accurate when that reward is at least this.
            optimizer: Optimizer callable (parameters -> optimizer).
            scheduler: Learning-rate schedule callable, stepped every optimizer step.
            disable_dropout: Set every dropout (model, LoRA adapter, critic) to 0, so that the training
                log-probs equal the sampler's and the reference's and a ratio starts at exactly 1; false keeps
                the model's dropout (noisier ratios and reference).
        """
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
        if kl_placement not in ("loss", "reward"):
            raise ValueError(f"kl_placement: expected 'loss' or 'reward', got {kl_placement!r}")
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        super().__init__(
            policy if policy is not None else PolicyModel("tiny-sort"),
            rewards if rewards is not None else [RewardSpec("align.rewards.sort_exact_match")],
            sampling, eval_sampling, optimizer, scheduler, ppo_epochs, num_minibatches, micro_batch_size,
            max_grad_norm, loss_aggregation, accuracy_reward, accuracy_threshold, disable_dropout,
        )
        self.group_size = group_size
        self.beta = beta
        self.kl_placement = kl_placement
        self.kl_estimator = kl_estimator or ("k3" if kl_placement == "loss" else "k1")
        self.clip_low, self.clip_high = clip_low, clip_high
        self.std_scale = std_scale
        self.log_entropy = log_entropy

    def setup(self, stage: str) -> None:
        if self.beta > 0:
            self.policy.setup_reference()

    def _scores(self, data: RLBatch, **kwargs):
        return self.policy.score(data.input_ids, data.attention_mask, response_length=data.response_length,
                                 temperature=self.score_temperature, **kwargs)

    def _loss(self, micro: RLBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict]:
        scores = self._scores(micro, return_entropy=self.log_entropy)
        mask = micro.response_mask
        old = scores.logprobs.detach() if self.on_policy else micro.old_logprobs
        policy_loss, stats = ppo_policy_loss(scores.logprobs, old, micro.advantages, mask, self.clip_low,
                                             self.clip_high, agg=self.loss_aggregation, normaliser=normaliser)
        loss = policy_loss
        metrics = {"train/policy_loss": policy_loss.detach() * normaliser / max(float(mask.sum()), 1.0),
                   "train/clipfrac": stats.clipfrac, "train/approx_kl": stats.approx_kl}
        if self.beta > 0:
            kl = kl_estimate(scores.logprobs, micro.ref_logprobs, self.kl_estimator)  # (n, r)
            if self.kl_placement == "loss":
                loss = loss + self.beta * aggregate(kl, mask, self.loss_aggregation, normaliser)
            metrics["train/kl"] = masked_mean(kl.detach(), mask)
        if scores.entropy is not None:
            metrics["train/entropy"] = masked_mean(scores.entropy.detach(), mask)
        metrics["train/loss"] = loss.detach() * normaliser / max(float(mask.sum()), 1.0)
        return loss, metrics

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        self.timings = {}
        with Timer(self.timings, "time/generation_s"):
            rollout = self.rollout(batch, self.group_size)
        rewards, parts = self.score_rewards(batch, rollout)  # (N,)
        with Timer(self.timings, "time/update_s"):
            ref_logprobs = None
            if self.beta > 0:
                with torch.no_grad():
                    ref_logprobs = self.policy.score(rollout.input_ids, rollout.attention_mask,
                                                     response_length=rollout.response_ids.shape[1],
                                                     temperature=self.score_temperature, reference=True).logprobs
            shaped = rewards
            if self.beta > 0 and self.kl_placement == "reward":
                kl = kl_estimate(rollout.old_logprobs, ref_logprobs, self.kl_estimator)  # (N, R)
                shaped = rewards - self.beta * masked_sum(kl, rollout.response_mask, dim=1)
            advantages = group_advantages(shaped, self.group_size, self.std_scale)  # (N,)
            stats = self.update(RLBatch.from_rollout(rollout, advantages, ref_logprobs), self._loss)
        grouped = rewards.view(-1, self.group_size)
        metrics = self.rollout_metrics(rollout, rewards, parts)
        metrics["rollout/zero_std_frac"] = float((grouped.std(dim=1) <= 1e-6).float().mean())
        self.log_metrics({**metrics, **stats, **self.timings})
