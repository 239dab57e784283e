"""What every ``align`` data module shares: its tokenizer and its chat encoder."""

from __future__ import annotations

from typing import Callable, Sequence

import lightning as L
from torch.utils.data import DataLoader, Dataset

from align.data.chat import ChatEncoder
from align.data.sampling import (EpochRandomSampler, EpochSequentialSampler, ResumableBatchSampler, ResumableDataLoader,
                                 WindowBatchSampler)
from align.errors import AlignDataError


class TokenizerDataModule(L.LightningDataModule):
    """A data module whose tokenizer is ``hparams.tokenizer`` when set, else the module's policy tokenizer.

    Subclasses call ``save_hyperparameters()`` with ``tokenizer`` and ``use_chat_template`` among their
    arguments. ``set_tokenizer`` supplies one directly (outside a trainer, or in tests).
    """

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = None

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _resolve_tokenizer(self):
        if self.tokenizer is None:
            if self.hparams.get("tokenizer") is not None:
                from align.models.loading import load_tokenizer

                self.tokenizer = load_tokenizer(self.hparams.tokenizer)
            elif self.trainer is not None and hasattr(self.trainer.lightning_module, "tokenizer"):
                self.tokenizer = self.trainer.lightning_module.tokenizer
            else:
                raise AlignDataError("data.tokenizer", None, None, "a tokenizer path, or a module with a policy")
        return self.tokenizer

    def encoder(self) -> ChatEncoder:
        return ChatEncoder(self._resolve_tokenizer(), self.hparams.get("use_chat_template"))

    def window_dataloader(self, dataset: Dataset, weights: Sequence[int], collate_fn: Callable) -> DataLoader:
        """Training batches whose items carry their optimizer step's total weight (see ``WindowBatchSampler``):
        shuffled when ``hparams.shuffle``, ``hparams.batch_size`` per micro-batch, one window per optimizer step.
        The loader resumes mid-epoch exactly (see ``align.data.sampling``)."""
        hp = self.hparams
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
        batch_sampler = WindowBatchSampler(self._train_sampler(dataset), hp.batch_size, drop_last=False,
                                           weights=weights, accumulate=accumulate)
        return ResumableDataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn,
                                   num_workers=hp.num_workers)

    def resumable_dataloader(self, dataset: Dataset, collate_fn: Callable, drop_last: bool = False) -> DataLoader:
        """Training batches of ``hparams.batch_size``, shuffled when ``hparams.shuffle``, that resume mid-epoch
        exactly (see ``align.data.sampling``)."""
        hp = self.hparams
        batch_sampler = ResumableBatchSampler(self._train_sampler(dataset), hp.batch_size, drop_last=drop_last)
        return ResumableDataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate_fn,
                                   num_workers=hp.num_workers)

    def _train_sampler(self, dataset: Dataset):
        # Shuffled by (seed_everything's seed, epoch), never by the global RNG: an epoch's order survives a restart.
        return EpochRandomSampler(dataset) if self.hparams.shuffle else EpochSequentialSampler(dataset)
