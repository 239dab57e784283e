"""DAPO's dynamic sampling filter (align.rollout.filter): informative groups, rollouts joined (prompts padded left,
responses right, groups renumbered, the oldest policy version kept), and the group filter filling an update across
batches, through a checkpoint, on a named reward part, at its cap and on several ranks."""

import sys
import threading
from pathlib import Path

import pytest
import torch

from align.models.policy import PolicyModel
from align.rollout.engine import SamplingConfig
from align.rollout.filter import GroupFilter, concat_rollouts, informative_groups
from align.rollout.rewards import training_rewards
from align.rollout.sampler import Sampler
from align.rollout.types import Rollout

sys.path.insert(0, str(Path(__file__).parents[1] / "modules"))
from _helpers import PROMPTS, length_reward, prompt_batch  # noqa: E402


@pytest.fixture(scope="module")
def policy():
    return PolicyModel("tiny-sort")


def sampler_of(policy, group_size=2, **kw) -> Sampler:
    reward, _ = training_rewards([length_reward], None, None)
    return Sampler(policy, reward, group_size, SamplingConfig(max_new_tokens=6), **kw)


PAD = 0


def fake_rollout(lengths, prompt_width=2, width=None, group_size=2):
    """Rows of response ``lengths`` (token ids 10 + row), prompts of ``prompt_width`` tokens (ids 100 + row)."""
    n, width = len(lengths), width or max(lengths)
    response_mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # (N, R)
    response_ids = torch.where(response_mask, 10 + torch.arange(n)[:, None], PAD)
    return Rollout(
        prompt_ids=(100 + torch.arange(n))[:, None].repeat(1, prompt_width),
        prompt_mask=torch.ones(n, prompt_width, dtype=torch.long),
        response_ids=response_ids,
        response_mask=response_mask,
        old_logprobs=-response_mask.float(),
        truncated=torch.tensor(lengths) >= width,
        texts=[f"t{i}" for i in range(n)],
        prompt_index=torch.arange(n // group_size).repeat_interleave(group_size),
        group_size=group_size,
        generation_seconds=1.0,
    )


def test_informative_groups_pinned():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 1e-8])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, False]
    assert informative_groups(rewards, 4).tolist() == [True, True]


def test_concat_pads_prompts_left_and_responses_right_and_renumbers_groups():
    a, b = fake_rollout([1, 2], prompt_width=1), fake_rollout([3, 1, 2, 2], prompt_width=3)
    out = concat_rollouts([a, b], PAD)
    assert out.prompt_ids.shape == (6, 3) and out.response_ids.shape == (6, 3)
    assert out.prompt_mask[0].tolist() == [0, 0, 1] and out.prompt_ids[0].tolist() == [PAD, PAD, 100]
    assert out.response_mask[1].tolist() == [True, True, False] and out.old_logprobs[1].tolist() == [-1.0, -1.0, 0.0]
    assert out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2] and out.texts[2] == "t0"
    assert out.generation_seconds == 2.0 and out.response_lengths.tolist() == [1, 2, 3, 1, 2, 2]


def test_fills_across_batches_then_returns_exactly_the_target_and_clears():
    f = GroupFilter(group_size=2, max_batches=5)
    r1 = fake_rollout([1, 4, 3, 3, 2, 2])  # 3 groups, width 4: row 1 is truncated
    # rewards: group 0 informative, group 1 all equal, group 2 informative
    assert f.add(r1, torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0, 2.0]), {}, target=3, pad_token_id=PAD) is None
    assert f.buffered_groups == 2 and f.filling
    r2 = fake_rollout([5, 6, 1, 1, 3, 3], width=7)
    out = f.add(r2, torch.tensor([3.0, 4.0, 5.0, 6.0, 0.0, 0.0]), {}, target=3, pad_token_id=PAD)
    assert out is not None and not f.filling and f.buffer == []
    # 4 informative groups buffered, 3 trained on: r1's groups 0 and 2, then r2's group 0; r2's group 1 dropped.
    assert out.rewards.tolist() == [0.0, 1.0, 0.0, 2.0, 3.0, 4.0]
    assert out.rollout.response_lengths.tolist() == [1, 4, 2, 2, 5, 6] and out.rollout.prompt_index.tolist() == [
        0,
        0,
        1,
        1,
        2,
        2,
    ]
    m = out.rollout.metrics
    assert (m["rollout/sampling_batches"], m["rollout/kept_groups"], m["rollout/kept_frac"]) == (
        2.0,
        3.0,
        pytest.approx(4 / 6),
    )
    assert m["rollout/completion_tokens"] == 15 + 19 and m["rollout/tokens_per_s"] == 34 / 2.0
    assert m["rollout/response_length"] == pytest.approx(20 / 6) and m["rollout/truncated_frac"] == pytest.approx(1 / 6)


