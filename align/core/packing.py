"""Padding-free layouts: sequences of different lengths laid end to end in a few rows, with no padding between them.

A packed row holds several sequences, each with its own positions (restarting at 0). transformers reads the
restarts in ``position_ids`` (with no ``attention_mask``) as sequence boundaries and gives each sequence a causal
mask of its own, so no token attends across a boundary and every sequence gets the numbers it gets alone in a
padded row, to float rounding. What is saved is the arithmetic of the padding: a padded batch costs its longest
row times its row count.

:func:`token_budget_chunks` groups padded rows into micro-batches of at most a number of tokens (the RL
update's ``updates.max_tokens_per_microbatch``).

:func:`first_fit_decreasing` chooses which sequences share a row; SFT packs its dataset with it once
(:func:`align.data.sft.pack`), and :func:`pack_scored_rows` packs a padded batch at every step, for the preference
losses' sequence log-probs, the reward model's scores and the RL update's per-token log-probs and values
(``padding_free``).

The other layouts here serve a scoring pass in which tokens that several rows share run once
(:mod:`align.models.shared_pass`): :func:`share_prompts` lays out rows behind their shared columns,
:func:`split_groups` cuts groups of rows into pieces of a chosen size, and :func:`common_prefix` finds the tokens
that every prompt starts with and moves them to the front of each row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins whose lengths sum to at most ``capacity``: longest first, each into
    the first bin with room. A length above ``capacity`` gets a bin of its own. Each bin lists its indices in
    increasing order, and the bins are ordered by their smallest index (roughly the input order)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return sorted((sorted(members) for members in bins), key=min)


def token_budget_chunks(widths: Sequence[int], budget: int, max_rows: int | None = None) -> list[list[int]]:
    """Indices of ``widths`` (each row's padded width) grouped into micro-batches that each cost at most ``budget``
    tokens, counted as a padded micro-batch costs: its row count times its widest row. Widest rows first; each
    micro-batch takes the next rows while the cost of adding one stays within the budget (and, with ``max_rows``,
    its rows within that count). A row wider than the budget is a micro-batch of its own. Each micro-batch lists
    its indices in increasing order; micro-batches come widest first."""
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    chunks: list[list[int]] = []
    for i in order:
        chunk = chunks[-1] if chunks else None
        if chunk is None or (len(chunk) + 1) * widths[chunk[0]] > budget or (max_rows and len(chunk) >= max_rows):
            chunks.append([i])
        else:
            chunk.append(i)
    return [sorted(chunk) for chunk in chunks]


@dataclass
class PackedRows:
    """Rows of a padded batch laid end to end (see :func:`pack_scored_rows`)."""

    input_ids: torch.Tensor  # (K, C)
    position_ids: torch.Tensor  # (K, C) restarting at 0 at each sequence; the tail padding is a sequence of its own
    targets: torch.Tensor  # (K, C) the token each position predicts where that token is scored, else ignore_index
    source: torch.Tensor  # (N,) long: for each scored position, in row-major order, the padded row it came from
    num_rows: int  # rows of the padded batch
    origins: torch.Tensor  # (B,) long: each padded row's position 0 in the flattened (K * C) rows (see ``locate``)

    def row_sums(self, values: torch.Tensor) -> torch.Tensor:
        """``(num_rows,)`` sums of ``values`` ``(N,)`` (one per scored position, row-major) by padded row."""
        return values.new_zeros(self.num_rows).index_add(0, self.source, values)

    def locate(self, positions: torch.Tensor) -> torch.Tensor:
        """Indices into the flattened ``(K * C)`` packed rows of real tokens of the padded rows, given by their
        positions in those rows: ``(B,)`` (one per row) or ``(B, L)`` (``L`` per row). Only the indices of real
        tokens are meaningful."""
        return self.origins.view(-1, *([1] * (positions.dim() - 1))) + positions


def pack_scored_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    scored: torch.Tensor,
    width: int | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
) -> PackedRows:
    """Pack the real tokens of each row of a padded batch into rows of at most ``width`` tokens.

    ``input_ids``, ``attention_mask`` and ``scored`` are ``(B, T)``; ``scored`` marks the tokens whose log-prob is
    wanted (each is predicted by the real token before it, so a row's first real token cannot be scored). Each
    row's real tokens must be contiguous, as in a left-padded prompt followed by a right-padded response.
    ``width`` defaults to ``T``, so no packed row is longer than the padded one and attention costs no more.
    Positions that predict nothing scored get ``ignore_index`` (``PolicyModel.next_token_logprobs``' default).
    ``scored`` may be all false when the caller reads the rows' hidden states at places of its own
    (``PackedRows.locate``; the reward model reads each sequence's last token).
    """
    B, T = input_ids.shape
    width = T if width is None else int(width)
    real, scored = attention_mask.bool(), scored.bool()
    length = real.sum(-1)  # (B,)
    first = real.long().argmax(-1)  # (B,) each row's first real token
    end = T - real.flip(-1).long().argmax(-1)  # (B,) one past its last
    broken = ((end - first != length) & (length > 0)).nonzero()
    if len(broken):
        raise ValueError(f"pack_scored_rows: row {int(broken[0])}'s real tokens are not contiguous")
    if bool((scored & ~real).any()) or bool(scored.gather(1, first[:, None]).any()):
        raise ValueError("pack_scored_rows: a scored token is padding or a row's first token (nothing predicts it)")
    lengths, starts = length.tolist(), first.tolist()
    if max(lengths, default=0) > width:
        raise ValueError(f"pack_scored_rows: a row holds {max(lengths)} real tokens, more than the width {width}")
    bins = first_fit_decreasing(lengths, width)
    K = len(bins)
    ids = torch.full((K, width), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    positions = torch.zeros((K, width), dtype=torch.long, device=input_ids.device)
    targets = torch.full((K, width), ignore_index, dtype=torch.long, device=input_ids.device)
    owner = torch.full((K, width), -1, dtype=torch.long, device=input_ids.device)
    origins = torch.zeros(B, dtype=torch.long, device=input_ids.device)
    arange = torch.arange(width, device=input_ids.device)
    for k, members in enumerate(bins):
        at = 0
        for r in members:
            n, s = lengths[r], starts[r]
            ids[k, at : at + n] = input_ids[r, s : s + n]
            origins[r] = k * width + at - s
            positions[k, at : at + n] = arange[:n]
            if n > 1:  # position j predicts token j + 1
                hit = scored[r, s + 1 : s + n]
                targets[k, at : at + n - 1] = torch.where(hit, input_ids[r, s + 1 : s + n].long(), ignore_index)
                owner[k, at : at + n - 1] = torch.where(hit, r, -1)
            at += n
        positions[k, at:] = arange[: width - at]
    return PackedRows(ids, positions, targets, owner[targets != ignore_index], B, origins)


@dataclass
class SharedPromptRows:
    """Rows that share a prompt, laid out as one row per prompt: ``[prompt | response 1 | response 2 | ...]``.

    Each response sees the prompt and itself, never another response (``attention_mask``), and keeps its own
    positions, so each row's hidden states are those of its padded row alone. Shapes: ``U`` distinct prompts, ``L``
    columns, ``B`` original rows, ``R`` scored positions per original row."""

    input_ids: torch.Tensor  # (U, L)
    attention_mask: torch.Tensor  # (U, 1, L, L) bool: query attends to key
    position_ids: torch.Tensor  # (U, L)
    group: torch.Tensor  # (B,) the laid-out row of each original row
    index: torch.Tensor  # (B, R) columns whose hidden states predict each original row's last R tokens


def group_representatives(group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``(num_groups,)`` one row of each group, for ``group`` ``(B,)`` in ``[0, num_groups)`` with none empty."""
    rows = torch.arange(group.shape[0], device=group.device)
    return torch.zeros(num_groups, dtype=torch.long, device=group.device).scatter_(0, group, rows)


def _rank_in_group(group: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``(B,)`` each row's rank within its group, in row order, for ``group`` ``(B,)`` with ``counts`` rows each."""
    rows = torch.arange(group.shape[0], device=group.device)
    by_group = torch.argsort(group, stable=True)
    rank = torch.empty_like(group)
    rank[by_group] = rows - (torch.cumsum(counts, 0) - counts)[group[by_group]]
    return rank


def split_groups(group: torch.Tensor, num_groups: int, size: int) -> tuple[torch.Tensor, int]:
    """``(piece, num_pieces)``: each group of ``group`` ``(B,)`` (in ``[0, num_groups)``, none empty) cut into
    pieces of at most ``size`` rows, in row order; ``piece`` ``(B,)`` numbers them ``[0, num_pieces)`` by group."""
    counts = torch.bincount(group, minlength=num_groups)  # (U,)
    rank = _rank_in_group(group, counts)
    pieces = (counts + size - 1) // size  # (U,)
    piece = (torch.cumsum(pieces, 0) - pieces)[group] + rank // size
    return piece, int(pieces.sum())


def share_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    response_length: int,
    group: torch.Tensor,
    num_groups: int,
) -> SharedPromptRows:
    """Lay out rows whose first ``T - R`` columns are equal within each ``group`` (``(B,)`` in ``[0, num_groups)``)
    so that each prompt appears once, followed by each of its rows' responses.

    Row ``i`` of the padded ``(B, T)`` batch is ``[prompt (P = T - R columns, left-padded) | response (R)]``; the
    hidden states that score its response are those of columns ``P - 1 .. T - 2``. Its response columns ``P .. T - 2``
    (the last token is only a target) become a segment of ``R - 1`` columns in its group's row, the ``s``-th segment
    for the ``s``-th row of the group. A query column attends to a key column when the key is a real token
    (``attention_mask``), comes no later, and is in the prompt or in the query's own segment, as in its padded row; a
    query with no such key (left padding) attends to itself, so that none is left with nothing to attend to.
    Positions are the rows' own (``position_ids``, or ``0 .. T - 1`` without them). The grouped row costs
    ``P + k (R - 1)`` columns for ``k`` rows instead of ``k T``."""
    B, T = input_ids.shape
    R = response_length
    P, S = T - R, R - 1
    device = input_ids.device
    counts = torch.bincount(group, minlength=num_groups)  # (U,)
    k = int(counts.max())
    slot = _rank_in_group(group, counts)  # which segment of its group's row each row takes
    first = group_representatives(group, num_groups)  # whose prompt columns each laid-out row takes
    L = P + k * S
    columns = P + slot[:, None] * S + torch.arange(S, device=device)  # (B, S) where each response column goes
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()  # (B, T)
    positions = torch.arange(T, device=device).expand(B, T) if position_ids is None else position_ids

    def lay_out(values: torch.Tensor, fill: int | bool) -> torch.Tensor:  # (U, L)
        out = torch.full((num_groups, L), fill, dtype=values.dtype, device=device)
        out[:, :P] = values[first, :P]
        out[group[:, None], columns] = values[:, P : T - 1]
        return out

    ids, keys_real, pos = lay_out(input_ids, 0), lay_out(real, False), lay_out(positions, 0)
    segment = torch.cat(
        [torch.zeros(P, dtype=torch.long, device=device), torch.arange(1, k + 1, device=device).repeat_interleave(S)]
    )  # (L,) 0: the prompt
    col = torch.arange(L, device=device)
    visible = (col[None, :] <= col[:, None]) & ((segment[None, :] == 0) | (segment[None, :] == segment[:, None]))
    mask = visible[None] & keys_real[:, None, :]  # (U, L, L)
    mask |= torch.eye(L, dtype=torch.bool, device=device) & ~mask.any(-1, keepdim=True)
    index = torch.cat([torch.full((B, 1), P - 1, device=device, dtype=torch.long), columns], dim=1)  # (B, R)
    return SharedPromptRows(ids, mask[:, None], pos, group, index)


def common_prefix(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, prompt_length: int
) -> tuple[int, torch.Tensor | None]:
    """``(C, order)``: the first ``C`` real tokens that every row's prompt starts with (a chat template's system
    prompt), at the same positions in every row, and the ``(B, T)`` column order that moves them to the front.

    The prompts are the first ``prompt_length`` columns, left-padded (each row's real prompt tokens contiguous and
    last). ``order`` lays each row out as ``[shared tokens | its padding | the rest of its prompt | the rest]``:
    the real tokens keep their order and positions, so a causal pass over the reordered row gives each real token
    the numbers it gets in the padded row, and the shared columns come first in every row, where one pass can
    serve them all. The last ``T - prompt_length + 1`` columns are not moved: ``C`` leaves every row at least one
    prompt token of its own. ``order`` is None when no column moves (no padding); ``C`` is 0 when nothing is shared
    or the prompts are not left-padded.
    """
    B, T = input_ids.shape
    P = prompt_length
    device = input_ids.device
    if B < 2 or P < 2:
        return 0, None
    if attention_mask is None:
        starts = torch.zeros(B, dtype=torch.long, device=device)
    else:
        real = attention_mask[:, :P].bool()  # (B, P)
        if not bool((real[:, 1:] >= real[:, :-1]).all()):  # real tokens after padding only: left-padded
            return 0, None
        starts = P - real.sum(1)  # (B,) each row's first real prompt column
    cap = P - int(starts.max()) - 1  # the shortest prompt, less the one token each row keeps
    if cap < 1:
        return 0, None
    columns = starts[:, None] + torch.arange(cap, device=device)  # (B, cap)
    same = (input_ids.gather(1, columns) == input_ids[:1].gather(1, columns[:1])).all(0)  # (cap,)
    if position_ids is not None:
        same &= (position_ids.gather(1, columns) == position_ids[:1].gather(1, columns[:1])).all(0)
    C = int(same.long().cumprod(0).sum())
    if C == 0 or not bool(starts.any()):
        return C, None
    j = torch.arange(T, device=device).expand(B, T)
    s = starts[:, None]
    order = torch.where(j < C, s + j, torch.where(j < C + s, j - C, j))  # (B, T) the old column of each new one
    return C, order


__all__ = [
    "PackedRows",
    "SharedPromptRows",
    "common_prefix",
    "first_fit_decreasing",
    "group_representatives",
    "pack_scored_rows",
    "share_prompts",
    "split_groups",
]
