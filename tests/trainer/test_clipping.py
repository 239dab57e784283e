"""Gradient clipping under bf16 with a fused optimizer, which Lightning's mixed-precision plugin refuses: the
gradient that reaches the optimizer's step is the clipped one, pinned by hand, under automatic and manual
optimization; under 16-mixed (a loss scale) the fused case fails on one line."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from align.errors import AlignConfigError
from align.modules.base import TrainingModule
from align.trainer.clipping import clip_gradients
from tests.modules._helpers import cpu_trainer

X = torch.tensor([3.0, 4.0])  # loss = w . x, so the gradient is x: norm 5
CLIPPED = torch.tensor([0.6, 0.8])  # x clipped to norm 1


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that records the gradient its step is given (after the closure's backward and clipping)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.seen: list[torch.Tensor] = []

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.seen.append(self.param_groups[0]["params"][0].grad.detach().float().clone().flatten())
        super().step()
        return loss


class Dot(TrainingModule):
    def __init__(self, fused: bool, manual: bool = False):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.zeros_(self.layer.weight)
        self.fused, self.automatic_optimization = fused, not manual
        self.scheduler = None

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch.to(self.layer.weight.dtype)).sum()
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss)
        clip_gradients(self, opt, 1.0)  # what the RL modules' learner calls
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        self.opt = RecordingAdamW(self.parameters(), lr=1e-3, fused=self.fused)
        return self.opt


def fit(precision: str, fused: bool, manual: bool) -> RecordingAdamW:
    module = Dot(fused, manual)
    clip = {} if manual else {"gradient_clip_val": 1.0}
    trainer = cpu_trainer(max_steps=1, precision=precision, **clip)
    trainer.fit(module, DataLoader([X], batch_size=None))
    return module.opt


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize(
    "precision, fused", [("bf16-mixed", True), ("bf16-mixed", False), ("bf16-true", True), ("32-true", True)]
)
def test_the_step_sees_the_gradient_clipped_to_norm_one(precision, fused, manual):
    opt = fit(precision, fused, manual)
    tol = 1e-2 if precision == "bf16-true" else 1e-5  # bf16 weights hold 0.6 as 0.6016
    assert len(opt.seen) == 1
    torch.testing.assert_close(opt.seen[0], CLIPPED, atol=tol, rtol=0)


def test_a_fused_optimizer_under_a_loss_scale_fails_on_one_line():
    from lightning.pytorch.plugins.precision import MixedPrecision

    module = Dot(fused=True)
    module._trainer = SimpleNamespace(precision_plugin=MixedPrecision("16-mixed", "cpu"))  # scaled gradients
    with pytest.raises(AlignConfigError, match="trainer.precision 16-mixed: .*fused.*bf16-mixed"):
        clip_gradients(module, module.configure_optimizers(), 1.0)
