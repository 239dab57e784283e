"""Padding-free layouts (``align.core.packing``): which sequences share a row, and the packed rows of a padded batch,
pinned by hand."""

import pytest
import torch

from align.core.packing import (
    common_prefix,
    first_fit_decreasing,
    pack_scored_rows,
    share_prompts,
    split_groups,
    token_budget_chunks,
)


def test_first_fit_decreasing_pinned():
    # Longest first: 6 -> bin A (room 2), 5 -> B (3), 4 -> C (4), 3 -> B (0), 2 -> A (0).
    assert first_fit_decreasing([5, 3, 4, 2, 6], 8) == [[0, 1], [2], [3, 4]]
    assert first_fit_decreasing([9, 1], 8) == [[0], [1]]  # too long for any bin: one of its own
    assert first_fit_decreasing([], 8) == []


def test_token_budget_chunks_pinned():
    # widest first: 6 alone (6 + 5 would cost 2 x 6 = 12), then 5 and 4 (2 x 5 = 10), then 3 and 2 (2 x 3 = 6)
    assert token_budget_chunks([5, 3, 4, 2, 6], 10) == [[4], [0, 2], [1, 3]]
    assert token_budget_chunks([5, 3, 4, 2, 6], 10, max_rows=1) == [[4], [0], [2], [1], [3]]
    assert token_budget_chunks([5, 3, 4, 2, 6], 100) == [[0, 1, 2, 3, 4]]
    assert token_budget_chunks([5, 3, 4, 2, 6], 100, max_rows=2) == [[0, 4], [1, 2], [3]]
    assert token_budget_chunks([9, 1], 8) == [[0], [1]]  # wider than the budget: a micro-batch of its own
    assert token_budget_chunks([], 8) == []


def test_pack_scored_rows_pinned():
    # Two rows laid out as [left-padded prompt (3) | right-padded response (2)], pad id 0.
    input_ids = torch.tensor([[0, 7, 8, 9, 0], [5, 6, 1, 2, 3]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    scored = torch.tensor(
        [
            [0, 0, 0, 1, 0],  # row 0's response is the one token 9
            [0, 0, 0, 1, 1],
        ]
    )  # row 1's is 2, 3
    packed = pack_scored_rows(input_ids, attention_mask, scored)  # width 5: the rows (3 and 5 tokens) cannot share
    assert packed.input_ids.tolist() == [[7, 8, 9, 0, 0], [5, 6, 1, 2, 3]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert packed.targets.tolist() == [[-100, 9, -100, -100, -100], [-100, -100, 2, 3, -100]]
    assert packed.source.tolist() == [0, 1, 1]
    last = torch.tensor([3, 4])  # each row's last real token, by its padded position
    assert packed.locate(last).tolist() == [2, 9]  # row 0 starts bin 0 at 0, row 1 bin 1 (flattened, 5 per bin)
    assert packed.input_ids.flatten()[packed.locate(last)].tolist() == [9, 3]
    torch.testing.assert_close(packed.row_sums(torch.tensor([1.0, 10.0, 100.0])), torch.tensor([1.0, 110.0]))

    wide = pack_scored_rows(input_ids, attention_mask, scored, width=9, pad_token_id=4)  # both fit in one row
    assert wide.input_ids.tolist() == [[7, 8, 9, 5, 6, 1, 2, 3, 4]]
    assert wide.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0]]
    assert wide.targets.tolist() == [[-100, 9, -100, -100, -100, 2, 3, -100, -100]]
    assert wide.source.tolist() == [0, 1, 1]
    assert wide.locate(last).tolist() == [2, 7]
    assert wide.input_ids.flatten()[wide.locate(last)].tolist() == [9, 3]


@pytest.mark.parametrize(
    "mask, scored, message",
    [
        ([[1, 0, 1]], [[0, 0, 1]], "not contiguous"),
        ([[1, 1, 0]], [[0, 0, 1]], "padding or a row's first token"),
        ([[0, 1, 1]], [[0, 1, 1]], "padding or a row's first token"),
    ],
)
def test_pack_scored_rows_refuses_layouts_it_cannot_pack(mask, scored, message):
    with pytest.raises(ValueError, match=message):
        pack_scored_rows(torch.tensor([[3, 4, 5]]), torch.tensor(mask), torch.tensor(scored))
    with pytest.raises(ValueError, match="more than the width 2"):
        pack_scored_rows(torch.tensor([[3, 4, 5]]), torch.ones(1, 3), torch.zeros(1, 3), width=2)


def test_share_prompts_lays_out_each_prompt_once_by_hand():
    # Rows 0 and 2 share prompt [pad 5 6], rows 1 and 3 share [11 12 13]; P = 3, R = 3, so each row feeds its
    # first two response tokens (the last is only a target) after its group's prompt.
    ids = torch.tensor([[0, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 0], [0, 5, 6, 17, 0, 0], [11, 12, 13, 24, 25, 26]])
    mask = (ids != 0).long()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    rows = share_prompts(ids, mask, positions, 3, torch.tensor([0, 1, 0, 1]), 2)
    assert rows.input_ids.tolist() == [[0, 5, 6, 7, 8, 17, 0], [11, 12, 13, 14, 15, 24, 25]]
    assert rows.position_ids.tolist() == [[0, 0, 1, 2, 3, 2, 2], [0, 1, 2, 3, 4, 3, 4]]
    # Row i's response is scored from the last prompt column, then from its own segment's columns.
    assert rows.index.tolist() == [[2, 3, 4], [2, 3, 4], [2, 5, 6], [2, 5, 6]]
    assert rows.group.tolist() == [0, 1, 0, 1]
    assert rows.attention_mask.shape == (2, 1, 7, 7)
    assert rows.attention_mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],  # left padding: itself only
        [0, 1, 0, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0, 0],
        [0, 1, 1, 1, 0, 0, 0],  # first response: the prompt and itself
        [0, 1, 1, 1, 1, 0, 0],
        [0, 1, 1, 0, 0, 1, 0],  # second response: the prompt and itself, not the first
        [0, 1, 1, 0, 0, 1, 0],  # its padding attends as in its padded row: the real tokens before it
    ]
    assert rows.attention_mask[1, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 1],
    ]


