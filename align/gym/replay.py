"""Experience replay (Lin 1992; DQN, arXiv 1312.5602): a fixed-size ring of transitions, sampled uniformly."""

from __future__ import annotations

import numpy as np
import torch

from align.gym.runner import Transition


class ReplayBuffer:
    """The last ``capacity`` transitions. Each stores ``s, a, r, s', terminated``: a time-limit truncation keeps
    its future value (``terminated`` false, ``s'`` the state it was cut off in), as Stable-Baselines3's
    ``handle_timeout_termination`` does. Sampling draws from torch's global generator, so a run restored with its
    RNG states (:class:`~align.trainer.checkpointing.ExactResume`) and this buffer (:meth:`state_dict`) samples the same
    batches."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"ReplayBuffer: capacity must be >= 1, got {capacity}")
        self.capacity, self.size, self.position = int(capacity), 0, 0
        self.storage: dict[str, torch.Tensor] = {}
        self._views: dict[str, np.ndarray] = {}  # numpy views of ``storage`` (same memory), for writes

    def _set_storage(self, storage: dict[str, torch.Tensor]) -> None:
        self.storage = storage
        # A write of one vector step through numpy costs about a fifth of a torch slice assignment, which
        # dominated the buffer's share of a DQN collection step. Types numpy cannot view (bfloat16) stay torch.
        self._views = {}
        for name, store in storage.items():
            try:
                self._views[name] = store.numpy()
            except (TypeError, RuntimeError):
                pass

    def __len__(self) -> int:
        return self.size

    def _allocate(self, transition: Transition) -> None:
        fields = {
            "observations": transition.observations,
            "actions": transition.actions,
            "rewards": transition.rewards,
            "next_observations": transition.next_observations,
            "terminated": transition.terminated,
        }
        self._set_storage({k: torch.zeros((self.capacity, *v.shape[1:]), dtype=v.dtype) for k, v in fields.items()})

    def add(self, transition: Transition) -> None:
        """Store the ``N`` transitions of one vector step, overwriting the oldest once full."""
        if not self.storage:
            self._allocate(transition)
        n = transition.rewards.shape[0]
        where: slice | torch.Tensor
        if self.position + n <= self.capacity:  # the usual case: a plain slice, several times cheaper than indices
            where = slice(self.position, self.position + n)
        else:
            where = (self.position + torch.arange(n)) % self.capacity
        for name, store in self.storage.items():
            value = getattr(transition, name)
            view = self._views.get(name)
            if view is not None and isinstance(where, slice) and value.device.type == "cpu":
                try:
                    view[where] = value.detach().numpy()
                    continue
                except TypeError:  # a value of a dtype numpy has no type for
                    pass
            store[where] = value
        self.position = (self.position + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, batch_size: int) -> dict[str, torch.Tensor]:
        """``batch_size`` transitions drawn uniformly with replacement: ``{observations (B, *obs), actions (B, ...),
        rewards (B,), next_observations (B, *obs), terminated (B,)}``."""
        if self.size == 0:
            raise ValueError("ReplayBuffer: nothing to sample, the buffer is empty")
        index = torch.randint(0, self.size, (batch_size,))
        return {name: store[index] for name, store in self.storage.items()}

    def state_dict(self) -> dict:
        """The stored transitions (oldest first) and nothing else: tensors and numbers only."""
        order = (
            (torch.arange(self.size) + (self.position - self.size)) % self.capacity if self.size else torch.arange(0)
        )
        return {
            "capacity": self.capacity,
            "size": self.size,
            "storage": {name: store[order].clone() for name, store in self.storage.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["capacity"]) != self.capacity:
            raise ValueError(
                f"ReplayBuffer: the checkpoint's buffer holds {state['capacity']} transitions, this one "
                f"{self.capacity} (model.buffer_size)"
            )
        self.size = int(state["size"])
        self.position = self.size % self.capacity
        storage = {}
        for name, stored in state["storage"].items():
            store = torch.zeros((self.capacity, *stored.shape[1:]), dtype=stored.dtype)
            store[: self.size] = stored
            storage[name] = store
        self._set_storage(storage)


__all__ = ["ReplayBuffer"]
