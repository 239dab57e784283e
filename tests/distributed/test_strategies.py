"""Single-process checks of ``align.strategies``: names, DeepSpeed config, the generation hooks."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from lightning.pytorch.strategies import StrategyRegistry

from align.models.tiny import build_tiny_model
from align.rollout import sample
from align.strategies import (
    DeepSpeedZeROStrategy,
    FSDP2Strategy,
    decoder_layers,
    generation_context,
    global_all,
    parameters_sharded,
)


def test_short_names_select_the_cpu_capable_strategies():
    zero3 = StrategyRegistry.get("zero3_offload")
    assert isinstance(zero3, DeepSpeedZeROStrategy) and zero3.zero_stage_3
    assert zero3.config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert zero3.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # A torch optimizer (the modules' AdamW) may run on offloaded state.
    assert zero3.config["zero_force_ds_cpu_optimizer"] is False
    assert StrategyRegistry.get("zero1").config["zero_optimization"]["stage"] == 1
    fsdp = StrategyRegistry.get("fsdp2_offload")
    assert isinstance(fsdp, FSDP2Strategy) and fsdp.cpu_offload


def test_deepspeed_needs_no_training_dataloader_for_its_batch_size():
    # The automatic choice builds the training dataloader, which does not exist while validating before fit.
    assert DeepSpeedZeROStrategy(stage=2).config["train_micro_batch_size_per_gpu"] == 1


def test_parameters_sharded():
    assert parameters_sharded(FSDP2Strategy()) and parameters_sharded(DeepSpeedZeROStrategy(stage=3))
    assert not parameters_sharded(DeepSpeedZeROStrategy(stage=2))


def test_decoder_layers_are_the_repeated_blocks():
    model = build_tiny_model(seed=0)
    layers = decoder_layers(model)
    assert layers and layers == list(model.model.layers)


def test_one_process_needs_no_generation_hook():
    assert global_all(True) is True and global_all(False) is False
    with generation_context(SimpleNamespace(_trainer=None)) as sync_stop:
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
    out = sample(synced, ids, mask, eos_token_id=2, pad_token_id=0, max_new_tokens=5,
                 sync_stop=lambda done: done and next(others_done_after))
    assert synced.calls == 4 and out.response_ids.tolist() == [[2, 0, 0, 0], [2, 0, 0, 0]]
    assert out.logprobs[:, 1:].abs().sum() == 0
