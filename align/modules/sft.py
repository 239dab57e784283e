"""Supervised fine-tuning: completion-only NLL, normalised per token over the whole optimizer step."""

from __future__ import annotations

import math
import time

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.data.chat import IGNORE_INDEX
from align.data.sft import SFTBatch
from align.models.policy import PolicyModel
from align.models.scorer import Scorer
from align.modules.base import AlignModule


class SFTModule(AlignModule):
    """Next-token NLL on the trained tokens (completions by default; see ``SFTDataModule.completion_only``).

    The loss of an optimizer step is the sum of token NLLs over every micro-batch of the accumulation window
    and every data-parallel rank, divided by their total token count. Each micro-batch carries its window's
    token count (``SFTBatch.window_tokens``), from which :meth:`AlignModule.window_loss` makes the micro-batch's
    exact share of the step loss, so accumulating 8 x 1 equals 1 x 8.

    Logged: ``train/loss``, ``train/tokens_per_s``, ``val/loss``, ``val/ppl``.
    """

    headline_metrics = ("val/loss", "val/ppl")
    progress_metrics = ("train/loss", "train/tokens_per_s")

    def __init__(
        self,
        policy: PolicyModel | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
    ):
        """
        Args:
            policy: The model to train; null means the embedded tiny model.
            optimizer: Optimizer callable (parameters -> optimizer); matrices get weight decay, vectors do not.
            scheduler: Learning-rate schedule callable (optimizer -> scheduler), stepped every optimizer step.
        """
        super().__init__(policy if policy is not None else PolicyModel(), optimizer, scheduler)
        self.scorer = Scorer(self.policy)
        self._reset_step_stats()
        self._val_nll, self._val_tokens = torch.zeros(()), torch.zeros(())  # () sums of a validation epoch

    def _reset_step_stats(self) -> None:
        self._step_loss = torch.zeros(())
        self._step_tokens = 0
        self._step_started = time.perf_counter()

    def _nll_sum(self, batch: SFTBatch) -> torch.Tensor:
        targets = torch.cat([batch.labels[:, 1:], torch.full_like(batch.labels[:, :1], IGNORE_INDEX)], dim=1)  # (B, T)
        logprobs = self.scorer.target_logprobs(
            batch.input_ids, targets, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        )
        return -logprobs.sum()

    def training_step(self, batch: SFTBatch, batch_idx: int) -> torch.Tensor:
        nll = self._nll_sum(batch)
        loss, window_tokens = self.window_loss(nll, batch.window_tokens)  # nll / the step's tokens on all ranks
        self._step_loss = self._step_loss.to(nll.device) + nll.detach() / window_tokens
        self._step_tokens += batch.num_tokens
        return loss

    def on_train_start(self) -> None:
        self._reset_step_stats()

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.accumulating():  # DeepSpeed: called after every micro-batch; the window is not complete yet
            return
        # Once per optimizer step: the window is complete, so its mean loss is exact.
        if self.logs_this_step():
            elapsed = max(time.perf_counter() - self._step_started, 1e-9)
            loss = self.all_reduce_sum(self._step_loss)
            tokens = float(self.all_reduce_sum(torch.tensor(float(self._step_tokens), device=self._step_loss.device)))
            self.log_step({"train/loss": loss, "train/tokens_per_s": tokens / elapsed})
        self._reset_step_stats()

    def on_validation_epoch_start(self) -> None:
        self._val_nll = torch.zeros((), device=self.device)
        self._val_tokens = torch.zeros((), device=self.device)

    def validation_step(self, batch: SFTBatch, batch_idx: int) -> None:
        self._val_nll += self._nll_sum(batch).detach()
        self._val_tokens += (batch.labels[:, 1:] != IGNORE_INDEX).sum()

    def on_validation_epoch_end(self) -> None:
        nll, tokens = self.all_reduce_sum(self._val_nll), self.all_reduce_sum(self._val_tokens.float())
        loss = float(nll / tokens.clamp(min=1))
        self.log("val/loss", loss, batch_size=1)
        self.log("val/ppl", math.exp(min(loss, 50.0)), batch_size=1)
