"""RL plumbing shared by GRPO and PPO: rollout -> rewards -> tensors, minibatch iteration, the manual
optimizer step with its step-wide loss normaliser, and the held-out reward evaluation.

Loss normalisation (docs/algorithms.md, "Losses"): one optimizer step consumes one *minibatch* of rollout rows, processed as
one or more micro-batches. Every micro-batch loss is a sum over its valid tokens (or sequences) divided by
the count over the whole minibatch on all ranks (:meth:`RLModule.step_normaliser`), and is multiplied by
the world size to undo the data-parallel gradient average. Accumulated gradients therefore equal the
gradient of the full minibatch loss, whatever the micro-batch size or the number of ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Callable, Literal, Optional

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.data.prompts import PromptBatch
from align.models.policy import PolicyModel
from align.modules.base import AlignModule, loss_count
from align.rewards import CombinedReward, RewardSpec
from align.rollout import Rollout, RolloutEngine, SamplingConfig
from align.strategies import accumulation_boundary

Aggregation = Literal["token_mean", "seq_mean", "constant"]


@dataclass
class RLBatch:
    """Rollout rows ready for a policy update. ``N`` rows, ``T = P + R`` tokens, ``R`` response tokens."""

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

    def select(self, index: torch.Tensor) -> "RLBatch":
        """The rows ``index``, with the padding columns that no selected row uses trimmed off."""
        rows = {f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[index]) for f in fields(self)}
        width = int(rows["response_mask"].sum(dim=1).max().clamp(min=1))
        cut = self.response_length - width
        for name in ("old_logprobs", "advantages", "ref_logprobs", "response_mask"):
            if rows[name] is not None:
                rows[name] = rows[name][:, :width]
        if cut:
            rows["input_ids"] = rows["input_ids"][:, :-cut]
            rows["attention_mask"] = rows["attention_mask"][:, :-cut]
        return RLBatch(**rows)

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
        raise ValueError(f"num_minibatches must be in [1, {n}] (rows per rollout), got {num_minibatches}")
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    out = []
    for mb in torch.tensor_split(order, num_minibatches):
        size = micro_batch_size or len(mb)
        out.append(list(torch.split(mb, size)))
    return out


class RLModule(AlignModule):
    """Base of the on-policy RL modules (manual optimization). Subclasses implement ``training_step`` with
    :meth:`rollout`, :meth:`score_rewards` and :meth:`update`.

    Evaluation: each validation batch is answered once per prompt with ``eval_sampling`` (greedy by
    default, so before/after numbers are not sampling noise) and logged as ``val/reward_mean`` (the
    weighted total), ``val/reward/<name>``, ``val/accuracy`` (share of completions whose
    ``accuracy_reward`` is at least ``accuracy_threshold``) and ``val/response_length``.
    """

    headline_metrics = ("val/reward_mean", "val/accuracy")

    def __init__(
        self,
        policy: PolicyModel,
        rewards: list[RewardSpec | str],
        sampling: SamplingConfig | None = None,
        eval_sampling: SamplingConfig | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        ppo_epochs: int = 1,
        num_minibatches: int = 1,
        micro_batch_size: int | None = None,
        max_grad_norm: float | None = 1.0,
        loss_aggregation: Aggregation = "token_mean",
        accuracy_reward: str | None = None,
        accuracy_threshold: float = 1.0,
        disable_dropout: bool = True,
    ):
        super().__init__(policy, optimizer, scheduler, disable_dropout)
        self.automatic_optimization = False
        self.reward = CombinedReward(rewards)
        self.engine = RolloutEngine(sampling or SamplingConfig())
        self.eval_engine = RolloutEngine(eval_sampling or SamplingConfig(
            max_new_tokens=self.engine.sampling.max_new_tokens, temperature=0.0))
        if ppo_epochs < 1 or num_minibatches < 1 or (micro_batch_size is not None and micro_batch_size < 1):
            raise ValueError("ppo_epochs, num_minibatches and micro_batch_size must be >= 1")
        if loss_aggregation not in ("token_mean", "seq_mean", "constant"):
            raise ValueError(f"loss_aggregation: expected token_mean, seq_mean or constant, got {loss_aggregation!r}")
        self.ppo_epochs = ppo_epochs
        self.num_minibatches = num_minibatches
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        self.loss_aggregation = loss_aggregation
        names = self.reward.names
        if accuracy_reward is not None and accuracy_reward not in names:
            raise ValueError(f"accuracy_reward: {accuracy_reward!r} is not one of the rewards {names}")
        self.accuracy_reward = accuracy_reward or names[0]
        self.accuracy_threshold = accuracy_threshold
        self.timings: dict[str, float] = {}
        # Saved in checkpoints: training rollouts (one per training batch) and optimizer steps taken by ``update``.
        self.rl_counters = {"rollouts": 0, "updates": 0}

    # ------------------------------------------------------------------ rollout and rewards
    @property
    def score_temperature(self) -> float:
        """Temperature of the training log-probs: the sampling temperature (1 for greedy sampling)."""
        return self.engine.sampling.temperature or 1.0

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout: the policy that sampled is the one being updated."""
        return self.ppo_epochs == 1 and self.num_minibatches == 1

    def rollout(self, batch: PromptBatch, group_size: int = 1, engine: RolloutEngine | None = None) -> Rollout:
        # Sharded parameters (FSDP2, ZeRO-3) need the generation context: see align.strategies.generation_context.
        from align.strategies import generation_context

        self.reward.check_inputs(list(batch.columns))  # a reward's missing argument fails before generating
        with generation_context(self) as sync_stop:
            return (engine or self.engine).generate(self.policy, batch.prompt_ids, group_size, sync_stop=sync_stop)

    def score_rewards(self, batch: PromptBatch, rollout: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(rewards (N,), {name: (N,)})``: the weighted total and each reward's values, on the device.

        Every reward is called with keyword arguments (:class:`align.rewards.RewardFunction`) and receives,
        besides the prompt texts, the completions and the data's columns, the whole
        prompt conversation (``prompt_messages``), the sampled token ids through the first stop token
        (``completion_ids``) and whether a completion was cut off at ``max_new_tokens`` (``completion_truncated``).
        """
        prompts, columns = batch.repeat(rollout.group_size)
        lengths = rollout.response_lengths.tolist()
        inputs = {"prompt_messages": batch.repeat_messages(rollout.group_size),
                  "completion_ids": [ids[:n] for ids, n in zip(rollout.response_ids.tolist(), lengths)],
                  "completion_truncated": [bool(t) for t in rollout.truncated.tolist()]}
        total, parts = self.reward(prompts=prompts, completions=rollout.texts, **columns, **inputs)
        to_tensor = lambda values: torch.tensor(values, dtype=torch.float32, device=rollout.response_ids.device)
        return to_tensor(total), {name: to_tensor(v) for name, v in parts.items()}

    def rollout_metrics(self, rollout: Rollout, rewards: torch.Tensor, parts: dict[str, torch.Tensor]) -> dict[str, float]:
        metrics = dict(rollout.metrics)
        metrics["rollout/reward_mean"] = float(rewards.mean())
        metrics["rollout/reward_std"] = float(rewards.std()) if rewards.numel() > 1 else 0.0
        for name, values in parts.items():
            metrics[f"rollout/reward/{name}"] = float(values.mean())
        return metrics

    # ------------------------------------------------------------------ updates
    def step_normaliser(self, response_mask: torch.Tensor) -> torch.Tensor:
        """The loss normaliser of one optimizer step over the minibatch rows ``response_mask`` (N_mb, R),
        summed over every rank, in the unit of ``loss_aggregation``."""
        count = loss_count(response_mask, self.loss_aggregation, self.engine.sampling.max_new_tokens)
        return self.window_normaliser(count)

    def update(self, data: RLBatch, loss_fn: Callable[[RLBatch, torch.Tensor], tuple[torch.Tensor, dict]],
               ) -> dict[str, float]:
        """``ppo_epochs`` passes over ``data``, one optimizer step per minibatch, micro-batches accumulated.

        ``loss_fn(micro, normaliser) -> (loss, {metric: value})`` returns the micro-batch's share of the
        step loss and metrics that are means over the micro-batch's valid tokens; they are averaged over
        all micro-batches weighted by valid tokens.
        """
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        world = self.trainer.world_size if self._trainer is not None else 1
        sums: dict[str, float] = {}
        weight_total = 0.0
        for _ in range(self.ppo_epochs):
            for micro_indices in minibatch_indices(len(data), self.num_minibatches, self.micro_batch_size):
                normaliser = self.step_normaliser(data.response_mask[torch.cat(micro_indices)])
                for j, index in enumerate(micro_indices):
                    accumulation_boundary(self, j == len(micro_indices) - 1)  # DeepSpeed: reduce on the last only
                    micro = data.select(index.to(data.input_ids.device))
                    loss, stats = loss_fn(micro, normaliser)
                    self.manual_backward(loss * self.gradient_scale())
                    weight = float(micro.response_mask.sum())
                    weight_total += weight
                    for name, value in stats.items():
                        sums[name] = sums.get(name, 0.0) + float(value) * weight
                if self.max_grad_norm is not None:
                    self.clip_gradients(optimizer, gradient_clip_val=self.max_grad_norm, gradient_clip_algorithm="norm")
                optimizer.step()  # a non-finite loss or gradient stops or skips here (align.guards.NonFiniteGuard)
                optimizer.zero_grad(set_to_none=True)
                self.rl_counters["updates"] += 1
                if scheduler is not None:
                    scheduler.step()
        if world > 1 and sums:  # token-weighted means over every rank's micro-batches (one all-reduce)
            names = sorted(sums)
            packed = self.all_reduce_sum(torch.tensor([sums[n] for n in names] + [weight_total], device=self.device))
            sums, weight_total = dict(zip(names, packed[:-1].tolist())), float(packed[-1])
        return {name: value / max(weight_total, 1.0) for name, value in sums.items()}

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.rl_counters["rollouts"] += 1

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint.setdefault("align", {})["rl"] = dict(self.rl_counters)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.rl_counters.update((checkpoint.get("align") or {}).get("rl") or {})

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
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

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
        for name, values in parts.items():
            self._val_add(f"reward/{name}", values)

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        totals = {k: self.all_reduce_sum(v) for k, v in self._val.items()}
        count = totals.pop("count").clamp(min=1.0)
        self.log_dict({f"val/{k}": float(v / count) for k, v in totals.items()}, batch_size=1)


class Timer:
    """Wall-clock seconds of a block, added to ``store[name]``."""

    def __init__(self, store: dict[str, float], name: str):
        self.store, self.name = store, name

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.store[self.name] = self.store.get(self.name, 0.0) + time.perf_counter() - self.start
