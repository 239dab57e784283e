"""What the offline preference modules share (``align.modules.preference``): a pair's accuracy by hand, the data module
each needs, and the cached reference across a resume (the checkpoint carries its fingerprint)."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from _helpers import cpu_trainer, write_varied_pairs

from align.data.preference import PreferenceDataModule, UnpairedDataModule
from align.errors import AlignConfigError
from align.models import PolicyModel
from align.modules.dpo import DPOModule
from align.modules.kto import KTOModule
from align.modules.preference import pair_correct


@pytest.fixture(scope="module")
def varied_pairs(tmp_path_factory):
    return write_varied_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl")


def data(path, **kwargs):
    return PreferenceDataModule(**{**dict(train_files=path, val_files=path, max_length=64, shuffle=False), **kwargs})


def test_resume_without_the_cache_refuses_to_use_updated_weights_as_reference(varied_pairs, tmp_path):
    from align.errors import AlignConfigError

    L.seed_everything(0)
    module = DPOModule(PolicyModel(), precompute_reference=True, reference_cache_dir=str(tmp_path / "a"))
    t = cpu_trainer(max_steps=1, limit_val_batches=0, default_root_dir=str(tmp_path))
    t.fit(module, data(varied_pairs, val_files=None, batch_size=4))
    ckpt = tmp_path / "step1.ckpt"
    t.save_checkpoint(ckpt)
    assert module.cached_reference.fingerprint is not None
    resumed = DPOModule(PolicyModel(), precompute_reference=True, reference_cache_dir=str(tmp_path / "b"))
    with pytest.raises(AlignConfigError, match="no longer the reference"):
        cpu_trainer(max_steps=2, limit_val_batches=0).fit(
            resumed, data(varied_pairs, val_files=None, batch_size=4), ckpt_path=str(ckpt)
        )
    # With the cache directory kept, the resume finds the cache by the fingerprint stored in the checkpoint.
    resumed = DPOModule(PolicyModel(), precompute_reference=True, reference_cache_dir=str(tmp_path / "a"))
    cpu_trainer(max_steps=2, limit_val_batches=0).fit(
        resumed, data(varied_pairs, val_files=None, batch_size=4), ckpt_path=str(ckpt)
    )
    torch.testing.assert_close(
        resumed.cached_reference.splits["train"].chosen, module.cached_reference.splits["train"].chosen
    )


def test_a_pair_is_right_when_the_chosen_reward_is_higher_and_half_right_on_a_tie():
    chosen, rejected = torch.tensor([2.0, -1.0, 0.5, 0.0]), torch.tensor([1.0, 3.0, 0.5, -0.0])
    assert pair_correct(chosen, rejected).tolist() == [1.0, 0.0, 0.5, 0.5]  # an untrained policy scores chance


@pytest.mark.parametrize(
    "module, data_module, message",
    [
        (DPOModule, UnpairedDataModule, r"PreferenceDataModule \(pairs\) for DPOModule, got UnpairedDataModule$"),
        (
            KTOModule,
            PreferenceDataModule,
            r"UnpairedDataModule \(unpaired examples\) for KTOModule, got PreferenceDataModule$",
        ),
    ],
)
def test_a_module_refuses_the_other_kind_of_preference_data_on_one_line(module, data_module, message):
    preference = module(PolicyModel())
    preference._trainer = SimpleNamespace(datamodule=data_module())
    with pytest.raises(AlignConfigError, match=r"^data: expected align\.data\.preference\." + message):
        preference.setup("fit")
