"""``align.trainer.strategies.gather`` (and the collective it uses): whole parameters around sampling from sharded
weights, and the rank-synchronised stop that ZeRO-3 needs."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import torch

from align.rollout.sampling import sample
from align.trainer.strategies import (
    DeepSpeedZeROStrategy,
    FSDP2Strategy,
    generation_context,
    global_all,
    parameters_sharded,
)


def test_parameters_sharded():
    assert parameters_sharded(FSDP2Strategy()) and parameters_sharded(DeepSpeedZeROStrategy(stage=3))
    assert not parameters_sharded(DeepSpeedZeROStrategy(stage=2))


def test_one_process_needs_no_generation_hook():
    assert global_all(True) is True and global_all(False) is False
    with generation_context(SimpleNamespace(_trainer=None)) as sync_stop:
        assert sync_stop is None


def test_generation_context_finds_the_trainer_of_a_module(private_api):
    # Read through the private attribute: the public ``trainer`` property raises on a detached module.
    used_by = (
        "align.trainer.strategies (generation_context, accumulation_boundary) and align.modules (the trainer, if any)"
    )
    module = L.LightningModule()
    assert private_api.require(module, "_trainer", used_by=used_by) is None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module.trainer = trainer
    assert module._trainer is trainer, f"LightningModule._trainer: {used_by}"
    with generation_context(module) as sync_stop:
        assert sync_stop is None


class CountingLM:
    """Emits EOS at once for every row, and counts its forward passes."""

    def __init__(self, vocab=8, eos=2):
        self.vocab, self.eos, self.calls = vocab, eos, 0

    def __call__(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep):
        self.calls += 1
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e9)
        logits[..., self.eos] = 0.0
        return SimpleNamespace(logits=logits, past_key_values=attention_mask.shape[1])


def test_sync_stop_keeps_a_finished_rank_decoding_until_every_rank_is_done():
    ids, mask = torch.tensor([[1, 5], [1, 6]]), torch.ones(2, 2, dtype=torch.long)
    alone = CountingLM()
    out = sample(alone, ids, mask, eos_token_id=2, pad_token_id=0, max_new_tokens=5)
    assert alone.calls == 1 and out.steps == 1
    # Another rank still has rows running for 3 more steps: this rank runs as many passes, emitting padding.
    others_done_after = iter([False, False, False, True])
    synced = CountingLM()
    out = sample(
        synced,
        ids,
        mask,
        eos_token_id=2,
        pad_token_id=0,
        max_new_tokens=5,
        sync_stop=lambda done: done and next(others_done_after),
    )
    assert synced.calls == 4 and out.response_ids.tolist() == [[2, 0, 0, 0], [2, 0, 0, 0]]
    assert out.logprobs[:, 1:].abs().sum() == 0
