from functools import partial

import lightning as L
import pytest
import torch
from _helpers import cpu_trainer, first_eval_batch, nudged_trainables, write_varied_pairs

from align.data.io import read_rows
from align.data.preference import PreferenceDataModule
from align.errors import AlignConfigError
from align.models import CriticSettings, LoraSettings, PolicyModel
from align.models.reward import sequence_scores
from align.models.reward_export import load_reward_model, save_reward_model
from align.modules.reward import RewardModule
from align.rollout.rewards import RewardModelScorer


@pytest.fixture(scope="module")
def varied_pairs(tmp_path_factory):
    return write_varied_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl")


def data(path, **kwargs):
    return PreferenceDataModule(**{**dict(train_files=path, val_files=path, max_length=64, shuffle=False), **kwargs})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A reward model trained for a few steps on the bundled pairs, with its export and checkpoint. It starts
    from the SFT-warmed ``tiny-sort``, as the recipe does: from random weights 30 steps are too few for the
    bundled negatives (mostly well-ordered answers with wrong letters); 60 steps reach 0.64."""
    root = tmp_path_factory.mktemp("rm")
    L.seed_everything(0)
    module = RewardModule(PolicyModel("tiny-sort"), optimizer=partial(torch.optim.AdamW, lr=1e-3))
    dm = PreferenceDataModule(batch_size=32, max_length=64)
    t = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=60,
        limit_val_batches=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
        enable_checkpointing=False,
    )
    before = t.validate(module, dm, verbose=False)[0]
    t.fit(module, dm)
    logged = dict(t.callback_metrics)
    after = t.validate(module, dm, verbose=False)[0]
    ckpt = root / "rm.ckpt"
    t.save_checkpoint(ckpt)
    return dict(module=module, dm=dm, logged=logged, before=before, after=after, export=module.export_dir(), ckpt=ckpt)


def one_step_params(path, batch_size, accumulate, lora=False):
    L.seed_everything(0)
    module = RewardModule(
        PolicyModel(lora=LoraSettings(r=4, alpha=8) if lora else None),
        optimizer=partial(torch.optim.SGD, lr=1.0),
        export=False,
    )
    cpu_trainer(max_steps=1, accumulate_grad_batches=accumulate, limit_val_batches=0).fit(
        module, data(path, val_files=None, batch_size=batch_size)
    )
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True])
def test_accumulating_8x1_equals_one_batch_of_8(varied_pairs, lora):
    full = one_step_params(varied_pairs, 8, 1, lora)
    accumulated = one_step_params(varied_pairs, 1, 8, lora)
    for name, value in full.items():
        torch.testing.assert_close(accumulated[name], value, atol=2e-6, rtol=1e-5, msg=name)


def test_margin_enters_the_loss(varied_pairs):
    L.seed_everything(0)
    module = RewardModule(PolicyModel()).eval()
    dm = data(varied_pairs, batch_size=8)
    dm.set_tokenizer(module.tokenizer)
    dm.setup("fit")
    batch = next(iter(dm.eval_dataloader(dm.train_set)))
    with torch.no_grad():
        with_margin, _ = module._loss_and_stats(batch)
        module.use_margin = False
        without, _ = module._loss_and_stats(batch)
    assert with_margin > without  # margins are >= 0 and make the loss harder to satisfy


def test_a_few_steps_raise_held_out_accuracy_and_log_metrics(trained):
    before, after = trained["before"], trained["after"]
    assert 0.2 < before["val/rm_accuracy"] < 0.8  # a random head ranks at about chance
    assert after["val/rm_accuracy"] > 0.6 and after["val/loss"] < before["val/loss"]
    for name in ("train/loss", "rm/accuracy", "rm/margin", "rm/score_chosen", "rm/score_rejected", "train/pairs_per_s"):
        assert torch.isfinite(trained["logged"][name]), name
    for name in ("val/rm_margin", "val/rm_score_chosen", "val/rm_score_rejected"):
        assert name in after, name


def test_export_loads_as_a_reward_callable(trained):
    export = trained["export"]
    assert (export / "reward_model.json").exists() and (export / "config.json").exists()
    assert not (export / "reward_head.safetensors").exists()  # the head is the classifier's own ``score``
    scorer = RewardModelScorer(str(export), batch_size=3)
    rows = read_rows("align:sort/preference/validation.jsonl")[:10]  # the bundled pairs validate by default
    prompts = [r["prompt"] for r in rows]
    chosen = scorer(prompts, [r["chosen"] for r in rows], answer=["ignored"] * len(rows))
    rejected = scorer(prompts, [r["rejected"] for r in rows])
    assert len(chosen) == len(rows) and all(isinstance(s, float) for s in chosen)
    assert scorer(prompts, [r["chosen"] for r in rows]) == chosen  # deterministic
    assert RewardModelScorer(str(export), batch_size=10)(prompts, [r["chosen"] for r in rows]) == pytest.approx(
        chosen, abs=1e-4
    )  # batching does not change scores
    # Same encoding as training: the scorer reproduces the module's scores of the same pairs.
    dm, module = trained["dm"], trained["module"].eval()
    batch = next(iter(dm.eval_dataloader(dm.val_set, batch_size=10)))
    with torch.no_grad():
        c, r = module.pair_scores(batch)
    assert c.tolist() == pytest.approx(chosen, abs=1e-4) and r.tolist() == pytest.approx(rejected, abs=1e-4)
    assert not any(p.requires_grad for p in scorer.model.parameters())


def test_checkpoint_loads_like_the_export(trained):
    prompts, completions = ["sort: c a b", "sort: b a"], ["a b c", "b a"]
    from_export = RewardModelScorer(str(trained["export"]))(prompts, completions)
    from_ckpt = RewardModelScorer(str(trained["ckpt"]))(prompts, completions)
    assert from_ckpt == pytest.approx(from_export, abs=1e-4)


def test_the_head_bias_stays_zero_so_the_export_scores_as_trained(trained):
    # Bradley-Terry does not depend on a constant offset, and a sequence classifier's head has none.
    bias = trained["module"].policy.critic.head.proj.bias
    assert not bias.requires_grad and float(bias) == 0.0


def test_align_export_of_an_rm_checkpoint_is_a_sequence_classifier(trained, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from align.cli.main import main

    main(["export", "--ckpt_path", str(trained["ckpt"]), "--output_dir", str(tmp_path / "hf")])
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert model.config.architectures == ["LlamaForSequenceClassification"] and model.config.num_labels == 1
    scorer = RewardModelScorer(str(trained["ckpt"]))
    prompt_ids, response_ids = scorer.encode("sort: c a b", "a b c")
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert hf.shape == (1, 1)
    assert hf.item() == pytest.approx(scorer(["sort: c a b"], ["a b c"])[0], abs=1e-4)
    assert RewardModelScorer(str(tmp_path / "hf")).encoding == scorer.encoding  # the training encoding travels


def test_lora_reward_model_round_trips(tmp_path):
    L.seed_everything(0)
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8), critic=CriticSettings())
    torch.nn.init.normal_(policy.critic.head.proj.weight)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    save_reward_model(policy, tmp_path / "export", {"max_length": 64})
    loaded, encoding = load_reward_model(tmp_path / "export")
    assert encoding["max_length"] == 64
    assert not any("lora" in name for name, _ in loaded.named_parameters())  # merged into the base weights
    ids = torch.tensor([[1, 5, 6, 7, 2]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.eval()(ids, torch.ones_like(ids)),
            sequence_scores(policy.eval(), ids, torch.ones_like(ids)),
            atol=1e-4,
            rtol=1e-4,
        )


def test_bad_paths_fail_clearly(tmp_path):
    with pytest.raises(AlignConfigError, match="does not exist"):
        RewardModelScorer(str(tmp_path / "nope"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(AlignConfigError, match="not a reward-model export"):
        RewardModelScorer(str(tmp_path / "plain"))
    with pytest.raises(AlignConfigError, match="batch_size"):
        RewardModelScorer(str(tmp_path / "plain"), batch_size=0)


def _direct_score(scorer, prompt_ids, response_ids):
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        return scorer.model(ids, torch.ones_like(ids)).item()


def test_the_scorer_sees_the_whole_conversation_and_the_sampled_ids(trained):
    from align.data.preference_rows import encode_prompt

    scorer = RewardModelScorer(str(trained["export"]))
    tok = scorer.tokenizer
    chat = [
        {"role": "system", "content": "Sort the letters."},
        {"role": "user", "content": "sort: c a b"},
        {"role": "assistant", "content": "a b c"},
        {"role": "user", "content": "sort: d b"},
    ]
    prompt_ids, _ = encode_prompt(scorer.encoder, chat)
    # The whole conversation is scored, not its last message re-templated as a single user turn.
    whole = scorer(["sort: d b"], ["b d"], prompt_messages=[chat])[0]
    assert whole == pytest.approx(_direct_score(scorer, prompt_ids, scorer.encode(chat, "b d")[1]), abs=1e-5)
    assert whole != pytest.approx(scorer(["sort: d b"], ["b d"])[0], abs=1e-4)
    # The sampled ids are scored as they are: a cut-off completion gets no end of turn appended ...
    cut = tok("b", add_special_tokens=False)["input_ids"]
    as_sampled = scorer(
        ["sort: d b"], ["b"], prompt_messages=[chat], completion_ids=[cut], completion_truncated=[True]
    )[0]
    assert as_sampled == pytest.approx(_direct_score(scorer, prompt_ids, cut), abs=1e-5)
    assert as_sampled != pytest.approx(scorer(["sort: d b"], ["b"], prompt_messages=[chat])[0], abs=1e-4)
    # ... nor when only its text is known,
    assert scorer(["sort: d b"], ["b"], prompt_messages=[chat], completion_truncated=[True])[0] == pytest.approx(
        as_sampled, abs=1e-5
    )
    # ... and ids that this tokenizer does not decode to the completion (another tokenizer's) are not used.
    foreign = tok("z z z", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert scorer(["sort: d b"], ["b d"], prompt_messages=[chat], completion_ids=[foreign])[0] == pytest.approx(
        whole, abs=1e-5
    )
    with pytest.raises(ValueError, match="1 completion_ids for 2 completions"):
        scorer(["a", "b"], ["a", "b"], completion_ids=[[1]])


def test_export_callback_on_a_reward_model_run_writes_the_reward_model(trained, tmp_path):
    from align.models.export import ExportCallback
    from align.models.loading import is_sequence_classifier

    module = trained["module"]
    ExportCallback(str(tmp_path / "cb")).on_fit_end(module.trainer, module)
    assert is_sequence_classifier(tmp_path / "cb")
    prompts, completions = ["sort: c a b"], ["a b c"]
    assert RewardModelScorer(str(tmp_path / "cb"))(prompts, completions) == pytest.approx(
        RewardModelScorer(str(trained["export"]))(prompts, completions), abs=1e-5
    )


@pytest.mark.parametrize("lora", [False, True])
def test_padding_free_scores_and_gradients_equal_the_padded_rows(varied_pairs, lora):
    torch.manual_seed(0)
    module = RewardModule(PolicyModel(critic=CriticSettings(), lora=LoraSettings(r=4, alpha=8) if lora else None))
    params = nudged_trainables(module)
    batch = first_eval_batch(data(varied_pairs, batch_size=8), module.tokenizer)
    assert float(batch.attention_mask.float().mean()) < 0.8  # padding to save
    out = {}
    for free in (False, True):
        module.scorer.padding_free = free
        chosen, rejected = module.pair_scores(batch)
        loss, _ = module._loss_and_stats(batch)
        out[free] = torch.cat([chosen, rejected]).detach(), torch.autograd.grad(loss, params)
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=1e-5)
    assert out[False][0].std() > 1e-3  # scores that differ between rows
    for a, b in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_policy_with_a_separate_critic_is_refused_naming_the_setting():
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.policy\.critic\.kind: expected 'shared' or a null critic "
        r"\(a reward model scores with a head on its own backbone\), got "
        r"'separate'$",
    ):
        RewardModule(PolicyModel(critic=CriticSettings(kind="separate")))
