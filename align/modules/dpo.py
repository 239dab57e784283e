"""Direct preference optimisation (Rafailov et al. 2023, arXiv 2305.18290) and its variants.

Each step runs chosen and rejected responses through **one** concatenated forward pass (``2B`` rows, see
:class:`~align.data.preference.PreferenceBatch`); only the response positions go through the LM head. Sequence
log-probs are sums over response tokens (turn end and EOS included).

Loss variants (``loss_type``), chosen in one place (:data:`PREFERENCE_LOSSES`), each calling ``align.core.losses``:

* ``sigmoid``: DPO. ``conservative``: cDPO, DPO with ``label_smoothing`` > 0 (labels flipped with that probability).
* ``ipo``: IPO (Azar et al. 2023, arXiv 2310.12036), on per-token *mean* log-probs so the target margin
  ``1 / (2 beta)`` is on the scale of ``h``.
* ``hinge``: SLiC-HF (Zhao et al. 2023, arXiv 2305.10425).
* ``simpo``: SimPO (Meng et al. 2024, arXiv 2405.14734): length-normalised and reference-free (``beta``,
  ``simpo_gamma``).
* ``orpo``: ORPO (Hong et al. 2024, arXiv 2403.07691): the chosen response's per-token NLL plus ``beta`` (the
  paper's lambda, TRL's name) times ``-log sigmoid`` of the log odds ratio of the length-normalised likelihoods.
  Reference-free; ``rpo_alpha`` is refused with it (it would add the NLL a second time).

``rpo_alpha`` > 0 adds ``alpha`` times the chosen response's per-token NLL to each pair's loss (RPO, Pang et al.
2024, arXiv 2404.19733). Departure: the NLL is a per-pair mean over the chosen tokens, so the whole loss stays a
per-pair mean and is exactly invariant to how a step is split into micro-batches.

Reference log-probs (not needed by ``simpo`` and ``orpo``): live or cached, see
:class:`~align.modules.preference.PreferenceModule`.

Normalisation: the loss of an optimizer step is the mean over every pair of the accumulation window on all ranks,
so accumulating 8 x 1 equals 1 x 8. Accuracy counts a tie (implicit rewards equal, as for the untrained policy,
which *is* its reference) as half right, so the untrained model scores exactly chance.

Logged per optimizer step: ``train/loss``, ``dpo/accuracy``, ``dpo/margin`` (mean chosen - rejected implicit
reward), ``dpo/rewards_chosen``, ``dpo/rewards_rejected``, ``dpo/logps_chosen``, ``dpo/logps_rejected``,
``dpo/nll_chosen`` (with ``rpo_alpha`` or ``orpo``), ``dpo/log_odds_ratio`` (``orpo``), ``train/pairs_per_s``.
With ``orpo`` the rewards are ``beta`` times the mean log-probs (as TRL logs them). Held out: ``val/loss`` and
``val/dpo_<same>``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.core.preference_losses import dpo_loss, orpo_loss, simpo_loss
from align.data.preference import PreferenceBatch
from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.modules.preference import PreferenceModule, pair_correct

LossType = Literal["sigmoid", "conservative", "ipo", "hinge", "simpo", "orpo"]


class PairLogps(NamedTuple):
    """Summed response log-probs of a micro-batch of ``B`` pairs."""

    chosen: torch.Tensor  # (B,) policy, with grad
    rejected: torch.Tensor  # (B,)
    chosen_tokens: torch.Tensor  # (B,) response lengths
    rejected_tokens: torch.Tensor  # (B,)
    ref_chosen: torch.Tensor | None  # (B,) no grad; None for reference-free losses
    ref_rejected: torch.Tensor | None  # (B,)

    def refs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ref_chosen, ref_rejected)``, which every loss outside ``REFERENCE_FREE`` is given."""
        assert self.ref_chosen is not None and self.ref_rejected is not None  # the module loaded a reference
        return self.ref_chosen, self.ref_rejected