def test_share_prompts_groups_of_different_sizes_and_no_mask():
    ids = torch.arange(1, 5 * 4 + 1).view(5, 4)
    ids[:, :2] = torch.tensor([[1, 2], [3, 4], [1, 2], [1, 2], [3, 4]])  # P = 2: groups {0, 2, 3} and {1, 4}
    rows = share_prompts(ids, None, None, 2, torch.tensor([0, 1, 0, 0, 1]), 2)
    # The longest group has 3 rows of 1 fed token: 2 + 3 columns; the shorter group's last segment is empty.
    assert rows.input_ids.tolist() == [[1, 2, 3, 11, 15], [3, 4, 7, 19, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 2, 2], [0, 1, 2, 2, 0]]
    assert rows.index.tolist() == [[1, 2], [1, 2], [1, 3], [1, 4], [1, 3]]
    assert rows.attention_mask[1, 0, 4].tolist() == [True, True, False, False, False]  # the empty segment: unused


def test_common_prefix_moves_the_shared_tokens_to_the_front_by_hand():
    # Three left-padded prompts of 6 columns, then 2 response columns. Each starts with 7, 8; row 1 goes on with 9 as
    # row 0 does, row 2 with 6. The shortest prompt (row 0, 4 tokens) keeps at least one token of its own.
    ids = torch.tensor([[0, 0, 7, 8, 9, 5, 40, 41], [7, 8, 9, 4, 3, 2, 42, 43], [0, 7, 8, 6, 1, 1, 44, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 0]])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    C, order = common_prefix(ids, mask, pos, 6)
    assert C == 2
    assert order.tolist() == [[2, 3, 0, 1, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7], [1, 2, 0, 3, 4, 5, 6, 7]]
    assert ids.gather(1, order).tolist() == [
        [7, 8, 0, 0, 9, 5, 40, 41],
        [7, 8, 9, 4, 3, 2, 42, 43],
        [7, 8, 0, 6, 1, 1, 44, 0],
    ]
    assert mask.gather(1, order).tolist() == [
        [1, 1, 0, 0, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1, 1],
        [1, 1, 0, 1, 1, 1, 1, 0],
    ]
    # Each real token keeps its position; the shared ones are at the same positions in every row.
    assert pos.gather(1, order).tolist() == [
        [0, 1, 0, 0, 2, 3, 4, 5],
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 0, 2, 3, 4, 5, 5],
    ]


def test_common_prefix_limits():
    ids = torch.tensor([[7, 8, 9, 5, 40], [7, 8, 9, 5, 41]])
    # Two equal prompts without padding: all but each row's last prompt token, and no column moves.
    assert common_prefix(ids, None, None, 4) == (3, None)
    assert common_prefix(ids, torch.ones_like(ids), None, 4) == (3, None)
    # The same tokens at other positions are not shared.
    pos = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 5, 6, 7]])
    assert common_prefix(ids, None, pos, 4) == (2, None)
    # Nothing shared; one row; a prompt of one token; padding inside a prompt (not left-padded).
    assert common_prefix(torch.tensor([[1, 2, 3], [4, 2, 3]]), None, None, 2) == (0, None)
    assert common_prefix(ids[:1], None, None, 4) == (0, None)
    assert common_prefix(torch.tensor([[0, 7, 9], [7, 7, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]), None, 2) == (
        0,
        None,
    )
    assert common_prefix(ids, torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), None, 4) == (0, None)


def test_split_groups_cuts_each_group_in_row_order():
    # Group 0 holds rows 0, 1, 3, 5, 6; group 1 rows 2, 4; group 2 row 7. Pieces of at most 2 rows.
    piece, pieces = split_groups(torch.tensor([0, 0, 1, 0, 1, 0, 0, 2]), 3, 2)
    assert pieces == 5 and piece.tolist() == [0, 0, 3, 1, 3, 1, 2, 4]
    piece, pieces = split_groups(torch.tensor([1, 0, 1, 0]), 2, 5)
    assert pieces == 2 and piece.tolist() == [1, 0, 1, 0]
