"""The module base (``align.modules.base``): the accumulation window pinned by hand without training (the loss
normaliser over every rank and the factor that undoes the framework's own loss scaling); per-step metrics computed
and logged only on the steps something reads them (``AlignModule.logs_this_step``), the rows the loggers write being
those of logging every step; and the private Lightning name the base relies on."""

import csv
from types import SimpleNamespace

import pytest
import torch
from _helpers import cpu_trainer, fit_dpo, write_varied_pairs
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loops.fit_loop import _FitLoop

from align.core.losses import loss_count
from align.data.preference import PreferenceDataModule
from align.modules.base import AlignModule, PairMetrics
from align.modules.dpo import DPOModule

# (3, 4): rows with 2, 1 and 3 valid tokens
MASK = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)


class OtherRanks:
    """A data-parallel strategy whose other ranks add ``others`` to every all-reduced sum."""

    def __init__(self, others: float, handles_gradient_accumulation: bool = False):
        self.others = others
        self.handles_gradient_accumulation = handles_gradient_accumulation

    def reduce(self, value, reduce_op):
        assert reduce_op == "sum"
        return value + self.others


def module_on(world_size=1, accumulate=1, others=0.0, deepspeed=False, manual=False) -> AlignModule:
    module = AlignModule(torch.nn.Linear(1, 1))  # the window needs no policy
    module.automatic_optimization = not manual
    module._trainer = SimpleNamespace(
        world_size=world_size,
        accumulate_grad_batches=accumulate,
        strategy=OtherRanks(others, handles_gradient_accumulation=deepspeed),
    )
    return module


@pytest.mark.parametrize(
    "world_size, accumulate, deepspeed, manual, expected",
    [
        (1, 1, False, False, 1.0),
        (1, 4, False, False, 4.0),  # Lightning divides each micro-batch loss by 4
        (2, 4, False, False, 8.0),  # ... and DDP averages gradients over 2 ranks
        (2, 4, True, False, 32.0),  # DeepSpeed's engine divides by 4 once more
        (2, 1, True, True, 2.0),  # manual optimization: only the average over ranks
    ],
)
def test_gradient_scale_undoes_the_frameworks_scaling(world_size, accumulate, deepspeed, manual, expected):
    module = module_on(world_size, accumulate, deepspeed=deepspeed, manual=manual)
    assert module.gradient_scale() == expected


def test_without_a_trainer_nothing_is_scaled_or_reduced():
    module = AlignModule(torch.nn.Linear(1, 1))
    assert module.gradient_scale() == 1.0
    assert float(module.window_normaliser(torch.tensor(6.0))) == 6.0


def test_window_normaliser_sums_every_rank_and_is_at_least_one():
    module = module_on(world_size=2, others=3.0)
    assert float(module.window_normaliser(loss_count(MASK))) == 9.0  # 6 tokens here, 3 on the other rank
    assert float(module_on(world_size=2).window_normaliser(torch.tensor(0.0))) == 1.0


def test_window_loss_is_the_micro_batch_share_of_the_step_mean():
    # Two ranks, accumulating 2 micro-batches each under DeepSpeed: scale 2 * 2 * 2 = 8. The window holds 5 pairs
    # here and 3 on the other rank, so a micro-batch whose pair losses sum to 4 returns 4 * 8 / 8.
    module = module_on(world_size=2, accumulate=2, others=3.0, deepspeed=True)
    loss_sum = torch.tensor(4.0, requires_grad=True)
    loss, normaliser = module.window_loss(loss_sum, torch.tensor(5.0))
    assert float(normaliser) == 8.0 and float(loss.detach()) == 4.0
    loss.backward()
    assert float(loss_sum.grad) == 1.0  # 8 / 8: the framework's later division by 8 leaves 1/8 per pair


def test_pair_metrics_are_means_over_every_ranks_pairs():
    window = PairMetrics()
    window.add(2, loss=torch.tensor(3.0))
    window.add(1, loss=torch.tensor(1.0))
    assert PairMetrics().means(module_on()) == {}
    means = window.means(module_on(world_size=2, others=4.0))  # the other rank adds 4 to the loss sum and to pairs
    assert means["loss"] == (3.0 + 1.0 + 4.0) / (3 + 4) and means["pairs_per_s"] > 0


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_varied_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl")


