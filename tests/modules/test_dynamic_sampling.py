"""DAPO's dynamic sampling (align.rollout.filter, align.rollout.source.FilteredSource) and the overlong penalty in the
RL base's rewards."""

import threading

import pytest
import torch
from _helpers import PROMPTS, prompt_batch, standalone

from align.core.shaping import overlong_penalty
from align.errors import AlignConfigError, NoLearningSignalError
from align.models.policy import PolicyModel
from align.modules.grpo import GRPOModule
from align.modules.options import GroupAdvantages, OverlongPenalty, Updates
from align.rollout.engine import SamplingConfig
from align.rollout.filter import GroupFilter, concat_rollouts, informative_groups
from align.rollout.source import FilteredSource
from align.rollout.types import Rollout, Scored

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


# ---------------------------------------------------------------- in GRPO


def prompt_dependent_reward(prompts, completions, **kw):
    """Constant for the second prompt (no signal), completion-dependent for the others."""
    return [1.0 if p == PROMPTS[1] else float(len(c) % 3) for p, c in zip(prompts, completions)]


def make_module(**kw):
    defaults = dict(
        policy=PolicyModel("tiny", seed=2),
        rewards=[prompt_dependent_reward],
        group_size=4,
        sampling=SamplingConfig(max_new_tokens=6),
        log_entropy=False,
        updates=Updates(max_grad_norm=None),
        source=FilteredSource(max_batches=3),
    )
    return GRPOModule(**{**defaults, **kw})


def test_grpo_fills_the_batch_before_one_optimizer_step():
    module = make_module()
    opt = standalone(module)
    torch.manual_seed(0)
    steps = []
    for i in range(3):
        module.training_step(prompt_batch(module.policy), i)
        steps.append(len(opt.grads))
    # 4 prompts per batch, one always uninformative: the first batch buffers at most 3 groups, the second fills it.
    assert steps[0] == 0 and steps[1] == 1
    m = module.last_metrics
    assert m["rollout/kept_groups"] == 4 and m["rollout/sampling_batches"] == 2 and m["rollout/zero_std_frac"] == 0
    assert m["rollout/kept_frac"] <= 6 / 8 and module.rl_counters == {"rollouts": 3, "updates": steps[2]}
    assert m["time/generation_s"] > 0 and "train/loss" in m


def constant_reward(prompts, completions, **kw):
    return [0.0] * len(completions)


def test_a_run_with_no_informative_group_stops_after_twice_the_cap():
    # Every fill ends at the cap with nothing to train on; trainer.max_steps, which counts updates, is never
    # reached, so after 2 * max_batches such batches the run stops on one line.
    module = make_module(rewards=[constant_reward], source=FilteredSource(max_batches=2))
    standalone(module)
    assert module.max_batches_without_update == 50  # the floor; 2 * max_batches is lower here
    module.max_batches_without_update = 4
    batch = prompt_batch(module.policy, PROMPTS[:2])
    for step in range(3):
        module.training_step(batch, step)
    with pytest.raises(
        NoLearningSignalError,
        match="dynamic sampling: no update could be filled with groups whose "
        "rewards differ in 4 training batches in a row",
    ):
        module.training_step(batch, 3)
    assert module.rl_counters["updates"] == 0


def test_bad_dynamic_sampling_and_overlong_settings_fail_on_one_line():
    with pytest.raises(AlignConfigError, match=r"^model\.source\.reward: expected one of the rewards"):
        make_module(source=FilteredSource(reward="accuracy"))
    with pytest.raises(AlignConfigError, match=r"^model\.source\.max_batches: expected >= 1"):
        FilteredSource(max_batches=0)
    with pytest.raises(AlignConfigError, match=r"^model\.overlong\.buffer: expected <= sampling\.max_new_tokens \(6\)"):
        make_module(overlong=OverlongPenalty(buffer=8))
    with pytest.raises(AlignConfigError, match=r"^model\.group_size: expected >= 2"):
        make_module(group_size=1)
    with pytest.raises(AlignConfigError, match=r"^model\.source: FilteredSource .* needs model\.group_size >= 2"):
        make_module(group_size=1, advantages=GroupAdvantages(estimator="reinforce_pp"))


def named_overlong(prompts, completions, **kw):
    return [0.0] * len(completions)


named_overlong.__name__ = "overlong"


def test_overlong_penalty_is_a_reward_part_and_in_the_total():
    module = make_module(overlong=OverlongPenalty(buffer=3, coef=0.5), source=None)
    torch.manual_seed(0)
    batch = prompt_batch(module.policy)
    rollout = module.sampler.rollout(batch)
    total, parts = module.sampler.score(batch, rollout)
    expected = overlong_penalty(rollout.response_lengths, 6, 3)
    assert (expected < 0).any()  # the random tiny model runs into the ramp
    torch.testing.assert_close(parts["overlong"], expected)
    torch.testing.assert_close(total, parts["prompt_dependent_reward"] + 0.5 * expected)
    assert "rollout/reward/overlong" in module.sampler.rollout_metrics(Scored(rollout, total, parts))
    with pytest.raises(AlignConfigError, match=r"^model\.rewards: the name 'overlong'"):
        make_module(rewards=[named_overlong], overlong=OverlongPenalty(buffer=3))
