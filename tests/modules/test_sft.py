import json
from functools import partial

import lightning as L
import pytest
import torch
from _helpers import cpu_trainer

from align.data import SFTDataModule
from align.models import LoraSettings, PolicyModel
from align.modules import SFTModule


@pytest.fixture(scope="module")
def varied_rows(tmp_path_factory):
    """Rows of very different lengths, so a mean of per-micro-batch means would differ from the token mean."""
    path = tmp_path_factory.mktemp("data") / "varied.jsonl"
    letters = "abcdefghij"
    rows = []
    for i in range(8):
        n = 1 + (i * 5) % 9
        prompt = " ".join(letters[(i + k) % 10] for k in range(n))
        rows.append({"prompt": f"sort: {prompt}", "completion": " ".join(sorted(prompt.split()))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def one_step_params(path, batch_size, accumulate, lora=False):
    L.seed_everything(0)
    module = SFTModule(
        PolicyModel(lora=LoraSettings(r=4, alpha=8) if lora else None), optimizer=partial(torch.optim.SGD, lr=1.0)
    )
    data = SFTDataModule(train_files=path, val_files=None, batch_size=batch_size, max_length=64, shuffle=False)
    cpu_trainer(max_steps=1, accumulate_grad_batches=accumulate, limit_val_batches=0).fit(module, data)
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True])
def test_accumulating_8x1_equals_one_batch_of_8(varied_rows, lora):
    full = one_step_params(varied_rows, batch_size=8, accumulate=1, lora=lora)
    for batch_size, accumulate in [(1, 8), (2, 4)]:
        accumulated = one_step_params(varied_rows, batch_size=batch_size, accumulate=accumulate, lora=lora)
        for name, value in full.items():
            torch.testing.assert_close(accumulated[name], value, atol=2e-6, rtol=1e-5, msg=name)


def test_a_few_steps_reduce_the_held_out_loss():
    L.seed_everything(0)
    module = SFTModule(PolicyModel(), optimizer=partial(torch.optim.AdamW, lr=3e-3))
    data = SFTDataModule(batch_size=32, max_length=64)
    t = cpu_trainer(max_steps=40, limit_val_batches=2)
    before = t.validate(module, data, verbose=False)[0]["val/loss"]
    t.fit(module, data)
    logged = dict(t.callback_metrics)
    assert torch.isfinite(logged["train/loss"]) and logged["train/tokens_per_s"] > 0
    after = t.validate(module, data, verbose=False)[0]["val/loss"]
    assert after < 0.7 * before


def test_packed_training_step_runs_and_matches_unpacked_loss():
    L.seed_everything(0)
    policy = PolicyModel()
    sums = {}
    for packing in (False, True):
        data = SFTDataModule(batch_size=64, max_length=128, packing=packing, shuffle=False)
        data.set_tokenizer(policy.tokenizer)
        data.setup("validate")
        module = SFTModule(policy)
        module.on_validation_epoch_start()
        for batch in data.val_dataloader():
            module.validation_step(batch, 0)
        sums[packing] = (float(module._val_nll), float(module._val_tokens))
    assert sums[True][1] == sums[False][1]
    assert sums[True][0] == pytest.approx(sums[False][0], rel=1e-4)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_gradients_are_released_after_the_step_and_kept_while_accumulating(varied_rows, accumulate):
    """The next forward pass starts with no gradient held once the optimizer has stepped (its activations reuse
    that memory); between micro-batches of one accumulated step the gradients stay."""
    held = []

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            held.append(any(p.grad is not None for p in module.parameters()))

    module = SFTModule(PolicyModel(), optimizer=partial(torch.optim.SGD, lr=0.1))
    data = SFTDataModule(train_files=varied_rows, val_files=None, batch_size=2, max_length=64, shuffle=False)
    cpu_trainer(max_steps=2, accumulate_grad_batches=accumulate, limit_val_batches=0, callbacks=[Probe()]).fit(
        module, data
    )
    assert held == ([False, False] if accumulate == 1 else [False, True, False, True])
    assert all(p.grad is None for p in module.parameters())


def test_a_checkpoint_loads_outside_a_trainer_with_load_from_checkpoint(varied_rows, tmp_path):
    """Lightning calls ``configure_model`` while loading, with no trainer attached; a module built with the run's
    arguments (here the defaults) gets the trained weights."""
    module = SFTModule(PolicyModel(), optimizer=partial(torch.optim.SGD, lr=0.1))
    data = SFTDataModule(train_files=varied_rows, val_files=None, batch_size=2, max_length=64, shuffle=False)
    cpu_trainer(max_steps=1, limit_val_batches=0, enable_checkpointing=True, default_root_dir=tmp_path).fit(
        module, data
    )
    path = next(tmp_path.rglob("*.ckpt"))
    loaded = SFTModule.load_from_checkpoint(path, policy=PolicyModel())
    trained = module.state_dict()
    assert loaded.state_dict().keys() == trained.keys()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert not torch.equal(trained["policy.model.lm_head.weight"], PolicyModel().state_dict()["model.lm_head.weight"])
