"""RL plumbing shared by GRPO and PPO: rollout -> rewards -> tensors, minibatch iteration, the manual
optimizer step with its step-wide loss normaliser, and the held-out reward evaluation.

Loss normalisation (docs/algorithms.md, "Losses"): one optimizer step consumes one *minibatch* of rollout rows, processed as
one or more micro-batches. Every micro-batch loss is a sum over its valid tokens (or sequences) divided by
the count over the whole minibatch on all ranks (:meth:`RLModule.step_normaliser`), and is multiplied by
the world size to undo the data-parallel gradient average. Accumulated gradients therefore equal the
gradient of the full minibatch loss, whatever the micro-batch size or the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.data.prompts import PromptBatch
from align.rollout.envs.chat import EnvironmentPool, EnvironmentSpec
from align.rollout.episodes import play_episodes
from align.errors import AlignConfigError, NoLearningSignalError
from align.core.kl import AdaptiveKLController, FixedKLController, KLController
from align.core.advantages import overlong_penalty
from align.core.masks import masked_sum
from align.models.policy import PolicyModel, TokenLogprobs
from align.modules.base import AlignModule, loss_count
from align.modules.options import Aggregation, Evaluation, KLPenalty, OverlongPenalty, Updates
from align.observability.timing import Timer, record_span
from align.rollout.rewards import LazyRewardModel, RewardModelSpec, RewardSpec, reward_inputs, training_rewards
from align.rollout.engine import Rollout, RolloutEngine, SamplingConfig
from align.trainer.strategies import accumulation_boundary

__all__ = ["Aggregation", "NO_UPDATE_LIMIT", "RLBatch", "RLModule", "Timer", "minibatch_indices"]

NO_UPDATE_LIMIT = 50
"""Training batches in a row without an update (all rewards tied) after which an RL run stops with an error."""


@dataclass
class RLBatch:
    """Rollout rows ready for a policy update. ``N`` rows, ``T = P + R`` tokens, ``R`` response tokens.

    Subclasses add fields (PPO: values, returns, ...). :meth:`select` handles every tensor field by its shape:
    ``(N, R)`` per response token, ``(N,)`` per row; other fields are per rollout and are not carried over.
    """

    input_ids: torch.Tensor  # (N, T) prompt (left-padded) + response
    attention_mask: torch.Tensor  # (N, T) prompt mask + response mask
    response_mask: torch.Tensor  # (N, R) bool
    old_logprobs: torch.Tensor  # (N, R) sampling log-probs
    advantages: torch.Tensor  # (N, R) per-token advantages (GRPO broadcasts one per sequence)
    ref_logprobs: Optional[torch.Tensor] = None  # (N, R) reference log-probs, when a KL term needs them

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    @staticmethod
    def selected_width(attention_mask: torch.Tensor, response_length: int, index: torch.Tensor) -> int:
        """Response columns that :meth:`select` keeps for the rows ``index``: up to the last one any of them uses."""
        used = attention_mask[index, attention_mask.shape[1] - response_length:].any(dim=0).nonzero()
        return int(used[-1]) + 1 if len(used) else 1

    def select(self, index: torch.Tensor) -> "RLBatch":
        """The rows ``index``, with the padding columns that no selected row uses trimmed off."""
        width = self.selected_width(self.attention_mask, self.response_length, index)
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

    @classmethod
    def from_rollout(cls, rollout: Rollout, advantages: torch.Tensor, ref_logprobs: Optional[torch.Tensor] = None) -> "RLBatch":
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(rollout.old_logprobs)  # (N,) -> (N, R)
        return cls(rollout.input_ids, rollout.attention_mask, rollout.response_mask, rollout.old_logprobs,
                   advantages, ref_logprobs)


def minibatch_indices(n: int, num_minibatches: int, micro_batch_size: Optional[int], shuffle: bool = True,
                      generator: Optional[torch.Generator] = None) -> list[list[torch.Tensor]]:
    """Split ``n`` rows into ``num_minibatches`` (one optimizer step each), each into micro-batches of at
    most ``micro_batch_size`` rows (``None``: one micro-batch). Returns ``[[indices, ...], ...]``."""
    if not 1 <= num_minibatches <= n:
        raise ValueError(f"updates.minibatches must be in [1, {n}] (rows per rollout), got {num_minibatches}")
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    out = []
    for mb in torch.tensor_split(order, num_minibatches):
        size = micro_batch_size or len(mb)
        out.append(list(torch.split(mb, size)))
    return out


class RLModule(AlignModule):
    """Base of the on-policy RL modules (manual optimization). Subclasses implement ``training_step`` with
    :meth:`rollout`, :meth:`score_rewards` and :meth:`update`.

    Evaluation: each validation batch is answered once per prompt with ``evaluation.sampling`` (greedy by
    default, so before/after numbers are not sampling noise) and logged as ``val/reward_mean`` (the
    weighted total), ``val/reward/<name>``, ``val/accuracy`` (share of completions whose
    ``evaluation.accuracy_reward`` is at least ``evaluation.accuracy_threshold``) and ``val/response_length``.

    Without a trainer (a notebook, a test), :meth:`use_optimizer` gives :meth:`update` an optimizer, and
    :meth:`log_metrics` keeps the step's numbers in ``last_metrics``.
    """

    headline_metrics = ("val/reward_mean", "val/accuracy")
    progress_metrics = ("rollout/reward_mean", "train/kl", "train/loss", "rollout/tokens_per_s")

    def __init__(
        self,
        policy: PolicyModel,
        rewards: list[RewardSpec | str] | None = None,
        reward_model: RewardModelSpec | str | None = None,
        eval_rewards: list[RewardSpec | str] | None = None,
        group_size: int = 1,
        sampling: SamplingConfig | None = None,
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
            sampling: How training completions are drawn (temperature, top_p, top_k, max_new_tokens, ...).
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
        self.environment = EnvironmentPool(environment) if environment is not None else None
        self.reward, self.eval_reward_names = training_rewards(rewards, reward_model, eval_rewards,
                                                               environment=self.environment is not None)
        self.group_size = group_size
        self.engine = RolloutEngine(sampling or SamplingConfig())
        self.eval_engine = RolloutEngine(evaluation.sampling or SamplingConfig(
            max_new_tokens=self.engine.sampling.max_new_tokens, temperature=0.0))
        self.updates, self.kl, self.log_entropy = updates, kl, log_entropy
        if overlong.enabled and self.environment is not None:
            raise AlignConfigError("model.overlong: the overlong penalty is per completion and does not apply to "
                                   "multi-turn episodes (model.environment); penalise length in the environment's "
                                   "rewards instead, or set overlong.buffer to 0")
        self.overlong, self.overlong_max_length = overlong, overlong.resolve(self.engine.sampling.max_new_tokens)
        for part, taken in (("overlong", overlong.enabled), ("env", self.environment is not None)):
            if taken and part in self.reward.names:
                raise AlignConfigError(f"model.rewards: the name '{part}' is the {part} reward part's; rename that "
                                       "reward")
        self.kl_controller: KLController = (AdaptiveKLController(kl.coef, kl.target, kl.horizon)
                                            if kl.target is not None else FixedKLController(kl.coef))
        names = self.reward.names + (["env"] if self.environment is not None else [])
        if evaluation.accuracy_reward is not None and evaluation.accuracy_reward not in names:
            raise AlignConfigError(f"model.evaluation.accuracy_reward: {evaluation.accuracy_reward!r} is not one of the "
                                   f"rewards {names}; name one of them, or null for the first")
        self.accuracy_reward = evaluation.accuracy_reward or (self.eval_reward_names or names)[0]
        self.accuracy_threshold = evaluation.accuracy_threshold
        self.timings: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}
        self._standalone: tuple[torch.optim.Optimizer, object] | None = None
        self._planned: list[list[torch.Tensor]] | None = None
        self.current_rows: torch.Tensor | None = None
        """The rows of the batch that the micro-batch being scored in :meth:`update` holds."""
        # Saved in checkpoints: training rollouts and optimizer steps taken by ``update``.
        self.rl_counters = {"rollouts": 0, "updates": 0}
        self.batches_without_update = 0
        self.max_batches_without_update = NO_UPDATE_LIMIT

    def setup(self, stage: str) -> None:
        for reward in self.reward.rewards:  # a reward model loads onto this process's device, before the first step
            if isinstance(reward.fn, LazyRewardModel):
                reward.fn.load(str(self.trainer.strategy.root_device) if self._trainer is not None else None)
        if self.needs_reference:
            self.policy.setup_reference()

    # ------------------------------------------------------------------ rollout and rewards
    @property
    def logprob_temperature(self) -> float:
        """Temperature of the training log-probs: the sampling temperature (1 for greedy sampling)."""
        return self.engine.sampling.temperature or 1.0

    @property
    def max_response_tokens(self) -> int:
        """Longest response a rollout can hold: ``sampling.max_new_tokens``, or an episode's token budget
        (``environment.max_tokens``, assistant and environment tokens)."""
        return self.environment.spec.max_tokens if self.environment is not None else self.engine.sampling.max_new_tokens

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout: the policy that sampled is the one being updated."""
        return self.updates.on_policy

    def rollout(self, batch: PromptBatch, group_size: int | None = None, engine: RolloutEngine | None = None) -> Rollout:
        """``group_size`` (default: the module's) completions per prompt; counted in ``rl_counters["rollouts"]``
        when the module is training and samples with the training engine."""
        # Sharded parameters (FSDP2, ZeRO-3) need the generation context: see align.trainer.strategies.generation_context.
        from align.trainer.strategies import generation_context

        self.reward.check_inputs(list(batch.columns))  # a reward's missing argument fails before generating
        if self.training and engine is None:
            self.rl_counters["rollouts"] += 1
        engine = engine or self.engine
        with generation_context(self) as sync_stop:
            if self.environment is None:
                return engine.generate(self.policy, batch.prompt_ids, group_size or self.group_size, sync_stop=sync_stop)
            rollout = play_episodes(self.policy, engine.sampling, batch, group_size or self.group_size,
                                    self.environment, engine.stop_ids(self.tokenizer), sync_stop=sync_stop)
        self.trace_environment(rollout)
        return rollout

    def trace_environment(self, rollout: Rollout) -> None:
        """An ``env_step`` span per environment call of a multi-turn rollout, under the span open here (the step's
        ``generation``), while tracing is on."""
        name = self.environment.name
        for index, episode in enumerate(rollout.episodes):
            for turn, start, end, reward, done in episode["calls"]:
                record_span("env_step", start, end, {"align.env.name": name, "align.env.episode": index,
                                                     "align.env.turn": turn, "align.env.reward": reward,
                                                     "align.env.done": done})

    def token_logprobs(self, data: RLBatch | Rollout, reference: bool = False, **kwargs) -> TokenLogprobs:
        """Per-token log-probs of the responses in ``data`` (and entropy or values on request), at the sampling
        temperature; ``reference=True``: under the reference policy."""
        return self.policy.token_logprobs(data.input_ids, data.attention_mask, response_length=data.response_mask.shape[1],
                                          temperature=self.logprob_temperature, reference=reference,
                                          padding_free=self.updates.padding_free, **kwargs)

    @property
    def needs_reference(self) -> bool:
        """Whether the reference is loaded and :meth:`reference_logprobs` computed: when the KL penalty is on
        (online DPO: always, its loss is relative to the reference)."""
        return self.kl.enabled

    @torch.no_grad()
    def reference_logprobs(self, rollout: RLBatch | Rollout) -> torch.Tensor | None:
        """``(N, R)`` reference log-probs of the rows, or None when no reference is needed."""
        return self.token_logprobs(rollout, reference=True).logprobs if self.needs_reference else None

    def score_rewards(self, batch: PromptBatch, rollout: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(rewards (N,), {name: (N,)})``: the weighted total and each reward's values, on the device.

        Every reward is called with keyword arguments (:class:`align.rollout.rewards.RewardFunction`) and receives,
        besides the prompt texts, the completions and the data's columns, the whole
        prompt conversation (``prompt_messages``), the sampled token ids through the first stop token
        (``completion_ids``) and whether a completion was cut off at ``max_new_tokens`` (``completion_truncated``).

        With ``overlong.buffer`` set, the part ``overlong`` holds each completion's penalty in ``[-1, 0]``
        (:func:`align.core.advantages.overlong_penalty` of its length, stop token included), and the total adds
        ``overlong.coef`` times it. A multi-turn rollout adds the part ``env``, each episode's summed environment
        rewards, with weight ``environment.weight``.
        """
        total, parts = self.reward(**reward_inputs(batch, rollout))
        to_tensor = lambda values: torch.tensor(values, dtype=torch.float32, device=rollout.response_ids.device)
        total, parts = to_tensor(total), {name: to_tensor(v) for name, v in parts.items()}
        if rollout.episodes is not None:
            parts["env"] = to_tensor([e["env_reward"] for e in rollout.episodes])
            total = total + self.environment.spec.weight * parts["env"]
        if self.overlong.enabled:
            parts["overlong"] = overlong_penalty(rollout.response_lengths, self.overlong_max_length,
                                                 self.overlong.buffer)  # (N,)
            total = total + self.overlong.coef * parts["overlong"]
        return total, parts

    def sample_and_score(self, batch: PromptBatch, fresh_timings: bool = True,
                         ) -> tuple[Rollout, torch.Tensor, dict[str, torch.Tensor]]:
        """A training rollout and its rewards (:meth:`score_rewards`), timed into ``self.timings``
        (``time/generation_s``, ``time/scoring_s``): a fresh dict, or with ``fresh_timings=False`` added to the
        current one (GRPO's dynamic sampling sums the batches of one update)."""
        if fresh_timings:
            self.timings = {}
        with Timer(self.timings, "time/generation_s"):
            rollout = self.rollout(batch)
        with Timer(self.timings, "time/scoring_s"):
            return (rollout, *self.score_rewards(batch, rollout))

    def rollout_metrics(self, rollout: Rollout, rewards: torch.Tensor, parts: dict[str, torch.Tensor]) -> dict[str, float]:
        metrics = dict(rollout.metrics)
        metrics["rollout/reward_mean"] = float(rewards.mean())
        metrics["rollout/reward_std"] = float(rewards.std()) if rewards.numel() > 1 else 0.0
        for name, values in parts.items():
            metrics[f"rollout/reward/{name}"] = float(values.mean())
        return metrics

    # ------------------------------------------------------------------ KL to the reference
    def update_kl_controller(self, kl: torch.Tensor, response_mask: torch.Tensor) -> None:
        """Feed the mean per-sequence KL ``kl`` (N, R) over all ranks to the controller; ``n_steps`` = sequences
        on all ranks. A fixed coefficient ignores it."""
        n = self.all_reduce_sum(torch.tensor(float(kl.shape[0]), device=kl.device))
        seq_kl = self.all_reduce_sum(masked_sum(kl, response_mask))
        self.kl_controller.update(float(seq_kl / n.clamp(min=1)), int(n))

    # ------------------------------------------------------------------ updates
    def step_normaliser(self, response_mask: torch.Tensor) -> torch.Tensor:
        """The loss normaliser of one optimizer step over the minibatch rows ``response_mask`` (N_mb, R),
        summed over every rank, in the unit of ``updates.loss_aggregation``."""
        count = loss_count(response_mask, self.updates.loss_aggregation, self.max_response_tokens)
        return self.window_normaliser(count)

    @staticmethod
    def as_token_mean(value: torch.Tensor, normaliser: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of a step loss (``value``, divided by the step's ``normaliser``), expressed as a
        mean over the micro-batch's own valid tokens ``mask``: the unit of the logged ``train/*`` losses."""
        return value.detach() * normaliser / max(float(mask.sum()), 1.0)

    def use_optimizer(self, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
        """Run :meth:`update` without a trainer: it steps ``optimizer`` (and ``scheduler``) itself."""
        self._standalone = (optimizer, scheduler)

    def _backward_and_step(self):
        """``(optimizer, scheduler, backward, clip)``: the trainer's, or plain torch without a trainer."""
        if self._trainer is None:
            if self._standalone is None:
                raise RuntimeError("RLModule.update without a trainer: call use_optimizer(optimizer) first")
            optimizer, scheduler = self._standalone
            clip = lambda norm: torch.nn.utils.clip_grad_norm_(self.parameters(), norm)
            return optimizer, scheduler, lambda loss: loss.backward(), clip
        optimizer = self.optimizers()
        clip = lambda norm: self.clip_gradients(optimizer, gradient_clip_val=norm, gradient_clip_algorithm="norm")
        return optimizer, self.lr_schedulers(), self.manual_backward, clip

    def plan_minibatches(self, n: int) -> list[list[torch.Tensor]]:
        """Draw the first epoch's minibatches of the next :meth:`update` of ``n`` rows now (the same random draw
        that update would make), so that the rollout's scoring can prepare for its first micro-batch."""
        u = self.updates
        self._planned = minibatch_indices(n, u.minibatches, u.micro_batch_size)
        return self._planned

    def update(self, data: RLBatch, loss_fn: Callable[[RLBatch, torch.Tensor], tuple[torch.Tensor, dict]],
               ) -> dict[str, float]:
        """``updates.epochs`` passes over ``data``, one optimizer step per minibatch, micro-batches accumulated.

        ``loss_fn(micro, normaliser) -> (loss, {metric: value})`` returns the micro-batch's share of the
        step loss and metrics that are means over the micro-batch's valid tokens; they are averaged over
        all micro-batches weighted by valid tokens. The first epoch's minibatches are those drawn by
        :meth:`plan_minibatches` when it was called for these rows (PPO, as it scores the rollout), else drawn here;
        :attr:`current_rows` names the rows of the micro-batch ``loss_fn`` is given.
        """
        optimizer, scheduler, backward, clip = self._backward_and_step()
        world = self.trainer.world_size if self._trainer is not None else 1
        u = self.updates
        sums: dict[str, float] = {}
        weight_total = 0.0
        planned, self._planned = self._planned, None
        if planned is not None and sum(len(i) for mb in planned for i in mb) != len(data):
            planned = None  # drawn for other rows
        for epoch in range(u.epochs):
            minibatches = (planned if epoch == 0 and planned is not None
                           else minibatch_indices(len(data), u.minibatches, u.micro_batch_size))
            for micro_indices in minibatches:
                normaliser = self.step_normaliser(data.response_mask[torch.cat(micro_indices)])
                for j, index in enumerate(micro_indices):
                    accumulation_boundary(self, j == len(micro_indices) - 1)  # DeepSpeed: reduce on the last only
                    micro = data.select(index.to(data.input_ids.device))
                    self.current_rows = index
                    loss, stats = loss_fn(micro, normaliser)
                    backward(loss * self.gradient_scale())
                    weight = float(micro.response_mask.sum())
                    weight_total += weight
                    for name, value in stats.items():
                        sums[name] = sums.get(name, 0.0) + float(value) * weight
                if u.max_grad_norm is not None:
                    clip(u.max_grad_norm)
                optimizer.step()  # a non-finite loss or gradient stops or skips here (align.trainer.guards.NonFiniteGuard)
                optimizer.zero_grad(set_to_none=True)
                self.rl_counters["updates"] += 1
                self.batches_without_update = 0
                if scheduler is not None:
                    scheduler.step()
        self.current_rows = None
        if world > 1 and sums:  # token-weighted means over every rank's micro-batches (one all-reduce)
            names = sorted(sums)
            packed = self.all_reduce_sum(torch.tensor([sums[n] for n in names] + [weight_total], device=self.device))
            sums, weight_total = dict(zip(names, packed[:-1].tolist())), float(packed[-1])
        return {name: value / max(weight_total, 1.0) for name, value in sums.items()}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint.setdefault("align", {})["rl"] = {**self.rl_counters, "kl_controller": self.kl_controller.state_dict()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get("align") or {}
        state = dict(saved.get("rl") or {})
        legacy = saved.get("ppo") or {}  # checkpoints written before the controller moved here
        controller = state.pop("kl_controller", None) or legacy.get("kl_controller")
        if controller:
            self.kl_controller.load_state_dict(controller)
        self.rl_counters.update(state)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Log the step's metrics, averaged over ranks (one all-reduce; every rank logs the same numbers).
        Ranks hold equally many rollout rows, so rollout means are global means; ``rollout/reward_std`` and
        ``time/*`` are means of per-rank values, ``rollout/tokens_per_s`` is per process."""
        metrics = {k: float(v) for k, v in metrics.items()}
        world = self.trainer.world_size if self._trainer is not None else 1
        if world > 1 and metrics:
            names = sorted(metrics)
            packed = self.all_reduce_sum(torch.tensor([metrics[n] for n in names], device=self.device)) / world
            metrics = dict(zip(names, packed.tolist()))
        self.last_metrics = metrics
        if self.logs_this_step():
            self.log_step(metrics)

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

    # ------------------------------------------------------------------ evaluation
    def on_validation_epoch_start(self) -> None:
        self._val: dict[str, torch.Tensor] = {}

    def _val_add(self, name: str, value: torch.Tensor) -> None:
        self._val[name] = self._val.get(name, torch.zeros((), device=self.device)) + value.detach().float().sum()

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        rollout = self.rollout(batch, 1, self.eval_engine)
        rewards, parts = self.score_rewards(batch, rollout)
        self._val_add("count", torch.tensor(float(len(rollout)), device=self.device))
        self._val_add("reward_mean", rewards)
        self._val_add("accuracy", (parts[self.accuracy_reward] >= self.accuracy_threshold).float())
        self._val_add("response_length", rollout.response_lengths)
        if rollout.episodes is not None:
            self._val_add("turns", torch.tensor([float(e["turns"]) for e in rollout.episodes], device=self.device))
        for name, values in parts.items():
            self._val_add(f"reward/{name}", values)

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        totals = {k: self.all_reduce_sum(v) for k, v in self._val.items()}
        count = totals.pop("count").clamp(min=1.0)
        self.log_dict({f"val/{k}": float(v / count) for k, v in totals.items()}, batch_size=1)

