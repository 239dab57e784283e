"""Partial rollouts: generations cut when newer weights arrive (``model.source.init_args.interrupt``).

An asynchronous source's generator normally finishes a batch with the weights it started it with. With
``interrupt: true`` it checks for newer weights after every token; when some have arrived, the rows still being
generated are cut there, the weights are loaded, and the cut rows are then

* ``discard``-ed (the default): their tokens are dropped and they are generated again from their prompt with the
  new weights, or
* ``continue``-d: they go on from their last token under the new weights, each token tagged with the policy
  version that sampled it (``Rollout.token_versions``), its log-prob that version's.

Rows that had already finished keep their tokens. Which token a cut falls on depends on when the trainer's update
arrives, so a run with interruption is not repeatable step for step (without it, it is).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from align.rollout.sampling import SampleOutput

__all__ = ["PARTIAL_MODES", "decode_with_cuts"]

PARTIAL_MODES = ("discard", "continue")


def decode_with_cuts(
    engine,
    policy,
    ids: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    generator: torch.Generator | None,
    newer: Callable[[], bool],
    take_newer: Callable[[], int],
    version: int,
    partial: str = "discard",
) -> tuple[SampleOutput, torch.Tensor, dict[str, float]]:
    """Decode left-padded contexts ``ids``/``mask`` ``(N, P)`` with ``engine``'s settings, cutting the unfinished
    rows whenever ``newer()`` says newer weights wait; ``take_newer()`` loads them and returns their version.

    Returns the tokens and log-probs ``(N, R)``, each token's policy version ``(N, R)`` (``version`` before any cut),
    and counts: ``rollout/interrupted_rows`` (rows cut at least once) and ``rollout/discarded_tokens``."""
    s = engine.sampling
    stop = torch.tensor(engine.stop_ids(policy.tokenizer), device=ids.device)
    n = ids.shape[0]
    tokens: list[list[torch.Tensor]] = [[] for _ in range(n)]  # per row: the pieces of its response
    logprobs: list[list[torch.Tensor]] = [[] for _ in range(n)]
    versions: list[list[torch.Tensor]] = [[] for _ in range(n)]
    active = torch.arange(n, device=ids.device)
    contexts, context_mask = ids, mask
    cut_rows = torch.zeros(n, dtype=torch.bool, device=ids.device)
    discarded = 0
    done_so_far = 0  # tokens every active row already holds (equal across them)
    first = True
    while active.numel():
        remaining = s.max_new_tokens - done_so_far
        stopped = {"cut": False}

        def cut(finished: bool) -> bool:
            if finished:
                return True
            stopped["cut"] = newer()  # noqa: B023
            return stopped["cut"]  # noqa: B023

        with engine.decoding(policy, contexts.shape[1] + remaining) as decode:
            out = decode(
                contexts,
                context_mask,
                max_new_tokens=remaining,
                min_new_tokens=max(s.min_new_tokens - done_so_far, 0),
                generator=generator,
                sync_stop=cut,
                shared_prefix=group_size if first else 1,
            )
        first = False
        steps = out.response_ids.shape[1]
        finished = torch.isin(out.response_ids, stop).any(dim=1) | (steps >= remaining)  # (A,)
        if not stopped["cut"]:
            finished = torch.ones_like(finished)
        for j, row in enumerate(active.tolist()):
            if finished[j] or partial == "continue":
                tokens[row].append(out.response_ids[j])
                logprobs[row].append(out.logprobs[j])
                versions[row].append(torch.full((steps,), version, dtype=torch.long, device=ids.device))
            else:
                discarded += steps
        if bool(finished.all()):
            break
        unfinished = ~finished
        cut_rows[active[unfinished]] = True
        version = take_newer()
        if partial == "continue":
            contexts = torch.cat([contexts[unfinished], out.response_ids[unfinished]], dim=1)
            context_mask = torch.cat([context_mask[unfinished], torch.ones_like(out.response_ids[unfinished])], dim=1)
            done_so_far += steps
        else:
            contexts, context_mask = contexts[unfinished], context_mask[unfinished]
        active = active[unfinished]
    pad = policy.tokenizer.pad_token_id
    lengths = [sum(piece.numel() for piece in row) for row in tokens]
    width = max(lengths)
    response = torch.full((n, width), pad, dtype=torch.long, device=ids.device)
    out_logprobs = torch.zeros((n, width), dtype=torch.float32, device=ids.device)
    out_versions = torch.full((n, width), version, dtype=torch.long, device=ids.device)
    for row, length in enumerate(lengths):
        response[row, :length] = torch.cat(tokens[row])
        out_logprobs[row, :length] = torch.cat(logprobs[row]).float()
        out_versions[row, :length] = row_versions = torch.cat(versions[row])
        out_versions[row, length:] = row_versions[-1]  # padding: the version of the row's last token
    stats = {"rollout/interrupted_rows": float(cut_rows.sum()), "rollout/discarded_tokens": float(discarded)}
    return SampleOutput(response, out_logprobs, width), out_versions, stats
