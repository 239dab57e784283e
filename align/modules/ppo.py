"""PPO-RLHF: a policy, a value model and a reward model (Ouyang et al. 2022, arXiv 2203.02155; Ziegler et al.
2019, arXiv 1909.08593), with the clipped surrogate of Schulman et al. 2017 (arXiv 1707.06347).

One training step is one scored rollout from the module's source, turned into a GAE batch (KL-shaped per-token
rewards, the value model's values, GAE: :class:`~align.modules.actor_critic.ActorCriticModule`, which TRPO shares).

The update (:meth:`PPOModule.update_policy`) runs ``updates.epochs`` passes over ``updates.minibatches``
minibatches (one optimizer step each, micro-batches accumulated, gradients clipped; :class:`align.modules.learner.
Learner`) of ``policy_loss + value.coef * value_loss``: the policy loss (``policy_loss.name``, a row of
:data:`align.core.policy_losses.POLICY_LOSSES`; the clipped surrogate by default) minus ``entropy_coef`` times the
entropy, and the squared-error value loss, clipped around the rollout values when ``value.clip`` is set. During the
first ``value.warmup_rollouts`` rollouts only the value loss is optimised.

KL coefficient: fixed (``kl.coef``), or adaptive when ``kl.target`` is set (:class:`align.core.kl.
AdaptiveKLController`, Ziegler et al.), updated after every rollout with the mean per-sequence KL averaged
over all ranks, ``n_steps`` = sequences on all ranks (:meth:`align.modules.rl.RLModule.update_kl_controller`).
Its state is saved in checkpoints.
"""

from __future__ import annotations

from functools import partial

import torch

from align.core.losses import aggregate
from align.errors import AlignConfigError
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.actor_critic import ActorCriticModule, GAEBatch
from align.modules.base import param_groups
from align.modules.critic_pass import KeptValues
from align.modules.learner import as_token_mean, policy_loss_terms
from align.modules.options import GAE, ClipRange, KLPenalty, PolicyLoss, ScoreShaping, Updates, ValueTraining
from align.rollout.rewards import RewardModelSpec, RewardSpec


class PPOModule(ActorCriticModule):
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

    def __init__(
        self,
        policy: PolicyModel | None = None,
        rewards: list[RewardSpec | str] | None = None,
        reward_model: RewardModelSpec | str | None = None,
        eval_rewards: list[RewardSpec | str] | None = None,
        updates: Updates = Updates(epochs=4),
        kl: KLPenalty = KLPenalty(coef=0.05, placement="reward"),
        clip: ClipRange = ClipRange(),
        policy_loss: PolicyLoss = PolicyLoss(),
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
            clip: Clip range of the policy loss (``low``, ``high``); null: the loss's own.
            policy_loss: The policy loss (``name``); a per-sequence ratio (``gspo``) does not fit GAE's per-token
                advantages and is refused; ``cispo``, ``sapo`` and ``gmpo`` are per-token.
            gae: Discount, lambda and advantage whitening.
            scores: Penalty, whitening, scaling and clipping of the sequence scores.
            value: Value loss weight and clipping, the value learning-rate scale and critic warm-up.
            entropy_coef: Weight of the entropy bonus (subtracted from the loss); 0: none.
        """
        policy_loss.clip_bounds(clip)  # a clip range set for a loss without one fails here
        if policy_loss.sequence_level:
            raise AlignConfigError(
                f"model.policy_loss.name: {policy_loss.name!r} takes one advantage per sequence, "
                "but GAE gives each token its own; expected a per-token loss such as 'clip'"
            )
        default_rm = reward_model is None and rewards is None and kwargs.get("environment") is None
        if default_rm:
            reward_model = "tiny-sort-rm"
        if eval_rewards is None:
            eval_rewards = [RewardSpec("align.rewards.sort_exact_match")] if default_rm else []
        if policy is None:
            policy = PolicyModel("tiny-sort", critic=CriticSettings(kind="separate", model="tiny-sort-rm"))
        if entropy_coef < 0:
            raise AlignConfigError(f"model.entropy_coef: expected >= 0, got {entropy_coef}")
        super().__init__(
            policy,
            rewards=rewards,
            reward_model=reward_model,
            eval_rewards=eval_rewards,
            updates=updates,
            kl=kl,
            gae=gae,
            scores=scores,
            value=value,
            **kwargs,
        )
        self.clip, self.policy_loss, self.entropy_coef = clip, policy_loss, entropy_coef
        self.log_entropy = self.log_entropy or entropy_coef > 0

    def configure_optimizers(self):
        """One optimizer; the value head / critic parameters get ``value.lr_scale`` times the learning rate."""
        if self.value.lr_scale == 1.0:
            return super().configure_optimizers()
        value_ids = {id(p) for p in self.value_parameters()}
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

    def policy_loss_of(self, micro: GAEBatch, normaliser: torch.Tensor, out) -> tuple[torch.Tensor, dict]:
        """The policy loss minus ``entropy_coef`` times the entropy: ``(loss share, metrics)``."""
        loss, metrics = policy_loss_terms(micro, normaliser, out, self.policy_loss, self.clip, self.updates)
        if out.entropy is not None and self.entropy_coef > 0:
            loss = loss - self.entropy_coef * aggregate(
                out.entropy, micro.response_mask, self.updates.loss_aggregation, normaliser
            )
        return loss, metrics

    def _joint_loss(
        self,
        micro: GAEBatch,
        normaliser: torch.Tensor,
        kept: KeptValues | None = None,
    ) -> tuple[torch.Tensor, dict]:
        values = kept.take(micro.rows) if kept is not None else None  # the rollout pass's, for the first micro-batch
        out = self.scorer.logprobs(micro, entropy=self.log_entropy, values=values is None)
        p_loss, p_metrics = self.policy_loss_of(micro, normaliser, out)
        values = out.values if values is None else values
        assert values is not None  # none kept: the policy pass computed them
        v_loss, v_metrics = self.value_loss(micro, normaliser, values)
        loss = p_loss + self.value.coef * v_loss
        return loss, {**p_metrics, **v_metrics, "train/loss": as_token_mean(loss, normaliser, micro.response_mask)}

    def update_policy(self, data: GAEBatch) -> dict[str, float]:
        """The PPO step: ``updates.epochs`` x ``updates.minibatches`` optimizer steps on policy + value loss."""
        return self.update(data, partial(self._joint_loss, kept=data.kept), data.plan)
