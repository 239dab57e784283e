"""Non-finite loss or gradient: the run stops naming the step, or the update is skipped and counted; the
weights and optimizer state never take a NaN."""

import copy
import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from align.errors import AlignConfigError
from align.trainer.guards import NonFiniteError, NonFiniteGuard


class Toy(L.LightningModule):
    """Linear regression whose loss is multiplied by ``poison`` (nan or inf) at optimizer step ``bad_step``."""

    def __init__(self, bad_step: int, poison: float = math.nan, manual: bool = False, where: str = "loss"):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 1)
        self.bad_step, self.poison, self.where = bad_step, poison, where
        self.automatic_optimization = not manual
        self.snapshots: dict[int, dict] = {}

    def _loss(self, batch):
        x, y = batch
        loss = ((self.layer(x) - y) ** 2).mean()
        if self.global_step == self.bad_step:
            if self.where == "loss":
                loss = loss * self.poison
            else:  # a finite loss whose gradient is not: poison one parameter's gradient
                self.layer.weight.register_hook(lambda g: g * self.poison) if not hasattr(self, "_hooked") else None
                self._hooked = True
        return loss

    def training_step(self, batch, batch_idx):
        self.snapshots[self.global_step] = {
            "params": copy.deepcopy(self.state_dict()),
            "opt": copy.deepcopy(self.optimizers().optimizer.state_dict()),
        }
        if self.automatic_optimization:
            return self._loss(batch)
        opt = self.optimizers()
        self.manual_backward(self._loss(batch))
        opt.step()
        opt.zero_grad(set_to_none=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1)


def fit(module: Toy, guard: NonFiniteGuard, steps: int = 4) -> L.Trainer:
    data = TensorDataset(torch.randn(16, 3, generator=torch.Generator().manual_seed(1)), torch.randn(16, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[guard],
    )
    trainer.fit(module, DataLoader(data, batch_size=4))
    return trainer


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
@pytest.mark.parametrize("poison", [math.nan, math.inf], ids=["nan", "inf"])
def test_error_policy_names_the_step_and_leaves_the_weights_of_the_previous_step(manual, poison):
    module = Toy(bad_step=2, poison=poison, manual=manual)
    with pytest.raises(NonFiniteError, match=r"non-finite loss and gradients at optimizer step 2 \(epoch 0, batch 2\)"):
        fit(module, NonFiniteGuard("error"))
    weights = module.state_dict()
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert all(torch.equal(weights[k], v) for k, v in module.snapshots[2]["params"].items())


def test_error_policy_names_the_parameter_with_a_bad_gradient():
    with pytest.raises(NonFiniteError, match=r"non-finite gradients at optimizer step 1 .*layer\.weight"):
        fit(Toy(bad_step=1, where="grad"), NonFiniteGuard("error"))


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_skip_policy_drops_the_update_and_counts_it(manual):
    module = Toy(bad_step=1, manual=manual)
    guard = NonFiniteGuard("skip")
    trainer = fit(module, guard, steps=4)
    assert guard.skipped == 1
    assert trainer.global_step == 4
    # Step 1 changed nothing: not the weights, not AdamW's moments or step count (no weight decay either).
    before, after = module.snapshots[1], module.snapshots[2]
    assert all(torch.equal(before["params"][k], v) for k, v in after["params"].items())
    for a, b in zip(before["opt"]["state"].values(), after["opt"]["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    # The other steps did train, and nothing non-finite reached the weights.
    assert not torch.equal(module.snapshots[0]["params"]["layer.weight"], module.snapshots[1]["params"]["layer.weight"])
    assert all(torch.isfinite(v).all() for v in module.state_dict().values())
    assert trainer.callback_metrics["train/nonfinite_skipped"] == 1.0
    assert guard.state_dict() == {"skipped": 1}


def test_every_align_module_is_guarded_unless_the_trainer_has_its_own_guard():
    from align.modules.sft import SFTModule
    from align.trainer.checkpointing import ExactResume

    module = SFTModule()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    module.trainer = trainer
    assert {type(cb) for cb in module.configure_callbacks()} == {ExactResume, NonFiniteGuard}
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, callbacks=[NonFiniteGuard("skip")])
    module.trainer = trainer
    assert [type(cb) for cb in module.configure_callbacks()] == [ExactResume]


def test_unknown_policy_is_refused():
    with pytest.raises(
        AlignConfigError,
        match=r"^trainer\.callbacks\.policy: expected 'error' or 'skip' "
        r"\(NonFiniteGuard's policy\), got 'ignore'$",
    ):
        NonFiniteGuard("ignore")
