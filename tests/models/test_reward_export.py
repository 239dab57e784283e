"""The reward-model export is a standard sequence-classification checkpoint, and align scores any such checkpoint
(its own or a peer's) exactly as transformers does."""

import json

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaForSequenceClassification

from align.hub.tiny import load_tiny_tokenizer, tiny_config
from align.models import CriticSettings, LoraSettings, PolicyModel
from align.models.reward import init_reward_head, sequence_scores
from align.models.reward_export import save_reward_model
from align.rollout.rewards import RewardModelScorer

EOS = 2


def reward_policy(seed=0, **kwargs):
    policy = PolicyModel(critic=CriticSettings(), seed=seed, **kwargs).eval()
    init_reward_head(policy, torch.Generator().manual_seed(seed))
    return policy


def padded(rows, pad, left=False):
    """``(ids, mask)`` of ``rows`` padded with ``pad`` to the longest, on the right or the left."""
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), pad)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(T - len(row), T) if left else slice(0, len(row))
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


# Sequences ending in EOS (a finished answer) and one cut off without it, of different lengths.
ROWS = [[1, 40, 41, 42, EOS], [1, 50, 51, EOS], [1, 60, 61, 62, 63, 64], [1, 70, EOS]]


def hf_scores(model, ids, mask):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits  # (N, 1)
    assert logits.shape == (ids.shape[0], 1)
    return logits.squeeze(-1)


@pytest.mark.parametrize("pad_equals_eos", [True, False])
def test_export_loads_in_transformers_with_its_head_and_scores_as_align(tmp_path, pad_equals_eos):
    policy = reward_policy(pad_equals_eos=pad_equals_eos)
    assert (policy.tokenizer.pad_token_id == EOS) == pad_equals_eos
    export = save_reward_model(policy, tmp_path / "export")
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and model.config.num_labels == 1
    # The trained head, not a fresh one; the pad token is never the EOS, so transformers pools on the EOS.
    torch.testing.assert_close(model.score.weight, policy.critic.head.proj.weight)
    assert model.config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id == EOS
    for left in (False, True):
        ids, mask = padded(ROWS, tokenizer.pad_token_id, left)
        with torch.no_grad():
            ours = sequence_scores(policy, ids, mask)
        torch.testing.assert_close(hf_scores(model, ids, mask), ours, atol=1e-5, rtol=1e-5)
    # Why the pad token moves: with pad == eos transformers skips each row's final EOS and reads the token before.
    model.config.pad_token_id = EOS
    naive = hf_scores(model, *padded(ROWS, EOS))
    ends_in_eos = torch.tensor([row[-1] == EOS for row in ROWS])
    assert not torch.allclose(naive[ends_in_eos], ours[ends_in_eos], atol=1e-3)
    torch.testing.assert_close(naive[~ends_in_eos], ours[~ends_in_eos], atol=1e-5, rtol=1e-5)


def test_lora_is_merged_into_the_export(tmp_path):
    torch.manual_seed(0)  # peft draws the adapter's A matrices from the global generator
    policy = reward_policy(lora=LoraSettings(r=4, alpha=8))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(1))
    export = save_reward_model(policy, tmp_path / "export")
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    assert not any("lora" in name for name, _ in model.named_parameters())
    ids, mask = padded(ROWS, model.config.pad_token_id)
    with torch.no_grad():
        ours = sequence_scores(policy, ids, mask)
        without_adapter = sequence_scores(PolicyModel(critic=CriticSettings()).eval().requires_grad_(False), ids, mask)
    # Merged weights round differently from base + adapter: agreement to float32 rounding of the merge.
    torch.testing.assert_close(hf_scores(model, ids, mask), ours, atol=2e-4, rtol=2e-4)
    assert not torch.allclose(ours - ours.mean(), without_adapter - without_adapter.mean(), atol=1e-3)


@pytest.mark.parametrize("pad_equals_eos", [True, False])
def test_a_peers_sequence_classifier_scores_as_in_transformers(tmp_path, pad_equals_eos):
    """As TRL's RewardTrainer saves one: a LlamaForSequenceClassification with one label and its tokenizer."""
    tokenizer = load_tiny_tokenizer(pad_equals_eos=pad_equals_eos)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(tiny_config(num_labels=1, pad_token_id=tokenizer.pad_token_id)).eval()
    torch.nn.init.normal_(model.score.weight)
    model.save_pretrained(tmp_path / "peer")
    tokenizer.save_pretrained(tmp_path / "peer")
    scorer = RewardModelScorer(str(tmp_path / "peer"), batch_size=3)
    prompts, completions = ["sort: c a b", "sort: b a", "sort: d c b a", "x"], ["a b c", "a b", "a", "b c d e f"]
    ours = scorer(prompts, completions)
    rows = [sum(scorer.encode(p, c), []) for p, c in zip(prompts, completions)]
    assert all(row[-1] == EOS for row in rows)  # each scored text ends its turn
    reference = hf_scores(model, *padded(rows, tokenizer.pad_token_id))
    torch.testing.assert_close(torch.tensor(ours), reference, atol=1e-5, rtol=1e-5)