def _sigmoid(x: PairLogps, m: DPOModule):
    return dpo_loss(x.chosen, x.rejected, *x.refs(), m.beta, "sigmoid")


def _conservative(x: PairLogps, m: DPOModule):
    return dpo_loss(x.chosen, x.rejected, *x.refs(), m.beta, "sigmoid", m.label_smoothing)


def _ipo(x: PairLogps, m: DPOModule):
    nc, nr = x.chosen_tokens.clamp(min=1), x.rejected_tokens.clamp(min=1)
    ref_chosen, ref_rejected = x.refs()
    return dpo_loss(x.chosen / nc, x.rejected / nr, ref_chosen / nc, ref_rejected / nr, m.beta, "ipo")


def _hinge(x: PairLogps, m: DPOModule):
    return dpo_loss(x.chosen, x.rejected, *x.refs(), m.beta, "hinge")


def _simpo(x: PairLogps, m: DPOModule):
    return simpo_loss(x.chosen, x.rejected, x.chosen_tokens, x.rejected_tokens, m.beta, m.simpo_gamma)


def _orpo(x: PairLogps, m: DPOModule):
    losses, chosen, rejected, nll, log_odds = orpo_loss(
        x.chosen, x.rejected, x.chosen_tokens, x.rejected_tokens, m.beta
    )
    return losses, chosen, rejected, {"nll_chosen": nll, "log_odds_ratio": log_odds}


PreferenceLossOutput = (
    tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    | tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
)
PREFERENCE_LOSSES: dict[str, Callable[[PairLogps, DPOModule], PreferenceLossOutput]] = {
    "sigmoid": _sigmoid,
    "conservative": _conservative,
    "ipo": _ipo,
    "hinge": _hinge,
    "simpo": _simpo,
    "orpo": _orpo,
}
"""Each returns ``(losses, rewards_chosen, rewards_rejected)``, each ``(B,)``, and optionally a dict of further
detached ``(B,)`` statistics to log."""
REFERENCE_FREE = frozenset({"simpo", "orpo"})


