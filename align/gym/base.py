"""Shared plumbing of the classic-RL modules (Gymnasium environments, small networks).

One *iteration* is one training step for Lightning: collect a window of environment steps (or episodes), then
update. Training stops once ``total_steps`` environment steps are taken (``trainer.max_steps``, which counts optimizer
steps, also stops it). The module brings its own data: an endless train loader (the environment is the data) and
a one-batch validation loader that plays ``evaluation.episodes`` greedy episodes on held-out seeds, so ``fit``'s
before/after and ``--trainer.val_check_interval N`` (every N iterations) work as for the language-model recipes.

Logged per iteration (on the steps the loggers write): ``rollout/episode_reward`` and ``rollout/episode_length``, means
over the last ``RECENT_EPISODES`` (100) finished episodes, as Stable-Baselines3's ``ep_rew_mean`` (a metric
logged only on some rows would repeat its last value on the others in Lightning's CSV), ``rollout/episodes``,
``rollout/env_steps``,
``rollout/steps_per_s``, ``train/lr`` and each algorithm's losses (``train/policy_loss``, ``train/value_loss``,
``train/entropy``, ``train/loss``; DQN's ``rollout/epsilon``). Validation logs ``val/episode_reward``,
``val/episode_reward_std`` and ``val/episode_length``. Under an ``OTelTracingCallback`` each iteration's collection
is a ``rollout`` span carrying ``rl.algorithm``, ``rl.episode`` (the last finished episode's number),
``rl.episodes``, ``rl.total_reward`` and ``rl.episode_length`` (means over the episodes it finished).

Exact resume: the checkpoint holds the networks, the optimizer, the counters and the runner's episodes in progress
(:mod:`align.gym.runner`); :class:`~align.trainer.checkpointing.ExactResume` restores the RNG that samples actions.
Subclasses add what else they own (DQN: its replay buffer) in :meth:`ClassicRLModule.extra_state`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader

from align.errors import AlignConfigError
from align.gym.make import EnvSpec, as_spec, make_env
from align.gym.optim import clip_grad_norm, fused_adam_step
from align.gym.options import EpisodeEvaluation, Schedule, as_group
from align.gym.runner import EnvRunner, Episode, OnStep, Policy, Steps
from align.modules.base import TrainingModule
from align.observability.timing import Timer
from align.trainer.guards import NonFiniteError

Metrics = dict[str, float | Callable[[], float]]
"""An iteration's metrics: numbers, or zero-argument callables computed only when the step is logged."""

RECENT_EPISODES = 100
"""Finished training episodes that ``rollout/episode_reward`` and ``rollout/episode_length`` average over."""


class _Iterations:
    """The training 'data': an endless count of iterations. Each batch starts one collect-and-update iteration."""

    def __iter__(self) -> Iterator[int]:
        i = 0
        while True:
            yield i
            i += 1


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


