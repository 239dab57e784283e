"""Shared LightningModule plumbing: the policy, optimizer and scheduler callables, checkpoint metadata, and the
accumulation window (each micro-batch's exact share of an optimizer step's loss and logged means)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import partial
from typing import cast

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.core.stats import Ranks
from align.models.policy import PolicyModel
from align.modules.learner import Optimization
from align.trainer.clipping import clip_gradients
from align.trainer.host_memory import keep_freed_host_memory
from align.trainer.optim import WarmupLR
from align.trainer.strategies import release_process_group_at_exit


def param_groups(module: torch.nn.Module) -> list[dict]:
    """Weight decay on matrices only: biases, norms and other vectors are not decayed."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in module.parameters():
        if p.requires_grad:
            # A parameter already partitioned by DeepSpeed ZeRO-3 (an earlier validation engine) holds an empty
            # local tensor; its real shape is ``ds_shape``.
            ndim = len(getattr(p, "ds_shape", p.shape))
            (decay if ndim >= 2 else no_decay).append(p)
    groups: list[dict] = [{"params": decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class PairMetrics:
    """Sums of per-pair statistics over an accumulation window (or a validation epoch), reduced across ranks."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.pairs = 0
        self.started = time.perf_counter()

    def add(self, pairs: int, **sums: torch.Tensor) -> None:
        for name, value in sums.items():
            value = value.detach().float()
            self.sums[name] = self.sums[name] + value if name in self.sums else value
        self.pairs += pairs

    def means(self, module: AlignModule) -> dict[str, float]:
        """Window means over all ranks (one all-reduce); ``pairs_per_s`` from this rank's clock."""
        if not self.sums:
            return {}
        names = list(self.sums)
        device = self.sums[names[0]].device
        packed = torch.stack([self.sums[n] for n in names] + [torch.tensor(float(self.pairs), device=device)])
        packed = module.all_reduce_sum(packed)
        pairs = float(packed[-1].clamp(min=1))
        out = {n: float(packed[i]) / pairs for i, n in enumerate(names)}
        out["pairs_per_s"] = float(packed[-1]) / max(time.perf_counter() - self.started, 1e-9)
        return out


def _last_step(trainer: L.Trainer) -> bool:
    """Whether the optimizer step in progress (or just taken, under manual optimization) is the run's last."""
    if trainer.max_steps > 0 and trainer.global_step + 1 >= trainer.max_steps:
        return True
    loop = trainer.fit_loop
    return bool(
        loop.max_epochs
        and loop.max_epochs > 0
        and trainer.current_epoch + 1 >= loop.max_epochs
        and loop.epoch_loop.batch_progress.is_last_batch
    )


# Trainer attributes that Lightning's connectors set on it, which its class does not declare.
def _callbacks(trainer: L.Trainer) -> list[L.Callback]:
    return trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector


def _fast_dev_run(trainer: L.Trainer) -> int | bool:
    return trainer.fast_dev_run  # type: ignore[attr-defined]  # set by Lightning's trainer setup


class TrainingModule(L.LightningModule):
    """Base of every module the command line trains, language-model algorithms and classic RL alike: per-step
    logging only on the steps that something reads, the optimizer's scheduler, and the callbacks every run needs
    (exact resume, the non-finite guard). Subclasses set ``headline_metrics`` (what the CLI prints before and after)
    and ``progress_metrics`` (the per-step values the progress bar shows)."""

    headline_metrics: tuple[str, ...] = ()
    progress_metrics: tuple[str, ...] = ()
    scheduler: LRSchedulerCallable | None  # set by the modules that call with_scheduler

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum across data-parallel ranks (identity on one process)."""
        if self._trainer is None or self.trainer.world_size == 1:
            return value
        return self.trainer.strategy.reduce(value.detach().clone(), reduce_op="sum")

    @property
    def ranks(self) -> Ranks:
        """This process's data-parallel rank, the number of ranks and the sum over them."""
        if self._trainer is None:
            return Ranks(all_reduce=self.all_reduce_sum)
        return Ranks(self.trainer.global_rank, self.trainer.world_size, self.all_reduce_sum)

    # ------------------------------------------------------------------ per-step metrics
    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Log one step's metrics, averaged over ranks (one all-reduce; every rank logs the same numbers), and keep
        them in ``last_metrics`` (read without a trainer). In the RL modules ranks hold equally many rollout rows, so
        rollout means are global means; ``rollout/reward_std`` and ``time/*`` are means of per-rank values,
        ``rollout/tokens_per_s`` is per process."""
        metrics = {k: float(v) for k, v in metrics.items()}
        world = self.trainer.world_size if self._trainer is not None else 1
        if world > 1 and metrics:
            names = sorted(metrics)
            packed = self.all_reduce_sum(torch.tensor([metrics[n] for n in names], device=self.device)) / world
            metrics = dict(zip(names, packed.tolist()))
        self.last_metrics = metrics
        if self.logs_this_step():
            self.log_step(metrics)

    def logs_this_step(self) -> bool:
        """Whether anything reads this optimizer step's on-step metrics: the loggers write them only every
        ``trainer.log_every_n_steps`` steps, while a progress bar or a callback that monitors a metric (a
        ``ModelCheckpoint`` or ``EarlyStopping`` with ``monitor``) reads them on every step.

        ``self.log`` costs about a millisecond per value on CPU, a sizeable share of a small model's step, and
        the window means behind the values take a collective and a device sync. Steps that nothing reads skip
        both; every row the loggers write is the same as when every step is logged. Decided from the step
        count, so every data-parallel rank decides alike. The run's last step is always logged, so that
        ``trainer.callback_metrics`` ends with the final values."""
        trainer = self._trainer
        if trainer is None:
            return False
        bar = trainer.progress_bar_callback
        # A progress bar that does not say whether it is enabled (Lightning's base class does not) is taken to be.
        if (bar is not None and getattr(bar, "is_enabled", True)) or _fast_dev_run(trainer):
            return True
        if any(getattr(cb, "monitor", None) for cb in _callbacks(trainer)):
            return True
        connector = getattr(trainer, "_logger_connector", None)
        return connector is None or bool(connector.should_update_logs) or _last_step(trainer)

    def log_step(self, metrics: Mapping[str, float | torch.Tensor], prog_bar: tuple[str, ...] | None = None) -> None:
        """Log one optimizer step's metrics; callers compute them only when :meth:`logs_this_step`. The
        ``prog_bar`` ones (by default :attr:`progress_metrics`) are shown on the progress bar."""
        prog_bar = self.progress_metrics if prog_bar is None else prog_bar
        self.log_nothing()  # a name logged on an earlier step and absent from this one is absent from its row
        for name, value in metrics.items():
            self.log(name, value, on_step=True, on_epoch=False, prog_bar=name in prog_bar, batch_size=1)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        """After the run's last optimizer step, write its row when the loggers would skip it: a run shorter than
        ``log_every_n_steps`` (or one whose last step falls between two rows) still ends with its last row.
        Lightning writes a step's row right after this hook, and only every ``log_every_n_steps`` steps."""
        trainer = self.trainer
        loop = trainer.fit_loop
        last = (0 < trainer.max_steps <= trainer.global_step) or bool(
            loop.max_epochs
            and loop.max_epochs > 0
            and trainer.current_epoch + 1 >= loop.max_epochs
            and loop.epoch_loop.batch_progress.is_last_batch
        )
        connector = getattr(trainer, "_logger_connector", None)
        if (
            last
            and connector is not None
            and trainer.log_every_n_steps > 0  # type: ignore[attr-defined]  # set by Lightning's logger connector
            and not (connector.should_update_logs or _fast_dev_run(trainer))
        ):
            connector.log_metrics(connector.metrics["log"])

    def log_nothing(self) -> None:
        """Forget the on-step values the current hook logged so far: Lightning's result collection keeps them
        until they are logged anew, so it would write them again in the row of a step that took no update (or,
        for a name this step does not log, such as an environment's ``info`` key no episode reported), and
        recompute them after every batch. Rows already written and ``trainer.callback_metrics`` keep them."""
        if self._trainer is not None and self.trainer._results is not None:
            self.trainer._results.reset(metrics=False, fx=self._current_fx_name or "training_step")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """``trainer.gradient_clip_val`` under any precision and optimizer: bf16 gradients carry no loss scale, so
        they are clipped even for a fused optimizer, which Lightning's mixed-precision plugin refuses
        (:func:`align.trainer.clipping.clip_gradients`)."""
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def with_scheduler(self, optimizer: torch.optim.Optimizer):
        """``configure_optimizers``' return value for ``optimizer`` and the module's scheduler, stepped every
        optimizer step (a :class:`~align.trainer.optim.WarmupLR` without total steps gets the trainer's)."""
        if self.scheduler is None:
            return optimizer
        scheduler = self.scheduler(optimizer)
        if isinstance(scheduler, WarmupLR) and scheduler.total_steps is None:
            scheduler.total_steps = int(self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self) -> None:
        # Large freed blocks stay with the process for the next step instead of being faulted in anew
        # (align.trainer.host_memory: about a fifth of a SmolLM2 PPO update on CPU).
        keep_freed_host_memory()
        release_process_group_at_exit()

    def on_validation_start(self) -> None:
        release_process_group_at_exit()  # a validate-only run (align validate) on several processes

    guards_own_steps = False
    """True for a module that checks its own losses and gradients for non-finite values before each step (classic
    RL, whose many small steps would pay for the callback's extra pass over the gradients): no
    :class:`~align.trainer.guards.NonFiniteGuard` is attached for it."""

    def configure_callbacks(self):
        """Exact resume (RNG states, dataloader position, atomic checkpoint writes) and the non-finite guard
        (policy ``error``), unless the trainer already has callbacks of those types."""
        from align.trainer.checkpointing import ExactResume
        from align.trainer.guards import NonFiniteGuard

        present = tuple(type(cb) for cb in (_callbacks(self.trainer) if self._trainer is not None else []))
        wanted = (ExactResume,) if self.guards_own_steps else (ExactResume, NonFiniteGuard)
        return [cb() for cb in wanted if not any(issubclass(t, cb) for t in present)]


class AlignModule(TrainingModule):
    """Base of every language-model algorithm module: the policy (a :class:`PolicyModel`), the optimizer over its
    trainable parameters, FSDP2 sharding, and the accumulation window."""

    def __init__(
        self,
        policy: PolicyModel,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        disable_dropout: bool = False,
    ):
        super().__init__()
        self.policy = policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._standalone: tuple[torch.optim.Optimizer, object] | None = None
        if disable_dropout:
            policy.disable_dropout()

    @property
    def tokenizer(self):
        return self.policy.tokenizer

    # ------------------------------------------------------------------ accumulation window
    # One optimizer step consumes a window: every micro-batch accumulated into it, on every data-parallel rank.
    # Its loss is a sum over the window's tokens (or sequences, pairs) divided by their count over the whole
    # window, so accumulating 8 x 1 equals 1 x 8 and two ranks equal one. Each micro-batch returns its own sum
    # divided by that global count (``window_normaliser``), times the factor that undoes what the framework
    # does to a returned loss (``gradient_scale``); ``window_loss`` does both.

    def gradient_scale(self) -> float:
        """The factor that undoes the framework's own loss scaling, so a loss divided by a global count is exact.

        Lightning divides each micro-batch loss by ``accumulate_grad_batches``; DeepSpeed's engine divides by it
        once more; data-parallel gradient averaging divides by the world size. Under manual optimization only the
        average over ranks applies (the module accumulates itself, and Lightning refuses
        ``accumulate_grad_batches`` there). 1 without a trainer (one process, nothing scaled).
        """
        trainer = self._trainer
        if trainer is None:
            return 1.0
        scale = trainer.world_size
        if self.automatic_optimization:
            scale *= trainer.accumulate_grad_batches
            if trainer.strategy.handles_gradient_accumulation:
                scale *= trainer.accumulate_grad_batches
        return float(scale)

    def window_normaliser(self, count: torch.Tensor) -> torch.Tensor:
        """The loss normaliser of one optimizer step: ``count`` (this rank's tokens, sequences or pairs in the
        window, see :func:`align.core.losses.loss_count`) summed over every rank, at least 1. A float ``()`` tensor."""
        return self.all_reduce_sum(count.float()).clamp(min=1.0)

    def window_loss(self, loss_sum: torch.Tensor, window_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, normaliser)``: the micro-batch's summed loss as the value to return from ``training_step``
        (its share of the step's mean, the framework's scaling undone), and the window's count on all ranks
        (for logged means). ``window_count`` is this rank's count over its whole window, carried by each
        micro-batch (``SFTBatch.window_tokens``, ``PreferenceBatch.window_pairs``)."""
        normaliser = self.window_normaliser(window_count.to(loss_sum.device))
        return loss_sum * (self.gradient_scale() / normaliser), normaliser

    def accumulating(self) -> bool:
        """Whether the current micro-batch does not end an optimizer step although the optimizer hooks run.

        Under DeepSpeed (which accumulates gradients itself) Lightning calls ``optimizer.step`` and
        ``on_before_optimizer_step`` after *every* micro-batch; the engine only updates at the window's end.
        Per-step bookkeeping (the window's loss, tokens/s) must wait for that end.
        """
        trainer = self._trainer
        return bool(
            trainer is not None
            and trainer.strategy.handles_gradient_accumulation
            and trainer.fit_loop._should_accumulate()
        )

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """The step, then the gradients are released at once.

        Lightning clears gradients after the next step's forward pass, so every activation of that pass is
        allocated while the previous step's gradients are still held: one extra gradient-sized block at the
        peak (445 MB of 3,686 on SmolLM2-135M SFT). Released here, the forward pass reuses that memory and
        Lightning's own clear finds nothing to do. Under a strategy that accumulates gradients itself
        (DeepSpeed) ``step`` runs after every micro-batch and the engine owns its buffers, so it is left alone.
        """
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        trainer = self._trainer
        if trainer is not None and not trainer.strategy.handles_gradient_accumulation:
            self.optimizer_zero_grad(epoch, batch_idx, optimizer)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        from align.trainer.strategies import unshard_root

        unshard_root(self.policy)  # FSDP2: for code that enters the model below the root (no-op otherwise)

    def on_validation_batch_start(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        from align.trainer.strategies import unshard_root

        unshard_root(self.policy)

    def configure_model(self) -> None:
        # FSDP2: shard per decoder layer, then the policy (reference and critic included).
        from lightning.pytorch.strategies import ModelParallelStrategy

        trainer = self._trainer  # None in load_from_checkpoint, which calls this hook outside a trainer
        if (
            trainer is not None
            and isinstance(trainer.strategy, ModelParallelStrategy)
            and not getattr(self, "_fsdp_applied", False)
        ):
            from align.trainer.strategies import apply_fsdp2

            apply_fsdp2(self.policy, trainer.strategy)
            self._fsdp_applied = True

    def configure_optimizers(self):
        return self.with_scheduler(self.optimizer(param_groups(self)))

    # ------------------------------------------------------------------ manual optimization
    def use_optimizer(self, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
        """Run :meth:`update` without a trainer: it steps ``optimizer`` (and ``scheduler``) itself."""
        self._standalone = (optimizer, scheduler)

    def optimization(self) -> Optimization:
        """The trainer's optimizer and hooks for the learner; plain torch's without a trainer."""
        if self._trainer is None:
            if self._standalone is None:
                raise RuntimeError("update without a trainer: call use_optimizer(optimizer) first")
            optimizer, scheduler = self._standalone
            return Optimization(
                optimizer,
                scheduler,
                lambda loss: loss.backward(),
                lambda norm: torch.nn.utils.clip_grad_norm_(self.parameters(), norm),
            )
        from align.trainer.strategies import accumulation_boundary

        trainer_optimizer = self.optimizers()
        assert not isinstance(trainer_optimizer, list)  # configure_optimizers returns one optimizer
        return Optimization(
            trainer_optimizer,
            self.lr_schedulers(),
            self.manual_backward,
            # A LightningOptimizer is made an instance of its optimizer's class at runtime.
            partial(clip_gradients, self, cast(torch.optim.Optimizer, trainer_optimizer)),
            lambda last: accumulation_boundary(self, last),
            self.gradient_scale(),
            self.ranks,
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Enough to rebuild the policy without the run's config (see ``align export``).
        checkpoint["align"] = {"policy": self.policy.spec, "module": type(self).__name__}
