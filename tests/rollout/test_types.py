"""What flows out of the rollout layer (align.rollout.types): a rollout's rows read as ids, attention mask and
response lengths (single-turn and multi-turn), and its state as a checkpoint stores it, read back and moved."""

import io

import torch

from align.rollout.types import Rollout, Scored, rollout_from_state, rollout_state, rollout_to


def two_rows(**extra) -> Rollout:
    """Two rows: prompts ``[0, 5]`` (left-padded) and ``[6, 7]``; responses of 2 and 3 tokens of width 3."""
    return Rollout(
        prompt_ids=torch.tensor([[0, 5], [6, 7]]),
        prompt_mask=torch.tensor([[0, 1], [1, 1]]),
        response_ids=torch.tensor([[8, 2, 0], [9, 9, 2]]),
        response_mask=torch.tensor([[True, True, False], [True, True, True]]),
        old_logprobs=torch.tensor([[-0.5, -0.25, 0.0], [-1.0, -0.5, -0.125]]),
        truncated=torch.tensor([False, False]),
        texts=["a", "b b"],
        prompt_index=torch.tensor([0, 0]),
        group_size=2,
        generation_seconds=1.5,
        **extra,
    )


def test_a_single_turn_rows_ids_mask_and_lengths():
    rollout = two_rows()
    assert len(rollout) == 2
    assert rollout.input_ids.tolist() == [[0, 5, 8, 2, 0], [6, 7, 9, 9, 2]]
    assert rollout.attention_mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert rollout.response_lengths.tolist() == [2, 3]
    assert (rollout.policy_version, rollout.metrics, rollout.episodes) == (0, {}, None)


def test_a_multi_turn_row_attends_to_the_environments_tokens_and_counts_only_the_policys():
    # Row 1: the policy's token, an environment reply of one token (in the context, not the response), the policy's.
    rollout = two_rows(context_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
    rollout.response_mask = torch.tensor([[True, True, False], [True, False, True]])
    assert rollout.attention_mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert rollout.response_lengths.tolist() == [2, 2]


def test_the_state_holds_plain_containers_and_reads_back_through_a_weights_only_load():
    rollout = two_rows(policy_version=3, token_versions=torch.tensor([[3, 3, 0], [3, 4, 4]]), metrics={"x": 1.0})
    buffer = io.BytesIO()
    torch.save(rollout_state(rollout), buffer)
    buffer.seek(0)
    back = rollout_from_state(torch.load(buffer, weights_only=True))
    for name, value in vars(rollout).items():
        other = getattr(back, name)
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, name
    assert back.correction_weights is None and back.texts == ["a", "b b"]


def test_moving_a_rollout_moves_every_tensor_and_returns_it_unchanged_when_already_there():
    rollout = two_rows(engine_logprobs=torch.zeros(2, 3))
    assert rollout_to(rollout, "cpu") is rollout
    moved = rollout_to(rollout, "meta")
    assert moved is not rollout and moved.texts is rollout.texts
    tensors = {k: v for k, v in vars(moved).items() if isinstance(v, torch.Tensor)}
    assert "engine_logprobs" in tensors and all(t.device.type == "meta" for t in tensors.values())
    assert rollout.response_ids.device.type == "cpu"  # the original is left where it was
    assert rollout_from_state(rollout_state(rollout), "meta").prompt_ids.device.type == "meta"


def test_a_scored_rollout_starts_with_no_timings():
    scored = Scored(two_rows(), torch.tensor([1.0, 0.0]), {"r": torch.tensor([1.0, 0.0])})
    assert scored.timings == {} and scored.rewards.tolist() == [1.0, 0.0]
