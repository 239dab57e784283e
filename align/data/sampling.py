"""Training batches that resume exactly mid-epoch, and micro-batches that know their optimizer step's token count.

**Resumable order.** :class:`EpochRandomSampler` shuffles with a permutation fixed by ``(seed, epoch)``, so the
order of an epoch never depends on the global RNG. :class:`ResumableBatchSampler` remembers its epoch and how
many batches of it were consumed; its ``state_dict`` / ``load_state_dict`` let a restarted run skip exactly
those batches (by index: no item is loaded to be skipped). :class:`ResumableDataLoader` counts the batches its
consumer took and exposes the state to Lightning, which stores it in every checkpoint (``loops`` ->
``fit_loop`` -> ``combined_loader``) and hands it back on resume.

**Step-wide token counts.** The loss of one optimizer step is a token mean over every micro-batch in the
accumulation window and every data-parallel rank. A micro-batch cannot know what comes after it, so
:class:`WindowBatchSampler` looks ahead: it groups ``accumulate`` micro-batches into a window and tags each
index with the window's loss-token count. The module all-reduces that count across ranks and divides by it,
so 8 accumulation steps x 1 equal 1 x 8 exactly (see ``align.core.losses.sft_loss``).

The batch samplers subclass ``BatchSampler`` and take the index ``sampler`` as their first argument, so
Lightning can swap in a ``DistributedSampler`` (itself seeded by seed and epoch) under DDP, FSDP or DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, SequentialSampler


class EpochRandomSampler(RandomSampler):
    """A fresh permutation each epoch, drawn from ``seed + epoch`` (as ``DistributedSampler`` does) instead of
    the global RNG, so the order of an epoch is reproducible after a restart. A ``RandomSampler`` subclass:
    Lightning recognises it as shuffled and shards it under data parallelism."""

    def __init__(self, data_source, seed: int | None = None):
        """``seed``: defaults to ``torch.initial_seed()`` (the value given to ``seed_everything``)."""
        super().__init__(data_source)
        self.seed = int(torch.initial_seed() if seed is None else seed) % (2**63)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed((self.seed + self.epoch) % (2**63))
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class EpochSequentialSampler(SequentialSampler):
    """``SequentialSampler`` that knows its epoch (Lightning calls ``set_epoch`` on a batch sampler's sampler)."""

    def __init__(self, data_source):
        super().__init__(data_source)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)


class ResumableBatchSampler(BatchSampler):
    """A ``BatchSampler`` whose position within the epoch can be saved and restored.

    The epoch is the one Lightning gives the index sampler (``set_epoch``, called on ``batch_sampler.sampler``
    at the start of every epoch). ``consumed`` counts the batches of that epoch handed out so far (a
    :class:`ResumableDataLoader` counts those its consumer took instead). After ``load_state_dict``, an
    iteration of the saved epoch skips its consumed batches; when they covered the whole epoch, the next
    epoch starts from its first batch.
    """

    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool):
        super().__init__(sampler, batch_size, drop_last)
        self.consumed = 0
        self._own_epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip)

    @property
    def epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", self._own_epoch))

    def set_epoch(self, epoch: int) -> None:
        self._own_epoch = int(epoch)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def batches(self) -> Iterator[Any]:
        """Every batch of the current epoch, from the first (subclasses change what a batch is)."""
        yield from super().__iter__()

    def pending_skip(self) -> int:
        """Batches the next iteration skips: the restored position, when it belongs to the current epoch."""
        return self._resume[1] if self._resume is not None and self._resume[0] == self.epoch else 0

    def __iter__(self) -> Iterator[Any]:
        skip, self._resume = self.pending_skip(), None
        self.consumed = skip
        for position, batch in enumerate(self.batches()):
            if position < skip:
                continue
            self.consumed = position + 1
            yield batch
        if not hasattr(self.sampler, "epoch"):
            self._own_epoch += 1

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "consumed": self.consumed, "num_batches": len(self)}
        if isinstance(self.sampler, EpochRandomSampler):
            state["seed"] = self.sampler.seed
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if "seed" in state and isinstance(self.sampler, EpochRandomSampler):
            self.sampler.seed = int(state["seed"])
        if consumed >= len(self):  # the epoch was complete: the next one starts from its beginning
            epoch, consumed = epoch + 1, 0
        self.set_epoch(epoch)
        self._resume = (epoch, consumed)
        self.consumed = consumed


class WindowBatchSampler(ResumableBatchSampler):
    def __init__(
        self,
        sampler: Sampler[int],
        batch_size: int,
        drop_last: bool,
        weights: Sequence[int],
        accumulate: int = 1,
    ):
        """
        Args:
            sampler: Yields dataset indices (shuffled, and sharded by rank under data parallelism).
            batch_size: Micro-batch size.
            drop_last: Drop a last micro-batch smaller than ``batch_size``.
            weights: Loss-token count of each dataset item.
            accumulate: Micro-batches per optimizer step (the trainer's ``accumulate_grad_batches``).
        """
        super().__init__(sampler, batch_size, drop_last)
        if accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {accumulate}")
        self.weights = weights
        self.accumulate = accumulate

    def batches(self) -> Iterator[list[tuple[int, int]]]:
        # Windows are formed over the whole epoch, so a resumed epoch tags its micro-batches exactly as an
        # uninterrupted one did.
        micro: list[list[int]] = []
        for batch in BatchSampler.__iter__(self):
            micro.append(batch)
            if len(micro) == self.accumulate:
                yield from self._tag(micro)
                micro = []
        if micro:
            yield from self._tag(micro)

    def _tag(self, window: list[list[int]]) -> Iterator[list[tuple[int, int]]]:
        tokens = sum(self.weights[i] for batch in window for i in batch)
        for batch in window:
            yield [(i, tokens) for i in batch]


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableBatchSampler` with ``state_dict`` / ``load_state_dict``, so
    Lightning saves its position in every checkpoint and restores it on resume.

    It counts the batches its consumer took, which stays exact with worker processes (they fetch index batches
    ahead of the consumer). Lightning's training fetcher does not fetch ahead of the step for a loader with a
    length, so at a checkpoint written after step ``k`` of an epoch the count is ``k``. Without a
    ``generator`` the loader gets a private one, so creating an iterator draws nothing from the global RNG (the
    sampling RNG of RL rollouts must not depend on when a dataloader iterator was made).
    """

    batch_sampler: ResumableBatchSampler  # __init__ refuses any other, and a DataLoader's cannot be replaced

    def __init__(self, *args: Any, **kwargs: Any):
        if kwargs.get("generator") is None:
            kwargs["generator"] = torch.Generator().manual_seed(torch.initial_seed() % (2**63))
        super().__init__(*args, **kwargs)
        if not isinstance(self.batch_sampler, ResumableBatchSampler):
            raise TypeError("ResumableDataLoader needs a ResumableBatchSampler as its batch_sampler")
        self._taken: int | None = None

    def __iter__(self):
        sampler = self.batch_sampler
        # Read when the first batch is requested: after any load_state_dict, and after Lightning's set_epoch.
        self._taken = sampler.pending_skip()
        for batch in super().__iter__():
            self._taken += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        state = self.batch_sampler.state_dict()
        if self._taken is not None:
            state["consumed"] = self._taken
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)
        self._taken = None
