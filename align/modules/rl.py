"""``RLModule``: the Lightning side of every on-policy RL algorithm, composed of a scorer, a sampler, a rollout source
and a learner (docs/architecture.md, "A step of GRPO").

* the :class:`~align.models.scorer.Scorer` scores rows: the policy's log-probs (with entropy and values), the
  reference's, the critic's values, at the module's temperature and packing; the losses call it directly;
* the :class:`~align.rollout.sampler.Sampler` samples and rewards rollouts (engine, rewards, environment episodes);
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

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.core.kl import AdaptiveKLController, FixedKLController, KLController
from align.core.masks import masked_sum
from align.data.prompts import PromptBatch
from align.errors import AlignConfigError, NoLearningSignalError
from align.models.policy import PolicyModel
from align.models.scorer import Scorer
from align.modules.base import AlignModule
from align.modules.learner import BatchT, Learner, LossFn, Plan
from align.modules.options import Evaluation, KLPenalty, OverlongPenalty, Updates
from align.rollout.engine import SamplingConfig
from align.rollout.envs.chat import EnvironmentPool, EnvironmentSpec
from align.rollout.evaluation import Evaluator
from align.rollout.rewards import RewardModelSpec, RewardSpec, training_rewards
from align.rollout.sampler import OverlongShaping, Sampler
from align.rollout.source import InlineSource, RolloutSource
from align.rollout.types import Scored

__all__ = ["NO_UPDATE_LIMIT", "RLModule", "accuracy_reward", "build_sampler"]

log = logging.getLogger(__name__)

NO_UPDATE_LIMIT = 50
"""Training batches in a row without an update (all rewards tied) after which an RL run stops with an error."""


def build_sampler(
    policy: PolicyModel,
    scorer: Scorer,
    rewards,
    reward_model,
    eval_rewards,
    group_size: int,
    sampling: SamplingConfig,
    eval_sampling: SamplingConfig | None,
    overlong: OverlongPenalty,
    environment,
) -> tuple[Sampler, list[str]]:
    """The sampler of an RL module's settings (see :class:`RLModule`), and the names of its eval rewards; the
    rewards, the overlong shaping and the environment are checked against each other first."""
    environment = EnvironmentPool(environment) if environment is not None else None
    reward, eval_names = training_rewards(rewards, reward_model, eval_rewards, environment=environment is not None)
    if overlong.enabled and environment is not None:
        raise AlignConfigError(
            "model.overlong: the overlong penalty is per completion and does not apply to "
            "multi-turn episodes (model.environment); penalise length in the environment's "
            "rewards instead, or set overlong.buffer to 0"
        )
    shaping = (
        OverlongShaping(overlong.coef, overlong.buffer, overlong.resolve(sampling.max_new_tokens))
        if overlong.buffer  # overlong.enabled
        else None
    )
    for part, taken in (("overlong", overlong.enabled), ("env", environment is not None)):
        if taken and part in reward.names:
            raise AlignConfigError(f"model.rewards: the name '{part}' is the {part} reward part's; rename that reward")
    sampler = Sampler(policy, reward, group_size, sampling, eval_sampling, environment, shaping, scorer)
    return sampler, eval_names


def accuracy_reward(sampler: Sampler, name: str | None, eval_names: list[str]) -> str:
    """The reward ``val/accuracy`` counts (``evaluation.accuracy_reward``): ``name``, else the first eval reward,
    else the first reward."""
    names = sampler.reward.names + (["env"] if sampler.environment is not None else [])
    if name is not None and name not in names:
        raise AlignConfigError(
            f"model.evaluation.accuracy_reward: {name!r} is not one of the rewards {names}; name "
            "one of them, or null for the first"
        )
    return name or (eval_names or names)[0]


class RLModule(AlignModule):
    """Base of the on-policy RL modules (manual optimization).

    Evaluation: each validation batch is answered once per prompt with ``evaluation.sampling`` (greedy by
    default, so before/after numbers are not sampling noise) and logged as ``val/reward_mean`` (the
    weighted total), ``val/reward/<name>``, ``val/accuracy`` (share of completions whose
    ``evaluation.accuracy_reward`` is at least ``evaluation.accuracy_threshold``) and ``val/response_length``.

    Without a trainer (a notebook, a test), :meth:`use_optimizer` gives :meth:`update` an optimizer, and
    :meth:`log_metrics` keeps the step's numbers in ``last_metrics``.
    """

    headline_metrics: tuple[str, ...] = ("val/reward_mean", "val/accuracy")
    progress_metrics: tuple[str, ...] = ("rollout/reward_mean", "train/kl", "train/loss", "rollout/tokens_per_s")

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
        self.group_size, self.kl, self.log_entropy = group_size, kl, log_entropy
        sampling = sampling or SamplingConfig()
        self.scorer = Scorer(policy, temperature=sampling.temperature or 1.0, padding_free=updates.padding_free)
        """Scores rows at the sampling temperature (the log-probs of the old and the new policy and the reference's
        are computed alike); 1 for greedy sampling."""
        self.sampler, self.eval_reward_names = build_sampler(
            policy,
            self.scorer,
            rewards,
            reward_model,
            eval_rewards,
            group_size,
            sampling,
            evaluation.sampling,
            overlong,
            environment,
        )
        self.sampler.generation_context = self._generation_context
        self.sampler.ranks = lambda: self.ranks
        self.source = source if source is not None else InlineSource()
        self.source.bind(self.sampler)
        self.learner = Learner(updates, self.sampler.max_response_tokens)
        self.kl_controller: KLController = (
            AdaptiveKLController(kl.coef, kl.target, kl.horizon)
            if kl.target is not None
            else FixedKLController(kl.coef)
        )
        self.accuracy_reward = accuracy_reward(self.sampler, evaluation.accuracy_reward, self.eval_reward_names)
        self.accuracy_threshold = evaluation.accuracy_threshold
        self.timings: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}
        self.batches_without_update = 0
        self.max_batches_without_update = max(NO_UPDATE_LIMIT, self.source.max_steps_without_update)

    # ------------------------------------------------------------------ parts and their settings
    @property
    def updates(self) -> Updates:
        """How each rollout is consumed: the learner's settings."""
        return self.learner.updates

    @property
    def needs_reference(self) -> bool:
        """Whether the reference is loaded and its log-probs computed: when the KL penalty is on (online DPO:
        always, its loss is relative to the reference)."""
        return self.kl.enabled

    @property
    def rl_counters(self) -> dict[str, int]:
        """Training rollouts sampled and optimizer steps taken (saved in checkpoints)."""
        return {"rollouts": self.sampler.rollouts, "updates": self.learner.steps}

    def _generation_context(self):
        # Sharded parameters (FSDP2, ZeRO-3) need the generation context: see align.trainer.strategies.
        from align.trainer.strategies import generation_context

        return generation_context(self)

    def setup(self, stage: str) -> None:
        from align.trainer.strategies import before_process_group_release

        self.sampler.setup(str(self.trainer.strategy.root_device) if self._trainer is not None else None)
        if self.needs_reference:
            self.policy.setup_reference()
        for engine in (self.sampler.engine, self.sampler.eval_engine):  # their process-wide state goes first
            before_process_group_release(type(engine).shutdown)

    # ------------------------------------------------------------------ a training step's parts
    def next_scored(self, batch: PromptBatch) -> Scored | None:
        """The source's scored rollout for this step, its timings become :attr:`timings`; None when the source
        yields none on this step (a filtered source filling up): the step is counted as one without an update
        (:meth:`no_update`, with the source's reason) and logs nothing, so the caller just returns."""
        scored = self.source.next(batch, self.learner.steps)
        if scored is None:
            self.no_update(self.source.no_update_reason)
            self.log_nothing()
            return None
        self.timings = dict(scored.timings)
        return scored

    def reference_logprobs(self, rows) -> torch.Tensor | None:
        """``(N, R)`` reference log-probs of ``rows`` (:meth:`Scorer.reference_logprobs
        <align.models.scorer.Scorer.reference_logprobs>`) when :attr:`needs_reference`, else None."""
        return self.scorer.reference_logprobs(rows) if self.needs_reference else None

    def update_kl_controller(self, kl: torch.Tensor, response_mask: torch.Tensor) -> None:
        """Feed the mean per-sequence KL ``kl`` (N, R) over all ranks to the controller; ``n_steps`` = sequences
        on all ranks. A fixed coefficient ignores it."""
        n = self.all_reduce_sum(torch.tensor(float(kl.shape[0]), device=kl.device))
        seq_kl = self.all_reduce_sum(masked_sum(kl, response_mask))
        self.kl_controller.update(float(seq_kl / n.clamp(min=1)), int(n))

    # ------------------------------------------------------------------ updates
    def update(self, data: BatchT, loss_fn: LossFn[BatchT], plan: Plan | None = None) -> dict[str, float]:
        """The learner's update of ``data`` with ``loss_fn`` (:meth:`align.modules.learner.Learner.update`; ``plan``:
        its first epoch's minibatches, drawn earlier by the learner)."""
        return self.learner.update(data, loss_fn, self.optimization(), self._updated, plan)

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
                "policy's completions apart (a graded reward, a larger group_size or sampling.temperature)"
            )

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
            log.warning(
                "rollout source: the checkpoint holds the work in progress of %d ranks, this run has %d; it is dropped",
                len(saved),
                self.trainer.world_size,
            )
            return
        self.source.load_state_dict(saved[self.trainer.global_rank], self.device)

    def on_train_end(self) -> None:
        self.source.close()

    # ------------------------------------------------------------------ evaluation
    def on_validation_epoch_start(self) -> None:
        self.held_out = Evaluator(self.accuracy_reward, self.accuracy_threshold, self.device)

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        rollout = self.sampler.rollout(batch, 1, self.sampler.eval_engine, version=self.learner.steps)
        self.held_out.add(rollout, *self.sampler.score(batch, rollout))

    def on_validation_epoch_end(self) -> None:
        means = self.held_out.means(self.all_reduce_sum, self._all_max)
        # The highest accuracy reward of the run's held-out passes: below the threshold, val/accuracy is 0 by
        # construction, and the command line prints the reward's mean instead.
        self.accuracy_reward_highest = max(
            getattr(self, "accuracy_reward_highest", -float("inf")), float(self.held_out.highest)
        )
        if means:
            self.log_dict({f"val/{k}": v for k, v in means.items()}, batch_size=1)

    def _all_max(self, value: torch.Tensor) -> torch.Tensor:
        if self._trainer is None or self.trainer.world_size == 1:
            return value
        return self.trainer.strategy.all_gather(value).max()
