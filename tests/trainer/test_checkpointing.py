"""Fast checks of the pieces behind exact resume and atomic checkpoints (the samplers' resume is in
tests/data/test_sampling.py, the SIGKILL tests in tests/e2e/test_resume.py)."""

import os
import pickle

import pytest
import torch

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
