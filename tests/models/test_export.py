"""Export (``align.models.export``): a checkpoint, or a run at its end, written as a Hugging Face model that scores as
the trained policy: a causal LM, or a sequence classifier for a reward model."""

import json
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from align.models import CriticSettings, PolicyModel
from align.models.export import ExportCallback, export_checkpoint
from align.models.loading import is_sequence_classifier
from align.models.reward import init_reward_head, sequence_scores

from ._tiny_batches import batch, naive_logprobs

ROW = torch.tensor([[1, 5, 6, 7, 2]])  # no padding: every rule reads the score at its last token


def trained_policy(reward=False):
    policy = PolicyModel(critic=CriticSettings() if reward else None, seed=1).eval()
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    if reward:
        init_reward_head(policy, torch.Generator().manual_seed(1))
    return policy


def checkpoint(path, policy, **meta):
    state = {f"policy.{k}": v for k, v in policy.state_dict().items()}
    torch.save({"align": {"policy": policy.spec, **meta}, "state_dict": state}, path)
    return path


def assert_causal_lm_of(out, policy):
    model = AutoModelForCausalLM.from_pretrained(out)
    ids, mask = batch(policy)
    with torch.no_grad():
        torch.testing.assert_close(
            naive_logprobs(model, ids, mask, 3),
            policy.token_logprobs(ids, mask, response_length=3).logprobs,
            atol=1e-5,
            rtol=1e-4,
        )


def assert_reward_model_of(out, policy):
    assert is_sequence_classifier(out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        expected = sequence_scores(policy, ROW, torch.ones_like(ROW))
        torch.testing.assert_close(model(input_ids=ROW, attention_mask=torch.ones_like(ROW)).logits[:, 0], expected)


def test_a_policy_checkpoint_exports_as_a_causal_lm_that_scores_as_the_policy(tmp_path):
    policy = trained_policy()
    ckpt = checkpoint(tmp_path / "run.ckpt", policy, module="GRPOModule")
    out = export_checkpoint(ckpt, tmp_path / "hf")
    assert out == tmp_path / "hf" and not is_sequence_classifier(out)
    assert_causal_lm_of(out, policy)


def test_a_reward_checkpoint_exports_as_a_sequence_classifier_with_its_encoding(tmp_path):
    policy = trained_policy(reward=True)
    ckpt = checkpoint(tmp_path / "rm.ckpt", policy, module="RewardModule", reward={"encoding": {"max_length": 48}})
    out = export_checkpoint(ckpt, tmp_path / "hf")
    assert_reward_model_of(out, policy)
    assert json.loads((out / "reward_model.json").read_text())["encoding"]["max_length"] == 48


def test_the_callback_writes_on_rank_zero_only_and_a_reward_model_for_a_reward_run(tmp_path):
    rank0, rank1 = SimpleNamespace(is_global_zero=True), SimpleNamespace(is_global_zero=False)
    policy = trained_policy()
    ExportCallback(str(tmp_path / "other-rank")).on_fit_end(rank1, SimpleNamespace(policy=policy))
    assert not (tmp_path / "other-rank").exists()
    ExportCallback(str(tmp_path / "lm")).on_fit_end(rank0, SimpleNamespace(policy=policy))
    assert_causal_lm_of(tmp_path / "lm", policy)
    # A reward-model run (a module with encoding_spec and a shared critic) writes the reward model's format.
    rm = trained_policy(reward=True)
    run = SimpleNamespace(policy=rm, encoding_spec=lambda: {"max_length": 32})
    ExportCallback(str(tmp_path / "rm")).on_fit_end(rank0, run)
    assert_reward_model_of(tmp_path / "rm", rm)
    # Without a shared critic (a policy run of a module that happens to have encoding_spec), a causal LM.
    ExportCallback(str(tmp_path / "plain")).on_fit_end(rank0, SimpleNamespace(policy=policy, encoding_spec=dict))
    assert not is_sequence_classifier(tmp_path / "plain")
