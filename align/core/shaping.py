"""Reward terms shaped by a response's form rather than its content: DAPO's soft overlong punishment.

* :func:`overlong_penalty`: Yu et al. 2025 (arXiv 2503.14476, eq. 13), a reward term in ``[-1, 0]`` by response
  length, which the sampler adds to the rewards (``model.overlong``).
"""

from __future__ import annotations

import torch

__all__ = ["overlong_penalty"]


@torch.no_grad()
def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), per response.

    With ``L_max = max_length`` and ``L_cache = buffer``::

        0                                   |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
        -1                                  |y| > L_max

    The penalty falls linearly from 0 to -1 across the last ``buffer`` tokens before ``max_length``. With
    ``buffer == 0`` it is a hard cut: 0 up to ``max_length``, -1 beyond.

    Args:
        lengths: ``(B,)`` response lengths in tokens (the response mask's sum, the stop token included).
        max_length: ``L_max``; ``buffer``: ``L_cache``, ``0 <= buffer <= max_length``.

    Returns:
        ``(B,)`` float32 penalties in ``[-1, 0]``.
    """
    if not 0 <= buffer <= max_length:
        raise ValueError(
            f"overlong_penalty: expected 0 <= buffer <= max_length, got buffer {buffer}, max_length {max_length}"
        )
    lengths = lengths.to(torch.float32)
    start = float(max_length - buffer)
    ramp = (start - lengths) / max(buffer, 1)  # (B,) only used where start < |y| <= max_length
    penalty = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_length, torch.full_like(lengths, -1.0), penalty)
