"""PPO-RLHF: a policy, a value model and a reward model (Ouyang et al. 2022, arXiv 2203.02155; Ziegler et al.
2019, arXiv 1909.08593), with the clipped surrogate of Schulman et al. 2017 (arXiv 1707.06347).

One training step is one rollout, turned into a :class:`PPOBatch` by :meth:`PPOModule.make_batch`:

1. **Rollout.** ``samples_per_prompt`` completions per prompt from the rollout engine, with the sampling
   log-probs recorded (computed as in training, same temperature).
2. **Scores.** The weighted total of the reward model's score (``reward_model``, a
   :class:`~align.models.reward.RewardModelScorer` loaded at setup and logged as ``rm``) and any reward
   callables (``rewards``); ``eval_rewards`` are logged but weigh 0. In this order and each off by default: a penalty for
   responses truncated without EOS (``missing_eos_penalty``), whitening of the scores over the rollout
   (``whiten_scores``, mean and std over every rank), a constant factor (``score_scale``) and clipping to
   ``[-score_clip, score_clip]``.
3. **Per-token rewards.** :func:`align.advantages.shape_rewards`: ``-kl_coef * KL_t`` on every response
   token (``kl_estimator``, ``k1`` by default, against the reference policy) and the score on the last valid
   token: the first EOS, or the last token of a response truncated at ``max_new_tokens`` (docs/algorithms.md, "Response mask").
4. **Values** ``V(s_t)`` from the value model at rollout time, then :func:`align.advantages.gae` (``gamma``,
   ``lam``): advantages and returns = unwhitened advantages + values. Advantages (only) are whitened over
   the valid tokens of the rollout on every rank (:func:`align.stats.whiten`, ``whiten_advantages``).

The update (:meth:`PPOModule.update_policy`) runs ``ppo_epochs`` passes over ``num_minibatches`` minibatches
(one optimizer step each, micro-batches accumulated, gradients clipped; :meth:`align.modules.rl.RLModule.
update`) of ``policy_loss + vf_coef * value_loss``: the clipped surrogate minus ``entropy_coef`` times the
entropy, and the squared-error value loss, clipped around the rollout values when ``value_clip`` is set.
During the first ``critic_warmup_steps`` rollouts only the value loss is optimised
(:meth:`PPOModule.update_value`); a shared value head then trains alone, so the policy does not move.

KL coefficient: fixed (``kl_coef``), or adaptive when ``kl_target`` is set (:class:`align.kl.
AdaptiveKLController`, Ziegler et al.), updated after every rollout with the mean per-sequence KL averaged
over all ranks, ``n_steps`` = sequences on all ranks. Its state is saved in checkpoints.

Value model: ``PolicyModel(value_head="shared")`` puts a scalar head on the policy backbone;
``value_head="separate"`` gives a critic with its own backbone loaded from ``critic_model`` (for example the
reward model; the policy when unset). When the critic backbone is a reward-model export, the critic's head
starts from the reward head (``critic_head_from_reward_model``), so the critic starts by predicting the
reward model's score of the prefix instead of 0.

Subclassing (TRPO and friends): :meth:`make_batch` (rollout to advantages and returns), :meth:`policy_loss`,
:meth:`value_loss`, :meth:`update_value` and :meth:`update_policy` are separate; a subclass that replaces the
policy step overrides :meth:`update_policy` and calls :meth:`update_value` for the critic.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align import stats
from align.advantages import gae, shape_rewards
from align.data.prompts import REWARD_INPUTS, PromptBatch
from align.errors import AlignConfigError
from align.kl import AdaptiveKLController, FixedKLController, KLController, kl_estimate
from align.logprobs import masked_mean, masked_sum
from align.losses import aggregate, ppo_policy_loss, value_loss
from align.models.policy import PolicyModel, TokenScores
from align.models.reward import RewardModelScorer, init_critic_head_from_reward_model
from align.models.tiny import TINY_SORT_RM
from align.modules.rl import Aggregation, RLBatch, RLModule, Timer
from align.rewards import RewardFunction, RewardSpec
from align.rollout import Rollout, SamplingConfig

KLKind = Literal["k1", "k2", "k3"]


class LazyRewardModel:
    """A :class:`~align.models.reward.RewardModelScorer` built by :meth:`load` (at setup) or on first call, so
    that building a module from a config does not need the reward model's weights."""

    def __init__(self, path: str, batch_size: int = 32):
        self.path, self.batch_size = path, batch_size
        self.scorer: RewardModelScorer | None = None

    def load(self, device: str | None = None) -> RewardModelScorer:
        if self.scorer is None:
            self.scorer = RewardModelScorer(self.path, batch_size=self.batch_size, device=device)
        return self.scorer

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        inputs = {k: columns[k] for k in REWARD_INPUTS if k in columns}  # the data's own columns are not used
        return self.load()(prompts, completions, **inputs)


