"""TRPO: trust region policy optimization for language-model policies (Schulman et al. 2015, arXiv 1502.05477).

The rollout, rewards, KL shaping to the reference, values and GAE are PPO's
(:meth:`align.modules.ppo.PPOModule.make_batch`); only the policy step differs. Instead of several clipped
optimizer steps, each rollout gives one step that maximises the importance-weighted surrogate

    L(theta) = aggregate_t( pi_theta(a_t | s_t) / pi_old(a_t | s_t) * A_t )

subject to a hard bound on the mean KL(pi_old || pi_theta) over the valid response tokens,
``KL <= max_kl``. The step (:func:`align.trust_region.trpo_step`) is the natural gradient ``F^-1 g``, found
by conjugate gradient on Fisher-vector products (double backpropagation through the mean KL, with
``damping``), scaled to the boundary of the quadratic trust region, and accepted by a backtracking line
search only where the *measured* surrogate improves and the *measured* mean KL is at most ``max_kl``;
otherwise the parameters are restored bit for bit. The step is applied in place under ``torch.no_grad``: it
is not an optimizer step.

Parameters in the trust region: the trainable parameters of the language model only, i.e. every weight of a
fully trained model, or only the LoRA adapter when ``policy.lora`` is set (the vectors of CG then live in the
adapter's parameter space, see docs/algorithms.md). The value model is never part of it.

The value model trains with its own optimizer (``optimizer``, built by :meth:`configure_optimizers` over the
value parameters only): ``value_epochs`` x ``value_minibatches`` steps on the squared-error value loss per
rollout, after the policy step. ``trainer.max_steps`` therefore counts value-optimizer steps. With a separate
critic (``policy.value_head: separate``, the default) policy and value share nothing. With a shared value
head, only the head is trained by the value optimizer and the backbone is frozen for it: a value update that
moved the shared backbone would move the policy outside the trust region the line search just certified.

Departures and choices:

* The KL is the sampled estimate ``k3`` of :func:`align.kl.kl_estimate` on the rollout's tokens (unbiased
  for KL(pi_old || pi_theta), since the tokens were sampled from pi_old), averaged with the response mask
  over every valid token of the step (all micro-batches and ranks). The paper computes the KL analytically
  over the action space; for a language model that would mean keeping the old policy's full-vocabulary
  distribution for every token. The Hessian of the sampled KL at ``theta_old`` is the Fisher of the sampled
  tokens (the mean outer product of their score vectors), an unbiased estimate of the Fisher, and the line
  search checks the same estimator the quadratic model approximates.
* ``fisher_fraction`` computes Fisher-vector products on a random share of the rollout's rows, as the
  reference implementations do (OpenAI baselines uses every fifth sample); gradient, surrogate and measured
  KL always use every row.
* ``pi_old`` is the policy at the start of the step, recomputed by the training forward pass rather than
  taken from the sampler, so the ratio is exactly 1 at ``theta_old``; dropout is off during the step so the
  surrogate and KL are deterministic functions of the parameters.
* Double backpropagation needs attention kernels that are twice differentiable; the KL forward of the
  Fisher products runs under the math backend of ``scaled_dot_product_attention``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from align.kl import kl_estimate
from align.logprobs import masked_sum
from align.losses import aggregate
from align.models.policy import PolicyModel
from align.modules.base import param_groups
from align.modules.ppo import KLKind, PPOBatch, PPOModule
from align.modules.rl import Aggregation, minibatch_indices
from align.rewards import RewardSpec
from align.rollout import SamplingConfig
from align.trust_region import fisher_vector_product_fn, flat_grad, trpo_step


class TRPOModule(PPOModule):
    """TRPO on prompt data (:class:`align.data.prompts.PromptDataModule`); see the module docstring.

    Logged per rollout, besides PPO's ``rollout/*``, ``train/kl`` (to the reference),
    ``train/explained_variance``, ``train/value_loss`` and ``time/*``:

    * ``trpo/kl``: measured mean KL(pi_old || pi_new) over valid tokens of the accepted step (0 if rejected);
    * ``trpo/max_kl``: the bound ``max_kl``, so every row of the metrics shows ``trpo/kl <= trpo/max_kl``;
    * ``trpo/surrogate_improvement`` and ``trpo/expected_improvement`` (linear model, full step);
    * ``trpo/line_search_steps`` (candidates tried; 1 = full step), ``trpo/step_fraction``,
      ``trpo/accepted`` (1 or 0);
    * ``trpo/cg_residual`` (relative ``||g - F s|| / ||g||``) and ``trpo/cg_iterations``;
    * ``train/policy_loss`` (minus the surrogate at the new parameters) and ``train/entropy``.
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
        max_kl: float = 0.01,
        damping: float = 0.1,
        cg_iters: int = 10,
        cg_tol: float = 1e-10,
        backtrack_ratio: float = 0.5,
        max_backtracks: int = 10,
        accept_ratio: float = 0.0,
        fisher_fraction: float = 1.0,
        kl_coef: float = 0.0,
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
        value_clip: float | None = None,
        value_epochs: int = 1,
        value_minibatches: int = 1,
        critic_warmup_steps: int = 0,
        critic_head_from_reward_model: bool = True,
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
                (``tiny-sort``) with a separate critic started from the same weights.
            reward_model: A trained reward model (an export directory, a reward-model ``.ckpt``, or
                ``tiny-sort-rm``), scored as the reward named ``rm`` (see :class:`~align.modules.ppo.PPOModule`).
            reward_model_weight: Weight of the reward-model score in the training reward.
            reward_model_batch_size: Sequences per reward-model forward pass.
            rewards: Reward functions with weights (docs/rewards.md), added to the reward-model score; null with no
                ``reward_model``: exact match on the sort task.
            eval_rewards: Rewards that are only logged (``rollout/reward/<name>``, ``val/reward/<name>``).
            samples_per_prompt: Completions sampled per prompt in each rollout.
            sampling: How training completions are drawn (temperature, top_p, top_k, max_new_tokens, min_new_tokens).
            eval_sampling: How held-out completions are drawn; null: greedy with the same max_new_tokens.
            max_kl: Trust-region radius delta: bound on the mean KL(old || new) over valid response tokens.
            damping: Added to the Fisher's diagonal in the Fisher-vector products (makes CG well posed).
            cg_iters: Conjugate-gradient iterations (Fisher-vector products) per policy step.
            cg_tol: Stop CG early when the relative residual falls to this.
            backtrack_ratio: Factor by which the line search shrinks a rejected step.
            max_backtracks: Shrinks tried after the full step before the step is rejected.
            accept_ratio: Required share of the linearly expected improvement (0: any improvement).
            fisher_fraction: Share of the rollout's rows used for Fisher-vector products (cost vs. accuracy).
            kl_coef: KL-to-reference penalty shaped into the rewards (PPO's); 0 with no target loads no reference.
            kl_target: Per-sequence KL the adaptive controller steers to; null keeps ``kl_coef`` fixed.
            kl_horizon: Horizon of the adaptive controller, in sequences.
            kl_estimator: Per-token KL-to-reference estimate shaped into the reward: ``k1``, ``k2`` or ``k3``.
            gamma: Discount of GAE.
            lam: Lambda of GAE.
            whiten_advantages: Whiten advantages over the valid tokens of each rollout (returns are not).
            missing_eos_penalty: Subtract this from the score of responses truncated without EOS; null: none.
            whiten_scores: Whiten the sequence scores over the rollout (all ranks) before scaling and clipping.
            score_scale: Multiply the sequence scores by this factor.
            score_clip: Clip the sequence scores to ``[-score_clip, score_clip]``; null: no clipping.
            value_clip: Clip new values to ``old -/+ value_clip`` in the value loss; null: no clipping.
            value_epochs: Passes of the value optimizer over each rollout.
            value_minibatches: Value-optimizer steps per pass; the rollout's rows are split evenly between them.
            critic_warmup_steps: Rollouts at the start of training that update only the value model.
            critic_head_from_reward_model: Start a separate critic's head from the reward head when its
                backbone (``critic_model``) is a reward-model export.
            micro_batch_size: Rows per forward/backward pass, for the policy step and the value updates; null:
                all rows at once.
            max_grad_norm: Clip the gradient norm of every value-optimizer step; null: no clipping.
            loss_aggregation: Surrogate and value loss: ``token_mean`` over the step, ``seq_mean`` or ``constant``.
                The trust region's KL is always a mean over valid tokens.
            log_entropy: Compute ``train/entropy`` (a full-vocabulary softmax per token).
            accuracy_reward: Reward whose value counts for ``val/accuracy``; null: the first eval reward, else the
                first reward.
            accuracy_threshold: A held-out completion is accurate when that reward is at least this.
            optimizer: Optimizer callable of the value model (the policy step needs none).
            scheduler: Learning-rate schedule of the value optimizer, stepped every value step.
            disable_dropout: Set every dropout (model, LoRA adapter, critic) to 0, so that the training
                log-probs equal the sampler's and the reference's and a ratio starts at exactly 1; false keeps
                the model's dropout (noisier ratios and reference).
        """
        for name, value in (("max_kl", max_kl), ("backtrack_ratio", backtrack_ratio)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not backtrack_ratio < 1:
            raise ValueError(f"backtrack_ratio must be < 1, got {backtrack_ratio}")
        if damping < 0 or cg_tol < 0 or accept_ratio < 0 or max_backtracks < 0:
            raise ValueError("damping, cg_tol, accept_ratio and max_backtracks must be >= 0")
        if cg_iters < 1:
            raise ValueError(f"cg_iters must be >= 1, got {cg_iters}")
        if not 0 < fisher_fraction <= 1:
            raise ValueError(f"fisher_fraction must be in (0, 1], got {fisher_fraction}")
        if rewards is None and reward_model is None:
            rewards = [RewardSpec("align.rewards.sort_exact_match")]
        if policy is None:
            policy = PolicyModel("tiny-sort", value_head="separate")
        super().__init__(
            policy=policy, reward_model=reward_model, reward_model_weight=reward_model_weight,
            reward_model_batch_size=reward_model_batch_size, rewards=rewards, eval_rewards=eval_rewards,
            samples_per_prompt=samples_per_prompt, sampling=sampling, eval_sampling=eval_sampling,
            kl_coef=kl_coef, kl_target=kl_target, kl_horizon=kl_horizon, kl_estimator=kl_estimator, gamma=gamma,
            lam=lam,
            whiten_advantages=whiten_advantages, missing_eos_penalty=missing_eos_penalty,
            whiten_scores=whiten_scores, score_scale=score_scale, score_clip=score_clip, value_clip=value_clip,
            critic_warmup_steps=critic_warmup_steps, critic_head_from_reward_model=critic_head_from_reward_model,
            ppo_epochs=value_epochs, num_minibatches=value_minibatches, micro_batch_size=micro_batch_size,
            max_grad_norm=max_grad_norm, loss_aggregation=loss_aggregation, log_entropy=log_entropy,
            accuracy_reward=accuracy_reward, accuracy_threshold=accuracy_threshold, optimizer=optimizer,
            scheduler=scheduler, disable_dropout=disable_dropout,
        )
        self.max_kl, self.damping = max_kl, damping
        self.cg_iters, self.cg_tol = cg_iters, cg_tol
        self.backtrack_ratio, self.max_backtracks, self.accept_ratio = backtrack_ratio, max_backtracks, accept_ratio
        self.fisher_fraction = fisher_fraction

    # ------------------------------------------------------------------ parameter scopes
    def policy_parameters(self) -> list[nn.Parameter]:
        """The trust region: trainable parameters of the language model (the LoRA adapter when there is one)."""
        return [p for p in self.policy.model.parameters() if p.requires_grad]

    def value_modules(self) -> nn.ModuleList:
        """What the value optimizer trains: the separate critic and its head, or the shared head alone."""
        if self.policy.critic is not None:
            return nn.ModuleList([self.policy.critic, self.policy.critic_head])
        return nn.ModuleList([self.policy.value_head])

    def configure_optimizers(self):
        optimizer = self.optimizer(param_groups(self.value_modules()))
        return self.with_scheduler(optimizer)

    @contextmanager
    def _frozen_policy(self) -> Iterator[None]:
        """No gradient reaches the language model (a shared backbone) while the value model trains."""
        params = self.policy_parameters()
        try:
            for p in params:
                p.requires_grad_(False)
            yield
        finally:
            for p in params:
                p.requires_grad_(True)

    @contextmanager
    def _deterministic_policy(self) -> Iterator[None]:
        was_training = self.policy.model.training
        self.policy.model.eval()
        try:
            yield
        finally:
            self.policy.model.train(was_training)

    # ------------------------------------------------------------------ the policy step
    def _logprobs(self, micro: PPOBatch, **kwargs):
        return self.policy.score(micro.input_ids, micro.attention_mask, response_length=micro.response_length,
                                 temperature=self.score_temperature, **kwargs)

    def _micro_batches(self, data: PPOBatch, rows: torch.Tensor | None = None) -> list[PPOBatch]:
        n = len(data) if rows is None else len(rows)
        [chunks] = minibatch_indices(n, 1, self.micro_batch_size, shuffle=False)
        device = data.input_ids.device
        return [data.select((chunk if rows is None else rows[chunk]).to(device)) for chunk in chunks]

    def _fisher_rows(self, data: PPOBatch) -> torch.Tensor | None:
        if self.fisher_fraction >= 1.0:
            return None
        n = max(1, round(self.fisher_fraction * len(data)))
        return torch.randperm(len(data))[:n].sort().values

    def _fvp(self, micros: list[PPOBatch], params: list[nn.Parameter]) -> Callable[[torch.Tensor], torch.Tensor]:
        """``v -> (F + damping I) v`` for the mean KL over the valid tokens of ``micros`` on every rank."""
        count = self.all_reduce_sum(sum(m.response_mask.sum() for m in micros).float()).clamp(min=1.0)

        def local_kl(micro: PPOBatch) -> torch.Tensor:
            with sdpa_kernel([SDPBackend.MATH]):
                logprobs = self._logprobs(micro).logprobs
            return masked_sum(kl_estimate(micro.old_logprobs, logprobs, "k3"), micro.response_mask) / count

        def reduce_and_damp(local: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
            return self.all_reduce_sum(local) + self.damping * vector

        if len(micros) == 1:  # keep the first-order graph for every CG iteration
            cached = fisher_vector_product_fn(local_kl(micros[0]), params)
            return lambda vector: reduce_and_damp(cached(vector), vector)

        def recomputed(vector: torch.Tensor) -> torch.Tensor:  # bounded memory: one micro-batch graph at a time
            total = torch.zeros_like(vector)
            for micro in micros:
                total += fisher_vector_product_fn(local_kl(micro), params)(vector)
            return reduce_and_damp(total, vector)

        return recomputed

    @torch.no_grad()
    def _evaluate(self, micros: list[PPOBatch], normaliser: torch.Tensor, count: torch.Tensor) -> tuple[float, float]:
        """``(surrogate, mean KL(old || current))`` of the current parameters over every rank."""
        surrogate = torch.zeros((), device=normaliser.device)
        kl_sum = torch.zeros((), device=normaliser.device)
        for micro in micros:
            logprobs = self._logprobs(micro).logprobs
            surrogate += self._surrogate(micro, logprobs, micro.old_logprobs, normaliser)
            kl_sum += masked_sum(kl_estimate(micro.old_logprobs, logprobs, "k3"), micro.response_mask)
        totals = self.all_reduce_sum(torch.stack([surrogate, kl_sum]))
        return float(totals[0]), float(totals[1] / count)

    def _surrogate(self, micro: PPOBatch, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                   normaliser: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the importance-weighted surrogate (to be maximised)."""
        ratio = torch.exp(kl_estimate(logprobs, old_logprobs, "k1"))  # pi / pi_old, log-ratio clamped
        return aggregate(ratio * micro.advantages, micro.response_mask, self.loss_aggregation, normaliser)

    def trust_region_step(self, data: PPOBatch) -> dict[str, float]:
        """One TRPO policy step on ``data``, in place; returns the ``trpo/*`` metrics."""
        params = self.policy_parameters()
        if not params:
            raise RuntimeError("TRPO: the policy has no trainable parameters")
        normaliser = self.step_normaliser(data.response_mask)
        count = self.all_reduce_sum(data.response_mask.sum().float()).clamp(min=1.0)
        with self._deterministic_policy():
            # g at theta_old; pi_old is this pass's log-probs, detached, so the ratio is exactly 1 here.
            grad = None
            old = torch.zeros_like(data.old_logprobs)  # (N, R)
            entropy_sum = torch.zeros((), device=old.device)
            offset = 0
            for micro in self._micro_batches(data):
                scores = self._logprobs(micro, return_entropy=self.log_entropy)
                old_logprobs = scores.logprobs.detach()
                old[offset : offset + len(micro), : micro.response_length] = old_logprobs
                offset += len(micro)
                g = flat_grad(self._surrogate(micro, scores.logprobs, old_logprobs, normaliser), params)
                grad = g if grad is None else grad + g
                if scores.entropy is not None:
                    entropy_sum += masked_sum(scores.entropy.detach(), micro.response_mask)
            grad = self.all_reduce_sum(grad)
            data = replace(data, old_logprobs=old)
            micros = self._micro_batches(data)
            surrogate_before = float(self.all_reduce_sum(
                aggregate(data.advantages, data.response_mask, self.loss_aggregation, normaliser)))
            fvp = self._fvp(self._micro_batches(data, self._fisher_rows(data)), params)
            result = trpo_step(params, grad, fvp, lambda: self._evaluate(micros, normaliser, count),
                               surrogate_before, self.max_kl, self.cg_iters, self.cg_tol, self.backtrack_ratio,
                               self.max_backtracks, self.accept_ratio)
        metrics = {
            "trpo/kl": result.kl,
            "trpo/max_kl": self.max_kl,
            "trpo/surrogate_improvement": result.improvement,
            "trpo/expected_improvement": result.expected_improvement,
            "trpo/line_search_steps": float(result.line_search_steps),
            "trpo/step_fraction": result.fraction,
            "trpo/accepted": float(result.accepted),
            "trpo/cg_residual": result.cg_residual,
            "trpo/cg_iterations": float(result.cg_iterations),
            "train/policy_loss": -(surrogate_before + result.improvement),
        }
        if self.log_entropy:
            metrics["train/entropy"] = float(self.all_reduce_sum(entropy_sum) / count)
        return metrics

    # ------------------------------------------------------------------ updates
    def update_value(self, data: PPOBatch) -> dict[str, float]:
        """``value_epochs`` x ``value_minibatches`` value-optimizer steps; the language model gets no gradient."""
        with self._frozen_policy():
            return super().update_value(data)

    def update_policy(self, data: PPOBatch) -> dict[str, float]:
        """The TRPO step on the policy, then the value model's own optimizer steps."""
        return {**self.trust_region_step(data), **self.update_value(data)}
