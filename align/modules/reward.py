"""Reward-model training: a Bradley-Terry loss on pairwise preferences (Ouyang et al. 2022, arXiv 2203.02155).

Head choice: the reward model is trained as the shared :class:`~align.models.policy.PolicyModel` with the scalar
head of a shared critic (``critic: {kind: shared}``) read at the last real token
(:func:`align.models.reward.sequence_scores`), and exported as a standard ``*ForSequenceClassification``
checkpoint. Reasons:

* One loading path: LoRA, QLoRA, dtype, gradient checkpointing, the tiny default and checkpoint metadata all come
  from the policy wrapper.
* The last token is found from the attention mask, not from ``input_ids != pad_token_id``, which picks the token
  before the response's EOS when ``pad == eos``; the export names a pad token other than the EOS, so transformers
  reads the same token (see :mod:`align.models.reward` and :mod:`align.models.reward_export`).
* Only the decoder runs; no vocabulary-sized logits are computed.

Loss normalisation: the loss of an optimizer step is the mean over every pair of its accumulation window and of all
data-parallel ranks (each micro-batch carries its window's pair count, as SFT does with tokens; see
:meth:`AlignModule.window_loss`), so 8 x 1 equals 1 x 8. The Llama 2 margin (arXiv 2307.09288) is taken from the
data's ``margin`` column when ``use_margin`` is on.

Departures: the head starts from small random weights instead of zeros, so the untrained model ranks pairs at about
chance instead of tying every pair (a tie counts as wrong in ``rm/accuracy``). Its bias is frozen: the loss does not
depend on it (only rounding noise reaches it, which Adam would turn into a drift), and a sequence classifier's head
has none.

Logged: ``train/loss``, ``rm/accuracy``, ``rm/margin`` (mean chosen - rejected score), ``rm/score_chosen``,
``rm/score_rejected``, ``train/pairs_per_s``; held out: ``val/loss``, ``val/rm_accuracy``, ``val/rm_margin``,
``val/rm_score_chosen``, ``val/rm_score_rejected``. At the end of ``fit`` the model is exported to
``<run dir>/export`` (see :mod:`align.models.reward_export`), loadable by :class:`align.rewards.RewardModelScorer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.core.preference_losses import bradley_terry_loss
from align.data.preference import PreferenceBatch
from align.errors import AlignConfigError
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.models.reward import init_reward_head
from align.models.reward_export import save_reward_model
from align.models.scorer import Scorer
from align.modules.base import AlignModule, PairMetrics

if TYPE_CHECKING:
    from align.models.loading import DType


class RewardModule(AlignModule):
    headline_metrics = ("val/rm_accuracy", "val/rm_margin", "val/loss")
    progress_metrics = ("train/loss", "rm/accuracy")

    def __init__(
        self,
        policy: PolicyModel | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        use_margin: bool = True,
        export: bool = True,
        export_dtype: str | None = None,
        disable_dropout: bool = True,
        padding_free: bool = False,
    ):
        """
        Args:
            policy: The backbone; a scalar head (``critic: {kind: shared}``) is added when missing. Null means the
                embedded tiny model.
            optimizer: Optimizer callable (parameters -> optimizer); matrices get weight decay, vectors do not.
            scheduler: Learning-rate schedule callable (optimizer -> scheduler), stepped every optimizer step.
            use_margin: Subtract the data's per-pair ``margin`` column inside the Bradley-Terry loss.
            export: Write the trained reward model to ``<run dir>/export`` when ``fit`` ends.
            export_dtype: Weight dtype of the export (null keeps the training dtype).
            disable_dropout: Set every dropout (model, LoRA adapter) to 0, as for DPO; false keeps it.
            padding_free: Run each micro-batch with its sequences laid end to end in rows no longer than the padded
                ones, so no arithmetic is spent on padding (same scores to float rounding; pays when lengths vary).
        """
        policy = policy if policy is not None else PolicyModel(critic=CriticSettings(kind="shared"))
        if policy.critic is None:
            policy.add_critic(CriticSettings(kind="shared"))
        assert policy.critic is not None  # added above when missing
        if policy.critic.separate:
            raise AlignConfigError(
                "model.policy.critic.kind: expected 'shared' or a null critic (a reward model "
                "scores with a head on its own backbone), got 'separate'"
            )
        if not bool(policy.critic.head.proj.weight.any()):  # a fresh (zero) head; a trained one is kept
            init_reward_head(policy)
        policy.critic.head.proj.bias.requires_grad_(False)
        super().__init__(policy, optimizer, scheduler, disable_dropout)
        self.use_margin = use_margin
        self.scorer = Scorer(self.policy, padding_free=padding_free)
        """Scores each sequence at its last real token (the shared critic's scalar head)."""
        self.export = export
        self.export_dtype = export_dtype
        self._window = PairMetrics()
        self._val = PairMetrics()

    # ------------------------------------------------------------------ shared
    def pair_scores(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen, rejected)`` scores, each ``(B,)``, from one forward pass over all ``2B`` rows."""
        scores = self.scorer.sequence_scores(batch.input_ids, batch.attention_mask)  # (2B,)
        chosen, rejected = scores.chunk(2)
        return chosen, rejected

    def _loss_and_stats(self, batch: PreferenceBatch) -> tuple[torch.Tensor, dict]:
        chosen, rejected = self.pair_scores(batch)
        margin = batch.margin.to(chosen.device) if self.use_margin else None
        loss, accuracy = bradley_terry_loss(chosen, rejected, margin)  # per-pair means over the micro-batch
        n = batch.num_pairs
        stats = dict(
            loss=loss.detach() * n,
            accuracy=accuracy * n,
            margin=(chosen - rejected).detach().sum(),
            score_chosen=chosen.detach().sum(),
            score_rejected=rejected.detach().sum(),
        )
        return loss * n, stats

    # ------------------------------------------------------------------ training
    def training_step(self, batch: PreferenceBatch, batch_idx: int) -> torch.Tensor:
        loss_sum, stats = self._loss_and_stats(batch)
        self._window.add(batch.num_pairs, **stats)
        return self.window_loss(loss_sum, batch.window_pairs)[0]

    def on_train_start(self) -> None:
        self._window = PairMetrics()

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.accumulating():  # DeepSpeed: called after every micro-batch; wait for the window's end
            return
        m = self._window.means(self) if self.logs_this_step() else {}
        if m:
            self.log_step(
                {
                    "train/loss": m["loss"],
                    "rm/accuracy": m["accuracy"],
                    **{f"rm/{name}": m[name] for name in ("margin", "score_chosen", "score_rejected")},
                    "train/pairs_per_s": m["pairs_per_s"],
                }
            )
        self._window = PairMetrics()

    # ------------------------------------------------------------------ validation
    def on_validation_epoch_start(self) -> None:
        self._val = PairMetrics()

    def validation_step(self, batch: PreferenceBatch, batch_idx: int) -> None:
        _, stats = self._loss_and_stats(batch)
        self._val.add(batch.num_pairs, **stats)

    def on_validation_epoch_end(self) -> None:
        m = self._val.means(self)
        if m:
            self.log("val/loss", m["loss"], batch_size=1)
            for name in ("accuracy", "margin", "score_chosen", "score_rejected"):
                self.log(f"val/rm_{name}", m[name], batch_size=1)

    # ------------------------------------------------------------------ export
    def encoding_spec(self) -> dict:
        trainer = self._trainer
        dm: Any = trainer.datamodule if trainer is not None else None  # type: ignore[attr-defined]  # Lightning sets it
        return dm.encoding_spec() if hasattr(dm, "encoding_spec") else {}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["align"]["reward"] = {"encoding": self.encoding_spec()}

    def export_dir(self) -> Path:
        return Path(self.trainer.log_dir or self.trainer.default_root_dir) / "export"

    def on_fit_end(self) -> None:
        if self.export and self.trainer.is_global_zero and not self.trainer.interrupted:
            # torch_dtype also takes the short names (fp32, bf16, fp16) that DType leaves out.
            dtype = cast("DType | None", self.export_dtype)
            save_reward_model(self.policy, self.export_dir(), self.encoding_spec(), dtype=dtype)
