"""What the offline preference modules (DPO and its variants, KTO) share: the reference log-probs of a
:class:`~align.data.preference.PreferenceBatch`, live or cached, and the per-window metrics.

Reference log-probs come live from ``PolicyModel.setup_reference()`` (with LoRA the adapter-disabled policy, no
copy; otherwise a frozen copy or ``reference_model``), or with ``precompute_reference`` computed once before the
first update and cached (:mod:`align.models.reference_cache`): no reference forward during training, and no frozen
copy is kept.

A subclass supplies ``_loss_and_stats(batch, split)``: the sum of the micro-batch's per-example losses and sums of
per-example statistics. The loss of an optimizer step is the mean over every example of the accumulation window on
all ranks, so accumulating 8 x 1 equals 1 x 8. The statistics are logged per optimizer step as
``<metric_prefix>/<name>`` with ``train/loss``, and held out as ``val/loss`` and ``val/<metric_prefix>_<name>``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.data.preference import PreferenceBatch, PreferenceDataset
from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.models.reference_cache import CachedReference
from align.models.scorer import Scorer
from align.modules.base import AlignModule, PairMetrics
from align.trainer.progress import phase


def pair_correct(rewards_chosen: torch.Tensor, rewards_rejected: torch.Tensor) -> torch.Tensor:
    """Per pair, 1 when the chosen response's implicit reward is above the rejected one's, 0 below, and 0.5 for a
    tie, so that an untrained policy (which is its own reference) scores exactly chance."""
    return (rewards_chosen > rewards_rejected).float() + 0.5 * (rewards_chosen == rewards_rejected).float()


class PreferenceModule(AlignModule):
    metric_prefix = "dpo"
    unpaired = False  # whether the module takes unpaired examples (UnpairedDataModule) rather than pairs
    throughput_metric = "train/pairs_per_s"

    def __init__(
        self,
        policy: PolicyModel | None,
        optimizer: OptimizerCallable,
        scheduler: LRSchedulerCallable | None,
        disable_dropout: bool,
        needs_reference: bool,
        precompute_reference: bool,
        reference_cache_dir: str | None,
        padding_free: bool = False,
    ):
        super().__init__(policy if policy is not None else PolicyModel(), optimizer, scheduler, disable_dropout)
        self.scorer = Scorer(self.policy, padding_free=padding_free)
        """Scores the pairs (summed response log-probs at temperature 1), the policy's and the reference's."""
        self.needs_reference = needs_reference
        self.precompute_reference = precompute_reference and needs_reference
        self.reference_cache_dir = reference_cache_dir
        self.cached_reference = CachedReference() if self.precompute_reference else None
        self._window = PairMetrics()
        self._val = PairMetrics()

    def setup(self, stage: str) -> None:
        dm = self.trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
        if dm is not None and getattr(dm, "unpaired", False) != self.unpaired:
            want = "UnpairedDataModule (unpaired examples)" if self.unpaired else "PreferenceDataModule (pairs)"
            raise AlignConfigError(
                f"data: expected align.data.preference.{want} for {type(self).__name__}, got {type(dm).__name__}"
            )
        if self.needs_reference and not self.precompute_reference:
            self.policy.setup_reference()  # before any checkpoint is restored, so a frozen copy is the initial model

    # ------------------------------------------------------------------ reference log-probs
    def _datasets(self) -> dict[str, PreferenceDataset]:
        dm = self.trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
        return {
            name: ds
            for name, ds in (("train", getattr(dm, "train_set", None)), ("val", getattr(dm, "val_set", None)))
            if ds is not None
        }

    def prepare_reference(self, needed: tuple[str, ...] = ("train", "val")) -> None:
        """Load or compute the cached reference log-probs (:class:`CachedReference`) once a ``needed`` split lacks
        them."""
        assert self.cached_reference is not None  # called only with precompute_reference, which builds it
        self.cached_reference.prepare(
            self.scorer,
            self._datasets(),
            self.trainer.datamodule.eval_dataloader,  # type: ignore[attr-defined]  # set by Lightning's data connector
            self.reference_cache_dir or Path(self.trainer.default_root_dir) / "ref_cache",
            needed=needed,
            updated=self.global_step > 0,
            device=self.device,
            write=self.trainer.is_global_zero,
            announce=phase,
        )

    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.precompute_reference:
            self.prepare_reference(("val",))

    def on_train_start(self) -> None:
        if self.precompute_reference:
            self.prepare_reference(("train", "val"))
        self._window = PairMetrics()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        cached = self.cached_reference
        checkpoint["align"]["reference_fingerprint"] = cached.fingerprint if cached is not None else None

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if self.cached_reference is not None:
            self.cached_reference.fingerprint = (checkpoint.get("align") or {}).get("reference_fingerprint")

    def _reference_logps(self, batch: PreferenceBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference log-probs of the batch's first and second ``B`` rows, each ``(B,)``."""
        if self.cached_reference is not None:
            return self.cached_reference.logps(batch, split, self.device)
        with torch.no_grad():
            first, second = self.scorer.sequence_logps(batch, reference=True).chunk(2)
        return first, second

    # ------------------------------------------------------------------ loss and metrics
    def _loss_and_stats(self, batch: PreferenceBatch, split: str) -> tuple[torch.Tensor, dict]:
        """Sum over the micro-batch's examples of the per-example loss, and sums of per-example statistics."""
        raise NotImplementedError

    def summarise(self, means: dict[str, float]) -> dict[str, float]:
        """The logged metrics from the window means of the statistics (identity here)."""
        return means

    def training_step(self, batch: PreferenceBatch, batch_idx: int) -> torch.Tensor:
        loss_sum, stats = self._loss_and_stats(batch, "train")
        self._window.add(batch.num_pairs, **stats)
        return self.window_loss(loss_sum, batch.window_pairs)[0]

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.accumulating():  # DeepSpeed: called after every micro-batch; wait for the window's end
            return
        m = self._window.means(self) if self.logs_this_step() else {}
        if m:
            step = {"train/loss": m.pop("loss"), self.throughput_metric: m.pop("pairs_per_s")}
            step.update({f"{self.metric_prefix}/{name}": value for name, value in self.summarise(m).items()})
            self.log_step(step, prog_bar=("train/loss", f"{self.metric_prefix}/accuracy"))
        self._window = PairMetrics()

    def on_validation_epoch_start(self) -> None:
        self._val = PairMetrics()

    def validation_step(self, batch: PreferenceBatch, batch_idx: int) -> None:
        _, stats = self._loss_and_stats(batch, "val")
        self._val.add(batch.num_pairs, **stats)

    def on_validation_epoch_end(self) -> None:
        m = self._val.means(self)
        if m:
            m.pop("pairs_per_s")
            self.log("val/loss", m.pop("loss"), batch_size=1)
            for name, value in self.summarise(m).items():
                self.log(f"val/{self.metric_prefix}_{name}", value, batch_size=1)
