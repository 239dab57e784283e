"""The learner of the RL modules: a rollout's rows as a batch (:class:`RLBatch`), its minibatches and micro-batches,
and the update loop, one optimizer step per minibatch with micro-batches accumulated under the step's loss normaliser.

Loss normalisation (docs/algorithms.md, "Losses"): one optimizer step consumes one *minibatch* of rollout rows,
processed as one or more micro-batches. Every micro-batch loss is a sum over its valid tokens (or sequences) divided
by the count over the whole minibatch on all ranks (:meth:`Learner.normaliser`), and is multiplied by the world size
to undo the data-parallel gradient average (``Optimization.gradient_scale``). Accumulated gradients therefore equal
the gradient of the full minibatch loss, whatever the micro-batch size or the number of ranks.

:func:`policy_loss_terms` evaluates a policy loss (a row of :data:`align.core.policy_losses.POLICY_LOSSES`) on a
micro-batch, with the metrics every policy-gradient module logs.

A :class:`Learner` knows nothing of Lightning nor of the module it trains: the module hands it an
:class:`Optimization` (the optimizer and the trainer's backward, clipping and accumulation hooks, or plain torch's)
and a loss function of a micro-batch, so it runs in a notebook or a test as well. Everything here takes what it uses
as arguments and calls nothing back but the loss function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, TypeVar

import torch

from align.core.losses import loss_count
from align.core.masks import masked_mean
from align.core.packing import token_budget_chunks
from align.core.policy_losses import POLICY_LOSSES, PolicyLossInputs, PolicyLossSettings
from align.core.stats import Ranks
from align.errors import AlignConfigError
from align.models.scoring import TokenLogprobs
from align.modules.options import ClipRange, PolicyLoss, Updates
from align.rollout.types import Rollout

__all__ = [
    "BatchT",
    "LossFn",
    "Learner",
    "Optimization",
    "Plan",
    "RLBatch",
    "as_token_mean",
    "corrected",
    "minibatch_indices",
    "policy_loss_terms",
]


BatchT = TypeVar("BatchT", bound="RLBatch")
"""An :class:`RLBatch` or a subclass: what :meth:`RLBatch.select` returns and a :data:`LossFn` is given."""


@dataclass
class RLBatch:
    """Rollout rows ready for a policy update. ``N`` rows, ``T = P + R`` tokens, ``R`` response tokens.

    Subclasses add fields (PPO: values, returns, ...). :meth:`select` handles every tensor field by its shape:
    ``(N, R)`` per response token, ``(N,)`` per row; other fields are per rollout and are not carried over. A
    selected batch records which rows of the batch it was selected from in ``rows``.
    """

    input_ids: torch.Tensor  # (N, T) prompt (left-padded) + response
    attention_mask: torch.Tensor  # (N, T) prompt mask + response mask
    response_mask: torch.Tensor  # (N, R) bool
    old_logprobs: torch.Tensor  # (N, R) sampling log-probs: the behaviour policy of the importance ratio
    advantages: torch.Tensor  # (N, R) per-token advantages (GRPO broadcasts one per sequence)
    ref_logprobs: torch.Tensor | None = None  # (N, R) reference log-probs, when a KL term needs them
    rows: torch.Tensor | None = None  # (N,) long: the rows of the batch these were selected from (None: all)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    @staticmethod
    def row_widths(attention_mask: torch.Tensor, response_length: int) -> list[int]:
        """Each row's width when :meth:`select` takes it alone: the prompt columns and its response's up to its
        last token (at least one)."""
        prompt = attention_mask.shape[1] - response_length
        used = attention_mask[:, prompt:].bool()
        last = response_length - used.flip(1).int().argmax(dim=1)  # one past the last used column
        return (prompt + torch.where(used.any(dim=1), last, 1)).tolist()

    @staticmethod
    def selected_width(attention_mask: torch.Tensor, response_length: int, index: torch.Tensor) -> int:
        """Response columns that :meth:`select` keeps for the rows ``index``: up to the last one any of them uses."""
        used = attention_mask[index, attention_mask.shape[1] - response_length :].any(dim=0).nonzero()
        return int(used[-1]) + 1 if len(used) else 1

    def select(self: BatchT, index: torch.Tensor) -> BatchT:
        """The rows ``index``, with the padding columns that no selected row uses trimmed off; its ``rows`` say which
        rows of this batch's own source they are."""
        width = self.selected_width(self.attention_mask, self.response_length, index)
        cut = self.response_length - width
        rows = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, torch.Tensor):
                continue
            value = value[index]
            if f.name in ("input_ids", "attention_mask"):
                value = value[:, : value.shape[1] - cut] if cut else value
            elif value.dim() == 2:
                value = value[:, :width]
            rows[f.name] = value
        if self.rows is None:
            rows["rows"] = index
        return type(self)(**rows)

    @classmethod
    def from_rollout(
        cls,
        rollout: Rollout,
        advantages: torch.Tensor,
        ref_logprobs: torch.Tensor | None = None,
    ) -> RLBatch:
        return cls(
            rollout.input_ids,
            rollout.attention_mask,
            rollout.response_mask,
            rollout.old_logprobs,
            corrected(advantages, rollout),
            ref_logprobs,
        )