@dataclass
class PPOBatch(RLBatch):
    """A rollout ready for PPO updates. ``N`` rows, ``T = P + R`` tokens, ``R`` response tokens.

    Inherited: ``input_ids`` (N, T), ``attention_mask`` (N, T), ``response_mask`` (N, R) bool,
    ``old_logprobs`` (N, R), ``advantages`` (N, R) (whitened when ``whiten_advantages``), ``ref_logprobs``
    (N, R) or None when no KL term is used. Every (N, R) tensor is 0 at masked positions.
    """

    values: torch.Tensor | None = None  # (N, R) V(s_t) at rollout time
    returns: torch.Tensor | None = None  # (N, R) value targets: unwhitened GAE advantages + values
    rewards: torch.Tensor | None = None  # (N, R) per-token rewards: -kl_coef * kl, score at the last valid token
    kl: torch.Tensor | None = None  # (N, R) per-token KL estimate to the reference (0 without a reference)
    scores: torch.Tensor | None = None  # (N,) sequence scores after penalty / whitening / scaling / clipping
    metrics: dict = field(default_factory=dict)  # rollout/* and time/* floats of the step that built it

    def select(self, index: torch.Tensor) -> PPOBatch:
        """The rows ``index`` with the response columns no selected row uses trimmed off (metrics dropped)."""
        width = int(self.response_mask[index].sum(dim=1).max().clamp(min=1))
        cut = self.response_length - width
        rows = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, torch.Tensor):
                continue
            value = value[index]
            if f.name in ("input_ids", "attention_mask"):
                value = value[:, : value.shape[1] - cut] if cut else value
            elif value.dim() == 2:
                value = value[:, :width]
            rows[f.name] = value
        return type(self)(**rows)


