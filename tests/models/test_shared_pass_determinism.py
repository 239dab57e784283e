"""The hidden states a shared-prompt scoring pass hands to each row (:func:`align.models.shared_pass.rows_of`)
have the same gradient on every call at 2 threads."""

import torch

from align.models.shared_pass import rows_of


def test_rows_of_is_the_indexed_positions():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)
    flat = torch.tensor([[5, 2], [2, 0]])  # (piece 1, position 2), (0, 2); (0, 2) again, (0, 0)
    expected = hidden[torch.tensor([[1, 0], [0, 0]]), torch.tensor([[2, 2], [2, 0]])]
    torch.testing.assert_close(rows_of(hidden, flat), expected)


def test_rows_of_sums_repeated_positions_the_same_way_on_every_call(two_threads):
    # 2048 rows x 30 positions x 64 wide, drawn from 2 x 3 positions: far above the 32768 elements from which
    # torch's CPU gradient of advanced indexing (hidden[piece, position]) adds repeats with atomics from both threads,
    # and long enough for the threads to overlap: with it, every call differed from the first.
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 40, 64, generator=g)
    flat = torch.randint(0, 2, (2048, 1), generator=g) * 40 + torch.randint(0, 3, (2048, 30), generator=g)
    upstream = torch.randn(2048, 30, 64, generator=g)

    def gradient() -> torch.Tensor:
        leaf = hidden.clone().requires_grad_()
        rows_of(leaf, flat).backward(upstream)
        return leaf.grad

    first = gradient()
    assert all(torch.equal(first, gradient()) for _ in range(8))
    summed = torch.zeros(80, 64, dtype=torch.float64).index_add_(0, flat.reshape(-1), upstream.reshape(-1, 64).double())
    torch.testing.assert_close(first, summed.float().view_as(hidden), atol=1e-2, rtol=1e-3)  # ~10000 terms each
    assert not torch.are_deterministic_algorithms_enabled()  # switched on for the sum only
