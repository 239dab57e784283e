"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv 2402.04792).

Each training step takes a scored rollout from the module's source (``group_size`` completions per prompt from the
current policy, scored by the RL reward stack: reward functions and/or a reward model,
:class:`~align.rollout.sampler.Sampler`), pairs the best against the worst of every prompt
(:func:`align.core.preference_losses.preference_pairs`) and takes a DPO step on summed response log-probs against the
reference (``loss_type`` from :data:`align.modules.dpo.PREFERENCE_LOSSES`, which call
:func:`align.core.preference_losses.dpo_loss`). The loss of a step is the mean over its decisive pairs on all ranks.

Departures from the paper and from TRL's ``OnlineDPOTrainer``:

* The ranking comes from rewards, not an LLM annotator (the paper) or a judge: what GRPO trains on ranks here too.
* A prompt whose completions all score the same (a tie) states no preference. Its pair is left out of the loss and
  counted in ``rollout/tie_frac``; TRL keeps it with the first completion as chosen, which trains on noise. When
  a rollout has no decisive pair on any rank, no optimizer step is taken. Every rank keeps as many pairs as the
  rank with the most decisive ones (at least ``updates.minibatches``), filling up with tied pairs whose response mask
  is empty (weight 0), so that every rank runs the same forward and backward passes.
* ``group_size`` may exceed the paper's 2: the pair is then the best against the worst of the group, a wider
  reward gap at the cost of sampling more.
* Log-probs are the policy's own (temperature 1, as TRL computes them), whatever ``sampling.temperature`` draws
  the pairs with: the temperature only steers exploration, the DPO objective is about the policy.
* ``ipo`` uses per-token mean log-probs, as :class:`~align.modules.dpo.DPOModule` does (TRL sums them), so that the
  target margin ``1 / (2 beta)`` is on the scale of the log-ratio.
* The KL regulariser is DPO's ``beta``; the RL base's ``kl`` block must stay off, yet the reference is loaded.

