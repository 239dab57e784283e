"""Micro-batches that know the token count of their whole optimizer step.

The loss of one optimizer step is a token mean over every micro-batch in the accumulation window and every
data-parallel rank. A micro-batch cannot know what comes after it, so the batch sampler looks ahead: it
groups ``accumulate`` micro-batches into a window and tags each index with the window's loss-token count.
The module all-reduces that count across ranks and divides by it, so 8 accumulation steps x 1 equal
1 x 8 exactly (see ``align.losses.sft_loss``).

The sampler subclasses ``BatchSampler`` and takes the index ``sampler`` as its first argument, so Lightning can
swap in a ``DistributedSampler`` under DDP, FSDP or DeepSpeed.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from torch.utils.data import BatchSampler, Sampler


class WindowBatchSampler(BatchSampler):
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

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        micro: list[list[int]] = []
        for batch in super().__iter__():
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
