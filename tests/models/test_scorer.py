"""The scorer: every way a module scores rows, at its temperature and packing, against a plain recomputation from the
model's own logits (the log-softmax of ``logits / T`` gathered at the next token) on the tiny model."""

import pytest
import torch

from align.core.masks import masked_sum
from align.models.critic import CriticSettings
from align.models.loading import LoraSettings
from align.models.policy import PolicyModel
from align.models.reward import sequence_scores
from align.models.scorer import Rows, Scorer


def rows_of(policy: PolicyModel) -> Rows:
    """Two left-padded prompts with right-padded responses of 3 and 1 tokens (a stop token, then padding)."""
    pad, eos = policy.tokenizer.pad_token_id, policy.tokenizer.eos_token_id
    input_ids = torch.tensor([[pad, 5, 6, 7, 8, 9, eos], [11, 12, 13, 14, eos, pad, pad]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    response_mask = torch.tensor([[True, True, True], [True, False, False]])
    return Rows(input_ids, attention_mask, response_mask)


def by_hand(model, rows: Rows, temperature: float) -> torch.Tensor:
    """``(N, R)`` log-probs of the response tokens from the model's full logits: the definition the scorer meets."""
    R = rows.response_mask.shape[1]
    positions = (rows.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, position_ids=positions).logits
    logprobs = torch.log_softmax(logits[:, -R - 1 : -1].double() / temperature, dim=-1)
    return logprobs.gather(-1, rows.input_ids[:, -R:, None])[..., 0].float()


@pytest.fixture(scope="module")
def policy():
    return PolicyModel("tiny", seed=4, critic=CriticSettings(kind="shared")).eval()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@pytest.mark.parametrize("padding_free", [False, True])
def test_logprobs_are_the_tempered_log_softmax_of_the_next_token(policy, temperature, padding_free):
    rows = rows_of(policy)
    out = Scorer(policy, temperature=temperature, padding_free=padding_free).logprobs(rows, entropy=True, values=True)
    mask = rows.response_mask
    expected = by_hand(policy.model, rows, temperature)
    torch.testing.assert_close(out.logprobs[mask], expected[mask], atol=2e-5, rtol=1e-5)
    assert out.logprobs.requires_grad and out.entropy is not None and out.values is not None
    assert out.logprobs.shape == out.entropy.shape == out.values.shape == mask.shape
    if padding_free:  # only the real response tokens are scored; padded positions are 0
        assert bool((out.logprobs[~mask] == 0).all())


def test_padding_free_and_padded_scoring_agree_on_every_output(policy):
    rows = rows_of(policy)
    padded = Scorer(policy, temperature=0.7).logprobs(rows, entropy=True, values=True)
    packed = Scorer(policy, temperature=0.7, padding_free=True).logprobs(rows, entropy=True, values=True)
    mask = rows.response_mask
    for a, b in zip(padded, packed):
        torch.testing.assert_close(a[mask], b[mask], atol=2e-5, rtol=1e-5)
    values = Scorer(policy, padding_free=True).values(rows)
    torch.testing.assert_close(values[mask], padded.values[mask], atol=2e-5, rtol=1e-5)


def test_the_reference_is_scored_without_gradients_at_the_same_temperature():
    policy = PolicyModel("tiny", seed=4, lora=LoraSettings(r=4, alpha=8)).eval()
    with torch.no_grad():  # move the adapter: the policy is no longer its reference
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    policy.setup_reference()
    rows, mask = rows_of(policy), rows_of(policy).response_mask
    scorer = Scorer(policy, temperature=0.5)
    reference = scorer.reference_logprobs(rows)
    assert not reference.requires_grad
    with policy.adapter_switch.off():  # LoRA's reference: the adapter switched off
        base = by_hand(policy.model, rows, 0.5)
    torch.testing.assert_close(reference[mask], base[mask], atol=2e-5, rtol=1e-5)
    assert not torch.allclose(scorer.logprobs(rows).logprobs[mask], reference[mask], atol=1e-3)


def test_a_shared_heads_values_can_leave_the_backbone_without_gradients(policy):
    rows = rows_of(policy)
    scorer = Scorer(policy)
    backbone = next(p for n, p in policy.model.named_parameters() if "layers.0." in n)
    for detach, reaches in ((False, True), (True, False)):
        policy.zero_grad(set_to_none=True)
        scorer.values(rows, detach_backbone=detach).sum().backward()
        assert (backbone.grad is not None) == reaches
        assert policy.critic.head.proj.weight.grad is not None


def test_response_logits_are_the_raw_logits_of_the_response_positions(policy):
    rows = rows_of(policy)
    logits = Scorer(policy, temperature=0.5).response_logits(rows)  # raw: GKD tempers them itself
    picked = torch.log_softmax(logits.double() / 0.5, -1).gather(-1, rows.input_ids[:, -3:, None])[..., 0]
    mask = rows.response_mask
    torch.testing.assert_close(picked.float()[mask], by_hand(policy.model, rows, 0.5)[mask], atol=2e-5, rtol=1e-5)


class Pairs:
    """A preference batch of one pair: its rows and response mask (the fields :meth:`Scorer.sequence_logps` reads)."""

    def __init__(self, rows: Rows):
        self.input_ids, self.attention_mask, self.response_mask = rows
        self.response_length = rows.response_mask.shape[1]


@pytest.mark.parametrize("padding_free", [False, True])
def test_sequence_logps_sum_each_rows_response_tokens(policy, padding_free):
    rows = rows_of(policy)
    summed = Scorer(policy, padding_free=padding_free).sequence_logps(Pairs(rows))
    expected = masked_sum(by_hand(policy.model, rows, 1.0), rows.response_mask, dim=-1)
    torch.testing.assert_close(summed, expected, atol=5e-5, rtol=1e-5)


def test_target_logprobs_score_given_targets_in_row_major_order(policy):
    rows = rows_of(policy)
    targets = torch.full_like(rows.input_ids, -100)
    targets[:, -4:-1] = rows.input_ids[:, -3:]  # the positions that predict the responses
    targets[1, -3:-1] = -100  # the second row's response is one token
    got = Scorer(policy).target_logprobs(rows.input_ids, targets, attention_mask=rows.attention_mask)
    expected = by_hand(policy.model, rows, 1.0)[rows.response_mask]
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_sequence_scores_are_the_reward_heads_at_the_last_real_token(policy):
    rows = rows_of(policy)
    scorer = Scorer(policy, padding_free=True)
    expected = sequence_scores(policy, rows.input_ids, rows.attention_mask)
    torch.testing.assert_close(
        scorer.sequence_scores(rows.input_ids, rows.attention_mask), expected, atol=2e-5, rtol=1e-5
    )