class PPOModule(RLModule):
    """PPO-RLHF on prompt data (:class:`align.data.prompts.PromptDataModule`), manual optimization.

    ``trainer.max_steps`` counts optimizer steps: ``ppo_epochs * num_minibatches`` per rollout, critic
    warm-up rollouts included.

    Logged per rollout: ``train/loss``, ``train/policy_loss``, ``train/value_loss``, ``train/entropy``,
    ``train/kl`` (mean per-sequence KL estimate to the reference, summed over tokens), ``train/kl_per_token``,
    ``train/kl_coef``, ``train/clipfrac``, ``train/approx_kl``, ``train/value_clipfrac``,
    ``train/explained_variance`` (of the rollout values for the returns, over valid tokens and all ranks),
    ``train/returns_mean``, ``train/values_mean``, ``train/advantages_mean`` (before whitening),
    ``train/score_mean`` (after the score options), ``train/critic_warmup`` (1 while warming up),
    ``rollout/reward_mean``, ``rollout/reward_std``, ``rollout/reward/<name>`` (every reward, eval rewards
    included), ``rollout/response_length``, ``rollout/tokens_per_s``, ``rollout/truncated_frac`` and
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
        reward_model: str | None = None,
        reward_model_weight: float = 1.0,
        reward_model_batch_size: int = 32,
        rewards: list[RewardSpec | str] | None = None,
        eval_rewards: list[RewardSpec | str] | None = None,
        samples_per_prompt: int = 1,
        sampling: SamplingConfig | None = None,
        eval_sampling: SamplingConfig | None = None,
        kl_coef: float = 0.05,
        kl_target: float | None = None,
        kl_horizon: float = 10000.0,
        kl_estimator: KLKind = "k1",
        gamma: float = 1.0,
        lam: float = 0.95,
        whiten_advantages: bool = True,
        missing_eos_penalty: float | None = None,
        whiten_scores: bool = False,
        score_scale: float = 1.0,
        score_clip: float | None = None,
        clip_range: float = 0.2,
        value_clip: float | None = 0.2,
        vf_coef: float = 0.1,
        entropy_coef: float = 0.0,
        critic_warmup_steps: int = 0,
        critic_head_from_reward_model: bool = True,
        value_lr_scale: float = 1.0,
        ppo_epochs: int = 4,
        num_minibatches: int = 1,
        micro_batch_size: int | None = None,
        max_grad_norm: float | None = 1.0,
        loss_aggregation: Aggregation = "token_mean",
        log_entropy: bool = True,
        accuracy_reward: str | None = None,
        accuracy_threshold: float = 1.0,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        disable_dropout: bool = True,
    ):
        """
        Args:
            policy: The model to train, with ``value_head`` set; null means the shipped SFT-warmed tiny model
                (``tiny-sort``) with a separate critic started from the shipped reward model (``tiny-sort-rm``).
            reward_model: A trained reward model (an export directory, a reward-model ``.ckpt``, or
                ``tiny-sort-rm``), scored as the reward named ``rm``; loaded at setup, so a config instantiates
                without its weights. With neither this nor ``rewards`` set: ``tiny-sort-rm``.
            reward_model_weight: Weight of the reward-model score in the training reward.
            reward_model_batch_size: Sequences per reward-model forward pass.
            rewards: Further training rewards, functions or classes with weights (docs/rewards.md), added to the
                reward-model score.
            eval_rewards: Rewards that are only logged (``rollout/reward/<name>``, ``val/reward/<name>``), never
                trained on, e.g. the task's true verifiable reward; null: exact match on the sort task when the
                default reward model is used, else none.
            samples_per_prompt: Completions sampled per prompt in each rollout.
            sampling: How training completions are drawn (temperature, top_p, top_k, max_new_tokens, min_new_tokens).
            eval_sampling: How held-out completions are drawn; null: greedy with the same max_new_tokens.
            kl_coef: KL penalty coefficient (the initial one when ``kl_target`` is set); 0 with no target loads
                no reference.
            kl_target: Per-sequence KL the adaptive controller steers to; null keeps ``kl_coef`` fixed.
            kl_horizon: Horizon of the adaptive controller, in sequences.
            kl_estimator: Per-token KL estimate shaped into the reward: ``k1`` (default), ``k2`` or ``k3``.
            gamma: Discount of GAE.
            lam: Lambda of GAE.
            whiten_advantages: Whiten advantages over the valid tokens of each rollout (returns are not).
            missing_eos_penalty: Subtract this from the score of responses truncated without EOS; null: none.
            whiten_scores: Whiten the sequence scores over the rollout (all ranks) before scaling and clipping.
            score_scale: Multiply the sequence scores by this factor.
            score_clip: Clip the sequence scores to ``[-score_clip, score_clip]``; null: no clipping.
            clip_range: Clip range of the importance ratio (``1 -/+ clip_range``).
            value_clip: Clip new values to ``old -/+ value_clip`` in the value loss; null: no clipping.
            vf_coef: Weight of the value loss in the joint loss.
            entropy_coef: Weight of the entropy bonus (subtracted from the loss); 0: none.
            critic_warmup_steps: Rollouts at the start of training that update only the value model.
            critic_head_from_reward_model: Start a separate critic's head from the reward head when its
                backbone (``critic_model``) is a reward-model export.
            value_lr_scale: Learning rate of the value head and critic relative to the policy's (a zero-initialised
                head needs many more steps than the policy to reach the scale of the returns).
            ppo_epochs: Passes over each rollout.
            num_minibatches: Optimizer steps per pass; the rollout's rows are split evenly between them.
            micro_batch_size: Rows per forward/backward pass (gradient accumulation); null: a whole minibatch.
            max_grad_norm: Clip the gradient norm of every optimizer step; null: no clipping.
            loss_aggregation: ``token_mean`` over the step, ``seq_mean`` (per-sequence means) or ``constant``.
            log_entropy: Compute ``train/entropy`` (a full-vocabulary softmax per token); on when entropy_coef > 0.
            accuracy_reward: Reward (or eval reward) whose value counts for ``val/accuracy``; null: the first eval
                reward, else the first reward.
            accuracy_threshold: A held-out completion is accurate when that reward is at least this.
            optimizer: Optimizer callable (parameters -> optimizer); one optimizer for policy and value model.
            scheduler: Learning-rate schedule callable, stepped every optimizer step.
            disable_dropout: Set every dropout (model, LoRA adapter, critic) to 0, so that the training
                log-probs equal the sampler's and the reference's and a ratio starts at exactly 1; false keeps
                the model's dropout (noisier ratios and reference).
        """
        default_rm = reward_model is None and rewards is None
        if default_rm:
            reward_model = TINY_SORT_RM
        if eval_rewards is None:
            eval_rewards = [RewardSpec("align.rewards.sort_exact_match")] if default_rm else []
        rewards = list(rewards or [])
        if reward_model is not None:
            if reward_model_batch_size < 1:
                raise ValueError(f"reward_model_batch_size must be >= 1, got {reward_model_batch_size}")
            self_rm = RewardFunction(LazyRewardModel(reward_model, reward_model_batch_size))
            self_rm.name, self_rm.weight = "rm", float(reward_model_weight)
            rewards.insert(0, self_rm)
        if not rewards:
            raise AlignConfigError("PPO needs a training reward: set reward_model and/or rewards")
        # Eval rewards join the reward list with weight 0: computed, checked and logged, never trained on.
        eval_specs = [RewardSpec(fn=s.fn, weight=0.0, name=s.name, kwargs=dict(s.kwargs), init_kwargs=s.init_kwargs)
                      if isinstance(s, RewardSpec) else RewardSpec(fn=s, weight=0.0) for s in eval_rewards]
        if policy is None:
            policy = PolicyModel("tiny-sort", value_head="separate", critic_model=TINY_SORT_RM)
        if policy.spec["value_head"] is None:
            raise AlignConfigError("PPO needs a value model: set policy.value_head to 'shared' (a head on the policy "
                                   "backbone) or 'separate' (a critic, e.g. with critic_model: <reward model export>)")
        for name, value, low in (("kl_coef", kl_coef, 0.0), ("kl_horizon", kl_horizon, 1e-12),
                                 ("score_scale", score_scale, None), ("clip_range", clip_range, 0.0),
                                 ("vf_coef", vf_coef, 0.0), ("entropy_coef", entropy_coef, 0.0)):
            if low is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
            raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
        if kl_target is not None and kl_target <= 0:
            raise ValueError(f"kl_target must be > 0 or null, got {kl_target}")
        if kl_target is not None and kl_coef <= 0:
            raise AlignConfigError(f"model.kl_coef: the adaptive controller (kl_target {kl_target}) multiplies the "
                                   f"coefficient, so it must start > 0 (e.g. 0.05), got {kl_coef}")
        for name, value in (("score_clip", score_clip), ("value_clip", value_clip)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or null, got {value}")
        if value_lr_scale <= 0:
            raise ValueError(f"value_lr_scale must be > 0, got {value_lr_scale}")
        if samples_per_prompt < 1 or critic_warmup_steps < 0:
            raise ValueError("samples_per_prompt must be >= 1 and critic_warmup_steps >= 0")
        super().__init__(
            policy, list(rewards) + eval_specs, sampling, eval_sampling, optimizer, scheduler, ppo_epochs,
            num_minibatches, micro_batch_size, max_grad_norm, loss_aggregation, None, accuracy_threshold,
            disable_dropout,
        )
        names = self.reward.names
        eval_names = names[len(rewards):]
        if accuracy_reward is not None and accuracy_reward not in names:
            raise ValueError(f"accuracy_reward: {accuracy_reward!r} is not one of the rewards {names}")
        self.accuracy_reward = accuracy_reward or (eval_names[0] if eval_names else names[0])
        self.eval_reward_names = eval_names
        self.samples_per_prompt = samples_per_prompt
        self.kl_coef, self.kl_target, self.kl_horizon = kl_coef, kl_target, kl_horizon
        self.kl_estimator = kl_estimator
        self.kl_controller: KLController = (AdaptiveKLController(kl_coef, kl_target, kl_horizon)
                                            if kl_target is not None else FixedKLController(kl_coef))
        self.use_reference = kl_coef > 0 or kl_target is not None
        self.gamma, self.lam = gamma, lam
        self.whiten_advantages = whiten_advantages
        self.missing_eos_penalty = missing_eos_penalty
        self.whiten_scores, self.score_scale, self.score_clip = whiten_scores, score_scale, score_clip
        self.clip_range, self.value_clip = clip_range, value_clip
        self.vf_coef, self.entropy_coef = vf_coef, entropy_coef
        self.critic_warmup_steps = critic_warmup_steps
        self.value_lr_scale = value_lr_scale
        self.log_entropy = log_entropy or entropy_coef > 0
        self.rollouts_done = 0
        self.headline_metrics = ("val/reward_mean", *(f"val/reward/{n}" for n in names), "val/accuracy", "val/kl")
        if critic_head_from_reward_model:
            init_critic_head_from_reward_model(self.policy)

    @property
    def reward_model(self) -> LazyRewardModel | None:
        """The reward model of the reward list (the reward named ``rm``), or None."""
        for reward in self.reward.rewards:
            if isinstance(reward.fn, LazyRewardModel):
                return reward.fn
        return None

    def configure_optimizers(self):
        """One optimizer; the value head / critic parameters get ``value_lr_scale`` times the learning rate."""
        if self.value_lr_scale == 1.0:
            return super().configure_optimizers()
        from align.modules.base import param_groups

        value_ids = {id(p) for m in (self.policy.value_head, self.policy.critic, self.policy.critic_head)
                     if m is not None for p in m.parameters()}
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
                group["lr"] *= self.value_lr_scale
        return self.with_scheduler(optimizer)

    def setup(self, stage: str) -> None:
        if self.reward_model is not None:
            self.reward_model.load(str(self.trainer.strategy.root_device) if self._trainer is not None else None)
        if self.use_reference:
            self.policy.setup_reference()

    # ------------------------------------------------------------------ rollout -> PPOBatch
    @property
    def warming_up(self) -> bool:
        """Whether the next rollout trains the value model only."""
        return self.rollouts_done < self.critic_warmup_steps

    def transform_scores(self, scores: torch.Tensor, rollout: Rollout) -> torch.Tensor:
        """The score options (:func:`align.stats.transform_scores`), whitening over every rank. ``(N,) -> (N,)``."""
        return stats.transform_scores(scores, rollout.truncated, self.missing_eos_penalty, self.whiten_scores,
                                      self.score_scale, self.score_clip, all_reduce=self.all_reduce_sum)

    @torch.no_grad()
    def make_batch(self, batch: PromptBatch) -> PPOBatch:
        """Rollout -> scores -> KL-shaped per-token rewards -> values -> GAE -> returns (module docstring)."""
        timings: dict[str, float] = {}
        with Timer(timings, "time/generation_s"):
            rollout = self.rollout(batch, self.samples_per_prompt)
        with Timer(timings, "time/scoring_s"):
            total, parts = self.score_rewards(batch, rollout)  # (N,), {name: (N,)}
            scores = self.transform_scores(total, rollout)
            mask = rollout.response_mask
            input_ids, attention_mask = rollout.input_ids, rollout.attention_mask
            R = mask.shape[1]
            ref_logprobs = None
            if self.use_reference:
                ref_logprobs = self.policy.score(input_ids, attention_mask, response_length=R,
                                                 temperature=self.score_temperature, reference=True).logprobs
            values = self.policy.values(input_ids, attention_mask, response_length=R)  # (N, R)
            values = torch.where(mask, values, torch.zeros_like(values))
            old_logprobs = rollout.old_logprobs
            rewards, kl = shape_rewards(scores, old_logprobs, old_logprobs if ref_logprobs is None else ref_logprobs,
                                        mask, self.kl_controller.value, kind=self.kl_estimator)
            raw_advantages, returns = gae(rewards, values, mask, self.gamma, self.lam)
            advantages = (stats.whiten(raw_advantages, mask, all_reduce=self.all_reduce_sum)
                          if self.whiten_advantages else raw_advantages)
        metrics = self.rollout_metrics(rollout, total, parts)
        seq_kl = masked_sum(kl, mask, dim=1)  # (N,)
        sums = self.all_reduce_sum(torch.stack([seq_kl.sum(), kl.sum(), mask.sum().float(),
                                                torch.tensor(float(len(rollout)), device=kl.device)]))
        metrics["train/kl"] = float(sums[0] / sums[3].clamp(min=1))
        metrics["train/kl_per_token"] = float(sums[1] / sums[2].clamp(min=1))
        metrics["train/kl_coef"] = float(self.kl_controller.value)
        explained = stats.explained_variance(values, returns, mask, all_reduce=self.all_reduce_sum)
        metrics["train/explained_variance"] = float(explained)
        metrics["train/returns_mean"] = float(masked_mean(returns, mask))
        metrics["train/values_mean"] = float(masked_mean(values, mask))
        metrics["train/advantages_mean"] = float(masked_mean(raw_advantages, mask))
        metrics["train/score_mean"] = float(scores.mean())
        metrics["rollout/truncated_frac"] = float(rollout.truncated.float().mean())
        metrics.update(timings)
        return PPOBatch(input_ids, attention_mask, mask, old_logprobs, advantages, ref_logprobs,
                        values=values, returns=returns, rewards=rewards, kl=kl, scores=scores, metrics=metrics)

    # ------------------------------------------------------------------ losses
    def _scores(self, micro: PPOBatch, **kwargs) -> TokenScores:
        return self.policy.score(micro.input_ids, micro.attention_mask, response_length=micro.response_length,
                                 temperature=self.score_temperature, **kwargs)

    def _token_mean(self, value: torch.Tensor, normaliser: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # A micro-batch's share of a step loss, expressed as a mean over its own valid tokens (for metrics).
        return value.detach() * normaliser / max(float(mask.sum()), 1.0)

    def policy_loss(self, micro: PPOBatch, normaliser: torch.Tensor, scores: TokenScores
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped surrogate minus ``entropy_coef`` times the entropy: ``(loss share, metrics)``."""
        mask = micro.response_mask
        old = scores.logprobs.detach() if self.on_policy else micro.old_logprobs
        loss, surrogate = ppo_policy_loss(scores.logprobs, old, micro.advantages, mask, self.clip_range,
                                      agg=self.loss_aggregation, normaliser=normaliser)
        metrics = {"train/policy_loss": self._token_mean(loss, normaliser, mask), "train/clipfrac": surrogate.clipfrac,
                   "train/approx_kl": surrogate.approx_kl}
        if scores.entropy is not None:
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * aggregate(scores.entropy, mask, self.loss_aggregation, normaliser)
            metrics["train/entropy"] = masked_mean(scores.entropy.detach(), mask)
        return loss, metrics

    def value_loss(self, micro: PPOBatch, normaliser: torch.Tensor, values: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Squared error to the returns, clipped around the rollout values: ``(loss share, metrics)``."""
        mask = micro.response_mask
        loss, clipfrac = value_loss(values, micro.values, micro.returns, mask, self.value_clip,
                                    agg=self.loss_aggregation, normaliser=normaliser)
        return loss, {"train/value_loss": self._token_mean(loss, normaliser, mask), "train/value_clipfrac": clipfrac}

    def _joint_loss(self, micro: PPOBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict]:
        scores = self._scores(micro, return_entropy=self.log_entropy, return_values=True)
        p_loss, p_metrics = self.policy_loss(micro, normaliser, scores)
        v_loss, v_metrics = self.value_loss(micro, normaliser, scores.values)
        loss = p_loss + self.vf_coef * v_loss
        return loss, {**p_metrics, **v_metrics, "train/loss": self._token_mean(loss, normaliser, micro.response_mask)}

    def _value_only_loss(self, micro: PPOBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict]:
        # During warm-up a shared head trains alone: the policy backbone must not move before its first update.
        values = self.policy.values(micro.input_ids, micro.attention_mask, response_length=micro.response_length,
                                    detach_backbone=self.warming_up)
        return self.value_loss(micro, normaliser, values)

    # ------------------------------------------------------------------ updates
    def update_value(self, data: PPOBatch) -> dict[str, float]:
        """``ppo_epochs`` x ``num_minibatches`` optimizer steps on the value loss alone."""
        return self.update(data, self._value_only_loss)

    def update_policy(self, data: PPOBatch) -> dict[str, float]:
        """The PPO step: ``ppo_epochs`` x ``num_minibatches`` optimizer steps on policy + ``vf_coef`` * value loss."""
        return self.update(data, self._joint_loss)

    def update_kl_controller(self, data: PPOBatch) -> None:
        """Feed the mean per-sequence KL over all ranks to the controller; ``n_steps`` = sequences on all ranks."""
        n = self.all_reduce_sum(torch.tensor(float(len(data)), device=data.kl.device))
        seq_kl = self.all_reduce_sum(masked_sum(data.kl, data.response_mask))
        self.kl_controller.update(float(seq_kl / n.clamp(min=1)), int(n))

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        data = self.make_batch(batch)
        warmup = self.warming_up
        timings: dict[str, float] = {}
        with Timer(timings, "time/update_s"):
            updates = self.update_value(data) if warmup else self.update_policy(data)
        self.update_kl_controller(data)
        self.rollouts_done += 1
        self.timings = {k: v for k, v in {**data.metrics, **timings}.items() if k.startswith("time/")}
        self.log_metrics({**data.metrics, **updates, **timings, "train/critic_warmup": float(warmup)})

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        if not self.use_reference:
            return
        rollout = self.rollout(batch, 1)
        ref = self.policy.score(rollout.input_ids, rollout.attention_mask, response_length=rollout.response_ids.shape[1],
                                temperature=self.score_temperature, reference=True).logprobs
        kl = kl_estimate(rollout.old_logprobs, ref, self.kl_estimator)
        self._val_add("kl", masked_sum(kl, rollout.response_mask, dim=1))

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint.setdefault("align", {})["ppo"] = {"kl_controller": self.kl_controller.state_dict(),
                                                     "rollouts_done": self.rollouts_done}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        state = (checkpoint.get("align") or {}).get("ppo")
        if state:
            self.kl_controller.load_state_dict(state["kl_controller"])
            self.rollouts_done = int(state.get("rollouts_done", 0))
