"""``RLModule``: the Lightning side of every on-policy RL algorithm, composed of a sampler, a rollout source and a
learner (docs/architecture.md, "A step of GRPO").

* the :class:`~align.rollout.sampler.Sampler` samples and scores rollouts (engine, rewards, environment episodes,
  reference log-probs);
* the :class:`~align.rollout.source.RolloutSource` (``model.source``) decides which scored rollout a training step
  updates on: the inline source samples one now, the filtered source (dynamic sampling) fills an update over steps;
* the :class:`~align.modules.learner.Learner` runs the update loop (minibatches, micro-batches, the step-wide loss
  normaliser) on the optimizer this module gets from Lightning, or from :meth:`RLModule.use_optimizer` without one.

The module keeps what belongs to Lightning and to the run: the hooks, manual optimization, the KL controller, the
counters saved in checkpoints, the stop after too many steps without an update, logging and the held-out evaluation.
An algorithm subclasses it with a ``training_step`` of a few lines: ``scored = self.next_scored(batch)``, its
advantages and batch, ``self.update(batch, loss_fn)``, ``self.log_metrics(...)``.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.core.kl import AdaptiveKLController, FixedKLController, KLController
from align.core.losses import loss_count
from align.core.masks import masked_sum
from align.data.prompts import PromptBatch
from align.errors import AlignConfigError, NoLearningSignalError
from align.models.policy import PolicyModel, TokenLogprobs
from align.modules.base import AlignModule
from align.modules.learner import Learner, LossFn, Optimization, RLBatch
from align.modules.options import Evaluation, KLPenalty, OverlongPenalty, Updates
from align.rollout.envs.chat import EnvironmentPool, EnvironmentSpec
from align.rollout.rewards import RewardModelSpec, RewardSpec, training_rewards
from align.rollout.sampler import OverlongShaping, Sampler
from align.rollout.sampling import SamplingConfig
from align.rollout.source import InlineSource, RolloutSource
from align.rollout.types import Scored

__all__ = ["NO_UPDATE_LIMIT", "RLModule"]

log = logging.getLogger(__name__)

NO_UPDATE_LIMIT = 50
"""Training batches in a row without an update (all rewards tied) after which an RL run stops with an error."""


class RLModule(AlignModule):
    """Base of the on-policy RL modules (manual optimization).

    Evaluation: each validation batch is answered once per prompt with ``evaluation.sampling`` (greedy by
    default, so before/after numbers are not sampling noise) and logged as ``val/reward_mean`` (the
    weighted total), ``val/reward/<name>``, ``val/accuracy`` (share of completions whose
    ``evaluation.accuracy_reward`` is at least ``evaluation.accuracy_threshold``) and ``val/response_length``.

    Without a trainer (a notebook, a test), :meth:`use_optimizer` gives :meth:`update` an optimizer, and
    :meth:`log_metrics` keeps the step's numbers in ``last_metrics``.
    """

    headline_metrics = ("val/reward_mean", "val/accuracy")
    progress_metrics = ("rollout/reward_mean", "train/kl", "train/loss", "rollout/tokens_per_s")
    policy_temperature: float | None = None
    """Temperature of the training and reference log-probs; None: the sampling temperature (1 for greedy)."""

    def __init__(
        self,
        policy: PolicyModel,
        rewards: list[RewardSpec | str] | None = None,
        reward_model: RewardModelSpec | str | None = None,
        eval_rewards: list[RewardSpec | str] | None = None,
        group_size: int = 1,
        sampling: SamplingConfig | None = None,
        source: RolloutSource | None = None,
        evaluation: Evaluation = Evaluation(),
        updates: Updates = Updates(),
        kl: KLPenalty = KLPenalty(),
        overlong: OverlongPenalty = OverlongPenalty(),
        environment: EnvironmentSpec | str | None = None,
        log_entropy: bool = True,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        disable_dropout: bool = True,
    ):
        """
        Args:
            policy: The model to train.
            rewards: Training rewards, functions or classes with weights (docs/rewards.md).
            reward_model: A trained reward model, scored as the training reward named ``rm`` (first in the list):
                a path, or ``{path, weight, batch_size}``.
            eval_rewards: Rewards that are only logged (``rollout/reward/<name>``, ``val/reward/<name>``), never
                trained on, e.g. the task's true verifiable reward next to a reward model's score.
            group_size: Completions sampled per prompt in each rollout.
            sampling: How training completions are drawn (engine, temperature, top_p, top_k, max_new_tokens, ...).
            source: Where training rollouts come from: null (``InlineSource``) samples each step's prompts now;
                ``align.rollout.source.FilteredSource`` is DAPO's dynamic sampling (``max_batches``, ``reward``);
                ``align.rollout.async_source.AsyncSource`` generates ahead of training (docs/async.md).
            evaluation: Held-out sampling (greedy by default) and what counts for ``val/accuracy``.
            updates: Passes over each rollout, optimizer steps per pass, micro-batch size, gradient clipping and
                loss aggregation.
            kl: KL penalty to the reference policy: coefficient (0: no reference is loaded), estimator, placement
                and the adaptive controller's target.
            overlong: DAPO's soft overlong punishment, added to the training reward as the part ``overlong``
                (``buffer``: the ramp's length; 0 or null: off).
            environment: A multi-turn environment (docs/environments.md): an import path, or ``{path, init_kwargs,
                max_turns, max_tokens, weight, step_timeout, workers}``. Each prompt row is played as
                ``group_size`` episodes; the environment's rewards, summed per episode, are the reward part ``env``,
                and ``rewards`` (optional then) score each episode's last assistant turn. Null: one completion per
                prompt, scored by ``rewards``.
            log_entropy: Compute ``train/entropy`` (a full-vocabulary softmax per token).
            optimizer: Optimizer callable (parameters -> optimizer).
            scheduler: Learning-rate schedule callable, stepped every optimizer step.
            disable_dropout: Set every dropout (model, LoRA adapter, critic) to 0, so that the training
                log-probs equal the sampler's and the reference's and a ratio starts at exactly 1; false keeps
                the model's dropout (noisier ratios and reference).
        """
        super().__init__(policy, optimizer, scheduler, disable_dropout)
        if group_size < 1:
            raise AlignConfigError(f"model.group_size: expected >= 1, got {group_size}")
        self.automatic_optimization = False
        environment = EnvironmentPool(environment) if environment is not None else None
        reward, self.eval_reward_names = training_rewards(rewards, reward_model, eval_rewards,
                                                          environment=environment is not None)
        sampling = sampling or SamplingConfig()
        if overlong.enabled and environment is not None:
            raise AlignConfigError("model.overlong: the overlong penalty is per completion and does not apply to "
                                   "multi-turn episodes (model.environment); penalise length in the environment's "
                                   "rewards instead, or set overlong.buffer to 0")
        shaping = (OverlongShaping(overlong.coef, overlong.buffer, overlong.resolve(sampling.max_new_tokens))
                   if overlong.enabled else None)
        for part, taken in (("overlong", overlong.enabled), ("env", environment is not None)):
            if taken and part in reward.names:
                raise AlignConfigError(f"model.rewards: the name '{part}' is the {part} reward part's; rename that "
                                       "reward")
        self.group_size, self.kl, self.log_entropy = group_size, kl, log_entropy
        self.sampler = Sampler(policy, reward, group_size, sampling, evaluation.sampling, environment, shaping,
                               self.policy_temperature, updates.padding_free, self.needs_reference)
        self.sampler.generation_context = self._generation_context
        self.sampler.ranks = lambda: self.ranks
        self.source = source if source is not None else InlineSource()
        self.source.bind(self.sampler)
        self.learner = Learner(updates, self.loss_count)
        self.kl_controller: KLController = (AdaptiveKLController(kl.coef, kl.target, kl.horizon)
                                            if kl.target is not None else FixedKLController(kl.coef))
        names = reward.names + (["env"] if environment is not None else [])
        if evaluation.accuracy_reward is not None and evaluation.accuracy_reward not in names:
            raise AlignConfigError(f"model.evaluation.accuracy_reward: {evaluation.accuracy_reward!r} is not one of the "
                                   f"rewards {names}; name one of them, or null for the first")
        self.accuracy_reward = evaluation.accuracy_reward or (self.eval_reward_names or names)[0]
        self.accuracy_threshold = evaluation.accuracy_threshold
        self.timings: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}
        self._standalone: tuple[torch.optim.Optimizer, object] | None = None
        self.batches_without_update = 0
        self.max_batches_without_update = max(NO_UPDATE_LIMIT, self.source.max_steps_without_update)

    # ------------------------------------------------------------------ parts and their settings
    @property
    def updates(self) -> Updates:
        """How each rollout is consumed (the learner's settings; the sampler's padding-free scoring follows them)."""
        return self.learner.updates

    @updates.setter
    def updates(self, value: Updates) -> None:
        self.learner.updates = value
        self.sampler.padding_free = value.padding_free

    @property
    def reward(self):
        return self.sampler.reward

    @property
    def environment(self) -> EnvironmentPool | None:
        return self.sampler.environment

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the training log-probs (:attr:`policy_temperature`, else the sampling temperature)."""
        return self.sampler.logprob_temperature

    @property
    def needs_reference(self) -> bool:
        """Whether the reference is loaded and its log-probs computed: when the KL penalty is on (online DPO:
        always, its loss is relative to the reference)."""
        return self.kl.enabled

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout: the policy that sampled is the one being updated."""
        return self.updates.on_policy

    @property
    def rl_counters(self) -> dict[str, int]:
        """Training rollouts sampled and optimizer steps taken (saved in checkpoints)."""
        return {"rollouts": self.sampler.rollouts, "updates": self.learner.steps}

    def loss_count(self, response_mask: torch.Tensor) -> torch.Tensor:
        """This rank's count of loss terms of a minibatch's rows, in the unit of ``updates.loss_aggregation``."""
        return loss_count(response_mask, self.updates.loss_aggregation, self.sampler.max_response_tokens)

    def _generation_context(self):
        # Sharded parameters (FSDP2, ZeRO-3) need the generation context: see align.trainer.strategies.
        from align.trainer.strategies import generation_context

        return generation_context(self)

    def setup(self, stage: str) -> None:
        self.sampler.setup(str(self.trainer.strategy.root_device) if self._trainer is not None else None)

    # ------------------------------------------------------------------ a training step's parts
    def next_scored(self, batch: PromptBatch) -> Scored | None:
        """The source's scored rollout for this step, its timings become :attr:`timings`; None when the source
        yields none on this step (a filtered source filling up): the step is counted as one without an update
        (:meth:`no_update`, with the source's reason) and logs nothing, so the caller just returns."""
        self.sampler.policy_version = self.learner.steps
        scored = self.source.next(batch)
        if scored is None:
            self.no_update(self.source.no_update_reason)
            self.log_nothing()
            return None
        self.timings = dict(scored.timings)
        return scored

    def token_logprobs(self, data, reference: bool = False, **kwargs) -> TokenLogprobs:
        """Per-token log-probs of the responses in ``data`` (and entropy or values on request), computed as the
        sampler computes them; ``reference=True``: under the reference policy."""
        return self.sampler.token_logprobs(data, reference=reference, **kwargs)

    def update_kl_controller(self, kl: torch.Tensor, response_mask: torch.Tensor) -> None:
        """Feed the mean per-sequence KL ``kl`` (N, R) over all ranks to the controller; ``n_steps`` = sequences
        on all ranks. A fixed coefficient ignores it."""
        n = self.all_reduce_sum(torch.tensor(float(kl.shape[0]), device=kl.device))
        seq_kl = self.all_reduce_sum(masked_sum(kl, response_mask))
        self.kl_controller.update(float(seq_kl / n.clamp(min=1)), int(n))

    @staticmethod
    def as_token_mean(value: torch.Tensor, normaliser: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of a step loss (``value``, divided by the step's ``normaliser``), expressed as a
        mean over the micro-batch's own valid tokens ``mask``: the unit of the logged ``train/*`` losses."""
        return value.detach() * normaliser / max(float(mask.sum()), 1.0)

    # ------------------------------------------------------------------ updates
    def use_optimizer(self, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
        """Run :meth:`update` without a trainer: it steps ``optimizer`` (and ``scheduler``) itself."""
        self._standalone = (optimizer, scheduler)

    def optimization(self) -> Optimization:
        """The trainer's optimizer and hooks for the learner; plain torch's without a trainer."""
        if self._trainer is None:
            if self._standalone is None:
                raise RuntimeError("RLModule.update without a trainer: call use_optimizer(optimizer) first")
            optimizer, scheduler = self._standalone
            return Optimization(optimizer, scheduler, lambda loss: loss.backward(),
                                lambda norm: torch.nn.utils.clip_grad_norm_(self.parameters(), norm))
        from align.trainer.clipping import clip_gradients
        from align.trainer.strategies import accumulation_boundary

        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        return Optimization(optimizer, scheduler, self.manual_backward, partial(clip_gradients, self, optimizer),
                            lambda last: accumulation_boundary(self, last), self.gradient_scale(), self.ranks)

    def update(self, data: RLBatch, loss_fn: LossFn) -> dict[str, float]:
        """The learner's update of ``data`` with ``loss_fn`` (:meth:`align.modules.learner.Learner.update`)."""
        return self.learner.update(data, loss_fn, self.optimization(), self._updated)

    def _updated(self) -> None:
        self.batches_without_update = 0

    def no_update(self, why: str) -> None:
        """Count a training step that sampled and scored but took no optimizer step (``why``: what was missing).
        ``trainer.max_steps`` counts updates, so a reward that never tells this policy's completions apart would
        otherwise keep the run sampling forever: after ``max_batches_without_update`` such steps in a row the run
        stops with :class:`~align.errors.NoLearningSignalError` (checkpoints already written are kept)."""
        self.batches_without_update += 1
        if self.batches_without_update >= self.max_batches_without_update:
            raise NoLearningSignalError(
                f"{why} in {self.batches_without_update} training batches in a row, so no update was taken and "
                "trainer.max_steps (which counts updates) cannot be reached: check that the rewards can tell this "
                "policy's completions apart (a graded reward, a larger group_size or sampling.temperature)")

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        from align.trainer.checkpointing import gather_objects

        super().on_save_checkpoint(checkpoint)
        checkpoint["align"]["rl"] = {**self.rl_counters, "kl_controller": self.kl_controller.state_dict()}
        state = self.source.state_dict()
        if state:  # every rank's work in progress (a filtered source's fill; empty when saved at an update)
            checkpoint["align"]["rollout_source"] = gather_objects(state)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("align") or {}
        state = dict(saved.get("rl") or {})
        controller = state.pop("kl_controller", None)
        if controller:
            self.kl_controller.load_state_dict(controller)
        self.sampler.rollouts = state.get("rollouts", self.sampler.rollouts)
        self.learner.steps = state.get("updates", self.learner.steps)
        self._saved_source = saved.get("rollout_source")

    def on_train_start(self) -> None:
        saved, self._saved_source = getattr(self, "_saved_source", None), None
        if not saved:
            return
        if len(saved) != self.trainer.world_size:  # resharded data: work on other ranks' prompts cannot continue
            log.warning("rollout source: the checkpoint holds the work in progress of %d ranks, this run has %d; "
                        "it is dropped", len(saved), self.trainer.world_size)
            return
        self.source.load_state_dict(saved[self.trainer.global_rank], self.device)

    def on_train_end(self) -> None:
        self.source.close()

    # ------------------------------------------------------------------ evaluation
    def on_validation_epoch_start(self) -> None:
        self._val: dict[str, torch.Tensor] = {}

    def _val_add(self, name: str, value: torch.Tensor) -> None:
        self._val[name] = self._val.get(name, torch.zeros((), device=self.device)) + value.detach().float().sum()

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        rollout = self.sampler.rollout(batch, 1, self.sampler.eval_engine)
        rewards, parts = self.sampler.score(batch, rollout)
        self._val_add("count", torch.tensor(float(len(rollout)), device=self.device))
        self._val_add("reward_mean", rewards)
        self._val_add("accuracy", (parts[self.accuracy_reward] >= self.accuracy_threshold).float())
        self._val["highest"] = torch.maximum(self._val.get("highest", torch.tensor(-torch.inf, device=self.device)),
                                             parts[self.accuracy_reward].detach().float().max())
        self._val_add("response_length", rollout.response_lengths)
        if rollout.episodes is not None:
            self._val_add("turns", torch.tensor([float(e["turns"]) for e in rollout.episodes], device=self.device))
        for name, values in parts.items():
            self._val_add(f"reward/{name}", values)

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        highest = self._val.pop("highest", torch.tensor(-torch.inf, device=self.device))
        if self._trainer is not None and self.trainer.world_size > 1:  # every rank joins, with or without rows
            highest = self.trainer.strategy.all_gather(highest).max()
        # The highest accuracy reward of the run's held-out passes: below the threshold, val/accuracy is 0 by
        # construction, and the command line prints the reward's mean instead.
        self.accuracy_reward_highest = max(getattr(self, "accuracy_reward_highest", -float("inf")), float(highest))
        totals = {k: self.all_reduce_sum(v) for k, v in self._val.items()}
        count = totals.pop("count").clamp(min=1.0)
        self.log_dict({f"val/{k}": float(v / count) for k, v in totals.items()}, batch_size=1)
