"""Padding-free layouts (``align.packing``): which sequences share a row, and the packed rows of a padded batch,
pinned by hand."""

import pytest
import torch

from align.packing import first_fit_decreasing, pack_scored_rows


def test_first_fit_decreasing_pinned():
    # Longest first: 6 -> bin A (room 2), 5 -> B (3), 4 -> C (4), 3 -> B (0), 2 -> A (0).
    assert first_fit_decreasing([5, 3, 4, 2, 6], 8) == [[0, 1], [2], [3, 4]]
    assert first_fit_decreasing([9, 1], 8) == [[0], [1]]  # too long for any bin: one of its own
    assert first_fit_decreasing([], 8) == []


def test_pack_scored_rows_pinned():
    # Two rows laid out as [left-padded prompt (3) | right-padded response (2)], pad id 0.
    input_ids = torch.tensor([[0, 7, 8, 9, 0],
                              [5, 6, 1, 2, 3]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 0],
                                   [1, 1, 1, 1, 1]])
    scored = torch.tensor([[0, 0, 0, 1, 0],  # row 0's response is the one token 9
                           [0, 0, 0, 1, 1]])  # row 1's is 2, 3
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


@pytest.mark.parametrize("mask, scored, message", [
    ([[1, 0, 1]], [[0, 0, 1]], "not contiguous"),
    ([[1, 1, 0]], [[0, 0, 1]], "padding or a row's first token"),
    ([[0, 1, 1]], [[0, 1, 1]], "padding or a row's first token"),
])
def test_pack_scored_rows_refuses_layouts_it_cannot_pack(mask, scored, message):
    with pytest.raises(ValueError, match=message):
        pack_scored_rows(torch.tensor([[3, 4, 5]]), torch.tensor(mask), torch.tensor(scored))
    with pytest.raises(ValueError, match="more than the width 2"):
        pack_scored_rows(torch.tensor([[3, 4, 5]]), torch.ones(1, 3), torch.zeros(1, 3), width=2)