def test_written_rows_are_those_of_logging_every_step(pairs, tmp_path):
    every, every_steps, _ = fit_dpo(pairs, tmp_path / "a", every_step=True)
    gated, gated_steps, trainer = fit_dpo(pairs, tmp_path / "b")
    assert every_steps == [0, 1, 2, 3, 4]
    assert gated_steps == [1, 3, 4]  # the loggers' steps (every 2nd), and the run's last step
    assert [r["step"] for r in gated] == ["1", "3", "4"] and gated == every  # the last step's row is written too
    # The final values reach callback_metrics although step 4 is not a logging step.
    assert {"train/loss", "dpo/accuracy", "train/pairs_per_s"} <= set(trainer.callback_metrics)


@pytest.mark.parametrize("reader", ["progress_bar", "monitor"])
def test_a_progress_bar_or_a_monitor_reads_every_step(pairs, tmp_path, reader):
    extra = (
        dict(enable_progress_bar=True)
        if reader == "progress_bar"
        else dict(
            enable_checkpointing=True,
            callbacks=[ModelCheckpoint(tmp_path / "ckpt", monitor="train/loss", every_n_train_steps=1)],
        )
    )
    _, steps, _ = fit_dpo(pairs, tmp_path, max_steps=3, log_every=50, **extra)
    assert steps == [0, 1, 2]


def test_without_a_trainer_nothing_is_logged():
    assert AlignModule(torch.nn.Linear(1, 1)).logs_this_step() is False


SHORT_RUN_ROWS = {
    "sft": [{"prompt": f"sort: {a} {b}", "completion": f"{min(a, b)} {max(a, b)}"} for a, b in zip("dbca", "acdb")],
    "dpo": [
        {"prompt": f"sort: {a} {b}", "chosen": f"{min(a, b)} {max(a, b)}", "rejected": f"{max(a, b)} {min(a, b)}"}
        for a, b in zip("dbca", "acdb")
    ],
    "kto": [{"prompt": f"sort: {a} {b}", "completion": f"{a} {b}", "label": a < b} for a, b in zip("dbca", "acdb")],
}


@pytest.mark.parametrize("recipe", ["sft", "dpo", "kto"])
def test_a_run_shorter_than_log_every_n_steps_writes_its_last_steps_row(tmp_path, recipe):
    """A 3-step run at the default log_every_n_steps (10) still writes a training row: its last step's."""
    import json

    from align.cli.recipes import run_recipe
    from align.data.preference import UnpairedDataModule
    from align.data.sft import SFTDataModule
    from align.modules.kto import KTOModule
    from align.modules.sft import SFTModule

    classes = {
        "sft": (SFTModule, SFTDataModule),
        "dpo": (DPOModule, PreferenceDataModule),
        "kto": (KTOModule, UnpairedDataModule),
    }
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SHORT_RUN_ROWS[recipe]))
    cli = run_recipe(
        recipe,
        *classes[recipe],
        args=[
            "--trainer.max_steps",
            "3",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--data.init_args.train_files",
            str(data),
            "--data.init_args.val_files",
            "null",
            "--data.init_args.batch_size",
            "2",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_checkpointing",
            "false",
            *(["--model.init_args.precompute_reference", "false"] if recipe == "dpo" else []),
        ],
    )
    rows = list(csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv")))
    assert cli.trainer.global_step == (2 if recipe == "dpo" else 3)  # DPO: one epoch of two batches
    assert [r["step"] for r in rows if r.get("train/loss")] == [str(cli.trainer.global_step - 1)]


def test_fit_loop_tells_whether_a_micro_batch_ends_its_window(private_api):
    used_by = "align.modules.base.AlignModule.accumulating (per-step bookkeeping under DeepSpeed)"
    private_api.require(_FitLoop, "_should_accumulate", ("self",), used_by=used_by)
    seen = []

    class Model(BoringModel):
        def on_before_backward(self, loss):
            seen.append(self.trainer.fit_loop._should_accumulate())

    cpu_trainer(max_steps=2, accumulate_grad_batches=2, limit_train_batches=4, limit_val_batches=0).fit(Model())
    assert seen == [True, False, True, False]
