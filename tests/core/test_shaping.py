import pytest
import torch

from align.core.shaping import overlong_penalty


def test_overlong_penalty_pinned_at_the_boundaries():
    # L_max 16, L_cache 4: no penalty up to 12 tokens, then -1/4 per token down to -1 at 16, -1 beyond.
    lengths = torch.tensor([0, 11, 12, 13, 14, 15, 16, 17, 40])
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_length=16, buffer=4), expected)


def test_overlong_penalty_paper_setting_and_hard_cut():
    # The paper's setting: L_max 16384 (expected length), L_cache 4096, generation allowed up to 20480.
    pen = overlong_penalty(torch.tensor([12288, 13312, 16384, 20480]), max_length=16384, buffer=4096)
    torch.testing.assert_close(pen, torch.tensor([0.0, -0.25, -1.0, -1.0]))
    # buffer 0: a hard cut (0 up to max_length, -1 beyond); buffer == max_length: the ramp starts at 0 tokens.
    torch.testing.assert_close(overlong_penalty(torch.tensor([8, 9]), 8, 0), torch.tensor([0.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(torch.tensor([0, 2, 8]), 8, 8), torch.tensor([0.0, -0.25, -1.0]))


def test_overlong_penalty_rejects_a_buffer_longer_than_max_length():
    with pytest.raises(ValueError, match="buffer <= max_length"):
        overlong_penalty(torch.tensor([1]), max_length=4, buffer=5)
