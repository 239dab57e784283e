import math
from types import SimpleNamespace

import pytest
import torch

from align.core.masks import response_mask
from align.rollout.engine import SamplingConfig, make_engine
from align.rollout.sampling import filter_logits, left_pad, sample

V, EOS, PAD = 8, 2, 0


class MockLM:
    """A causal LM stand-in: logits from a rule, a cache that only counts calls. Knows no tokenizer."""

    def __init__(self, rule=None):
        self.rule = rule or (lambda step, batch: torch.zeros(batch, V))  # uniform
        self.calls = 0

    def __call__(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep):
        assert attention_mask.shape[1] == (past_key_values or 0) + input_ids.shape[1]
        assert position_ids.shape == input_ids.shape
        step = self.calls
        self.calls += 1
        logits = self.rule(step, input_ids.shape[0]).unsqueeze(1)  # (B, 1, V)
        return SimpleNamespace(logits=logits, past_key_values=attention_mask.shape[1])


def prompts():
    return left_pad([[1, 5, 6], [1, 7], [1, 3, 4, 5]], PAD)


def run(model, **kw):
    ids, mask = prompts()
    kw = {"eos_token_id": EOS, "pad_token_id": PAD, "max_new_tokens": 6, **kw}
    return sample(model, ids, mask, **kw)


def test_left_pad_and_positions():
    ids, mask = prompts()
    assert ids.tolist() == [[0, 1, 5, 6], [0, 0, 1, 7], [1, 3, 4, 5]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]


def test_uniform_logits_shapes_and_logprobs():
    out = run(MockLM(lambda s, b: torch.zeros(b, V).index_fill(1, torch.tensor([EOS]), -math.inf)))
    assert out.response_ids.shape == out.logprobs.shape == (3, 6)
    assert out.logprobs.dtype == torch.float32
    # Log-probs are of the full distribution at the temperature: here EOS has 0 mass, so log(1/7).
    torch.testing.assert_close(out.logprobs, torch.full((3, 6), -math.log(V - 1)))


def test_logprobs_are_those_of_the_full_tempered_distribution_not_the_filtered_one():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    out = run(MockLM(lambda s, b: logits.expand(b, V).clone()), temperature=0.5, top_k=2, max_new_tokens=3)
    expected = torch.log_softmax(logits / 0.5, -1)
    assert set(out.response_ids.flatten().tolist()) <= {6, 7}
    torch.testing.assert_close(out.logprobs, expected[out.response_ids])


def eos_at(steps_per_row):
    """Greedy-friendly rule: row b emits EOS at step steps_per_row[b], token 5 before."""

    def rule(step, batch):
        logits = torch.zeros(batch, V)
        for b, k in enumerate(steps_per_row):
            logits[b, EOS if step == k else 5] = 10.0
        return logits

    return rule


@pytest.mark.parametrize("pad", [PAD, EOS])
def test_stops_on_eos_pads_after_and_stops_early(pad):
    model = MockLM(eos_at([1, 3, 0]))
    out = run(model, temperature=0.0, pad_token_id=pad, max_new_tokens=10)
    assert model.calls == 4 and out.steps == 4  # all rows done after step 3: no call for the rest
    ids = out.response_ids
    assert ids.tolist() == [[5, EOS, pad, pad], [5, 5, 5, EOS], [EOS, pad, pad, pad]]
    mask = response_mask(ids, EOS)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]  # EOS included, also when pad == eos
    assert (out.logprobs[~mask] == 0).all() and (out.logprobs[mask] < 0).all()


def test_min_new_tokens_forbids_eos_before_the_minimum():
    def always_eos(s, b):
        return torch.zeros(b, V).index_fill(1, torch.tensor([EOS]), 10.0)

    out = run(MockLM(always_eos), temperature=0.0, min_new_tokens=3, max_new_tokens=10)
    assert out.steps == 4
    assert out.response_ids[:, 3].tolist() == [EOS] * 3
    assert (out.response_ids[:, :3] != EOS).all()


def test_truncated_rows_get_no_eos_appended():
    out = run(MockLM(eos_at([1, 99, 99])), temperature=0.0, max_new_tokens=5)
    assert out.response_ids.shape == (3, 5)
    assert out.response_ids[1].tolist() == [5] * 5 and EOS not in out.response_ids[2].tolist()


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.05, 0.3, 0.1, 0.04, 0.03, 0.03]]))
    kept_k = torch.isfinite(filter_logits(logits, top_k=3))
    assert kept_k.nonzero()[:, 1].tolist() == [1, 3, 4]
    kept_p = torch.isfinite(filter_logits(logits, top_p=0.7))
    assert kept_p.nonzero()[:, 1].tolist() == [1, 3]  # 0.4 + 0.3 reaches 0.7
    kept_tiny_p = torch.isfinite(filter_logits(logits, top_p=0.01))
    assert kept_tiny_p.nonzero()[:, 1].tolist() == [1]  # the most likely token always stays
    torch.manual_seed(0)
    out = run(MockLM(lambda s, b: logits.expand(b, V).clone()), top_p=0.7, max_new_tokens=20, eos_token_id=[99])
    assert set(out.response_ids.flatten().tolist()) == {1, 3}


def test_sampling_config_validates():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingConfig(max_new_tokens=4, min_new_tokens=5)


@pytest.fixture(scope="module")
def policy():
    from align.models.policy import PolicyModel

    return PolicyModel("tiny", seed=3)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_match_policy_score(policy, temperature):
    from align.data.chat import ChatEncoder

    enc = ChatEncoder(policy.tokenizer)
    prompt_ids = [enc.prompt_ids([{"role": "user", "content": c}]) for c in ("sort: d a c b", "sort: a b")]
    torch.manual_seed(0)
    rollout = make_engine(max_new_tokens=12, temperature=temperature, top_k=50).generate(policy, prompt_ids, 3)
    n, r = rollout.response_ids.shape
    assert n == 6 and rollout.prompt_index.tolist() == [0, 0, 0, 1, 1, 1] and rollout.group_size == 3
    assert rollout.prompt_ids.shape[0] == 6 and len(rollout.texts) == 6
    assert rollout.truncated.tolist() == (~(rollout.response_ids == policy.tokenizer.eos_token_id).any(1)).tolist()
    assert set(rollout.metrics) == {
        "rollout/tokens_per_s",
        "rollout/response_length",
        "rollout/truncated_frac",
        "rollout/completion_tokens",
    }
    assert rollout.metrics["rollout/completion_tokens"] == int(rollout.response_mask.sum())
    with torch.no_grad():
        scores = policy.token_logprobs(
            rollout.input_ids, rollout.attention_mask, response_length=r, temperature=temperature
        )
    m = rollout.response_mask
    torch.testing.assert_close(rollout.old_logprobs[m], scores.logprobs[m], atol=1e-4, rtol=1e-4)
    assert policy.training  # restored after sampling in eval mode
