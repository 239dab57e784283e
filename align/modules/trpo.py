"""TRPO: trust region policy optimization for language-model policies (Schulman et al. 2015, arXiv 1502.05477).

The rollout, rewards, KL shaping to the reference, values and GAE are shared with PPO
(:meth:`align.modules.actor_critic.ActorCriticModule.make_batch`); only the policy step differs. Instead of several
clipped optimizer steps, each rollout gives one step that maximises the importance-weighted surrogate

    L(theta) = aggregate_t( pi_theta(a_t | s_t) / pi_old(a_t | s_t) * A_t )

subject to a hard bound on the mean KL(pi_old || pi_theta) over the valid response tokens,
``KL <= max_kl``. The step (:func:`align.core.trust_region.trpo_step`) is the natural gradient ``F^-1 g``, found
by conjugate gradient on Fisher-vector products (double backpropagation through the mean KL, with
``damping``), scaled to the boundary of the quadratic trust region, and accepted by a backtracking line
search only where the *measured* surrogate improves and the *measured* mean KL is at most ``max_kl``;
otherwise the parameters are restored bit for bit. The step is applied in place under ``torch.no_grad``: it
is not an optimizer step.

Parameters in the trust region: the trainable parameters of the language model only, i.e. every weight of a
fully trained model, or only the LoRA adapter when ``policy.lora`` is set (the vectors of CG then live in the
adapter's parameter space, see docs/algorithms.md). The value model is never part of it.

The value model trains with its own optimizer (``optimizer``, built by :meth:`configure_optimizers` over the
value parameters only): ``updates.epochs`` x ``updates.minibatches`` steps on the squared-error value loss per
rollout, after the policy step. ``trainer.max_steps`` therefore counts value-optimizer steps. With a separate
critic (``policy.critic: {kind: separate}``, the default) policy and value share nothing. With a shared value
head, only the head is trained by the value optimizer and the backbone is frozen for it: a value update that
moved the shared backbone would move the policy outside the trust region the line search just certified.

Departures and choices:

* The KL is the sampled estimate ``k3`` of :func:`align.core.kl.kl_estimate` on the rollout's tokens (unbiased
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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from align.core.kl import kl_estimate
from align.core.losses import aggregate
from align.core.masks import masked_sum
from align.core.policy_losses import importance_ratio
from align.core.trust_region import fisher_vector_product_fn, flat_grad, trpo_step
from align.errors import AlignConfigError
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.actor_critic import ActorCriticModule, GAEBatch
from align.modules.base import param_groups
from align.modules.learner import minibatch_indices
from align.modules.options import GAE, KLPenalty, ScoreShaping, TrustRegion, ValueTraining
from align.rollout.rewards import RewardModelSpec, RewardSpec


class TRPOModule(ActorCriticModule):
    """TRPO on prompt data (:class:`align.data.prompts.PromptDataModule`); see the module docstring.

    Logged per rollout, besides PPO's ``rollout/*``, ``train/kl`` (to the reference),
    ``train/explained_variance``, ``train/value_loss`` and ``time/*``:

    * ``trpo/kl``: measured mean KL(pi_old || pi_new) over valid tokens of the accepted step (0 if rejected);
    * ``trpo/max_kl``: the bound ``trust_region.max_kl``, so every row of the metrics shows ``trpo/kl <= trpo/max_kl``;
    * ``trpo/surrogate_improvement`` and ``trpo/expected_improvement`` (linear model, full step);
    * ``trpo/line_search_steps`` (candidates tried; 1 = full step), ``trpo/step_fraction``,
      ``trpo/accepted`` (1 or 0);
    * ``trpo/cg_residual`` (relative ``||g - F s|| / ||g||``) and ``trpo/cg_iterations``;
    * ``train/policy_loss`` (minus the surrogate at the new parameters) and ``train/entropy``.
    """

    keeps_critic_pass = False  # the trust-region step runs first; the critic's graph would be held through it

    def __init__(
        self,
        policy: PolicyModel | None = None,
        rewards: list[RewardSpec | str] | None = None,
        reward_model: RewardModelSpec | str | None = None,
        trust_region: TrustRegion = TrustRegion(),
        kl: KLPenalty = KLPenalty(coef=0.0, placement="reward"),
        gae: GAE = GAE(),
        scores: ScoreShaping = ScoreShaping(),
        value: ValueTraining = ValueTraining(clip=None),
        **kwargs,
    ):
        """
        Args:
            policy: The model to train, with ``critic`` set; null means the shipped SFT-warmed tiny model
                (``tiny-sort``) with a separate critic started from the same weights.
            rewards: Reward functions with weights (docs/rewards.md), added to the reward-model score; null with no
                ``reward_model``: exact match on the sort task.
            reward_model: A trained reward model, scored as the reward named ``rm`` (see
                :class:`~align.modules.ppo.PPOModule`).
            trust_region: The KL bound ``max_kl``, conjugate gradient and line-search settings of the policy step.
            kl: KL-to-reference penalty shaped into the rewards (PPO's); 0 with no target loads no reference.
            gae: Discount, lambda and advantage whitening.
            scores: Penalty, whitening, scaling and clipping of the sequence scores.
            value: Value-loss clipping and critic warm-up. The value model has its own optimizer (``optimizer``,
                ``scheduler``), stepped ``updates.epochs`` x ``updates.minibatches`` times per rollout with
                ``updates.micro_batch_size``, ``updates.max_grad_norm`` and ``updates.loss_aggregation`` (which also
                reduces the surrogate; the trust region's KL is always a mean over valid tokens).
        """
        defaults = ValueTraining()
        for key in ("coef", "lr_scale"):
            if getattr(value, key) != getattr(defaults, key):
                raise AlignConfigError(
                    f"model.value.{key}: TRPO trains the value model with its own optimizer "
                    "(set its learning rate in model.optimizer); leave this unset"
                )
        if rewards is None and reward_model is None and kwargs.get("environment") is None:
            rewards = [RewardSpec("align.rewards.sort_exact_match")]
        if policy is None:
            policy = PolicyModel("tiny-sort", critic=CriticSettings(kind="separate"))
        super().__init__(
            policy, rewards=rewards, reward_model=reward_model, kl=kl, gae=gae, scores=scores, value=value, **kwargs
        )
        self.trust_region = trust_region

    # ------------------------------------------------------------------ parameter scopes
    def policy_parameters(self) -> list[nn.Parameter]:
        """The trust region: trainable parameters of the language model (the LoRA adapter when there is one)."""
        return [p for p in self.policy.model.parameters() if p.requires_grad]

    def configure_optimizers(self):
        """The value model's own optimizer: the separate critic and its head, or the shared head alone."""
        return self.with_scheduler(self.optimizer(param_groups(nn.ParameterList(self.value_parameters()))))

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
    def _micro_batches(self, data: GAEBatch, rows: torch.Tensor | None = None) -> list[GAEBatch]:
        n = len(data) if rows is None else len(rows)
        u = self.updates
        widths = None
        if u.max_tokens_per_microbatch is not None:
            widths = data.row_widths(data.attention_mask, data.response_length)
            widths = widths if rows is None else [widths[i] for i in rows.tolist()]
        [chunks] = minibatch_indices(
            n, 1, u.micro_batch_size, shuffle=False, widths=widths, max_tokens=u.max_tokens_per_microbatch
        )
        device = data.input_ids.device
        return [data.select((chunk if rows is None else rows[chunk]).to(device)) for chunk in chunks]

    def _fisher_rows(self, data: GAEBatch) -> torch.Tensor | None:
        if self.trust_region.fisher_fraction >= 1.0:
            return None
        n = max(1, round(self.trust_region.fisher_fraction * len(data)))
        return torch.randperm(len(data))[:n].sort().values

    def _fvp(self, micros: list[GAEBatch], params: list[nn.Parameter]) -> Callable[[torch.Tensor], torch.Tensor]:
        """``v -> (F + damping I) v`` for the mean KL over the valid tokens of ``micros`` on every rank."""
        count = self.all_reduce_sum(torch.stack([m.response_mask.sum() for m in micros]).sum().float()).clamp(min=1.0)

        def local_kl(micro: GAEBatch) -> torch.Tensor:
            with sdpa_kernel([SDPBackend.MATH]):
                logprobs = self.scorer.logprobs(micro).logprobs
            return masked_sum(kl_estimate(micro.old_logprobs, logprobs, "k3"), micro.response_mask) / count

        def reduce_and_damp(local: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
            return self.all_reduce_sum(local) + self.trust_region.damping * vector

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
    def _evaluate(self, micros: list[GAEBatch], normaliser: torch.Tensor, count: torch.Tensor) -> tuple[float, float]:
        """``(surrogate, mean KL(old || current))`` of the current parameters over every rank."""
        surrogate = torch.zeros((), device=normaliser.device)
        kl_sum = torch.zeros((), device=normaliser.device)
        for micro in micros:
            logprobs = self.scorer.logprobs(micro).logprobs
            surrogate += self._surrogate(micro, logprobs, micro.old_logprobs, normaliser)
            kl_sum += masked_sum(kl_estimate(micro.old_logprobs, logprobs, "k3"), micro.response_mask)
        totals = self.all_reduce_sum(torch.stack([surrogate, kl_sum]))
        return float(totals[0]), float(totals[1] / count)

    def _surrogate(
        self, micro: GAEBatch, logprobs: torch.Tensor, old_logprobs: torch.Tensor, normaliser: torch.Tensor
    ) -> torch.Tensor:
        """This micro-batch's share of the importance-weighted surrogate (to be maximised)."""
        ratio = importance_ratio(logprobs, old_logprobs)  # (n, r) pi / pi_old
        return aggregate(ratio * micro.advantages, micro.response_mask, self.updates.loss_aggregation, normaliser)

    def trust_region_step(self, data: GAEBatch) -> dict[str, float]:
        """One TRPO policy step on ``data``, in place; returns the ``trpo/*`` metrics."""
        params, tr = self.policy_parameters(), self.trust_region
        if not params:
            raise RuntimeError("TRPO: the policy has no trainable parameters")
        normaliser = self.learner.normaliser(data.response_mask, self.ranks)
        count = self.all_reduce_sum(data.response_mask.sum().float()).clamp(min=1.0)
        with self._deterministic_policy():
            # g at theta_old; pi_old is this pass's log-probs, detached, so the ratio is exactly 1 here.
            grad = None
            old = torch.zeros_like(data.old_logprobs)  # (N, R)
            entropy_sum = torch.zeros((), device=old.device)
            offset = 0
            for micro in self._micro_batches(data):
                out = self.scorer.logprobs(micro, entropy=self.log_entropy)
                old_logprobs = out.logprobs.detach()
                old[offset : offset + len(micro), : micro.response_length] = old_logprobs
                offset += len(micro)
                g = flat_grad(self._surrogate(micro, out.logprobs, old_logprobs, normaliser), params)
                grad = g if grad is None else grad + g
                if out.entropy is not None:
                    entropy_sum += masked_sum(out.entropy.detach(), micro.response_mask)
            assert grad is not None  # a batch has at least one micro-batch
            grad = self.all_reduce_sum(grad)
            data = replace(data, old_logprobs=old)
            micros = self._micro_batches(data)
            surrogate_before = float(
                self.all_reduce_sum(
                    aggregate(data.advantages, data.response_mask, self.updates.loss_aggregation, normaliser)
                )
            )
            fvp = self._fvp(self._micro_batches(data, self._fisher_rows(data)), params)
            result = trpo_step(
                params,
                grad,
                fvp,
                lambda: self._evaluate(micros, normaliser, count),
                surrogate_before,
                tr.max_kl,
                tr.cg_iters,
                tr.cg_tol,
                tr.backtrack_ratio,
                tr.max_backtracks,
                tr.accept_ratio,
            )
        metrics = {
            "trpo/kl": result.kl,
            "trpo/max_kl": tr.max_kl,
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
    def update_value(self, data: GAEBatch) -> dict[str, float]:
        """``updates.epochs`` x ``updates.minibatches`` value-optimizer steps; the language model gets no gradient."""
        with self._frozen_policy():
            return super().update_value(data)

    def update_policy(self, data: GAEBatch) -> dict[str, float]:
        """The TRPO step on the policy, then the value model's own optimizer steps."""
        return {**self.trust_region_step(data), **self.update_value(data)}
