"""Live progress of a run: one bar over the optimizer steps with the algorithm's key numbers, and a line for each
long phase (the held-out pass, the reference log-probs).

:class:`AlignProgressBar` is the bar the CLI adds when ``trainer.enable_progress_bar`` is true (the default of every
shipped config). It counts optimizer steps against ``trainer.max_steps`` (Lightning's own bar counts the batches of
an epoch, and reads ``Epoch 0/-2`` when only ``max_steps`` bounds the run) and shows, after each step, the values
the module logs with ``prog_bar`` under short names: ``reward``, ``kl``, ``loss``, ``tok/s`` for the RL modules,
``loss`` and ``acc`` for SFT, DPO and the reward model, plus the last held-out headline values (``val_...``).

The bar is drawn only when standard output is a terminal and ``CI`` is not set; otherwise it switches itself
off, and modules then log on the loggers' steps only (:meth:`align.modules.base.AlignModule.logs_this_step`).
:func:`phase` lines are printed either way: they are a few lines per run and say what a long wait is for.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_only

# Short names shown in the bar for the last part of a metric's name.
SHORT_NAMES = {
    "reward_mean": "reward",
    "tokens_per_s": "tok/s",
    "pairs_per_s": "pairs/s",
    "accuracy": "acc",
    "rm_accuracy": "acc",
    "dpo_accuracy": "acc",
    "kto_accuracy": "acc",
}


def interactive(stream=None) -> bool:
    """Whether live output belongs on ``stream`` (standard output): a terminal, outside CI."""
    stream = sys.stdout if stream is None else stream
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def short_name(metric: str) -> str:
    """``rollout/reward_mean`` -> ``reward``; ``val/dpo_accuracy`` -> ``val_acc``; unknown names keep their last
    part."""
    last = metric.rsplit("/", 1)[-1]
    label = SHORT_NAMES.get(last, last)
    return f"val_{label}" if metric.startswith("val/") else label


def format_value(value: float) -> str:
    """Four significant digits, without exponent noise for the usual ranges."""
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3g}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.4g}"


class AlignProgressBar(TQDMProgressBar):
    """A bar over the run's optimizer steps (``trainer.global_step`` of ``trainer.max_steps``; resumed runs start
    where they stopped) with the module's key metrics, and a held-out bar during validation.

    Args:
        refresh_rate: redraw every this many batches.
        force: draw even when standard output is not a terminal or ``CI`` is set (for tests and log captures).
    """

    def __init__(self, refresh_rate: int = 1, force: bool = False):
        super().__init__(refresh_rate=refresh_rate, leave=False)
        if not (force or interactive()):
            self.disable()

    @property
    def train_description(self) -> str:
        return "train"

    @property
    def validation_description(self) -> str:
        return "held-out"

    def _total_steps(self) -> int | None:
        trainer = self.trainer
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return int(trainer.max_steps)
        estimated = trainer.estimated_stepping_batches
        return None if estimated is None or math.isinf(estimated) else int(estimated)

    def on_train_start(self, trainer, pl_module) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        self.train_progress_bar.unit = "step"
        self.train_progress_bar.reset(total=self._total_steps())
        self.train_progress_bar.initial = trainer.global_step  # a resumed run counts from its checkpoint
        self.train_progress_bar.n = trainer.global_step
        self.train_progress_bar.refresh()

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        pass  # one bar for the whole run, not one per epoch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if self.is_enabled and bar is not None and not bar.disable and (batch_idx + 1) % self.refresh_rate == 0:
            bar.n = trainer.global_step
            bar.set_postfix_str(self.postfix(trainer, pl_module), refresh=True)
            if bar.total is not None and bar.n >= bar.total:
                bar.close()  # before Lightning's closing line, which would otherwise share the bar's line

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self.has_dataloader_changed(dataloader_idx):
            return
        super().on_validation_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
        self.val_progress_bar.set_description(self.validation_description)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.val_progress_bar.close()
        self.reset_dataloader_idx_tracker()
        if self._train_progress_bar is not None and trainer.state.fn == "fit" and not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix_str(self.postfix(trainer, pl_module), refresh=True)

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        """The values shown: the step's ``prog_bar`` metrics, then the module's held-out headline metrics from the
        last validation, under short names (no ``v_num``)."""
        shown: dict[str, Any] = {}
        for name, value in trainer.progress_bar_metrics.items():
            shown[short_name(name)] = value
        for name in getattr(pl_module, "headline_metrics", ()) or ():
            value = trainer.callback_metrics.get(name)
            if value is not None and name.startswith("val/"):
                shown.setdefault(short_name(name), float(value))
        return shown

    def postfix(self, trainer, pl_module) -> str:
        return " ".join(
            f"{k} {format_value(float(v))}" if isinstance(v, (int, float)) else f"{k} {v}"
            for k, v in self.get_metrics(trainer, pl_module).items()
        )


@rank_zero_only
def say(message: str) -> None:
    """A line for the user on rank 0, printed above a live progress bar when one is drawn."""
    print(message, flush=True)


@contextmanager
def phase(what: str) -> Iterator[None]:
    """Announce a long phase on rank 0 and say how long it took: ``what ...`` then ``what: done in 3.2 s``."""
    say(f"{what} ...")
    start = time.perf_counter()
    yield
    say(f"{what}: done in {time.perf_counter() - start:.1f} s")
