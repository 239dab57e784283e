"""Kahneman-Tversky optimisation (Ethayarajh et al. 2024, arXiv 2402.01306) on unpaired examples.

Each example is a prompt, a completion and a label: desirable or undesirable
(:class:`~align.data.preference.UnpairedDataModule`, which also reads preference pairs as one of each). With the
implicit reward ``r = log pi(y|x) - log pi_ref(y|x)`` of the completion (summed over its tokens) and the reference
point ``z0``, the loss (:func:`align.core.preference_losses.kto_loss`, Eq. 7) is ``desirable_weight * (1 - sigmoid(beta
(r - z0)))`` for a desirable example and ``undesirable_weight * (1 - sigmoid(beta (z0 - r)))`` for an undesirable one.

``z0`` estimates KL(pi || pi_ref) from mismatched pairs, as in the paper and TRL: each prompt with another example's
completion (fixed once by :func:`~align.data.preference.mismatch_completions`), ``max(0, mean(log pi - log pi_ref))``
over the micro-batch's mismatched pairs on every rank, detached. The policy scores the mismatched pairs without a
gradient, in a forward pass of their own (no backward through them).

Reference log-probs (of both the completions and the mismatched pairs) are live or cached exactly as DPO's
(:class:`~align.modules.preference.PreferenceModule`: the LoRA adapter-disabled policy, a frozen copy, or
``precompute_reference``).

Normalisation: the loss of an optimizer step is the mean over every example of the accumulation window on all
ranks. Each example's weight is its label's weight, so with more examples of one kind the weights should balance
them: the paper (section 4.2) keeps ``desirable_weight * n_desirable / (undesirable_weight * n_undesirable)`` in
``[1, 4/3]``; a warning gives the range when the training data falls outside it.

Logged per optimizer step: ``train/loss``, ``kto/kl`` (z0), ``kto/accuracy`` (fraction of examples on their
label's side of z0: ``r > z0`` when desirable, ``r < z0`` when undesirable; a tie counts half),
``kto/rewards_desirable`` and ``kto/rewards_undesirable`` (mean ``beta * r`` of each kind), ``kto/margin`` (their
difference), ``kto/logps_desirable``, ``kto/logps_undesirable``, ``train/examples_per_s``. Held out: ``val/loss``
and ``val/kto_<same>``.
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn

from align.core.preference_losses import kto_loss
from align.data.preference import PreferenceBatch
from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.modules.preference import PreferenceModule


class KTOModule(PreferenceModule):
    metric_prefix = "kto"
    unpaired = True
    throughput_metric = "train/examples_per_s"
    headline_metrics = ("val/kto_accuracy", "val/kto_margin", "val/loss")

    def __init__(
        self,
        policy: PolicyModel | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
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
            beta: Inverse temperature of the implicit reward (TRL's ``beta``).
            desirable_weight: Weight of each desirable example's loss (the paper's lambda_D).
            undesirable_weight: Weight of each undesirable example's loss (lambda_U).
            precompute_reference: Compute reference log-probs once before training and cache them (no reference
                forward while training, no frozen copy of the model).
            reference_cache_dir: Where cached reference log-probs are kept; null: ``<default_root_dir>/ref_cache``.
            disable_dropout: Set every dropout (model, LoRA adapter) to 0, so that the policy and reference
                passes over an example are deterministic; false keeps the model's dropout.
            padding_free: Score each micro-batch with its sequences laid end to end in rows no longer than the
                padded ones, so no arithmetic is spent on padding (same log-probs to float rounding; pays when
                response lengths vary widely). False scores the padded rows, where a pair's shared prompt runs once
                on models large enough for that to pay.
        """
        for name, value in (
            ("beta", beta),
            ("desirable_weight", desirable_weight),
            ("undesirable_weight", undesirable_weight),
        ):
            if not value > 0:
                raise AlignConfigError(f"model.{name}: expected > 0, got {value}")
        super().__init__(
            policy, optimizer, scheduler, disable_dropout, True, precompute_reference, reference_cache_dir, padding_free
        )
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight

    def on_train_start(self) -> None:
        super().on_train_start()
        datamodule = self.trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
        examples = datamodule.train_set.examples
        desirable = sum(bool(ex.label) for ex in examples)
        undesirable = len(examples) - desirable
        ratio = self.desirable_weight * desirable / max(self.undesirable_weight * undesirable, 1e-12)
        if not 1.0 <= ratio <= 4 / 3:
            low, high = undesirable * self.undesirable_weight / max(desirable, 1), 4 / 3
            rank_zero_warn(
                f"KTO: {desirable} desirable and {undesirable} undesirable training examples; with these "
                f"weights desirable_weight * n_desirable / (undesirable_weight * n_undesirable) = "
                f"{ratio:.2f}, outside the paper's [1, 4/3]: for example model.desirable_weight in "
                f"[{low:.2f}, {low * high:.2f}]"
            )

    def _loss_and_stats(self, batch: PreferenceBatch, split: str) -> tuple[torch.Tensor, dict]:
        B = batch.num_pairs
        # The completions and the mismatched ones in one pass, as the reference's: an example and its mismatched
        # completion share the prompt, which runs once, and an untrained policy scores exactly as its reference.
        logps, kl_logps = self.scorer.sequence_logps(batch).split(B)  # (B,) each, with grad
        kl_logps = kl_logps.detach()
        ref_logps, ref_kl_logps = self._reference_logps(batch, split)
        assert batch.label is not None  # unpaired examples carry their labels
        kl_sum = (kl_logps - ref_kl_logps).sum().float()
        packed = self.all_reduce_sum(torch.stack([kl_sum, torch.tensor(float(B), device=kl_sum.device)]))
        z0 = (packed[0] / packed[1]).clamp(min=0)  # every rank's mismatched pairs
        losses, rewards = kto_loss(
            logps, ref_logps, batch.label, z0, self.beta, self.desirable_weight, self.undesirable_weight
        )  # (B,) each
        desirable = batch.label.to(rewards.dtype)  # (B,)
        side = (rewards - self.beta * z0) * (2 * desirable - 1)  # > 0: on its label's side of z0
        logps = logps.detach()
        stats = dict(
            loss=losses.detach().sum(),
            kl=z0 * B,
            accuracy=(side > 0).sum() + 0.5 * (side == 0).sum(),
            desirable=desirable.sum(),
            rewards_desirable=(rewards * desirable).sum(),
            rewards_undesirable=(rewards * (1 - desirable)).sum(),
            logps_desirable=(logps * desirable).sum(),
            logps_undesirable=(logps * (1 - desirable)).sum(),
        )
        return losses.sum(), stats

    def summarise(self, means: dict[str, float]) -> dict[str, float]:
        """Per-kind means (a kind absent from the window is not logged) and their margin."""
        share = {"desirable": means.pop("desirable")}
        share["undesirable"] = 1.0 - share["desirable"]
        for kind, fraction in share.items():
            for name in (f"rewards_{kind}", f"logps_{kind}"):
                value = means.pop(name)
                if fraction > 0:
                    means[name] = value / fraction
        if "rewards_desirable" in means and "rewards_undesirable" in means:
            means["margin"] = means["rewards_desirable"] - means["rewards_undesirable"]
        return means