def test_a_fill_in_progress_survives_a_checkpoint_round_trip():
    import io

    first, second = fake_rollout([1, 2, 3, 4]), fake_rollout([2, 1, 1, 1], prompt_width=3, width=6)
    runs = []
    for resume in (False, True):
        f = GroupFilter(group_size=2, max_batches=3)
        assert f.add(first, torch.tensor([0.0, 1.0, 1.0, 1.0]), {"x": torch.arange(4.0)}, 2, PAD) is None
        if resume:  # as a checkpoint stores it: weights-only torch.save / torch.load
            buffer = io.BytesIO()
            torch.save({"fill": f.state_dict()}, buffer)
            buffer.seek(0)
            f = GroupFilter(group_size=2, max_batches=3)
            f.load_state_dict(torch.load(buffer, weights_only=True)["fill"])
            assert f.filling and f.buffered_groups == 1
        runs.append(f.add(second, torch.tensor([1.0, 0.0, 5.0, 5.0]), {"x": torch.arange(4.0)}, 2, PAD))
    plain, resumed = runs
    assert plain.rollout.metrics == resumed.rollout.metrics and plain.rollout.texts == resumed.rollout.texts
    for name in ("input_ids", "attention_mask", "response_mask", "old_logprobs", "prompt_index"):
        assert torch.equal(getattr(plain.rollout, name), getattr(resumed.rollout, name)), name
    assert torch.equal(plain.rewards, resumed.rewards) and torch.equal(plain.parts["x"], resumed.parts["x"])


def test_filters_on_a_named_reward_part():
    f = GroupFilter(group_size=2, max_batches=1, reward="acc")
    totals = torch.tensor([0.0, 1.0, 0.5, 0.5])  # the totals differ in group 0 only
    out = f.add(fake_rollout([1, 1, 1, 1]), totals, {"acc": torch.tensor([1.0, 1.0, 0.0, 1.0])}, 2, PAD)
    assert out.rewards.tolist() == [0.5, 0.5] and out.parts["acc"].tolist() == [0.0, 1.0]


def test_at_the_cap_updates_on_what_it_has_or_skips_when_nothing():
    f = GroupFilter(group_size=2, max_batches=2)
    same = torch.ones(4)
    assert f.add(fake_rollout([1, 2, 3, 4]), torch.tensor([0.0, 1.0, 1.0, 1.0]), {}, 2, PAD) is None
    out = f.add(fake_rollout([1, 2, 3, 4]), same, {}, 2, PAD)
    assert out.rollout.metrics["rollout/kept_groups"] == 1.0 and len(out.rollout) == 2
    assert f.add(fake_rollout([1, 1, 1, 1]), same, {}, 2, PAD) is None
    assert f.add(fake_rollout([1, 1, 1, 1]), same, {}, 2, PAD) is None and not f.filling  # skipped, cleared


def test_ranks_update_together_on_the_smallest_count():
    """Two ranks (threads summing each other's tensors): rank 1 finds no informative group in the first batch, so
    neither updates; at the cap both train on the same number of groups."""
    barrier, slots, out = threading.Barrier(2, timeout=10), [None, None], [[], []]

    def rank(r, batches):
        def all_reduce(t):
            slots[r] = t
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total

        f = GroupFilter(group_size=2, max_batches=2)
        for rewards in batches:
            filled = f.add(fake_rollout([1, 2, 3, 4]), torch.tensor(rewards), {}, 2, PAD, all_reduce, r, 2)
            out[r].append(
                None if filled is None else (len(filled.rollout), filled.rollout.metrics["rollout/kept_frac"])
            )

    batches = ([[0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0]], [[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    threads = [threading.Thread(target=rank, args=(r, b)) for r, b in enumerate(batches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # rank 0 had 2 groups after batch 1 (its target) but rank 1 had none: wait. At the cap rank 1 has 1: both take 1.
    assert out == [[None, (2, 5 / 8)], [None, (2, 5 / 8)]]


def test_joined_rollouts_keep_the_oldest_policy_version(policy):
    sampler = sampler_of(policy)
    batch = prompt_batch(policy, PROMPTS[:2])
    first = sampler.rollout(batch)
    second = sampler.rollout(batch, version=3)
    joined = concat_rollouts([second, first], policy.tokenizer.pad_token_id)
    assert (first.policy_version, second.policy_version, joined.policy_version) == (0, 3, 0)
