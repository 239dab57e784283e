"""Reference log-probs of preference pairs, computed once and kept on disk (DPO's ``precompute_reference``).

A preference loss needs the reference model's summed response log-probs of every pair. They do not change while
the policy trains, so they can be computed once before the first update: then no reference forward runs per step
and no frozen copy of the model is kept.

* :class:`ReferenceCache` is one file: the log-probs of every pair of one dataset, as safetensors (no pickle, safe
  to load), keyed by content (the tokenized pairs and the reference weights), so a rerun over the same data and
  reference finds it and any change computes a new one.
* :class:`CachedReference` holds a run's caches, one per data split, and decides when one may be computed.

Without LoRA or a separately loaded reference model the reference *is* the policy before its first update. Every
split is then prepared at the first call, and the reference fingerprint is taken once and kept
(:attr:`CachedReference.fingerprint`, stored in checkpoints by the caller): after an update a missing cache can no
longer be computed, and a resume finds the files by that stored fingerprint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.models.scorer import Scorer

if TYPE_CHECKING:
    from align.data.preference import PreferenceBatch, PreferenceDataset

log = logging.getLogger(__name__)


def batch_to(batch: PreferenceBatch, device: torch.device) -> PreferenceBatch:
    """``batch`` with every tensor field on ``device``."""
    return dataclasses.replace(
        batch,
        **{
            f.name: getattr(batch, f.name).to(device)
            for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)
        },
    )


def live_reference(policy: PolicyModel) -> bool:
    """Whether the reference can still be run after updates (LoRA, or a separately loaded model)."""
    return policy.has_adapter or bool(policy.spec.get("reference_model"))


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

    @classmethod
    @torch.no_grad()
    def compute(
        cls, scorer: Scorer, batches: Iterable[PreferenceBatch], pairs: int, device: torch.device
    ) -> ReferenceCache:
        """Reference log-probs of ``pairs`` pairs from ``batches`` (each pair placed by ``batch.index``), in eval
        mode, scored by ``scorer``. Without LoRA or a loaded reference, the policy itself is the reference (before its
        first update)."""
        chosen, rejected = torch.zeros(pairs), torch.zeros(pairs)
        policy = scorer.policy
        reference = policy.has_adapter or policy.ref_model is not None
        was_training = policy.training
        policy.eval()
        try:
            for batch in batches:
                batch = batch_to(batch, device)
                c, r = scorer.sequence_logps(batch, reference=reference).float().cpu().chunk(2)
                chosen[batch.index.cpu()], rejected[batch.index.cpu()] = c, r
        finally:
            policy.train(was_training)
        return cls(chosen, rejected)

    def save(self, path: Path, key: str) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(
            {"chosen": self.chosen.contiguous(), "rejected": self.rejected.contiguous()},
            str(tmp),
            metadata={"format": self.FORMAT, "version": self.VERSION, "key": key, "pairs": str(len(self.chosen))},
        )
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, key: str, pairs: int) -> ReferenceCache | None:
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
        if (
            bad
            or chosen.shape != (pairs,)
            or rejected.shape != (pairs,)
            or not bool(torch.isfinite(chosen).all() and torch.isfinite(rejected).all())
        ):
            log.warning("reference cache %s does not match this data/reference (%s); recomputing", path, bad or "shape")
            return None
        return cls(chosen.float(), rejected.float())


_NO_LONGER_THE_REFERENCE = (
    "the policy has been updated, so it is no longer the reference; keep reference_cache_dir "
    "across resumes or set precompute_reference false"
)


class CachedReference:
    """A run's reference log-probs, one :class:`ReferenceCache` per data split (``"train"``, ``"val"``)."""

    def __init__(self) -> None:
        self.splits: dict[str, ReferenceCache] = {}
        # The policy-is-reference fingerprint, taken before the first update; None while not taken (or with a
        # live reference, whose weights can be fingerprinted at any time).
        self.fingerprint: str | None = None

    def _reference_fingerprint(self, policy: PolicyModel, updated: bool) -> str:
        if live_reference(policy):
            policy.setup_reference()
            return reference_fingerprint(policy)
        if self.fingerprint is None:
            if updated:
                raise AlignConfigError(
                    "model.precompute_reference: the cached reference log-probs are gone and "
                    + _NO_LONGER_THE_REFERENCE
                )
            self.fingerprint = reference_fingerprint(policy)
        return self.fingerprint

    def prepare(
        self,
        scorer: Scorer,
        datasets: dict[str, PreferenceDataset],
        batches: Callable[[PreferenceDataset], Iterable[PreferenceBatch]],
        directory: str | Path,
        *,
        needed: tuple[str, ...],
        updated: bool,
        device: torch.device,
        write: bool,
        announce: Callable[[str], ContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        """Load or compute the caches of ``datasets`` (split name -> dataset) once one of the ``needed`` splits has
        none: every missing split then, since later the policy may no longer be the reference. ``scorer`` scores
        the pairs (its policy's reference).

        ``batches(dataset)`` iterates a dataset's pairs; ``updated``: whether the policy has taken an optimizer step;
        ``write``: whether this process writes computed caches to ``directory`` (one process of a run);
        ``announce(what)``: a context around each computation, to tell the user (the CLI's phase lines).
        """
        missing = {n: ds for n, ds in datasets.items() if n not in self.splits}
        if not any(n in missing for n in needed):
            return
        policy = scorer.policy
        ref = self._reference_fingerprint(policy, updated)
        for name, dataset in missing.items():
            key = ReferenceCache.key(dataset.fingerprint, ref)
            path = ReferenceCache.path(directory, key)
            cache = ReferenceCache.load(path, key, len(dataset))
            if cache is None:
                if updated and not live_reference(policy):
                    raise AlignConfigError(
                        f"model.precompute_reference: no valid cache at {path} and " + _NO_LONGER_THE_REFERENCE
                    )
                with announce(f"reference log-probs of {len(dataset)} {name} pairs"):
                    cache = ReferenceCache.compute(scorer, batches(dataset), len(dataset), device)
                if write:
                    cache.save(path, key)
                log.info("reference log-probs of %d %s pairs cached at %s", len(dataset), name, path)
            self.splits[name] = cache
        if policy.ref_model is not None:
            policy.ref_model = None  # the cache replaces it; checkpoints stay free of it

    def logps(self, batch: PreferenceBatch, split: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen, rejected)`` reference log-probs of the batch's pairs, each ``(B,)`` on ``device``."""
        cache = self.splits[split]
        index = batch.index.cpu()
        return cache.chosen[index].to(device), cache.rejected[index].to(device)