class ClassicRLModule(TrainingModule):
    """Base of the classic-RL modules (manual optimization). Subclasses build their networks in ``__init__`` (the
    spaces are known there) and implement :meth:`iteration` and :meth:`act`."""

    algorithm = "rl"
    guards_own_steps = True
    headline_metrics = ("val/episode_reward", "val/episode_length")
    progress_metrics = ("rollout/episode_reward", "rollout/env_steps", "train/loss")

    def __init__(
        self,
        env: EnvSpec = EnvSpec(),
        total_steps: int = 100_000,
        evaluation: EpisodeEvaluation = EpisodeEvaluation(),
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_schedule: Schedule = "constant",
        max_grad_norm: float | None = 0.5,
    ):
        """The arguments every classic-RL module shares; ``max_grad_norm`` comes from the subclass's ``updates``
        group (null: no clipping)."""
        super().__init__()
        self.automatic_optimization = False
        self.env = as_spec(env)
        if total_steps < 1:
            raise AlignConfigError(f"model.total_steps: expected >= 1 environment steps, got {total_steps}")
        if lr_schedule not in ("constant", "linear"):
            raise AlignConfigError(f"model.lr_schedule: expected 'constant' or 'linear', got {lr_schedule!r}")
        self.total_steps, self.evaluation = int(total_steps), as_group(EpisodeEvaluation, evaluation)
        self.optimizer, self.lr_schedule, self.max_grad_norm = optimizer, lr_schedule, max_grad_norm
        probe = make_env(self.env)  # the spaces, and a bad id or constructor fails here, on one line
        self.observation_space, self.action_space = probe.observation_space, probe.action_space
        probe.close()
        self._runner: EnvRunner | None = None
        self._eval_runner: EnvRunner | None = None
        self._pending_state: dict | None = None
        self._recent: deque[Episode] = deque(maxlen=RECENT_EPISODES)  # the latest finished training episodes
        self._window_steps, self._window_start = 0, time.perf_counter()
        self.timings: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}
        self._trainable: list[torch.nn.Parameter] | None = None
        self._unhooked_steps: bool | None = None  # decided at the first step of each fit

    # ------------------------------------------------------------------ environments
    @property
    def runner(self) -> EnvRunner:
        """The training environments, built on first use (and restored from a checkpoint when resuming)."""
        if self._runner is None:
            self._runner = EnvRunner(self.env)
            if self._pending_state is not None:
                self._runner.load_state_dict(self._pending_state["runner"])
        return self._runner

    @property
    def env_steps(self) -> int:
        return (
            self._runner.steps
            if self._runner is not None
            else int((self._pending_state or {}).get("runner", {}).get("steps", 0))
        )

    def progress(self) -> float:
        """Share of ``total_steps`` taken, in [0, 1]."""
        return min(self.env_steps / self.total_steps, 1.0)

    def act(self, obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        """Actions ``(N, *act)`` for observations ``(N, *obs)``, for evaluation (and :meth:`policy` by default)."""
        raise NotImplementedError

    def collect(self, policy: Policy, num_steps: int | None = None, on_step: OnStep | None = None) -> Steps:
        """``num_steps`` vector steps (``None``: one complete episode per environment), timed as the ``rollout``
        section and span, with the episodes it finished as the span's ``rl.*`` attributes."""
        with Timer(self.timings, "time/rollout_s") as timer:
            before = len(self.runner.finished)
            if num_steps is None:
                steps = self.runner.collect_episodes(policy)
            else:
                steps = self.runner.collect(policy, num_steps, on_step)
            finished = self.runner.finished[before:]
            if finished:
                timer.annotate(
                    {
                        "rl.algorithm": self.algorithm,
                        "rl.episode": finished[-1].index,
                        "rl.episodes": len(finished),
                        "rl.total_reward": _mean([e.reward for e in finished]),
                        "rl.episode_length": _mean([float(e.length) for e in finished]),
                    }
                )
        return steps

    # ------------------------------------------------------------------ optimization
    def configure_optimizers(self):
        return self.optimizer([p for p in self.parameters() if p.requires_grad])

    def _optimizer(self) -> LightningOptimizer:
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)  # configure_optimizers returns one optimizer
        return optimizer

    def current_lr(self) -> float:
        return float(self._optimizer().param_groups[0]["lr"])

    def _anneal_lr(self) -> None:
        """``lr_schedule: linear``: every group's learning rate falls linearly to 0 at ``total_steps``."""
        optimizer = self._optimizer()
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
            if self.lr_schedule == "linear":
                group["lr"] = group["initial_lr"] * (1.0 - self.progress())

    # Not Lightning's hook of the same name, which manual optimization never calls: the modules' own step.
    def optimizer_step(self, loss: torch.Tensor) -> float:  # type: ignore[override]  # not Lightning's hook
        """Backward, clip to ``updates.max_grad_norm`` and step; returns the gradient norm before clipping.

        The non-finite guard is done here, on the norm the clipping computes anyway (``guards_own_steps``): a NaN
        or infinite loss or gradient stops the run with :class:`~align.trainer.guards.NonFiniteError` before the step is
        taken. In 32-bit precision the backward is torch's own (Lightning's ``manual_backward`` adds nothing there
        but hook calls, a sizeable share of a small network's step)."""
        if self._trainable is None:  # walking the module tree on every step costs more than a small model's step
            self._trainable = [p for p in self.parameters() if p.requires_grad]
        for p in self._trainable:  # the optimizer's zero_grad(set_to_none=True), without its profiler record
            p.grad = None
        if not math.isfinite(float(loss.detach())):
            self._non_finite("loss")
        if type(self.trainer.precision_plugin) is Precision:
            loss.backward()
        else:
            self.manual_backward(loss)
        norm = float(clip_grad_norm(self._trainable, self.max_grad_norm))
        if not math.isfinite(norm):
            self._non_finite("gradients")
        optimizer = self._optimizer()
        if self._unhooked_steps is None:
            self._unhooked_steps = self._nothing_hooks_the_step(optimizer)
        if self._unhooked_steps:
            # Lightning's count of the step (trainer.global_step) and its profiler section, around torch's step.
            # A fused Adam's kernel is called directly (align.gym.optim.fused_adam_step), where that applies.
            optimizer._on_before_step()
            if not fused_adam_step(optimizer.optimizer):
                optimizer.optimizer.step()
            optimizer._on_after_step()
        else:
            optimizer.step()
        return norm

    def _nothing_hooks_the_step(self, optimizer) -> bool:
        """Whether Lightning's optimizer step would add nothing but its count to torch's: 32-bit precision on one
        device, and no callback nor this module implementing ``on_before_optimizer_step``. Then the step skips
        Lightning's closure wrapping and hook dispatch, which cost about as much as a small network's Adam step
        (70-200 us against 50-250 us for DQN's 256x256 network) and DQN takes 128 such steps per iteration."""
        trainer = self.trainer
        if type(trainer.precision_plugin) is not Precision or type(trainer.strategy) is not SingleDeviceStrategy:
            return False
        if not (hasattr(optimizer, "_on_before_step") and hasattr(optimizer, "_on_after_step")):
            return False
        if type(self).on_before_optimizer_step is not L.LightningModule.on_before_optimizer_step:
            return False
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector
        return all(type(cb).on_before_optimizer_step is Callback.on_before_optimizer_step for cb in callbacks)

    def _non_finite(self, what: str) -> None:
        raise NonFiniteError(
            f"non-finite {what} at optimizer step {self.trainer.global_step} (iteration "
            f"{self.trainer.fit_loop.epoch_loop.batch_idx}, {self.env_steps} environment steps). The update was not "
            "applied. Lower the learning rate, or check the environment's rewards and observations"
        )

    def iteration(self) -> Metrics:
        """Collect and update once; returns this iteration's loss metrics (``train/...``). A value may be a
        zero-argument callable: it is called only on steps whose metrics are logged, so diagnostics that cost
        more than a small network's update (explained variance, means over minibatches) are not computed for
        rows nobody writes."""
        raise NotImplementedError

    # ------------------------------------------------------------------ Lightning loop
    def setup(self, stage: str) -> None:
        if self.trainer.world_size > 1:
            raise AlignConfigError(
                f"trainer.devices: classic RL runs in one process (its environments are stepped in "
                f"one place), got {self.trainer.world_size} processes; use model.env.num_envs and "
                "model.env.vectorization: async to step more environments at once"
            )

    def train_dataloader(self) -> _Iterations:
        # A plain iterable: a DataLoader's per-batch machinery costs more than a small network's update.
        return _Iterations()

    def on_train_start(self) -> None:
        self._unhooked_steps = None
        self._window_steps, self._window_start = self.env_steps, time.perf_counter()

    def training_step(self, batch: int, batch_idx: int) -> None:
        self._anneal_lr()
        self.timings = {}
        metrics = self.iteration()
        self._recent.extend(self.runner.pop_episodes())
        if self.env_steps >= self.total_steps:
            self.trainer.should_stop = True  # before logging: the loggers write the row of a stopping step
        if self.logs_this_step():
            self.log_step(self._step_metrics(metrics))
        else:  # Lightning would recompute the last row's values after every batch until the next row
            self.log_nothing()

    def _step_metrics(self, metrics: Metrics) -> dict[str, float]:
        now = time.perf_counter()
        out = {
            "rollout/env_steps": float(self.env_steps),
            "rollout/episodes": float(self.runner.episodes),
            "rollout/steps_per_s": (self.env_steps - self._window_steps) / max(now - self._window_start, 1e-9),
            "train/lr": self.current_lr(),
            **{k: v() if callable(v) else v for k, v in metrics.items()},
            **self.timings,
        }
        if self._recent:
            out["rollout/episode_reward"] = _mean([e.reward for e in self._recent])
            out["rollout/episode_length"] = _mean([float(e.length) for e in self._recent])
        self._window_steps, self._window_start = self.env_steps, now
        self.last_metrics = out
        return out

    # ------------------------------------------------------------------ evaluation
    def val_dataloader(self) -> DataLoader:
        return DataLoader([0], batch_size=None)  # type: ignore[arg-type]  # torch's stub wants a Dataset; a list is one

    @torch.no_grad()
    def evaluate(self, episodes: int | None = None, deterministic: bool | None = None) -> list[Episode]:
        """Play ``episodes`` (default ``evaluation.episodes``) complete episodes, one per environment, on the same
        held-out seeds every time, so two evaluations differ only by the policy."""
        n = self.evaluation.episodes if episodes is None else episodes
        greedy = self.evaluation.deterministic if deterministic is None else deterministic
        if self._eval_runner is None or self._eval_runner.num_envs != n:
            if self._eval_runner is not None:
                self._eval_runner.close()
            self._eval_runner = EnvRunner(
                EnvSpec(**{**vars(self.env), "num_envs": n, "vectorization": "sync"}), stream=1
            )
        runner = self._eval_runner
        runner.rewind()  # the same seeds every evaluation
        was_training = self.training
        self.eval()
        try:
            steps = runner.collect_episodes(lambda obs: (self.act(obs, greedy), {}))
        finally:
            self.train(was_training)
        runner.pop_episodes()
        assert steps.valid is not None  # collect_episodes marks each environment's first episode
        valid = steps.valid.float()  # (T, N)
        rewards, lengths = (steps.rewards * valid).sum(0), valid.sum(0)
        return [Episode(float(r), int(n_), i + 1, False) for i, (r, n_) in enumerate(zip(rewards, lengths))]

    def validation_step(self, batch: int, batch_idx: int) -> None:
        episodes = self.evaluate()
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
        metrics = {
            "val/episode_reward": rewards.mean(),
            "val/episode_reward_std": rewards.std(unbiased=False),
            "val/episode_length": torch.tensor([float(e.length) for e in episodes]).mean(),
        }
        for name, value in metrics.items():
            self.log(name, float(value), on_step=False, on_epoch=True, batch_size=1)

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any]:
        """What a subclass owns beyond its parameters and buffers, for exact resume (tensors and numbers only)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        recent = torch.tensor([[e.reward, e.length, e.index, e.truncated] for e in self._recent], dtype=torch.float64)
        checkpoint["classic_rl"] = {
            "runner": self.runner.state_dict(),
            "extra": self.extra_state(),
            "recent": recent,
            "algorithm": self.algorithm,
            "env": self.env.id,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("classic_rl")
        if state is None:
            raise AlignConfigError("checkpoint: it holds no classic-RL state; it was not written by this module")
        self._pending_state = state
        self._recent.clear()
        self._recent.extend(Episode(float(r), int(n), int(i), bool(t)) for r, n, i, t in state["recent"].tolist())
        if self._runner is not None:  # already built: rebuild its episodes now
            self._runner.load_state_dict(state["runner"])
        self.load_extra_state(state["extra"])


__all__ = ["ClassicRLModule", "Metrics"]