def corrected(advantages: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """``(N, R)`` advantages of the rollout's tokens (``(N,)`` broadcast), times the rollout's importance weights for
    the engine mismatch when it has them (:meth:`align.rollout.sampler.Sampler.correct`). Every policy loss is
    positively homogeneous in the advantage of a token (a row's, for the sequence-level ``gspo`` and ``gmpo`` at
    ``correction.level: sequence``), so this weighs each token's (row's) term by ``w >= 0``, detached."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(rollout.old_logprobs)  # (N,) -> (N, R)
    if rollout.correction_weights is not None:
        advantages = advantages * rollout.correction_weights
    return advantages


def minibatch_indices(
    n: int,
    num_minibatches: int,
    micro_batch_size: int | None,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
    widths: list[int] | None = None,
    max_tokens: int | None = None,
) -> list[list[torch.Tensor]]:
    """Split ``n`` rows into ``num_minibatches`` (one optimizer step each), each into micro-batches of at
    most ``micro_batch_size`` rows (``None``: one micro-batch), or, with ``max_tokens``, into micro-batches of at
    most that many padded tokens given each row's width ``widths`` (:func:`align.core.packing.token_budget_chunks`,
    within ``micro_batch_size`` rows too when set). Returns ``[[indices, ...], ...]``."""
    if not 1 <= num_minibatches <= n:
        raise AlignConfigError(
            f"model.updates.minibatches: expected a value in [1, {n}] (the rows of a rollout on "
            f"this rank), got {num_minibatches}"
        )
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    out = []
    for mb in torch.tensor_split(order, num_minibatches):
        if max_tokens is not None:
            assert widths is not None, "minibatch_indices: max_tokens needs the rows' widths"
            chunks = token_budget_chunks([widths[i] for i in mb.tolist()], max_tokens, micro_batch_size)
            out.append([mb[torch.tensor(chunk, dtype=torch.long)] for chunk in chunks])
        else:
            out.append(list(torch.split(mb, micro_batch_size or len(mb))))
    return out


def _no_boundary(last: bool) -> None:
    return None


class Optimization(NamedTuple):
    """How a learner takes optimizer steps: the trainer's hooks under Lightning, plain torch's otherwise."""

    optimizer: Any
    scheduler: Any = None  # stepped after every optimizer step
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    clip: Callable[[float], Any] | None = None  # clips the gradient norm to the given value (None: torch's, in update)
    boundary: Callable[[bool], None] = _no_boundary  # told whether a micro-batch ends the step (DeepSpeed)
    gradient_scale: float = 1.0  # undoes the framework's own scaling of a returned loss
    ranks: Ranks = Ranks()


LossFn = Callable[[BatchT, torch.Tensor], tuple[torch.Tensor, dict]]
"""``loss_fn(micro, normaliser) -> (loss, {metric: value})``: the micro-batch's share of the step loss and metrics
that are means over the micro-batch's valid tokens."""

Plan = list[list[torch.Tensor]]
"""The minibatches of one pass over a batch, each a list of micro-batches' row indices."""


def as_token_mean(value: torch.Tensor, normaliser: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A micro-batch's share of a step loss (``value``, divided by the step's ``normaliser``), expressed as a mean
    over the micro-batch's own valid tokens ``mask``: the unit of the logged ``train/*`` losses."""
    return value.detach() * normaliser / max(float(mask.sum()), 1.0)


