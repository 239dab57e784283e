"""The replay buffer: a ring of the last ``capacity`` transitions, sampled uniformly from torch's global RNG."""

import pytest
import torch

from align.gym.replay import ReplayBuffer
from align.gym.runner import Transition


def vector_step(first: int, n: int = 2) -> Transition:
    """``n`` transitions numbered ``first .. first + n - 1``: every field carries its transition's number."""
    ids = torch.arange(first, first + n)
    return Transition(
        observations=ids.float().unsqueeze(1).repeat(1, 3),  # (N, 3)
        actions=ids,  # (N,) discrete
        rewards=ids.float() / 10,
        next_observations=ids.float().unsqueeze(1).repeat(1, 3) + 0.5,
        terminated=ids % 3 == 0,
        done=ids % 3 == 0,
    )


def numbers(buffer: ReplayBuffer) -> list[int]:
    """The transition numbers in the state dict's order (oldest first)."""
    return buffer.state_dict()["storage"]["actions"].tolist()


def test_add_and_sample_shapes():
    buffer = ReplayBuffer(10)
    assert len(buffer) == 0
    buffer.add(vector_step(0))
    buffer.add(vector_step(2))
    assert len(buffer) == 4
    batch = buffer.sample(7)
    assert batch["observations"].shape == (7, 3) and batch["observations"].dtype == torch.float32
    assert batch["next_observations"].shape == (7, 3)
    assert batch["actions"].shape == (7,) and batch["actions"].dtype == torch.int64
    assert batch["rewards"].shape == (7,)
    assert batch["terminated"].shape == (7,) and batch["terminated"].dtype == torch.bool
    assert set(batch) == {"observations", "actions", "rewards", "next_observations", "terminated"}
    # Every sampled row is one whole stored transition (its fields agree) and one of the 4 stored.
    ids = batch["actions"]
    assert set(ids.tolist()) <= {0, 1, 2, 3}
    torch.testing.assert_close(batch["observations"][:, 0], ids.float())
    torch.testing.assert_close(batch["next_observations"][:, 0], ids.float() + 0.5)
    torch.testing.assert_close(batch["rewards"], ids.float() / 10)
    assert torch.equal(batch["terminated"], ids % 3 == 0)


def test_ring_overwrites_oldest():
    buffer = ReplayBuffer(5)
    for first in range(0, 8, 2):  # transitions 0..7, two at a time
        buffer.add(vector_step(first))
    assert len(buffer) == 5
    assert numbers(buffer) == [3, 4, 5, 6, 7]  # 0, 1, 2 overwritten, oldest first
    assert sorted(buffer.storage["actions"].tolist()) == [3, 4, 5, 6, 7]
    buffer.add(vector_step(8))
    assert numbers(buffer) == [5, 6, 7, 8, 9]


def test_one_vector_step_larger_than_the_buffer_keeps_the_newest():
    buffer = ReplayBuffer(3)
    buffer.add(vector_step(0, n=2))
    buffer.add(vector_step(2, n=4))  # transitions 2..5 into a ring of 3 already holding 0, 1
    assert len(buffer) == 3
    assert numbers(buffer) == [3, 4, 5]
    buffer.add(vector_step(6, n=1))
    assert numbers(buffer) == [4, 5, 6]


def test_state_dict_round_trip_then_continue(tmp_path):
    for stop in (3, 8, 10):  # not full, wrapped, exactly full
        unbroken, first = ReplayBuffer(5), ReplayBuffer(5)
        for k in range(stop):
            step = vector_step(k, n=1)
            unbroken.add(step)
            first.add(step)
        path = tmp_path / f"buffer{stop}.pt"
        torch.save(first.state_dict(), path)
        restored = ReplayBuffer(5)
        restored.load_state_dict(torch.load(path, weights_only=True))
        assert len(restored) == len(unbroken) == min(stop, 5)
        assert numbers(restored) == numbers(unbroken)
        for k in range(stop, stop + 4):
            unbroken.add(vector_step(k, n=1))
            restored.add(vector_step(k, n=1))
        a, b = unbroken.state_dict(), restored.state_dict()
        assert a["size"] == b["size"]
        for name in a["storage"]:
            assert torch.equal(a["storage"][name], b["storage"][name]), (stop, name)


def test_empty_state_dict_round_trip():
    restored = ReplayBuffer(3)
    restored.load_state_dict(ReplayBuffer(3).state_dict())
    assert len(restored) == 0
    restored.add(vector_step(0))
    assert numbers(restored) == [0, 1]


def test_sampling_uses_torch_global_rng():
    buffer = ReplayBuffer(50)
    for first in range(0, 40, 4):
        buffer.add(vector_step(first, n=4))
    torch.manual_seed(123)
    a = buffer.sample(16)
    torch.manual_seed(123)
    b = buffer.sample(16)
    c = buffer.sample(16)
    assert torch.equal(a["actions"], b["actions"])
    assert not torch.equal(b["actions"], c["actions"])
    # Only the filled part is sampled.
    assert int(torch.cat([a["actions"], c["actions"]]).max()) < 40


def test_capacity_mismatch_raises():
    buffer = ReplayBuffer(4)
    buffer.add(vector_step(0))
    with pytest.raises(ValueError, match="holds 4 transitions, this one 5"):
        ReplayBuffer(5).load_state_dict(buffer.state_dict())


def test_empty_sample_and_bad_capacity_raise():
    with pytest.raises(ValueError, match="empty"):
        ReplayBuffer(4).sample(2)
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(0)


def test_writes_land_in_the_stored_tensors_for_every_dtype():
    """Writes go through numpy views of the storage where numpy has the dtype, through torch where it has not
    (bfloat16); either way the sampled and saved tensors hold what was added."""
    buffer = ReplayBuffer(5)
    for first in (0, 2, 4):  # the third add wraps around the ring (index writes)
        t = vector_step(first)
        t.observations = t.observations.to(torch.bfloat16)
        buffer.add(t)
    assert buffer.storage["observations"].dtype == torch.bfloat16
    assert numbers(buffer) == [1, 2, 3, 4, 5]
    state = buffer.state_dict()["storage"]
    torch.testing.assert_close(state["observations"][:, 0].float(), torch.arange(1.0, 6.0))
    torch.testing.assert_close(state["rewards"], torch.arange(1.0, 6.0) / 10)
    assert state["terminated"].tolist() == [False, False, True, False, False]
    restored = ReplayBuffer(5)
    restored.load_state_dict(buffer.state_dict())
    restored.add(vector_step(6, n=1))  # a write into the restored storage, through its new views
    assert numbers(restored) == [2, 3, 4, 5, 6]
    torch.testing.assert_close(restored.state_dict()["storage"]["rewards"], torch.arange(2.0, 7.0) / 10)
