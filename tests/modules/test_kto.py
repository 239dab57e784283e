from functools import partial

import lightning as L
import pytest
import torch
from _helpers import cpu_trainer, first_eval_batch, nudged_trainables, write_varied_pairs

from align.core.preference_losses import kto_loss
from align.data.preference import PreferenceDataModule, UnpairedDataModule
from align.errors import AlignConfigError
from align.models import LoraSettings, PolicyModel
from align.models.scorer import Scorer
from align.modules.dpo import DPOModule
from align.modules.kto import KTOModule


@pytest.fixture(scope="module")
def varied_pairs(tmp_path_factory):
    return write_varied_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl")


def data(path, **kwargs):
    return UnpairedDataModule(**{**dict(train_files=path, val_files=path, max_length=64, shuffle=False), **kwargs})


def test_loss_is_kto_with_z0_from_the_mismatched_pairs(varied_pairs):
    L.seed_everything(0)
    module = KTOModule(PolicyModel(), beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)
    initial = {k: v.clone() for k, v in module.policy.model.state_dict().items()}
    with torch.no_grad():  # a reference away from the policy (and below it on these rows), so z0 > 0
        for p in module.policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    module.policy.setup_reference()  # a frozen copy of the perturbed weights
    module.policy.model.load_state_dict(initial)
    dm = data(varied_pairs, batch_size=16)
    dm.set_tokenizer(module.tokenizer)
    dm.setup("fit")
    batch = next(iter(dm.eval_dataloader(dm.train_set)))
    assert batch.num_pairs == 16 and batch.label.sum() == 8  # 8 pairs: 8 desirable, 8 undesirable
    loss_sum, stats = module._loss_and_stats(batch, "train")
    with torch.no_grad():
        logps, kl_logps = Scorer(module.policy).sequence_logps(batch).chunk(2)
        ref, ref_kl = Scorer(module.policy).sequence_logps(batch, reference=True).chunk(2)
    z0 = (kl_logps - ref_kl).mean().clamp(min=0)
    assert z0 > 0
    losses, rewards = kto_loss(logps, ref, batch.label, z0, 0.5, 1.0, 1.5)
    torch.testing.assert_close(loss_sum.detach(), losses.sum())
    torch.testing.assert_close(stats["kl"], z0 * 16)
    d = batch.label
    torch.testing.assert_close(stats["rewards_desirable"], rewards[d].sum())
    torch.testing.assert_close(stats["rewards_undesirable"], rewards[~d].sum())
    side = torch.where(d, rewards > 0.5 * z0, rewards < 0.5 * z0).float().sum()
    torch.testing.assert_close(stats["accuracy"], side)
    means = module.summarise({k: float(v) / 16 for k, v in stats.items()})
    assert means["rewards_desirable"] == pytest.approx(float(rewards[d].mean()), rel=1e-5)
    assert means["margin"] == pytest.approx(float(rewards[d].mean() - rewards[~d].mean()), rel=1e-5, abs=1e-6)
    loss_sum.backward()  # the mismatched pairs carry no gradient: only the completions' pass is differentiated
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)


@pytest.mark.parametrize("lora", [False, True])
def test_cached_reference_equals_the_live_one_and_a_few_steps_log_every_metric(varied_pairs, tmp_path, lora):
    settings = LoraSettings(r=4, alpha=8) if lora else None
    L.seed_everything(0)
    module = KTOModule(
        PolicyModel(lora=settings),
        optimizer=partial(torch.optim.AdamW, lr=1e-3),
        precompute_reference=True,
        reference_cache_dir=str(tmp_path),
    )
    dm = data(varied_pairs, batch_size=4)
    t = cpu_trainer(max_steps=2, limit_val_batches=1, val_check_interval=2)
    t.fit(module, dm)
    assert module.policy.ref_model is None and set(module.cached_reference.splits) == {"train", "val"}
    for name in (
        "train/loss",
        "kto/kl",
        "kto/accuracy",
        "kto/rewards_desirable",
        "kto/rewards_undesirable",
        "kto/margin",
        "kto/logps_desirable",
        "kto/logps_undesirable",
        "train/examples_per_s",
        "val/loss",
        "val/kto_accuracy",
        "val/kto_kl",
    ):
        assert torch.isfinite(t.callback_metrics[name]), name
    live = PolicyModel(lora=settings)
    live.setup_reference()  # with LoRA: the adapter-disabled policy; without: a copy of the initial model
    live.eval()
    with torch.no_grad():
        for batch in dm.eval_dataloader(dm.train_set):
            c, kl = module.cached_reference.logps(batch, "train", torch.device("cpu"))
            torch.testing.assert_close(
                torch.cat([c, kl]), Scorer(live).sequence_logps(batch, reference=True), atol=1e-5, rtol=1e-5
            )


def test_bad_settings_and_paired_data_fail_before_any_compute(varied_pairs):
    policy = PolicyModel()
    for name in ("beta", "desirable_weight", "undesirable_weight"):
        with pytest.raises(AlignConfigError, match=f"model.{name}: expected > 0, got 0"):
            KTOModule(policy, **{name: 0})
    with pytest.raises(AlignConfigError, match="data: expected align.data.preference.UnpairedDataModule"):
        cpu_trainer(max_steps=1).fit(KTOModule(policy), PreferenceDataModule(train_files=varied_pairs))
    with pytest.raises(AlignConfigError, match=r"data: expected align.data.preference.PreferenceDataModule \(pairs\)"):
        cpu_trainer(max_steps=1).fit(DPOModule(policy), data(varied_pairs))


def test_unbalanced_weights_warn_with_the_paper_range(tmp_path, caplog):
    import json

    rows = [{"prompt": f"sort: {c} a", "completion": f"a {c}", "label": i < 6} for i, c in enumerate("bcdefghi")]
    path = tmp_path / "u.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(
        UserWarning,
        match=r"6 desirable and 2 undesirable .* = 3.00, outside the paper's \[1, 4/3\]: "
        r"for example model.desirable_weight in \[0.33, 0.44\]",
    ):
        cpu_trainer(max_steps=1, limit_val_batches=0).fit(
            KTOModule(PolicyModel()), data(str(path), val_files=None, batch_size=8)
        )


def test_padding_free_loss_and_gradients_equal_the_padded_ones(varied_pairs):
    """KTO scores its completions and its mismatched pairs as two row ranges of one batch; packed, each range is
    laid out on its own and gives the padded values."""
    L.seed_everything(0)
    module = KTOModule(PolicyModel(lora=LoraSettings(r=4, alpha=8)), beta=0.5)
    module.policy.setup_reference()
    params = nudged_trainables(module)
    batch = first_eval_batch(data(varied_pairs, batch_size=16), module.tokenizer)
    out = {}
    for free in (False, True):
        module.scorer.padding_free = free
        loss_sum, stats = module._loss_and_stats(batch, "train")
        out[free] = loss_sum.detach(), torch.autograd.grad(loss_sum, params), stats
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for name, value in out[False][2].items():
        torch.testing.assert_close(out[True][2][name], value, atol=1e-4, rtol=1e-4, msg=name)