class DPOModule(PreferenceModule):
    headline_metrics = ("val/dpo_accuracy", "val/dpo_margin", "val/loss")

    def __init__(
        self,
        policy: PolicyModel | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        loss_type: LossType = "sigmoid",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        simpo_gamma: float = 1.0,
        rpo_alpha: float = 0.0,
        precompute_reference: bool = False,
        reference_cache_dir: str | None = None,
        disable_dropout: bool = True,
        padding_free: bool = False,
    ):
        """
        Args:
            policy: The model to train (LoRA recommended: its reference is the adapter-disabled policy). Null means
                the embedded tiny model.
            optimizer: Optimizer callable (parameters -> optimizer); matrices get weight decay, vectors do not.
            scheduler: Learning-rate schedule callable (optimizer -> scheduler), stepped every optimizer step.
            loss_type: ``sigmoid`` (DPO), ``conservative`` (cDPO), ``ipo``, ``hinge`` (SLiC), ``simpo`` or ``orpo``.
            beta: Inverse temperature of the implicit reward (IPO's tau; SimPO's reward scale; ORPO's lambda, the
                weight of its odds-ratio term, as in TRL's ``ORPOConfig``).
            label_smoothing: Assumed label-flip probability for ``conservative``, in (0, 0.5).
            simpo_gamma: SimPO's target reward margin (the paper's gamma, in reward units: the loss is
                ``-log sigmoid(beta * (mean logp chosen - mean logp rejected) - simpo_gamma)``); ``simpo`` only.
                Named as in TRL's ``CPOConfig``, which SimPO users know, and so that it is not read as the GAE
                discount ``gamma`` of the RL modules. A ``gamma_beta_ratio`` r (the SimPO repository's setting) is
                ``simpo_gamma = r * beta``.
            rpo_alpha: Weight of the NLL of the chosen responses added to the loss (RPO); 0 turns it off. Refused
                with ``orpo``, whose loss already holds that NLL.
            precompute_reference: Compute reference log-probs once before training and cache them (no reference
                forward while training, no frozen copy of the model).
            reference_cache_dir: Where cached reference log-probs are kept; null: ``<default_root_dir>/ref_cache``.
            disable_dropout: Set every dropout (model, LoRA adapter) to 0, so that the policy and reference
                passes over a pair are deterministic; false keeps the model's dropout.
            padding_free: Score each micro-batch with its sequences laid end to end in rows no longer than the
                padded ones, so no arithmetic is spent on padding (same log-probs to float rounding; pays when
                response lengths vary widely). False scores the padded rows, where a pair's shared prompt runs once
                on models large enough for that to pay.
        """
        if loss_type not in PREFERENCE_LOSSES:
            raise AlignConfigError(f"model.loss_type: expected one of {sorted(PREFERENCE_LOSSES)}, got {loss_type!r}")
        if beta <= 0:
            raise AlignConfigError(f"model.beta: expected > 0, got {beta}")
        if loss_type == "conservative" and not 0.0 < label_smoothing < 0.5:
            raise AlignConfigError(
                f"model.label_smoothing: loss_type 'conservative' needs a value in (0, 0.5), got {label_smoothing}"
            )
        if label_smoothing and loss_type != "conservative":
            raise AlignConfigError(
                f"model.label_smoothing: expected 0 with loss_type {loss_type!r} (it applies to "
                f"'conservative' only), got {label_smoothing}"
            )
        if rpo_alpha < 0:
            raise AlignConfigError(f"model.rpo_alpha: expected >= 0, got {rpo_alpha}")
        if rpo_alpha and loss_type == "orpo":
            raise AlignConfigError(
                f"model.rpo_alpha: expected 0 with loss_type 'orpo', whose loss already holds the "
                f"chosen NLL, got {rpo_alpha}"
            )
        super().__init__(
            policy,
            optimizer,
            scheduler,
            disable_dropout,
            loss_type not in REFERENCE_FREE,
            precompute_reference,
            reference_cache_dir,
            padding_free,
        )
        self.loss_type, self.beta, self.label_smoothing = loss_type, beta, label_smoothing
        self.simpo_gamma = simpo_gamma
        self.rpo_alpha = rpo_alpha

    # ------------------------------------------------------------------ loss
    def pair_logps(self, batch: PreferenceBatch, split: str = "train") -> PairLogps:
        logps = self.scorer.sequence_logps(batch)  # (2B,) chosen, rejected: one pass
        tokens = batch.response_mask.sum(-1).to(logps.dtype)  # (2B,)
        chosen, rejected = logps.chunk(2)
        ref = self._reference_logps(batch, split) if self.needs_reference else (None, None)
        return PairLogps(chosen, rejected, *tokens.chunk(2), *ref)

    def _loss_and_stats(self, batch: PreferenceBatch, split: str) -> tuple[torch.Tensor, dict]:
        """Sum over the micro-batch's pairs of the per-pair loss, and sums of the per-pair statistics."""
        x = self.pair_logps(batch, split)
        losses, rewards_chosen, rewards_rejected, *extra = PREFERENCE_LOSSES[self.loss_type](x, self)  # (B,) each
        stats = {name: value.sum() for name, value in (extra[0] if extra else {}).items()}
        if self.rpo_alpha:
            nll = -x.chosen / x.chosen_tokens.clamp(min=1)  # (B,) per-token NLL of each chosen response
            losses = losses + self.rpo_alpha * nll
            stats["nll_chosen"] = nll.detach().sum()
        correct = pair_correct(rewards_chosen, rewards_rejected)
        stats.update(
            loss=losses.detach().sum(),
            accuracy=correct.sum(),
            margin=(rewards_chosen - rewards_rejected).sum(),
            rewards_chosen=rewards_chosen.sum(),
            rewards_rejected=rewards_rejected.sum(),
            logps_chosen=x.chosen.detach().sum(),
            logps_rejected=x.rejected.detach().sum(),
        )
        return losses.sum(), stats
