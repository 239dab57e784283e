"""The private Lightning and torch names that exact resume (``align.trainer.checkpointing``) and the non-finite guard
(``align.trainer.guards``) rely on, each checked on a tiny case. Both read them defensively, so without these checks an
upgrade that renamed them would silently turn mid-epoch resume or the fast gradient check off."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.utilities.combined_loader import CombinedLoader


def test_fit_loop_keeps_the_loader_states_it_has_not_applied(private_api):
    used_by = "align.trainer.checkpointing.ExactResume._restore_loader_position"
    loop = L.Trainer(accelerator="cpu", devices=1, logger=False).fit_loop
    assert private_api.require(loop, "_combined_loader_states_to_load", used_by=used_by) == []
    assert private_api.require(loop, "_combined_loader", used_by=used_by) is None
    assert private_api.require(loop, "_data_fetcher", used_by=used_by) is None
    # A checkpoint's loader states wait there until the loader exists.
    loop.on_load_checkpoint({"combined_loader": [{"at": 3}]})
    assert loop._combined_loader_states_to_load == [{"at": 3}], f"_FitLoop._combined_loader_states_to_load: {used_by}"


class Position:
    """A stateful iterable, as the resumable data loaders are."""

    def __init__(self):
        self.at = 0

    def __iter__(self):
        return iter(range(self.at, 4))

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.at = state["at"]


def test_combined_loader_loads_its_iterables_states(private_api):
    used_by = "align.trainer.checkpointing.ExactResume._restore_loader_position"
    private_api.require(CombinedLoader, "_load_state_dicts", ("self", "states"), used_by=used_by)
    inner = Position()
    CombinedLoader(inner)._load_state_dicts([{"at": 3}])
    assert inner.at == 3


def test_foreach_norm_gives_every_tensors_norm(private_api):
    norm = private_api.require(
        torch, "_foreach_norm", used_by="align.trainer.guards.NonFiniteGuard (one kernel for all grads)"
    )
    norms = norm([torch.tensor([3.0, 4.0]), torch.tensor([float("inf")])])
    assert norms[0].item() == 5.0 and not torch.isfinite(norms[1])


def test_result_collection_forgets_a_steps_values_on_reset(private_api):
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    used_by = "align.modules.base.TrainingModule.log_nothing (no stale metrics row after a step without an update)"
    private_api.require(L.Trainer, "_results", used_by=used_by)
    private_api.require(_ResultCollection, "reset", ("self", "metrics", "fx"), used_by=used_by)
    results = _ResultCollection(training=True)
    results.log("training_step", "rollout/reward_mean", torch.tensor(1.0), on_step=True, on_epoch=False)
    assert "rollout/reward_mean" in results.metrics(on_step=True)["log"]
    results.reset(metrics=False, fx="training_step")
    assert results.metrics(on_step=True)["log"] == {}, f"_ResultCollection.reset: {used_by}"


def test_logger_connector_says_which_steps_the_loggers_write(private_api):
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

    used_by = "align.modules.base.AlignModule.logs_this_step (without it, every step is logged)"
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, log_every_n_steps=3)
    connector = private_api.require(trainer, "_logger_connector", used_by=used_by)
    assert isinstance(connector, _LoggerConnector)
    private_api.require(_LoggerConnector, "should_update_logs", used_by=used_by)
    assert connector.should_update_logs is True  # no active loop: every value is written


def test_manual_optimization_counts_a_step_between_the_optimizers_step_callbacks(private_api):
    used_by = (
        "align.gym.base.ClassicRLModule.optimizer_step (torch's step without Lightning's hook "
        "dispatch, still counted in trainer.global_step)"
    )
    seen = {}

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.w = torch.nn.Parameter(torch.ones(2))

        def configure_optimizers(self):
            return torch.optim.SGD([self.w], lr=0.5)

        def train_dataloader(self):
            return [0, 1]

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            before = self.trainer.global_step
            self.w.grad = torch.ones(2)
            private_api.require(optimizer, "_on_before_step", used_by=used_by)()
            optimizer.optimizer.step()
            private_api.require(optimizer, "_on_after_step", used_by=used_by)()
            seen[batch_idx] = (before, self.trainer.global_step)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        max_epochs=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module())
    assert seen == {0: (0, 1), 1: (1, 2)}, f"LightningOptimizer._on_before_step/_on_after_step: {used_by}"


def test_logger_connector_writes_the_collected_on_step_values(private_api):
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

    used_by = "align.modules.base.TrainingModule.on_train_batch_end (the row of a run's last step)"
    private_api.require(_LoggerConnector, "log_metrics", ("self", "metrics", "step"), used_by=used_by)
    assert isinstance(getattr(_LoggerConnector, "metrics", None), property), f"_LoggerConnector.metrics: {used_by}"


def test_model_checkpoint_saves_through_the_methods_align_checkpoint_overrides(private_api):
    from lightning.pytorch.callbacks import ModelCheckpoint

    used_by = "align.trainer.checkpointing.AlignCheckpoint (last.ckpt a hard link to the step's checkpoint)"
    private_api.require(
        ModelCheckpoint, "_save_topk_checkpoint", ("self", "trainer", "monitor_candidates"), used_by=used_by
    )
    private_api.require(ModelCheckpoint, "_save_checkpoint", ("self", "trainer", "filepath"), used_by=used_by)
    checkpoint = ModelCheckpoint()
    for name in ("_last_checkpoint_saved", "_last_global_step_saved", "_enable_version_counter"):
        private_api.require(checkpoint, name, used_by=used_by)
