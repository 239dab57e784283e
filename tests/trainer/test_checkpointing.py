"""Fast checks of the pieces behind exact resume and atomic checkpoints (the SIGKILL tests are in test_resume.py)."""

import os
import pickle

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
from align.errors import AlignConfigError
from align.trainer.checkpointing import AtomicCheckpointIO, atomic_write, rng_state, set_rng_state


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "last.ckpt"
    atomic_write(target, lambda f: f.write(b"old"))

    def torn(f):
        f.write(b"half of the new")
        raise KeyboardInterrupt  # any interruption between the first byte and the rename

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, torn)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_a_temporary_file_left_by_a_killed_writer_is_removed_by_the_next_save(tmp_path):
    (tmp_path / ".last.ckpt.tmp.12345").write_bytes(b"torn")
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(2)}, tmp_path / "last.ckpt")
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert torch.equal(AtomicCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")["w"], torch.ones(2))


class Payload:  # a class that only a full unpickle restores
    pass


def test_checkpoints_load_weights_only_and_code_carrying_files_are_refused(tmp_path):
    path = tmp_path / "x.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "obj": Payload()}, path)
    with pytest.raises(AlignConfigError, match="only a full unpickle can restore"):
        AtomicCheckpointIO().load_checkpoint(path)
    assert isinstance(AtomicCheckpointIO(weights_only=False).load_checkpoint(path)["obj"], Payload)
    with pytest.raises(AlignConfigError, match="does not exist"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "missing.ckpt")


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    import random

    import numpy as np

    state = rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    AtomicCheckpointIO().save_checkpoint({"rng": state}, tmp_path / "r.ckpt")
    random.random(), np.random.rand(), torch.rand(())
    set_rng_state(AtomicCheckpointIO().load_checkpoint(tmp_path / "r.ckpt")["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
    pickle.dumps(state)  # plain data


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
