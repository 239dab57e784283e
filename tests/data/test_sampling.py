"""The samplers and the loader of ``align.data.sampling``: the window totals of accumulation, and a resume in the
middle of an epoch or of a window."""

import pytest
import torch
from torch.utils.data import TensorDataset

from align.data.sampling import (
    EpochRandomSampler,
    EpochSequentialSampler,
    ResumableBatchSampler,
    ResumableDataLoader,
    WindowBatchSampler,
)


def test_window_sampler_tags_each_micro_batch_with_its_window_total():
    weights = [1, 2, 3, 4, 5, 6, 7]
    sampler = WindowBatchSampler(range(7), batch_size=2, drop_last=False, weights=weights, accumulate=2)
    batches = list(sampler)
    assert [[i for i, _ in b] for b in batches] == [[0, 1], [2, 3], [4, 5], [6]]
    assert [b[0][1] for b in batches] == [10, 10, 18, 18]  # 1+2+3+4, then 5+6+7 for the short last window


def epoch_batches(sampler, epoch):
    sampler.sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize(
    "make",
    [
        lambda ds: ResumableBatchSampler(EpochRandomSampler(ds, seed=3), 3, drop_last=False),
        lambda ds: ResumableBatchSampler(EpochSequentialSampler(ds), 3, drop_last=True),
        lambda ds: WindowBatchSampler(
            EpochRandomSampler(ds, seed=3), 2, drop_last=False, weights=list(range(10)), accumulate=3
        ),
    ],
    ids=["shuffled", "sequential", "windows"],
)
def test_batch_sampler_resumes_mid_epoch_and_at_the_epoch_end(make):
    ds = list(range(10))
    reference = make(ds)
    epochs = [epoch_batches(reference, e) for e in range(3)]
    assert epochs[0] != epochs[1] or isinstance(reference.sampler, EpochSequentialSampler)
    for epoch in range(2):
        n = len(epochs[epoch])
        for consumed in range(n + 1):
            sampler = make(ds)
            sampler.sampler.set_epoch(epoch)
            it = iter(sampler)
            for _ in range(consumed):
                next(it)
            state = sampler.state_dict()
            assert state["epoch"] == epoch and state["consumed"] == consumed
            fresh = make(ds)
            fresh.load_state_dict(state)
            if consumed < n:  # the rest of this epoch, then the next one whole
                assert list(fresh) == epochs[epoch][consumed:]
                fresh.sampler.set_epoch(epoch + 1)
            assert list(fresh) == epochs[epoch + 1]


def test_window_tags_survive_a_resume_inside_a_window():
    ds = list(range(10))
    full = list(WindowBatchSampler(EpochSequentialSampler(ds), 2, False, weights=[1] * 10, accumulate=3))
    fresh = WindowBatchSampler(EpochSequentialSampler(ds), 2, False, weights=[1] * 10, accumulate=3)
    fresh.load_state_dict({"epoch": 0, "consumed": 1})
    assert list(fresh) == full[1:]
    assert full[1][0][1] == 6  # the window of micro-batches 0-2 holds 6 items


def test_loader_counts_what_its_consumer_took_even_with_workers_fetching_ahead():
    ds = TensorDataset(torch.arange(12))
    loader = ResumableDataLoader(
        ds, batch_sampler=ResumableBatchSampler(EpochRandomSampler(ds, seed=0), 2, False), num_workers=2
    )
    it = iter(loader)
    taken = [next(it)[0].tolist() for _ in range(2)]
    assert loader.state_dict()["consumed"] == 2
    resumed = ResumableDataLoader(ds, batch_sampler=ResumableBatchSampler(EpochRandomSampler(ds, seed=0), 2, False))
    resumed.load_state_dict(loader.state_dict())
    rest = [b[0].tolist() for b in resumed]
    del it
    assert sorted(sum(taken + rest, [])) == list(range(12))


def test_making_a_loader_iterator_draws_nothing_from_the_global_rng():
    ds = TensorDataset(torch.arange(6))
    loader = ResumableDataLoader(ds, batch_sampler=ResumableBatchSampler(EpochRandomSampler(ds), 2, False))
    state = torch.get_rng_state()
    list(loader)
    assert torch.equal(torch.get_rng_state(), state)
