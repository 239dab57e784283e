"""Partial rollouts: rows cut when newer weights arrive are discarded and generated again, or continued under the
new weights with each token tagged by version; every token's log-prob is the one of the weights that sampled it."""

import pytest
import torch

from align.models.policy import PolicyModel
from align.rollout.engine import NativeEngine, SamplingConfig, make_engine
from align.rollout.partial import decode_with_cuts

PROMPTS = ["sort: d a c b", "sort: b a", "sort: c c a", "sort: j e f g"]


@pytest.fixture(scope="module")
def policy():
    return PolicyModel("tiny-sort")


def contexts(policy, engine, group=2):
    from align.data.chat import ChatEncoder

    enc = ChatEncoder(policy.tokenizer)
    return engine.contexts(policy, [enc.prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS], group)


class Updates:
    """``newer()`` turns true at the ``at``-th token; ``take_newer()`` nudges the weights (a new version)."""

    def __init__(self, policy, at: int):
        self.policy, self.at, self.calls, self.version, self.snapshots = policy, at, 0, 0, []

    def newer(self) -> bool:
        self.calls += 1
        return self.calls == self.at

    def take_newer(self) -> int:
        self.snapshots.append({k: v.clone() for k, v in self.policy.state_dict().items()})
        with torch.no_grad():
            for p in self.policy.parameters():
                p.add_(0.02 * torch.randn_like(p))
        self.version += 1
        return self.version


def logprobs_under(policy, ids, mask, response):
    full = torch.cat([ids, response], dim=1)
    attention = torch.cat([mask, torch.ones_like(response)], dim=1)
    with torch.no_grad():
        return policy.token_logprobs(full, attention, response_length=response.shape[1]).logprobs


def test_without_a_cut_it_is_the_engines_generation(policy):
    engine = make_engine(SamplingConfig(max_new_tokens=8, temperature=1.0))
    ids, mask, _ = contexts(policy, engine)
    out, versions, stats = decode_with_cuts(
        engine, policy, ids, mask, 2, torch.Generator().manual_seed(3), lambda: False, None, 5, "continue"
    )
    with engine.decoding(policy, ids.shape[1] + 8) as decode:
        plain = decode(ids, mask, max_new_tokens=8, generator=torch.Generator().manual_seed(3), shared_prefix=2)
    assert torch.equal(out.response_ids, plain.response_ids) and torch.equal(out.logprobs, plain.logprobs)
    assert (versions == 5).all() and stats == {"rollout/interrupted_rows": 0.0, "rollout/discarded_tokens": 0.0}


@pytest.mark.parametrize("partial", ["continue", "discard"])
def test_cut_rows_are_continued_or_regenerated_under_the_new_weights(policy, partial):
    torch.manual_seed(0)
    engine = NativeEngine(fast_decoder=False).bound(SamplingConfig(max_new_tokens=10, temperature=1.0))
    ids, mask, _ = contexts(policy, engine)
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    updates = Updates(policy, at=3)
    try:
        out, versions, stats = decode_with_cuts(
            engine,
            policy,
            ids,
            mask,
            2,
            torch.Generator().manual_seed(1),
            updates.newer,
            updates.take_newer,
            0,
            partial,
        )
        new = logprobs_under(policy, ids, mask, out.response_ids)
        policy.load_state_dict(original)
        old = logprobs_under(policy, ids, mask, out.response_ids)
    finally:
        policy.load_state_dict(original)
    stop = policy.tokenizer.eos_token_id
    mask_r = torch.cumsum((out.response_ids == stop).long(), 1) - (out.response_ids == stop).long() == 0
    cut = versions.max(dim=1).values == 1
    assert stats["rollout/interrupted_rows"] == float(cut.sum()) > 0
    # Each token's log-prob is the one of the version that sampled it (a row finished before the cut: version 0).
    expected = torch.where(versions == 1, new, old)
    assert torch.allclose(out.logprobs[mask_r], expected[mask_r], atol=1e-4)
    if partial == "continue":  # the first 3 tokens of a cut row are the old weights', the rest the new ones'
        assert (versions[cut, :3] == 0).all() and (versions[cut, 3:] == 1).all()
        assert stats["rollout/discarded_tokens"] == 0
    else:  # a cut row starts again: every token of it is the new weights'
        assert (versions[cut] == 1).all() and stats["rollout/discarded_tokens"] == 3 * float(cut.sum())
    assert (versions[~cut] == 0).all()