class Learner:
    """``updates.epochs`` passes over a batch, ``updates.minibatches`` optimizer steps per pass, each minibatch in
    micro-batches of ``updates.micro_batch_size`` rows or of ``updates.max_tokens_per_microbatch`` padded tokens.
    ``count(response_mask) -> ()`` is this rank's count of loss terms in a minibatch (online DPO's decisive pairs);
    by default :func:`align.core.losses.loss_count` in the unit of ``updates.loss_aggregation``, with Dr. GRPO's
    constant normaliser counting ``max_length`` tokens per row."""

    def __init__(
        self,
        updates: Updates,
        max_length: int | None = None,
        count: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.updates, self.max_length = updates, max_length
        self.count = count if count is not None else self.loss_count
        self.steps = 0
        """Optimizer steps taken: the version of the policy being trained (saved in checkpoints by the module)."""

    def loss_count(self, response_mask: torch.Tensor) -> torch.Tensor:
        """This rank's count of loss terms of a minibatch's rows, in the unit of ``updates.loss_aggregation``."""
        return loss_count(response_mask, self.updates.loss_aggregation, self.max_length)

    def split(self, n: int, widths: list[int] | None = None) -> Plan:
        """One pass's minibatches and micro-batches of ``n`` rows of widths ``widths`` (needed with
        ``updates.max_tokens_per_microbatch``; see :meth:`RLBatch.row_widths`), in a fresh random order."""
        u = self.updates
        return minibatch_indices(
            n, u.minibatches, u.micro_batch_size, widths=widths, max_tokens=u.max_tokens_per_microbatch
        )

    def plan(self, n: int, widths: list[int] | None = None) -> Plan:
        """The first epoch's minibatches of an update of ``n`` rows (of widths ``widths``), drawn now: the same random
        draw :meth:`update` would make first, so that a rollout's scoring can prepare for its first micro-batch. Pass
        it to that update as ``plan``."""
        return self.split(n, widths)

    def normaliser(self, response_mask: torch.Tensor, ranks: Ranks) -> torch.Tensor:
        """The loss normaliser of one optimizer step over the minibatch rows ``response_mask`` (N_mb, R): their
        count of loss terms summed over every rank, at least 1."""
        return ranks.all_reduce(self.count(response_mask).float()).clamp(min=1.0)

    def update(
        self,
        data: BatchT,
        loss_fn: LossFn[BatchT],
        opt: Optimization,
        on_step: Callable[[], None] = lambda: None,
        plan: Plan | None = None,
    ) -> dict[str, float]:
        """Train on ``data``; returns the step metrics of ``loss_fn``, averaged over every micro-batch of every
        rank weighted by valid tokens. The first epoch's minibatches are ``plan`` (drawn by :meth:`plan` for these
        rows) when given, else drawn here; each micro-batch ``loss_fn`` is given records its rows of ``data`` in
        ``rows``. ``on_step`` runs after every optimizer step."""
        u, ranks = self.updates, opt.ranks
        sums: dict[str, float] = {}
        weight_total = 0.0
        planned = plan
        if planned is not None and sum(len(i) for mb in planned for i in mb) != len(data):
            planned = None  # drawn for other rows
        widths = (
            RLBatch.row_widths(data.attention_mask, data.response_length)
            if u.max_tokens_per_microbatch is not None
            else None
        )
        for epoch in range(u.epochs):
            minibatches = planned if epoch == 0 and planned is not None else self.split(len(data), widths)
            for micro_indices in minibatches:
                normaliser = self.normaliser(data.response_mask[torch.cat(micro_indices)], ranks)
                for j, index in enumerate(micro_indices):
                    opt.boundary(j == len(micro_indices) - 1)  # DeepSpeed: reduce on the last only
                    micro = data.select(index.to(data.input_ids.device))
                    loss, stats = loss_fn(micro, normaliser)
                    opt.backward(loss * opt.gradient_scale)
                    weight = float(micro.response_mask.sum())
                    weight_total += weight
                    for name, value in stats.items():
                        sums[name] = sums.get(name, 0.0) + float(value) * weight
                if u.max_grad_norm is not None:
                    if opt.clip is not None:
                        opt.clip(u.max_grad_norm)
                    else:  # plain torch without a clip hook: the optimizer's own parameters
                        params = [p for group in opt.optimizer.param_groups for p in group["params"]]
                        torch.nn.utils.clip_grad_norm_(params, u.max_grad_norm)
                opt.optimizer.step()  # a non-finite loss or gradient stops or skips here (align.trainer.guards)
                opt.optimizer.zero_grad(set_to_none=True)
                self.steps += 1
                on_step()
                if opt.scheduler is not None:
                    opt.scheduler.step()
        if ranks.size > 1 and sums:  # token-weighted means over every rank's micro-batches (one all-reduce)
            names = sorted(sums)
            device = data.input_ids.device
            packed = ranks.all_reduce(torch.tensor([sums[n] for n in names] + [weight_total], device=device))
            sums, weight_total = dict(zip(names, packed[:-1].tolist())), float(packed[-1])
        return {name: value / max(weight_total, 1.0) for name, value in sums.items()}


def policy_loss_terms(
    micro: RLBatch,
    normaliser: torch.Tensor,
    out: TokenLogprobs,
    policy_loss: PolicyLoss,
    clip: ClipRange,
    updates: Updates,
) -> tuple[torch.Tensor, dict]:
    """``(loss share, metrics)`` of the policy loss ``policy_loss`` with the clip range ``clip`` on the micro-batch
    ``micro`` whose current log-probs are ``out``, aggregated as ``updates.loss_aggregation`` says (GRPO's, PPO's and
    distillation's). With one optimizer step per rollout (``updates.on_policy``) the old policy is the current one
    (detached), so the ratio is exactly 1."""
    mask, agg = micro.response_mask, updates.loss_aggregation
    old = out.logprobs.detach() if updates.on_policy else micro.old_logprobs
    low, high = policy_loss.clip_bounds(clip)
    settings = PolicyLossSettings(
        clip_low=low,
        clip_high=high,
        agg=agg,
        normaliser=normaliser,
        tau_pos=policy_loss.tau_pos,
        tau_neg=policy_loss.tau_neg,
    )
    loss, stats = POLICY_LOSSES[policy_loss.name](PolicyLossInputs(out.logprobs, old, micro.advantages, mask), settings)
    metrics = {
        "train/policy_loss": as_token_mean(loss, normaliser, mask),
        "train/clipfrac": stats.clipfrac,
        "train/approx_kl": stats.approx_kl,
    }
    if out.entropy is not None:
        metrics["train/entropy"] = masked_mean(out.entropy.detach(), mask)
    return loss, metrics