Logged per rollout: ``train/loss`` (mean per decisive pair), ``train/kl`` (per-token estimate ``kl.estimator``,
k3 by default), ``train/entropy``, ``online_dpo/accuracy`` (implicit reward of the chosen above the rejected; a
tie counts half), ``online_dpo/margin``, ``online_dpo/rewards_chosen``, ``online_dpo/rewards_rejected`` (implicit
rewards ``beta * (logp - ref_logp)``), ``online_dpo/logps_chosen``, ``online_dpo/logps_rejected`` (summed response
log-probs), ``rollout/reward_chosen``, ``rollout/reward_rejected`` (scores of the best and worst completion of each
prompt, ties included),
``rollout/tie_frac``, the rollout metrics of GRPO (``rollout/reward_mean``, ``rollout/reward_std``,
``rollout/reward/<name>``, ``rollout/response_length``, ``rollout/tokens_per_s``, ``rollout/completion_tokens``,
``rollout/truncated_frac``) and ``time/generation_s`` / ``time/scoring_s`` / ``time/update_s``. The ``online_dpo/*``
and ``train/*`` values are means over the step's pairs, weighted by tokens across micro-batches as in every RL
module. Validation: see :class:`~align.modules.rl.RLModule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from align.core.kl import kl_estimate
from align.core.masks import masked_mean, masked_sum
from align.core.preference_losses import preference_pairs
from align.data.prompts import PromptBatch
from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.modules.dpo import PREFERENCE_LOSSES, PairLogps
from align.modules.learner import RLBatch
from align.modules.preference import pair_correct
from align.modules.rl import RLModule
from align.observability.timing import Timer
from align.rollout.rewards import RewardModelSpec, RewardSpec

OnlineLossType = Literal["sigmoid", "ipo", "hinge"]


@dataclass
class PairBatch(RLBatch):
    """``P`` preference pairs as ``2P`` rollout rows: the chosen completions, then the rejected ones in the same
    order. ``len`` counts pairs and :meth:`select` takes pairs, so :meth:`RLModule.update` splits pairs, never
    the two sides of one. ``advantages`` holds each row's reward (the loss does not use it). A pair whose
    response-mask rows are empty weighs nothing (a tie kept only so that every rank runs the same passes)."""

    def __len__(self) -> int:
        return self.input_ids.shape[0] // 2

    def select(self, index: torch.Tensor) -> PairBatch:
        return super().select(torch.cat([index, index + len(self)]))


def decisive_pairs(response_mask: torch.Tensor) -> torch.Tensor:
    """The loss normaliser's count of a minibatch of pairs: its decisive pairs, whose chosen rows ``response_mask``
    holds (a weightless tie's rows are empty)."""
    return response_mask.any(dim=1).sum().float()


class OnlineDPOModule(RLModule):
    """Online DPO on prompt data (:class:`align.data.prompts.PromptDataModule`), manual optimization.

    ``trainer.max_steps`` counts optimizer steps: ``updates.epochs * updates.minibatches`` per rollout with a
    decisive pair.
    """

    needs_reference = True  # the DPO loss is relative to the reference, whatever kl.coef says

    def __init__(
        self,
        policy: PolicyModel | None = None,
        rewards: list[RewardSpec | str] | None = None,
        reward_model: RewardModelSpec | str | None = None,
        group_size: int = 2,
        beta: float = 0.1,
        loss_type: OnlineLossType = "sigmoid",
        **kwargs,
    ):
        """
        Args:
            policy: The model to train; null means the shipped SFT-warmed tiny model (``tiny-sort``).
            rewards: Reward functions with weights that rank the sampled completions (docs/rewards.md).
            reward_model: A trained reward model that ranks them, scored as the reward named ``rm``: a path, or
                ``{path, weight, batch_size}``. At least one of ``rewards`` and ``reward_model`` is needed.
            group_size: Completions sampled per prompt (the paper: 2); the best and the worst form the pair.
            beta: Inverse temperature of the implicit reward (the KL regularisation; IPO's tau). TRL's default.
            loss_type: ``sigmoid`` (DPO), ``ipo`` or ``hinge`` (SLiC), as in :class:`~align.modules.dpo.DPOModule`.
        """
        if group_size < 2:
            raise AlignConfigError(
                f"model.group_size: expected >= 2 (online DPO pairs completions of a prompt), got {group_size}"
            )
        if not rewards and reward_model is None and kwargs.get("environment") is None:
            raise AlignConfigError(
                "model.rewards: online DPO ranks its completions with rewards, a reward_model "
                "and/or an environment; expected at least one, got none"
            )
        if loss_type not in get_args(OnlineLossType):
            raise AlignConfigError(
                f"model.loss_type: expected one of {list(get_args(OnlineLossType))}, got {loss_type!r}"
            )
        if beta <= 0:
            raise AlignConfigError(f"model.beta: expected > 0, got {beta}")
        kl = kwargs.get("kl")
        if kl is not None and kl.enabled:
            raise AlignConfigError(
                f"model.kl.coef: online DPO regularises towards the reference with beta; expected "
                f"0 and no kl.target, got coef {kl.coef}, target {kl.target}"
            )
        super().__init__(
            policy if policy is not None else PolicyModel("tiny-sort"),
            rewards=rewards,
            reward_model=reward_model,
            group_size=group_size,
            **kwargs,
        )
        environment = self.sampler.environment
        if not any(r.weight for r in self.sampler.reward.rewards) and not (environment and environment.spec.weight):
            raise AlignConfigError(
                "model.rewards: every training reward has weight 0, so nothing ranks the "
                "completions; expected a non-zero weight"
            )
        self.beta, self.loss_type = beta, loss_type
        # The loss is on the policy itself, not on its tempered sampling distribution (no ratio to the sampler here),
        # and its normaliser counts decisive pairs.
        self.scorer.temperature = 1.0
        self.learner.count = decisive_pairs

    def _loss(self, micro: PairBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict]:
        out = self.scorer.logprobs(micro, entropy=self.log_entropy)
        mask = micro.response_mask  # (2p, r)
        assert micro.ref_logprobs is not None  # pair_batch scores the reference
        logps, ref = masked_sum(out.logprobs, mask, dim=1), masked_sum(micro.ref_logprobs, mask, dim=1)  # (2p,)
        tokens = mask.sum(dim=1).to(logps.dtype)
        x = PairLogps(*logps.chunk(2), *tokens.chunk(2), *ref.chunk(2))
        # The online loss types (sigmoid, ipo, hinge) read only the module's beta, and add no statistics; (p,) each.
        loss_fn = PREFERENCE_LOSSES[self.loss_type]
        losses, rewards_chosen, rewards_rejected, *_ = loss_fn(x, self)  # type: ignore[arg-type]  # reads only beta
        valid = mask[: len(micro)].any(dim=1).to(losses.dtype)  # (p,) 0 for a weightless tie
        loss = (losses * valid).sum() / normaliser
        n = valid.sum().clamp(min=1)

        def pair_mean(v):
            return (v.detach() * valid).sum() / n

        correct = pair_correct(rewards_chosen, rewards_rejected)
        metrics = {
            "train/loss": pair_mean(losses),
            "online_dpo/accuracy": pair_mean(correct),
            "online_dpo/margin": pair_mean(rewards_chosen - rewards_rejected),
            "online_dpo/rewards_chosen": pair_mean(rewards_chosen),
            "online_dpo/rewards_rejected": pair_mean(rewards_rejected),
            "online_dpo/logps_chosen": pair_mean(x.chosen),
            "online_dpo/logps_rejected": pair_mean(x.rejected),
            "train/kl": masked_mean(kl_estimate(out.logprobs.detach(), micro.ref_logprobs, self.kl.kind), mask),
        }
        if out.entropy is not None:
            metrics["train/entropy"] = masked_mean(out.entropy.detach(), mask)
        return loss, metrics

    def pair_batch(self, rollout, rewards: torch.Tensor) -> tuple[PairBatch | None, dict[str, float]]:
        """The rollout's pairs as a :class:`PairBatch` with reference log-probs (None when no rank has a decisive
        pair), and the pairing metrics."""
        pairs = preference_pairs(rewards, self.group_size)  # (B,) each
        decisive = pairs.decisive
        metrics = {
            "rollout/tie_frac": float(1.0 - decisive.float().mean()),
            "rollout/reward_chosen": float(rewards[pairs.chosen].mean()),
            "rollout/reward_rejected": float(rewards[pairs.rejected].mean()),
        }
        ranks = self.ranks
        counts = torch.zeros(ranks.size, device=rewards.device)
        counts[ranks.rank] = decisive.sum()
        counts = ranks.all_reduce(counts)  # every rank's decisive pairs
        if float(counts.sum()) == 0:
            return None, metrics
        # Decisive pairs first; ties fill up to the most decisive pairs of any rank (at least one pair per minibatch)
        # and weigh nothing (empty response mask), so every rank splits as many pairs into as many micro-batches.
        keep = min(max(int(counts.max()), self.updates.minibatches), len(decisive))
        order = torch.argsort((~decisive).int(), stable=True)[:keep]
        rows = torch.cat([pairs.chosen[order], pairs.rejected[order]])  # (2P,)
        response_mask = rollout.response_mask[rows] & decisive[order].repeat(2)[:, None]
        data = PairBatch(
            rollout.input_ids[rows],
            rollout.attention_mask[rows],
            response_mask,
            rollout.old_logprobs[rows],
            rewards[rows, None].expand_as(response_mask),
        )
        data.ref_logprobs = self.scorer.reference_logprobs(data)
        return data, metrics

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        scored = self.next_scored(batch)
        if scored is None:  # a filtered source: the next batch adds to this update's groups
            return
        stats = {}
        with Timer(self.timings, "time/update_s"):
            data, pair_metrics = self.pair_batch(scored.rollout, scored.rewards)  # rewards (N,)
            if data is not None:
                stats = self.update(data, self._loss)
            else:
                self.no_update("online DPO: the rewards tied for every prompt (rollout/tie_frac 1.0)")
        self.log_metrics({**self.sampler.rollout_metrics(scored), **pair_metrics, **stats, **self.timings})
