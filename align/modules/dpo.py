"""Direct preference optimisation (Rafailov et al. 2023, arXiv 2305.18290) and its variants.

Each step runs chosen and rejected responses through **one** concatenated forward pass (``2B`` rows, see
:class:`~align.data.preference.PreferenceBatch`); only the response positions go through the LM head. Sequence
log-probs are sums over response tokens (turn end and EOS included).

Loss variants (``loss_type``), chosen in one place (:data:`PREFERENCE_LOSSES`), each calling ``align.losses``:

* ``sigmoid``: DPO. ``conservative``: cDPO, DPO with ``label_smoothing`` > 0 (labels flipped with that probability).
* ``ipo``: IPO (Azar et al. 2023, arXiv 2310.12036), on per-token *mean* log-probs so the target margin
  ``1 / (2 beta)`` is on the scale of ``h``.
* ``hinge``: SLiC-HF (Zhao et al. 2023, arXiv 2305.10425).
* ``simpo``: SimPO (Meng et al. 2024, arXiv 2405.14734): length-normalised and reference-free (``beta``, ``gamma``).

``rpo_alpha`` > 0 adds ``alpha`` times the chosen response's per-token NLL to each pair's loss (RPO, Pang et al.
2024, arXiv 2404.19733). Departure: the NLL is a per-pair mean over the chosen tokens, so the whole loss stays a
per-pair mean and is exactly invariant to how a step is split into micro-batches.

Reference log-probs: live from ``PolicyModel.setup_reference()`` (with LoRA the adapter-disabled policy, no copy;
otherwise a frozen copy or ``reference_model``), or with ``precompute_reference`` computed once before the first
update and cached (:class:`ReferenceCache`): no reference forward during training, and no frozen copy is kept.

Normalisation: the loss of an optimizer step is the mean over every pair of the accumulation window on all ranks,
so accumulating 8 x 1 equals 1 x 8. Accuracy counts a tie (implicit rewards equal, as for the untrained policy,
which *is* its reference) as half right, so the untrained model scores exactly chance.

Logged per optimizer step: ``train/loss``, ``dpo/accuracy``, ``dpo/margin`` (mean chosen - rejected implicit
reward), ``dpo/rewards_chosen``, ``dpo/rewards_rejected``, ``dpo/logps_chosen``, ``dpo/logps_rejected``,
``dpo/nll_chosen`` (with ``rpo_alpha``), ``train/pairs_per_s``. Held out: ``val/loss`` and ``val/dpo_<same>``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Callable, Literal, NamedTuple

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from align.data.preference import PreferenceBatch, PreferenceDataset
from align.errors import AlignConfigError
from align.logprobs import masked_sum
from align.losses import dpo_loss, simpo_loss
from align.models.policy import PolicyModel
from align.modules.base import AlignModule, PairMetrics

log = logging.getLogger(__name__)

LossType = Literal["sigmoid", "conservative", "ipo", "hinge", "simpo"]


class PairLogps(NamedTuple):
    """Summed response log-probs of a micro-batch of ``B`` pairs."""

    chosen: torch.Tensor  # (B,) policy, with grad
    rejected: torch.Tensor  # (B,)
    chosen_tokens: torch.Tensor  # (B,) response lengths
    rejected_tokens: torch.Tensor  # (B,)
    ref_chosen: torch.Tensor | None  # (B,) no grad; None for reference-free losses
    ref_rejected: torch.Tensor | None  # (B,)


def _sigmoid(x: PairLogps, m: "DPOModule"):
    return dpo_loss(x.chosen, x.rejected, x.ref_chosen, x.ref_rejected, m.beta, "sigmoid")


def _conservative(x: PairLogps, m: "DPOModule"):
    return dpo_loss(x.chosen, x.rejected, x.ref_chosen, x.ref_rejected, m.beta, "sigmoid", m.label_smoothing)


def _ipo(x: PairLogps, m: "DPOModule"):
    nc, nr = x.chosen_tokens.clamp(min=1), x.rejected_tokens.clamp(min=1)
    return dpo_loss(x.chosen / nc, x.rejected / nr, x.ref_chosen / nc, x.ref_rejected / nr, m.beta, "ipo")


def _hinge(x: PairLogps, m: "DPOModule"):
    return dpo_loss(x.chosen, x.rejected, x.ref_chosen, x.ref_rejected, m.beta, "hinge")


def _simpo(x: PairLogps, m: "DPOModule"):
    return simpo_loss(x.chosen, x.rejected, x.chosen_tokens, x.rejected_tokens, m.beta, m.gamma)


PREFERENCE_LOSSES: dict[str, Callable[[PairLogps, "DPOModule"], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
    "sigmoid": _sigmoid,
    "conservative": _conservative,
    "ipo": _ipo,
    "hinge": _hinge,
    "simpo": _simpo,
}
REFERENCE_FREE = frozenset({"simpo"})


def batch_to(batch: PreferenceBatch, device: torch.device) -> PreferenceBatch:
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


def sequence_logps(policy: PolicyModel, batch: PreferenceBatch, reference: bool = False) -> torch.Tensor:
    """Summed response log-probs of all ``2B`` rows from one forward pass. ``(2B,)``"""
    scores = policy.score(batch.input_ids, batch.attention_mask, response_length=batch.response_length,
                          reference=reference)
    return masked_sum(scores.logprobs, batch.response_mask, dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# reference cache


def reference_fingerprint(policy: PolicyModel) -> str:
    """sha256 of the reference's identity: model spec and the bytes of every weight the reference uses.

    With LoRA the reference is the adapter-disabled policy (its base weights; adapter weights are skipped); with a
    loaded ``reference_model`` it is that model; otherwise the policy's *current* weights, which are the reference
    only before the first update (the caller checks that).
    """
    spec = {k: policy.spec.get(k) for k in ("model", "revision", "dtype", "quantization", "reference_model")}
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    model = policy.ref_model if policy.ref_model is not None else policy.model
    for name, tensor in sorted(model.state_dict().items()):
        if policy.ref_model is None and policy.has_adapter and "lora_" in name:
            continue
        h.update(name.encode())
        h.update(str(tensor.dtype).encode())
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ReferenceCache:
    """Reference log-probs of every pair of a dataset, stored as safetensors (no pickle, safe to load).

    The file name and its metadata carry the key: sha256 of the tokenized pairs (:attr:`PreferenceDataset.fingerprint`)
    and the reference fingerprint. Loading checks format, key and shapes, and recomputes on any mismatch.
    """

    FORMAT = "align-dpo-reference-logps"
    VERSION = "1"

    def __init__(self, chosen: torch.Tensor, rejected: torch.Tensor):
        self.chosen, self.rejected = chosen, rejected  # (N,) each, float32

    @staticmethod
    def key(data_fingerprint: str, ref_fingerprint: str) -> str:
        return hashlib.sha256(f"{data_fingerprint}:{ref_fingerprint}".encode()).hexdigest()

    @classmethod
    def path(cls, directory: str | Path, key: str) -> Path:
        return Path(directory) / f"ref-logps-{key[:24]}.safetensors"

    def save(self, path: Path, key: str) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"chosen": self.chosen.contiguous(), "rejected": self.rejected.contiguous()}, str(tmp),
                  metadata={"format": self.FORMAT, "version": self.VERSION, "key": key, "pairs": str(len(self.chosen))})
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, key: str, pairs: int) -> "ReferenceCache | None":
        """The cache at ``path`` if it is valid for ``key`` and ``pairs``; ``None`` (with a warning) otherwise."""
        from safetensors import safe_open

        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                chosen, rejected = f.get_tensor("chosen"), f.get_tensor("rejected")
        except Exception as err:  # noqa: BLE001 - any unreadable file is recomputed
            log.warning("reference cache %s is unreadable (%s); recomputing", path, err)
            return None
        expected = {"format": cls.FORMAT, "version": cls.VERSION, "key": key, "pairs": str(pairs)}
        bad = {k: meta.get(k) for k, v in expected.items() if meta.get(k) != v}
        if bad or chosen.shape != (pairs,) or rejected.shape != (pairs,) or not bool(
                torch.isfinite(chosen).all() and torch.isfinite(rejected).all()):
            log.warning("reference cache %s does not match this data/reference (%s); recomputing", path, bad or "shape")
            return None
        return cls(chosen.float(), rejected.float())


# ---------------------------------------------------------------------------------------------------------------
# module


class DPOModule(AlignModule):
    headline_metrics = ("val/dpo_accuracy", "val/dpo_margin", "val/loss")

    def __init__(
        self,
        policy: PolicyModel | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        scheduler: LRSchedulerCallable | None = None,
        loss_type: LossType = "sigmoid",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        gamma: float = 1.0,
        rpo_alpha: float = 0.0,
        precompute_reference: bool = False,
        reference_cache_dir: str | None = None,
        disable_dropout: bool = True,
    ):
        """
        Args:
            policy: The model to train (LoRA recommended: its reference is the adapter-disabled policy). Null means
                the embedded tiny model.
            optimizer: Optimizer callable (parameters -> optimizer); matrices get weight decay, vectors do not.
            scheduler: Learning-rate schedule callable (optimizer -> scheduler), stepped every optimizer step.
            loss_type: ``sigmoid`` (DPO), ``conservative`` (cDPO), ``ipo``, ``hinge`` (SLiC) or ``simpo``.
            beta: Inverse temperature of the implicit reward (IPO's tau; SimPO's reward scale).
            label_smoothing: Assumed label-flip probability for ``conservative``, in (0, 0.5).
            gamma: SimPO's target reward margin.
            rpo_alpha: Weight of the NLL of the chosen responses added to the loss (RPO); 0 turns it off.
            precompute_reference: Compute reference log-probs once before training and cache them (no reference
                forward while training, no frozen copy of the model).
            reference_cache_dir: Where cached reference log-probs are kept; null: ``<default_root_dir>/ref_cache``.
            disable_dropout: Set every dropout (model, LoRA adapter) to 0, so that the policy and reference
                passes over a pair are deterministic; false keeps the model's dropout.
        """
        super().__init__(policy if policy is not None else PolicyModel(), optimizer, scheduler, disable_dropout)
        if loss_type not in PREFERENCE_LOSSES:
            raise AlignConfigError(f"model.loss_type: expected one of {sorted(PREFERENCE_LOSSES)}, got {loss_type!r}")
        if beta <= 0:
            raise AlignConfigError(f"model.beta: expected > 0, got {beta}")
        if loss_type == "conservative" and not 0.0 < label_smoothing < 0.5:
            raise AlignConfigError(f"model.label_smoothing: loss_type 'conservative' needs a value in (0, 0.5), "
                                   f"got {label_smoothing}")
        if label_smoothing and loss_type != "conservative":
            raise AlignConfigError(f"model.label_smoothing applies to loss_type 'conservative' only, not {loss_type!r}")
        if rpo_alpha < 0:
            raise AlignConfigError(f"model.rpo_alpha: expected >= 0, got {rpo_alpha}")
        self.loss_type, self.beta, self.label_smoothing, self.gamma = loss_type, beta, label_smoothing, gamma
        self.rpo_alpha = rpo_alpha
        self.needs_reference = loss_type not in REFERENCE_FREE
        self.precompute_reference = precompute_reference and self.needs_reference
        self.reference_cache_dir = reference_cache_dir
        self._caches: dict[str, ReferenceCache] = {}
        self._ref_fingerprint: str | None = None
        self._window = PairMetrics()
        self._val = PairMetrics()

    def setup(self, stage: str) -> None:
        if self.needs_reference and not self.precompute_reference:
            self.policy.setup_reference()  # before any checkpoint is restored, so a frozen copy is the initial model

    # ------------------------------------------------------------------ reference log-probs
    def _datasets(self) -> dict[str, PreferenceDataset]:
        dm = self.trainer.datamodule
        return {name: ds for name, ds in (("train", getattr(dm, "train_set", None)), ("val", getattr(dm, "val_set", None)))
                if ds is not None}

    def _live_reference(self) -> bool:
        """Whether the reference can still be run after updates (LoRA, or a separately loaded model)."""
        return self.policy.has_adapter or bool(self.policy.spec.get("reference_model"))

    def _fingerprint(self) -> str:
        if self._live_reference():
            self.policy.setup_reference()
            return reference_fingerprint(self.policy)
        if self._ref_fingerprint is None:
            if self.global_step > 0:
                raise AlignConfigError("model.precompute_reference: the cached reference log-probs are gone and the "
                                       "policy has been updated, so it is no longer the reference; keep "
                                       "reference_cache_dir across resumes or set precompute_reference false")
            self._ref_fingerprint = reference_fingerprint(self.policy)
        return self._ref_fingerprint

    @torch.no_grad()
    def _compute_cache(self, dataset: PreferenceDataset) -> ReferenceCache:
        dm = self.trainer.datamodule
        chosen, rejected = torch.zeros(len(dataset)), torch.zeros(len(dataset))
        # Without LoRA or a loaded reference, the policy before its first update is the reference itself.
        reference = self.policy.has_adapter or self.policy.ref_model is not None
        was_training = self.policy.training
        self.policy.eval()
        try:
            for batch in dm.eval_dataloader(dataset):
                batch = batch_to(batch, self.device)
                c, r = sequence_logps(self.policy, batch, reference=reference).float().cpu().chunk(2)
                chosen[batch.index.cpu()], rejected[batch.index.cpu()] = c, r
        finally:
            self.policy.train(was_training)
        return ReferenceCache(chosen, rejected)

    def prepare_reference(self, splits: tuple[str, ...] = ("train", "val")) -> None:
        """Load or compute the cached reference log-probs of the named splits (all splits at the first call)."""
        missing = {n: ds for n, ds in self._datasets().items() if n not in self._caches}
        if not missing or not any(n in missing for n in splits):
            return
        ref = self._fingerprint()
        directory = self.reference_cache_dir or str(Path(self.trainer.default_root_dir) / "ref_cache")
        for name, dataset in missing.items():  # every split now: later the policy is no longer the reference
            key = ReferenceCache.key(dataset.fingerprint, ref)
            path = ReferenceCache.path(directory, key)
            cache = ReferenceCache.load(path, key, len(dataset))
            if cache is None:
                if self.global_step > 0 and not self._live_reference():
                    raise AlignConfigError(f"model.precompute_reference: no valid cache at {path} and the policy has "
                                           "been updated, so it is no longer the reference; keep reference_cache_dir "
                                           "across resumes or set precompute_reference false")
                cache = self._compute_cache(dataset)
                if self.trainer.is_global_zero:
                    cache.save(path, key)
                log.info("reference log-probs of %d %s pairs cached at %s", len(dataset), name, path)
            self._caches[name] = cache
        if self.policy.ref_model is not None:
            self.policy.ref_model = None  # the cache replaces it; checkpoints stay free of it

    def on_validation_start(self) -> None:
        if self.precompute_reference:
            self.prepare_reference(("val",))

    def on_train_start(self) -> None:
        if self.precompute_reference:
            self.prepare_reference(("train", "val"))
        self._window = PairMetrics()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["align"]["reference_fingerprint"] = self._ref_fingerprint

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._ref_fingerprint = (checkpoint.get("align") or {}).get("reference_fingerprint")

    def _reference_logps(self, batch: PreferenceBatch, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.precompute_reference:
            cache = self._caches[split]
            index = batch.index.cpu()
            return cache.chosen[index].to(self.device), cache.rejected[index].to(self.device)
        with torch.no_grad():
            return sequence_logps(self.policy, batch, reference=True).chunk(2)

    # ------------------------------------------------------------------ loss
    def pair_logps(self, batch: PreferenceBatch, split: str = "train") -> PairLogps:
        logps = sequence_logps(self.policy, batch)  # (2B,) one forward pass for chosen and rejected
        tokens = batch.response_mask.sum(-1).to(logps.dtype)  # (2B,)
        chosen, rejected = logps.chunk(2)
        ref = self._reference_logps(batch, split) if self.needs_reference else (None, None)
        return PairLogps(chosen, rejected, *tokens.chunk(2), *ref)

    def _loss_and_stats(self, batch: PreferenceBatch, split: str) -> tuple[torch.Tensor, dict]:
        """Sum over the micro-batch's pairs of the per-pair loss, and sums of the per-pair statistics."""
        x = self.pair_logps(batch, split)
        losses, rewards_chosen, rewards_rejected = PREFERENCE_LOSSES[self.loss_type](x, self)  # (B,) each
        stats = {}
        if self.rpo_alpha:
            nll = -x.chosen / x.chosen_tokens.clamp(min=1)  # (B,) per-token NLL of each chosen response
            losses = losses + self.rpo_alpha * nll
            stats["nll_chosen"] = nll.detach().sum()
        correct = (rewards_chosen > rewards_rejected).float() + 0.5 * (rewards_chosen == rewards_rejected).float()
        stats.update(loss=losses.detach().sum(), accuracy=correct.sum(),
                     margin=(rewards_chosen - rewards_rejected).sum(), rewards_chosen=rewards_chosen.sum(),
                     rewards_rejected=rewards_rejected.sum(), logps_chosen=x.chosen.detach().sum(),
                     logps_rejected=x.rejected.detach().sum())
        return losses.sum(), stats

    def training_step(self, batch: PreferenceBatch, batch_idx: int) -> torch.Tensor:
        loss_sum, stats = self._loss_and_stats(batch, "train")
        self._window.add(batch.num_pairs, **stats)
        return self.window_loss(loss_sum, batch.window_pairs)[0]

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.accumulating():  # DeepSpeed: called after every micro-batch; wait for the window's end
            return
        m = self._window.means(self)
        if m:
            self.log("train/loss", m.pop("loss"), on_step=True, prog_bar=True, batch_size=1)
            self.log("train/pairs_per_s", m.pop("pairs_per_s"), on_step=True, batch_size=1)
            for name, value in m.items():
                self.log(f"dpo/{name}", value, on_step=True, prog_bar=name == "accuracy", batch_size=1)
        self._window = PairMetrics()

    # ------------------------------------------------------------------ validation
    def on_validation_epoch_start(self) -> None:
        self._val = PairMetrics()

    def validation_step(self, batch: PreferenceBatch, batch_idx: int) -> None:
        _, stats = self._loss_and_stats(batch, "val")
        self._val.add(batch.num_pairs, **stats)

    def on_validation_epoch_end(self) -> None:
        m = self._val.means(self)
        if m:
            m.pop("pairs_per_s")
            self.log("val/loss", m.pop("loss"), batch_size=1)
            for name, value in m.items():
                self.log(f"val/dpo_{name}", value, batch_size=1)
