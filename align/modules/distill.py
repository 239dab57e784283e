"""On-policy distillation: the student samples, a teacher scores the student's tokens, the student moves toward it.

Two objectives (``objective``), both on the student's own samples (:mod:`align.core.distillation`):

* ``reverse_kl`` (the on-policy distillation recipe; Agarwal et al. 2024, arXiv 2306.13649; Lu & Thinking Machines
  2025): each sampled token's advantage is ``log pi_T(y_t) - log pi_S(y_t)``, minus its reverse-KL estimate, with no
  discounting, and the update minimises a policy loss of the ``POLICY_LOSSES`` table (``policy_loss``, ``clip``;
  with one step per rollout the clipped surrogate's gradient is the plain ``-A_t * grad log pi_S(y_t)``). The dense
  per-token signal needs no reward and no group: ``group_size`` 1 is the default.
* ``gkd`` (GKD, Agarwal et al. 2024): the generalized Jensen-Shannon divergence ``JSD(beta)`` between the teacher's
  and the student's whole next-token distributions at every response position, minimised directly (``beta`` 0: the
  forward KL, 1: the reverse KL). With ``lmbda < 1`` a step trains, with probability ``1 - lmbda``, on the data's
  reference completions (``completion_column``) instead of the student's samples (GKD's mixed data); the draw is
  seeded by the step, so it is the same on every rank and after a resume.

Both are compared at the sampling temperature (``sampling.temperature``; 1 for greedy): the student's and the
teacher's log-probs are divided by it, as the sampler draws, so the student learns the teacher's tempered
distribution, the one the teacher was trained and is used at (the tiny GRPO teacher, trained at 0.3, has 0.22 nats of
entropy per token there and 6.14 untempered: matching the untempered one flattens the student).

The teacher is any causal LM that shares the student's tokenizer. It is loaded as the policy's reference model
(:mod:`align.models.reference`: frozen, in eval mode, on the policy's device and dtype, sharded like the policy under
FSDP2 and ZeRO-3), so ``policy.reference_model`` must be unset or name the teacher, and the RL base's ``kl`` block
stays off (the teacher takes the reference's place). Checkpoints leave the teacher out (it is loaded from
``teacher`` again on resume), so they are the size of a student's. The task's ``rewards`` are only scored and logged
(``rollout/reward_mean``, ``val/accuracy``): nothing is trained on them. The teacher's own held-out numbers are
measured once, in the first held-out pass, and logged with every pass as ``val/teacher_reward_mean`` and
``val/teacher_accuracy`` (not under FSDP2 or ZeRO-3, where the teacher's weights are sharded).

Logged per step: ``train/loss``, ``distill/reverse_kl`` (the mean per-token estimate ``log pi_S - log pi_T`` over
the sampled tokens; ``reverse_kl`` objective), ``distill/jsd`` (the mean divergence per token; ``gkd``),
``distill/on_policy`` (1 when the step trained on the student's samples), ``train/clipfrac`` and ``train/approx_kl``
(``reverse_kl``), ``train/entropy``, and the rollout metrics of GRPO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, cast

import torch
from torch import nn

from align.core.distillation import generalized_jsd, reverse_kl_advantages
from align.core.losses import aggregate
from align.core.masks import masked_mean
from align.data.prompts import PromptBatch
from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.modules.learner import RLBatch, as_token_mean, policy_loss_terms
from align.modules.options import ClipRange, PolicyLoss
from align.modules.rl import RLModule
from align.observability.timing import Timer
from align.rollout.evaluation import Evaluator
from align.rollout.given import given_rollout
from align.rollout.rewards import RewardSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Objective = Literal["reverse_kl", "gkd"]

TEACHER_PREFIX = "policy.ref_model."
"""Where the teacher's weights sit in the module's state dict (left out of checkpoints)."""


class _Teacher(nn.Module):
    """The teacher as the engines see a policy: its model and the student's tokenizer (for held-out sampling, single
    completions or environment episodes)."""

    def __init__(self, model: nn.Module, tokenizer):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer


class DistillModule(RLModule):
    """On-policy distillation on prompt data (:class:`align.data.prompts.PromptDataModule`), manual optimization.

    ``trainer.max_steps`` counts optimizer steps: ``updates.epochs * updates.minibatches`` per rollout.
    """

    headline_metrics = ("val/reward_mean", "val/accuracy", "val/teacher_accuracy")
    progress_metrics = ("distill/reverse_kl", "distill/jsd", "train/loss", "rollout/reward_mean")
    needs_reference = True  # the teacher is loaded and scored as the reference

    def __init__(
        self,
        policy: PolicyModel | None = None,
        teacher: str = "tiny-sort-grpo",
        objective: Objective = "reverse_kl",
        beta: float = 0.5,
        lmbda: float = 1.0,
        completion_column: str = "answer",
        rewards: list[RewardSpec | str] | None = None,
        group_size: int = 1,
        clip: ClipRange = ClipRange(),
        policy_loss: PolicyLoss = PolicyLoss(),
        **kwargs,
    ):
        """
        Args:
            policy: The student; null means the shipped SFT-warmed tiny model (``tiny-sort``).
            teacher: The teacher: a model id or folder sharing the student's tokenizer (null: ``tiny-sort-grpo``,
                ``tiny-sort`` after the GRPO recipe).
            objective: ``reverse_kl`` (the teacher's token log-probs as per-token advantages) or ``gkd``
                (generalized JSD over whole next-token distributions).
            beta: ``gkd``: the JSD's interpolation, 0 the forward KL ``KL(teacher || student)``, 1 the reverse KL.
            lmbda: ``gkd``: the share of steps on the student's own samples; the rest train on the data's
                ``completion_column`` (1: always on-policy).
            completion_column: ``gkd`` with ``lmbda < 1``: the data column holding each prompt's reference completion.
            rewards: The task's rewards, only scored and logged (``val/accuracy``); null: exact match on the sort task.
            group_size: Completions sampled per prompt.
            clip: ``reverse_kl``: the clip range of ``policy_loss`` (null: the loss's own).
            policy_loss: ``reverse_kl``: the policy loss over the per-token advantages (``clip`` by default).
        """
        if objective not in ("reverse_kl", "gkd"):
            raise AlignConfigError(f"model.objective: expected reverse_kl or gkd, got {objective!r}")
        if not 0.0 <= beta <= 1.0:
            raise AlignConfigError(f"model.beta: expected a value in [0, 1], got {beta}")
        if not 0.0 <= lmbda <= 1.0:
            raise AlignConfigError(f"model.lmbda: expected a value in [0, 1], got {lmbda}")
        if objective == "reverse_kl" and lmbda != 1.0:
            raise AlignConfigError(
                f"model.lmbda: the reverse_kl objective trains on the student's samples only; "
                f"expected 1 (or objective: gkd), got {lmbda}"
            )
        if not isinstance(teacher, str) or not teacher.strip():
            raise AlignConfigError(f"model.teacher: expected a model id or folder, got {teacher!r}")
        policy_loss.clip_bounds(clip)
        kl = kwargs.get("kl")
        if kl is not None and kl.enabled:
            raise AlignConfigError(
                f"model.kl.coef: distillation pulls the student toward the teacher, which takes the "
                f"reference's place; expected 0 and no kl.target, got coef {kl.coef}"
            )
        policy = policy if policy is not None else PolicyModel("tiny-sort")
        reference = policy.spec.get("reference_model")
        if reference and reference != teacher:
            raise AlignConfigError(
                f"model.policy.reference_model: the teacher is loaded as the reference, so it must "
                f"be unset or equal model.teacher ({teacher!r}), got {reference!r}"
            )
        policy.spec["reference_model"] = teacher
        if rewards is None and kwargs.get("environment") is None:
            rewards = [RewardSpec("align.rewards.sort_exact_match")]
        super().__init__(policy, rewards=rewards, group_size=group_size, **kwargs)
        self.teacher, self.objective, self.beta, self.lmbda = teacher, objective, beta, lmbda
        self.completion_column, self.clip, self.policy_loss = completion_column, clip, policy_loss
        self.teacher_scores: dict[str, float] | None = None

    def setup(self, stage: str) -> None:
        super().setup(stage)
        teacher_model = self.policy.ref_model
        assert teacher_model is not None  # loaded by RLModule.setup: the policy's reference_model is the teacher
        # A transformers model, whose config PolicyModel's nn.Module annotation does not show.
        student, teacher = self.policy.config.vocab_size, cast("PretrainedConfig", teacher_model.config).vocab_size
        if student != teacher:
            raise AlignConfigError(
                f"model.teacher: {self.teacher!r} has a vocabulary of {teacher} tokens and the "
                f"student {student}; expected a teacher that shares the student's tokenizer"
            )

    # ------------------------------------------------------------------ checkpoints without the teacher
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The teacher is frozen and loaded from model.teacher: a checkpoint does not carry a copy of it.
        super().on_save_checkpoint(checkpoint)
        state = checkpoint.get("state_dict")
        if state is not None:
            for key in [k for k in state if k.startswith(TEACHER_PREFIX)]:
                del state[key]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Before Lightning loads the state: the teacher's weights are the ones loaded from model.teacher.
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("state_dict")
        if state is not None and self.policy.ref_model is not None:
            for key, value in self.policy.ref_model.state_dict().items():
                state.setdefault(TEACHER_PREFIX + key, value)

    # ------------------------------------------------------------------ a step
    def on_student_samples(self) -> bool:
        """Whether this step trains on the student's samples: always for ``lmbda`` 1, else a draw seeded by the
        optimizer step (the same on every rank, and after a resume)."""
        if self.lmbda >= 1.0:
            return True
        generator = torch.Generator().manual_seed(1_000_003 * self.learner.steps + 7)
        return float(torch.rand((), generator=generator)) < self.lmbda

    def _reverse_kl_loss(self, micro: RLBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict]:
        out = self.scorer.logprobs(micro, entropy=self.log_entropy)
        loss, metrics = policy_loss_terms(micro, normaliser, out, self.policy_loss, self.clip, self.updates)
        assert micro.ref_logprobs is not None  # the teacher's, put there by training_step
        metrics["distill/reverse_kl"] = masked_mean(out.logprobs.detach() - micro.ref_logprobs, micro.response_mask)
        metrics["train/loss"] = as_token_mean(loss, normaliser, micro.response_mask)
        return loss, metrics

    def _gkd_loss(self, micro: RLBatch, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict]:
        mask = micro.response_mask
        student = self.scorer.response_logits(micro)
        with torch.no_grad():
            teacher = self.scorer.response_logits(micro, reference=True)
        per_token = generalized_jsd(student, teacher, self.beta, self.scorer.temperature)  # (n, R)
        loss = aggregate(per_token, mask, self.updates.loss_aggregation, normaliser)
        return loss, {
            "train/loss": as_token_mean(loss, normaliser, mask),
            "distill/jsd": masked_mean(per_token.detach(), mask),
        }

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        if self.on_student_samples():
            scored = self.next_scored(batch)
            if scored is None:  # a filtered source: the next batch adds to this update's groups
                return
            rollout, metrics = scored.rollout, {**self.sampler.rollout_metrics(scored), "distill/on_policy": 1.0}
        else:
            rollout = given_rollout(self.policy, batch, self.completion_column, self.sampler.max_response_tokens)
            metrics, self.timings = {"distill/on_policy": 0.0}, {}
        with Timer(self.timings, "time/update_s"):
            if self.objective == "gkd":
                data = RLBatch.from_rollout(rollout, torch.zeros_like(rollout.old_logprobs))
                stats = self.update(data, self._gkd_loss)
            else:
                teacher = self.scorer.reference_logprobs(rollout)  # (N, R) the teacher's log-probs of the samples
                advantages = reverse_kl_advantages(rollout.old_logprobs, teacher, rollout.response_mask)
                stats = self.update(RLBatch.from_rollout(rollout, advantages, teacher), self._reverse_kl_loss)
        self.log_metrics({**metrics, **stats, **self.timings})

    # ------------------------------------------------------------------ the teacher's held-out numbers
    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        self.teacher_held_out = Evaluator(self.accuracy_reward, self.accuracy_threshold, self.device)

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        if self.teacher_scores is None and self._teacher_is_whole():
            assert self.policy.ref_model is not None  # the teacher, loaded by setup
            view = _Teacher(self.policy.ref_model, self.policy.tokenizer)
            rollout = self.sampler.rollout(batch, 1, self.sampler.eval_engine, policy=view)
            self.teacher_held_out.add(rollout, *self.sampler.score(batch, rollout))

    def on_validation_epoch_end(self) -> None:
        if self.teacher_scores is None and self.teacher_held_out.count:
            means = self.teacher_held_out.means(self.all_reduce_sum)
            self.teacher_scores = {f"val/teacher_{k}": means[k] for k in ("reward_mean", "accuracy")}
        super().on_validation_epoch_end()
        if self.teacher_scores is not None:
            self.log_dict(self.teacher_scores, batch_size=1)

    def _teacher_is_whole(self) -> bool:
        # Sampling runs the teacher's weights directly: not when FSDP2 or ZeRO-3 shards them, nor in Lightning's
        # sanity check (a few batches, not the held-out set).
        from align.trainer.strategies import parameters_sharded

        trainer = self._trainer
        return trainer is None or not (trainer.sanity_checking or parameters_sharded(trainer.strategy))
