"""The accumulation window on the module base, pinned by hand without training: the loss normaliser (count of a
step on all ranks) and the factor that undoes the framework's own loss scaling."""

from types import SimpleNamespace

import pytest
import torch

from align.core.losses import loss_count
from align.modules.base import AlignModule, PairMetrics

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


@pytest.mark.parametrize("aggregation, expected", [("token_mean", 6.0), ("seq_mean", 3.0), ("constant", 15.0)])
def test_loss_count_of_a_hand_made_mask(aggregation, expected):
    count = loss_count(MASK, aggregation, max_length=5)  # constant: 3 rows x 5, not the padded width 4
    assert count.dtype == torch.float32 and count.shape == () and float(count) == expected


def test_loss_count_refuses_an_unknown_aggregation_or_a_constant_without_length():
    with pytest.raises(ValueError, match="max_length"):
        loss_count(MASK, "constant")
    with pytest.raises(ValueError, match="seq_sum"):
        loss_count(MASK, "seq_sum")


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
