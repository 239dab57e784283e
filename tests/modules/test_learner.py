"""The learner (align.modules.learner) without a trainer: plain torch, a hand-made batch, a one-parameter loss."""

import pytest
import torch

from align.core.losses import loss_count
from align.core.stats import Ranks
from align.errors import AlignConfigError
from align.modules.learner import Learner, Optimization, RLBatch, minibatch_indices
from align.modules.options import Updates

# Eight rows, response widths 3; row i has i % 3 + 1 valid tokens and advantage i on each.
N, R = 8, 3
LENGTHS = torch.tensor([i % 3 + 1 for i in range(N)])
MASK = torch.arange(R)[None, :] < LENGTHS[:, None]  # (N, R)


def batch() -> RLBatch:
    ids = torch.arange(N * (R + 2)).view(N, R + 2)
    attention = torch.cat([torch.ones(N, 2, dtype=torch.long), MASK.long()], dim=1)
    advantages = torch.arange(N, dtype=torch.float32)[:, None].expand(N, R)
    return RLBatch(ids, attention, MASK, torch.zeros(N, R), advantages)


class Recorder(torch.optim.SGD):
    """SGD with learning rate 0 that records each step's gradient."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.grads = []

    def step(self, closure=None):
        self.grads.append(self.param_groups[0]["params"][0].grad.clone())
        return super().step(closure)


def run(updates: Updates, seed: int = 0):
    w = torch.nn.Parameter(torch.tensor(1.0))
    optimizer = Recorder([w])
    learner = Learner(updates)
    steps = []

    def loss_fn(micro: RLBatch, normaliser):  # token-sum of w * advantage over the step's tokens
        per_token = w * micro.advantages * micro.response_mask
        return per_token.sum() / normaliser, {"train/loss": per_token.sum().detach() / micro.response_mask.sum()}

    torch.manual_seed(seed)
    clip = lambda norm: torch.nn.utils.clip_grad_norm_([w], norm)  # noqa: E731
    metrics = learner.update(
        batch(), loss_fn, Optimization(optimizer, clip=clip), on_step=lambda: steps.append(learner.steps)
    )
    return optimizer.grads, metrics, steps, learner


def test_one_step_over_the_whole_batch_is_the_token_mean_gradient():
    grads, metrics, steps, learner = run(Updates(max_grad_norm=None))
    expected = float((torch.arange(N) * LENGTHS).sum() / LENGTHS.sum())  # d/dw of the token mean of w * A
    assert len(grads) == 1 and steps == [1] and learner.steps == 1
    torch.testing.assert_close(grads[0], torch.tensor(expected))
    torch.testing.assert_close(torch.tensor(metrics["train/loss"]), torch.tensor(expected))


def test_eight_micro_batches_of_one_equal_one_of_eight():
    whole, _, _, _ = run(Updates(max_grad_norm=None))
    pieces, metrics, _, _ = run(Updates(max_grad_norm=None, micro_batch_size=1))
    torch.testing.assert_close(pieces[0], whole[0])
    # The logged mean is weighted by each micro-batch's valid tokens, so it is the whole batch's too.
    torch.testing.assert_close(torch.tensor(metrics["train/loss"]), whole[0])


def test_epochs_and_minibatches_take_one_step_each_and_clip():
    grads, _, steps, learner = run(Updates(epochs=2, minibatches=2, max_grad_norm=None))
    assert steps == [1, 2, 3, 4] and learner.steps == 4 and len(grads) == 4
    clipped, _, _, _ = run(Updates(max_grad_norm=0.5))  # the token-mean gradient (about 3.9) clipped to norm 0.5
    torch.testing.assert_close(clipped[0], torch.tensor(0.5))


def test_planned_minibatches_are_the_ones_the_update_uses():
    updates = Updates(minibatches=2, micro_batch_size=2, max_grad_norm=None)
    learner = Learner(updates, count=lambda mask: loss_count(mask))
    torch.manual_seed(3)
    planned = learner.plan(N)
    torch.manual_seed(3)
    assert [[i.tolist() for i in mb] for mb in planned] == [
        [i.tolist() for i in mb] for mb in minibatch_indices(N, 2, 2)
    ]
    seen = []
    w = torch.nn.Parameter(torch.tensor(1.0))

    def loss_fn(micro, normaliser):
        seen.append(micro.rows.tolist())
        return (w * micro.advantages).sum() * 0, {}

    learner.update(batch(), loss_fn, Optimization(torch.optim.SGD([w], lr=0.0)), plan=planned)
    assert seen == [i.tolist() for mb in planned for i in mb]


def test_the_normaliser_sums_every_rank():
    learner = Learner(Updates(), count=lambda mask: loss_count(mask))
    assert float(learner.normaliser(MASK, Ranks())) == float(LENGTHS.sum())
    doubled = Ranks(0, 2, lambda x: 2 * x)  # a second rank with the same count
    assert float(learner.normaliser(MASK, doubled)) == 2 * float(LENGTHS.sum())
    assert float(learner.normaliser(torch.zeros(2, 3, dtype=torch.bool), Ranks())) == 1.0  # at least 1


def test_bad_minibatch_counts_fail_naming_the_setting():
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.updates\.minibatches: expected a value in \[1, 8\] \(the rows "
        r"of a rollout on this rank\), got 9$",
    ):
        minibatch_indices(N, 9, None)
