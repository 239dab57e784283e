from functools import partial

import lightning as L
import pytest
import torch
from _helpers import cpu_trainer, first_eval_batch, nudged_trainables, write_varied_pairs

from align.data.preference import PreferenceDataModule
from align.models import LoraSettings, PolicyModel
from align.models.scorer import Scorer
from align.modules.dpo import PREFERENCE_LOSSES, REFERENCE_FREE, DPOModule, PairLogps


@pytest.fixture(scope="module")
def varied_pairs(tmp_path_factory):
    return write_varied_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl")


def data(path, **kwargs):
    return PreferenceDataModule(**{**dict(train_files=path, val_files=path, max_length=64, shuffle=False), **kwargs})


def one_step_params(path, batch_size, accumulate, **module_kwargs):
    L.seed_everything(0)
    module = DPOModule(
        PolicyModel(lora=module_kwargs.pop("lora", None)), optimizer=partial(torch.optim.SGD, lr=1.0), **module_kwargs
    )
    cpu_trainer(max_steps=1, accumulate_grad_batches=accumulate, limit_val_batches=0).fit(
        module, data(path, val_files=None, batch_size=batch_size)
    )
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad and "ref_model" not in n}


def perturbed(module):
    """Move the policy away from its reference, so the implicit rewards are not all zero."""
    with torch.no_grad():
        for p in module.policy.model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(rpo_alpha=0.5, loss_type="ipo", beta=0.5), dict(lora=LoraSettings(r=4, alpha=8))],
    ids=["sigmoid", "ipo+rpo", "lora"],
)
def test_accumulating_8x1_equals_one_batch_of_8(varied_pairs, settings):
    full = one_step_params(varied_pairs, 8, 1, **dict(settings))
    for batch_size, accumulate in [(1, 8), (2, 4)]:
        accumulated = one_step_params(varied_pairs, batch_size, accumulate, **dict(settings))
        for name, value in full.items():
            torch.testing.assert_close(accumulated[name], value, atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_a_few_steps_raise_held_out_accuracy():
    L.seed_everything(0)
    # From the SFT-warmed model with the recipe's beta; the bundled negatives (mostly well-ordered answers with
    # wrong letters) need more than the 20 steps that sufficed for swaps alone.
    module = DPOModule(PolicyModel("tiny-sort"), optimizer=partial(torch.optim.AdamW, lr=1e-3), beta=0.25)
    dm = PreferenceDataModule(batch_size=32, max_length=64)
    t = cpu_trainer(max_steps=50, limit_val_batches=3)
    before = t.validate(module, dm, verbose=False)[0]
    assert before["val/dpo_accuracy"] == pytest.approx(0.5) and before["val/dpo_margin"] == pytest.approx(0.0)
    t.fit(module, dm)
    logged = dict(t.callback_metrics)
    for name in (
        "train/loss",
        "dpo/accuracy",
        "dpo/margin",
        "dpo/rewards_chosen",
        "dpo/rewards_rejected",
        "dpo/logps_chosen",
        "dpo/logps_rejected",
        "train/pairs_per_s",
    ):
        assert torch.isfinite(logged[name]), name
    after = t.validate(module, dm, verbose=False)[0]
    assert after["val/dpo_accuracy"] > 0.6 and after["val/loss"] < before["val/loss"]  # 0.68 measured
    assert after["val/dpo_margin"] > 0


@pytest.mark.parametrize("loss_type", sorted(PREFERENCE_LOSSES))
def test_each_loss_type_trains(varied_pairs, loss_type):
    L.seed_everything(0)
    extra = {"label_smoothing": 0.1} if loss_type == "conservative" else {}
    module = DPOModule(PolicyModel(), optimizer=partial(torch.optim.AdamW, lr=1e-3), loss_type=loss_type, **extra)
    t = cpu_trainer(max_steps=3, limit_val_batches=1)
    t.fit(module, data(varied_pairs, batch_size=4))
    assert torch.isfinite(t.callback_metrics["train/loss"])
    assert (module.policy.ref_model is None) == (loss_type in REFERENCE_FREE)  # SimPO, ORPO


def test_lora_reference_is_the_adapter_disabled_policy(varied_pairs):
    module = DPOModule(PolicyModel(lora=LoraSettings(r=4, alpha=8)))
    cpu_trainer(max_steps=1, limit_val_batches=0).fit(module, data(varied_pairs, batch_size=4, val_files=None))
    assert module.policy.ref_model is None  # no second copy
    dm = data(varied_pairs, batch_size=8)
    dm.set_tokenizer(module.tokenizer)
    dm.setup("fit")
    batch = next(iter(dm.eval_dataloader(dm.train_set)))
    module.eval()
    base = PolicyModel().eval()
    with torch.no_grad():
        torch.testing.assert_close(
            Scorer(module.policy).sequence_logps(batch, reference=True), Scorer(base).sequence_logps(batch)
        )
        assert not torch.allclose(Scorer(module.policy).sequence_logps(batch), Scorer(base).sequence_logps(batch))


@pytest.mark.parametrize("lora", [False, True])
def test_cached_reference_logps_equal_live_ones(varied_pairs, tmp_path, lora):
    settings = LoraSettings(r=4, alpha=8) if lora else None
    L.seed_everything(0)
    cached = DPOModule(PolicyModel(lora=settings), precompute_reference=True, reference_cache_dir=str(tmp_path))
    dm = data(varied_pairs, batch_size=3)
    t = cpu_trainer(max_steps=2, limit_val_batches=0)
    t.fit(cached, dm)
    # Train and val are the same file here, so they share one cache entry.
    assert cached.policy.ref_model is None and len(list(tmp_path.glob("*.safetensors"))) == 1
    assert set(cached.cached_reference.splits) == {"train", "val"}
    live = DPOModule(PolicyModel(lora=settings))
    live.policy.setup_reference()
    live.eval()
    with torch.no_grad():
        for batch in dm.eval_dataloader(dm.train_set):
            c, r = cached._reference_logps(batch, "train")
            torch.testing.assert_close(
                torch.cat([c, r]), Scorer(live.policy).sequence_logps(batch, reference=True), atol=1e-5, rtol=1e-5
            )


def test_bad_settings_fail_early():
    from align.errors import AlignConfigError

    policy = PolicyModel()
    with pytest.raises(AlignConfigError, match="loss_type"):
        DPOModule(policy, loss_type="nope")
    with pytest.raises(AlignConfigError, match="label_smoothing"):
        DPOModule(policy, loss_type="conservative")
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.label_smoothing: expected 0 with loss_type 'sigmoid' \(it "
        r"applies to 'conservative' only\), got 0\.1$",
    ):
        DPOModule(policy, label_smoothing=0.1)
    with pytest.raises(AlignConfigError, match="model.rpo_alpha: expected 0 with loss_type 'orpo'"):
        DPOModule(policy, loss_type="orpo", rpo_alpha=1.0)


def test_simpo_gamma_is_the_simpo_target_margin():
    module = DPOModule(PolicyModel(), loss_type="simpo", beta=2.0, simpo_gamma=0.5)
    x = PairLogps(torch.tensor([-2.0]), torch.tensor([-6.0]), torch.tensor([2.0]), torch.tensor([3.0]), None, None)
    losses, _, _ = PREFERENCE_LOSSES["simpo"](x, module)
    # 2 * (-2 / 2 - -6 / 3) - 0.5 = 1.5 (the default margin 1 would give 1)
    torch.testing.assert_close(losses, torch.nn.functional.softplus(torch.tensor([-1.5])))


def test_orpo_is_sft_plus_the_odds_ratio_term_without_a_reference(varied_pairs):
    from align.core.preference_losses import orpo_loss

    module = DPOModule(PolicyModel(), loss_type="orpo", beta=0.25, precompute_reference=True)
    assert not module.needs_reference and module.cached_reference is None
    dm = data(varied_pairs, batch_size=8)
    dm.set_tokenizer(module.tokenizer)
    dm.setup("fit")
    batch = next(iter(dm.eval_dataloader(dm.train_set)))
    loss_sum, stats = module._loss_and_stats(batch, "train")
    assert module.policy.ref_model is None  # no reference pass was needed
    logps = Scorer(module.policy).sequence_logps(batch).detach()
    tokens = batch.response_mask.sum(-1).float()
    losses, *_, nll, log_odds = orpo_loss(*logps.chunk(2), *tokens.chunk(2), lam=0.25)
    torch.testing.assert_close(loss_sum.detach(), losses.sum())
    torch.testing.assert_close(stats["nll_chosen"], nll.sum())
    torch.testing.assert_close(stats["log_odds_ratio"], log_odds.sum())
    # its SFT half: the NLL is the per-token mean over each chosen response
    chosen_tokens = tokens.chunk(2)[0]
    torch.testing.assert_close(nll, -logps.chunk(2)[0] / chosen_tokens)
    loss_sum.backward()
    assert all(torch.isfinite(p.grad).all() for p in module.parameters() if p.grad is not None)


@pytest.mark.parametrize("lora", [False, True])
def test_padding_free_scoring_equals_the_padded_rows(varied_pairs, lora):
    """Sequence log-probs of the packed layout equal the padded rows', for the policy (values and gradients) and
    for the reference."""
    torch.manual_seed(0)
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8) if lora else None)
    policy.setup_reference()
    params = nudged_trainables(policy)
    batch = first_eval_batch(data(varied_pairs, batch_size=8), policy.tokenizer)
    assert float(batch.attention_mask.float().mean()) < 0.8  # padding to save
    weights = torch.randn(batch.input_ids.shape[0])
    results = {}
    for free in (False, True):
        logps = Scorer(policy, padding_free=free).sequence_logps(batch)
        grads = torch.autograd.grad((weights * logps).sum(), params)
        with torch.no_grad():
            ref = Scorer(policy, padding_free=free).sequence_logps(batch, reference=True)
        results[free] = logps.detach(), grads, ref
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(results[True][2], results[False][2], atol=1e-4, rtol=1e-5)
    assert not torch.allclose(results[False][0], results[False][2])  # the reference is another model
    for free_grad, padded_grad in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(free_grad, padded_grad, atol=1e-5, rtol=1e-4)


def test_padding_free_training_step_equals_the_padded_one(varied_pairs):
    padded = one_step_params(varied_pairs, 8, 1, rpo_alpha=0.5)
    free = one_step_params(varied_pairs, 8, 1, rpo_alpha=0.5, padding_free=True)
    for name, value in padded.items():
        torch.testing.assert_close(free[name], value, atol=2e-6, rtol=1e-5, msg=name)
