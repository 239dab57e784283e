import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from align.data.preference import PreferenceDataModule
from align.errors import AlignConfigError
from align.models import PolicyModel
from align.models.reference_cache import CachedReference, ReferenceCache, batch_to
from align.models.scorer import Scorer


def write_pairs(path, extra: str = "") -> str:
    """Four sorting pairs of different lengths; ``extra`` changes the first chosen response (other data)."""
    rows = []
    for i, letters in enumerate(["c a", "d b a", "e c b a", "b a"]):
        words = letters.split()
        rows.append(
            {
                "prompt": "sort: " + letters,
                "chosen": " ".join(sorted(words)) + (extra if i == 0 else ""),
                "rejected": " ".join(words),
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def train_set(path, policy, batch_size=4):
    dm = PreferenceDataModule(train_files=path, val_files=None, max_length=64, batch_size=batch_size, shuffle=False)
    dm.set_tokenizer(policy.tokenizer)
    dm.setup("fit")
    return dm


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl")


def test_concatenated_forward_equals_separate_forwards(pairs):
    policy = PolicyModel().eval()
    dm = train_set(pairs, policy)
    batch = next(iter(dm.eval_dataloader(dm.train_set)))
    B = batch.num_pairs
    assert B == 4
    with torch.no_grad():
        together = Scorer(policy).sequence_logps(batch)  # (2B,)
        for b, ex in enumerate(dm.train_set.examples):
            for row, response in ((b, ex.chosen_ids), (B + b, ex.rejected_ids)):
                ids = torch.tensor([ex.prompt_ids + response])
                alone = policy.token_logprobs(ids, torch.ones_like(ids), response_length=len(response)).logprobs.sum()
                torch.testing.assert_close(together[row], alone, atol=1e-4, rtol=1e-5)


def test_batch_to_moves_every_tensor(pairs):
    dm = train_set(pairs, PolicyModel(), batch_size=2)
    batch = batch_to(next(iter(dm.eval_dataloader(dm.train_set))), torch.device("cpu"))
    assert batch.input_ids.device.type == "cpu" and batch.num_pairs == 2


def test_cache_validation_rejects_a_mismatched_file(tmp_path):
    cache = ReferenceCache(torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0]))
    path = tmp_path / "c.safetensors"
    cache.save(path, "k1")
    assert ReferenceCache.load(path, "k1", 2) is not None
    assert ReferenceCache.load(path, "k2", 2) is None  # other data/reference
    assert ReferenceCache.load(path, "k1", 3) is None  # other number of pairs
    path.write_bytes(b"not a safetensors file")
    assert ReferenceCache.load(path, "k1", 2) is None


def test_the_on_disk_format_is_pinned(tmp_path):
    # A file written by an earlier version (same names, tensors and metadata) still loads.
    key = "ab" * 32
    path = ReferenceCache.path(tmp_path, key)
    assert path.name == "ref-logps-" + "ab" * 12 + ".safetensors"
    save_file(
        {"chosen": torch.tensor([-1.5]), "rejected": torch.tensor([-2.5])},
        str(path),
        metadata={"format": "align-dpo-reference-logps", "version": "1", "key": key, "pairs": "1"},
    )
    loaded = ReferenceCache.load(path, key, 1)
    assert loaded is not None and float(loaded.chosen[0]) == -1.5 and float(loaded.rejected[0]) == -2.5
    ReferenceCache(torch.tensor([-1.0]), torch.tensor([-2.0])).save(path, key)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "align-dpo-reference-logps", "version": "1", "key": key, "pairs": "1"}


def prepare(policy, path, directory, updated=False, reference=None):
    dm = train_set(path, policy, batch_size=3)
    reference = reference or CachedReference()
    reference.prepare(
        Scorer(policy),
        {"train": dm.train_set},
        dm.eval_dataloader,
        directory,
        needed=("train",),
        updated=updated,
        device=torch.device("cpu"),
        write=True,
    )
    return reference


def test_computed_log_probs_are_the_policys_placed_by_pair_index(pairs, tmp_path):
    policy = PolicyModel()
    reference = prepare(policy, pairs, tmp_path)
    dm = train_set(pairs, policy)
    batch = next(iter(dm.eval_dataloader(dm.train_set)))
    with torch.no_grad():
        live = Scorer(policy.eval()).sequence_logps(batch)
    chosen, rejected = reference.logps(batch, "train", torch.device("cpu"))
    torch.testing.assert_close(torch.cat([chosen, rejected]), live, atol=1e-5, rtol=1e-5)


def test_cache_is_reused_and_invalidated_when_data_or_reference_change(pairs, tmp_path):
    directory = tmp_path / "cache"
    first = prepare(PolicyModel(), pairs, directory)
    files = sorted(directory.glob("*.safetensors"))
    assert len(files) == 1 and first.fingerprint is not None
    # Same data and reference: the file is loaded, not recomputed.
    stamp = files[0].stat().st_mtime_ns
    second = prepare(PolicyModel(), pairs, directory)
    assert files[0].stat().st_mtime_ns == stamp
    torch.testing.assert_close(second.splits["train"].chosen, first.splits["train"].chosen)
    # Different reference weights: a new key.
    prepare(PolicyModel(seed=1), pairs, directory)
    assert len(list(directory.glob("*.safetensors"))) == 2
    # Different data: a new key.
    prepare(PolicyModel(), write_pairs(tmp_path / "other.jsonl", extra=" a"), directory)
    assert len(list(directory.glob("*.safetensors"))) == 3


def test_an_updated_policy_is_not_taken_for_the_reference(pairs, tmp_path):
    with pytest.raises(AlignConfigError, match="no longer the reference"):
        prepare(PolicyModel(), pairs, tmp_path / "a", updated=True)
    # With the fingerprint taken before the update (a resume restores it), the earlier files are found.
    before = prepare(PolicyModel(), pairs, tmp_path / "a")
    resumed = CachedReference()
    resumed.fingerprint = before.fingerprint
    with torch.no_grad():
        for p in (policy := PolicyModel()).parameters():
            p.add_(0.1)  # the update: these weights are no longer the reference
    prepare(policy, pairs, tmp_path / "a", updated=True, reference=resumed)
    torch.testing.assert_close(resumed.splits["train"].chosen, before.splits["train"].chosen)
    elsewhere = CachedReference()
    elsewhere.fingerprint = before.fingerprint
    with pytest.raises(AlignConfigError, match="no valid cache"):
        prepare(policy, pairs, tmp_path / "b", updated=True, reference=elsewhere)
