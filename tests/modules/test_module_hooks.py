"""The private Lightning names ``align.modules.base`` relies on, each checked on a tiny run."""

from __future__ import annotations

from _helpers import cpu_trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loops.fit_loop import _FitLoop


def test_fit_loop_tells_whether_a_micro_batch_ends_its_window(private_api):
    used_by = "align.modules.base.AlignModule.accumulating (per-step bookkeeping under DeepSpeed)"
    private_api.require(_FitLoop, "_should_accumulate", ("self",), used_by=used_by)
    seen = []

    class Model(BoringModel):
        def on_before_backward(self, loss):
            seen.append(self.trainer.fit_loop._should_accumulate())

    cpu_trainer(max_steps=2, accumulate_grad_batches=2, limit_train_batches=4, limit_val_batches=0).fit(Model())
    assert seen == [True, False, True, False]
