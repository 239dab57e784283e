"""Scoring: align's chunked head, the model's own forward and the padding-free path give the same numbers."""

import pytest
import torch

from align.models import CriticSettings, LoraSettings, PolicyModel
from align.models.shared_pass import layout_mask_kind

from ._tiny_batches import batch, naive_logprobs


def test_logprobs_equal_naive_log_softmax_gather():
    policy = PolicyModel()
    ids, mask = batch(policy)
    out = policy.token_logprobs(ids, mask, response_length=3, return_entropy=True)
    torch.testing.assert_close(out.logprobs, naive_logprobs(policy.model, ids, mask, 3))
    assert out.entropy.shape == (2, 3) and (out.entropy >= 0).all()
    hot = policy.token_logprobs(ids, mask, response_length=3, temperature=0.5).logprobs
    assert not torch.allclose(hot, out.logprobs)


def test_bf16_logprobs_and_entropy_at_a_temperature_match_the_samplers_formula():
    # The sampler records log_softmax(logits.float() / T); the trainer must compute the same numbers from the
    # same bf16 logits, or every importance ratio starts away from 1.
    policy = PolicyModel(dtype="bfloat16").eval()
    ids, mask = batch(policy)
    with torch.no_grad():
        out = policy.token_logprobs(ids, mask, response_length=4, temperature=0.7, return_entropy=True)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = policy.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -5:-1]
    assert logits.dtype == torch.bfloat16
    logp = torch.log_softmax(logits.float() / 0.7, -1)
    torch.testing.assert_close(out.logprobs, logp.gather(-1, ids[:, -4:, None]).squeeze(-1), atol=2e-6, rtol=0)
    torch.testing.assert_close(out.entropy, -(logp.exp() * logp).sum(-1), atol=2e-6, rtol=0)


def test_left_padding_does_not_change_logprobs():
    policy = PolicyModel()
    ids, mask = batch(policy)
    alone = policy.tokenizer(["sort: b a"], return_tensors="pt")["input_ids"]
    padded = policy.token_logprobs(ids[:1], mask[:1], response_length=2).logprobs
    torch.testing.assert_close(
        padded, policy.token_logprobs(alone, torch.ones_like(alone), response_length=2).logprobs, atol=1e-5, rtol=1e-4
    )


# ---------------------------------------------------------------- the chunked output head


def _paths_agree(policy, run, monkeypatch):
    """``run(policy)`` -> (outputs, loss) through align's chunked head and through the model's own forward:
    the outputs and every parameter gradient agree to float rounding."""
    import align.models.scoring as scoring

    results = []
    for unsupported in (lambda model: None, lambda model: "forced for the test"):
        monkeypatch.setattr(scoring, "chunked_head_unsupported", unsupported)
        policy.zero_grad(set_to_none=True)
        outputs, loss = run(policy)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append(([o.detach() for o in outputs], grads))
    (chunked, chunked_grads), (full, full_grads) = results
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert chunked_grads.keys() == full_grads.keys() and chunked_grads
    for name in full_grads:
        torch.testing.assert_close(chunked_grads[name], full_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("lora", [False, True])
def test_chunked_head_equals_the_models_own_logits_forward_and_backward(lora, monkeypatch):
    # Left padding, a temperature, entropy and a shared value head: every output and every gradient (the tied
    # embedding and head included) is the one the full (B, R, V) logits give.
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8) if lora else None, critic=CriticSettings())
    ids, mask = batch(policy)
    weights = torch.linspace(-1, 1, 3 * ids.shape[0]).view(ids.shape[0], 3)

    def run(p):
        out = p.token_logprobs(ids, mask, response_length=3, temperature=0.8, return_entropy=True, return_values=True)
        loss = (out.logprobs * weights).sum() + out.entropy.mean() + out.values.sum()
        return (out.logprobs, out.entropy, out.values), loss

    _paths_agree(policy, run, monkeypatch)


def test_chunked_head_equals_the_models_own_logits_for_the_reference_and_for_sft(monkeypatch):
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8))
    policy.setup_reference()
    ids, mask = batch(policy)
    targets = torch.where(mask.bool(), ids, -100).roll(-1, dims=1)
    targets[:, -1] = -100
    targets[:, :2] = -100  # a "prompt" without loss

    def run(p):
        with torch.no_grad():
            ref = p.token_logprobs(ids, mask, response_length=3, reference=True).logprobs
        nll = -p.next_token_logprobs(ids, targets, attention_mask=mask)
        return (ref, nll), nll.sum()

    _paths_agree(policy, run, monkeypatch)


@pytest.mark.parametrize("head", ["chunks", "one chunk", "model forward"])
def test_chunked_head_keeps_no_vocabulary_sized_tensor(head, monkeypatch):
    # What autograd saves for the backward of a scoring pass: with the chunked head over several chunks, no
    # activation has a vocabulary dimension; when the scored positions fit in one chunk, that chunk's (B * R, V)
    # log-probabilities are kept instead of recomputed; through the model's own forward, (B, R, V) logits and more.
    import align.core.logprobs as logprobs_module
    import align.models.scoring as scoring

    if head == "model forward":
        monkeypatch.setattr(scoring, "chunked_head_unsupported", lambda model: "forced for the test")
    if head == "chunks":
        monkeypatch.setattr(logprobs_module, "_rows_per_chunk", lambda vocab: 2)
    policy = PolicyModel()
    ids, mask = batch(policy)
    vocab = policy.config.vocab_size
    weights = {p.data_ptr() for p in policy.parameters()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = policy.token_logprobs(ids, mask, response_length=3, return_entropy=True)
    vocabulary_sized = [tuple(t.shape) for t in saved if t.data_ptr() not in weights and t.shape[-1:] == (vocab,)]
    if head == "model forward":
        assert vocabulary_sized and all(s[:1] == (ids.shape[0],) and len(s) == 3 for s in vocabulary_sized)
    else:
        assert vocabulary_sized == {"chunks": [], "one chunk": [(ids.shape[0] * 3, vocab)]}[head], vocabulary_sized
    (out.logprobs.sum() + out.entropy.sum()).backward()


def test_unsupported_heads_fall_back_to_the_models_forward_and_say_so_once(caplog):
    from align.models.scoring import chunked_head_unsupported

    policy = PolicyModel()
    assert chunked_head_unsupported(policy.model) is None
    policy.model.config.model_type = "gemma2"  # softcapped logits: only the model's forward computes them
    ids, mask = batch(policy)
    with caplog.at_level("INFO", logger="align.models.scoring"):
        full = policy.token_logprobs(ids, mask, response_length=3).logprobs
        policy.token_logprobs(ids, mask, response_length=3)
    assert [r.getMessage() for r in caplog.records if "full-vocabulary" in r.getMessage()] == [
        "policy: full-vocabulary logits for model type 'gemma2' (the chunked output head covers plain linear heads "
        "of llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, phi3, olmo2, smollm3 models)"
    ]
    torch.testing.assert_close(full, naive_logprobs(policy.model, ids, mask, 3))


def _groups(policy, group=3):
    """Two prompts of different lengths (left-padded), each with ``group`` different right-padded responses."""
    ids, mask = batch(policy)
    prompts, prompt_mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(5, policy.config.vocab_size, (prompts.shape[0], 5), generator=g)
    response_mask = torch.ones_like(responses)
    response_mask[1, 3:] = 0  # a response that ended early, then padding
    response_mask[4, 1:] = 0
    return torch.cat([prompts, responses], 1), torch.cat([prompt_mask, response_mask], 1)


def _decoder_calls(decoder) -> list[torch.Size]:
    calls: list[torch.Size] = []
    decoder.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    return calls


@pytest.mark.parametrize("path", ["one call", "prompt cache"])
@pytest.mark.parametrize("lora", [False, True])
def test_shared_prompts_run_once_and_score_as_one_pass_over_every_row(lora, path, monkeypatch):
    # A GRPO batch: rows of a group share their prompt, which the chunked path runs once per prompt (in one call
    # over [prompt | response 1 | response 2 | response 3] rows, or as a prompt pass whose cache the continuations
    # read); log-probs, entropies, values and every gradient equal one pass over the whole rows (the model's own
    # forward).
    from align.models import shared_pass

    if path == "prompt cache":
        monkeypatch.setattr(shared_pass, "layout_mask_kind", lambda decoder: None)
        monkeypatch.setattr(shared_pass, "_MIN_SHARED_PREFIX_WORK", 0)  # the tiny model is below the threshold
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8) if lora else None, critic=CriticSettings())
    ids, mask = _groups(policy)
    weights = torch.linspace(-1, 1, ids.shape[0] * 5).view(ids.shape[0], 5)
    calls = _decoder_calls(policy.model.get_decoder() if not lora else policy.base_model.get_decoder())

    def run(p):
        out = p.token_logprobs(ids, mask, response_length=5, temperature=0.9, return_entropy=True, return_values=True)
        loss = (out.logprobs * weights).sum() + out.entropy.mean() + out.values.sum()
        return (out.logprobs, out.entropy, out.values), loss

    _paths_agree(policy, run, monkeypatch)
    prompt_length = ids.shape[1] - 5
    if path == "one call":  # 2 rows of the prompt and 3 responses of 4 fed tokens each
        assert calls[:1] == [torch.Size([2, prompt_length + 3 * 4])]
    else:  # 2 prompts once, then 6 continuations
        assert calls[:2] == [torch.Size([2, prompt_length]), torch.Size([6, 4])]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompts_reference_pass_and_which_layout(attention, monkeypatch):
    from align.models import shared_pass

    policy = PolicyModel(attn_implementation=attention)
    policy.setup_reference()
    ids, mask = _groups(policy)
    calls = _decoder_calls(policy.ref_model.get_decoder())

    def grouped():
        with torch.no_grad():
            return policy.token_logprobs(ids, mask, response_length=5, reference=True).logprobs

    with torch.no_grad():
        alone = torch.cat(
            [
                policy.token_logprobs(ids[i : i + 1], mask[i : i + 1], response_length=5, reference=True).logprobs
                for i in range(ids.shape[0])
            ]
        )
    P = ids.shape[1] - 5
    calls.clear()
    torch.testing.assert_close(grouped(), alone, atol=1e-5, rtol=1e-5)
    assert calls == [torch.Size([2, P + 3 * 4])]  # one call over the laid-out rows
    # Without the layout, too little shared work on the tiny model for the prompt cache: one pass over the rows.
    monkeypatch.setattr(shared_pass, "layout_mask_kind", lambda decoder: None)
    calls.clear()
    torch.testing.assert_close(grouped(), alone, atol=1e-5, rtol=1e-5)
    assert calls == [ids.shape]
    monkeypatch.setattr(shared_pass, "_MIN_SHARED_PREFIX_WORK", 0)
    calls.clear()
    torch.testing.assert_close(grouped(), alone, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2  # the 2 prompts once, then the 6 continuations


def test_shared_prompts_in_one_call_under_gradient_checkpointing(monkeypatch):
    from align.models import shared_pass

    # Checkpointing recomputes each layer without a cache, so the prompt-cache pass does not apply; the one-call
    # layout does, with the same log-probs and gradients as the plain rows.
    results = []
    for layout in (True, False):
        torch.manual_seed(0)
        policy = PolicyModel(gradient_checkpointing=True, lora=LoraSettings(r=4, alpha=8))
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        if not layout:
            monkeypatch.setattr(shared_pass, "layout_mask_kind", lambda decoder: None)
        ids, mask = _groups(policy)
        calls = _decoder_calls(policy.base_model.get_decoder())
        out = policy.token_logprobs(ids, mask, response_length=5)
        out.logprobs.sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append((out.logprobs.detach(), grads, calls))
    (lp, grads, calls), (lp0, grads0, calls0) = results
    assert calls == [torch.Size([2, ids.shape[1] - 5 + 3 * 4])] and calls0 == [ids.shape]
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads0.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], grads0[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_piece_size_of_a_layout_minimises_its_flops():
    from align.models.shared_pass import best_piece_size

    # Two groups of 6 rows sharing 6 columns, 4 fed columns each after them. k rows per laid-out row cost
    # rows(k) * L(k) * (token + pair * L(k)), L(k) = 6 + 4k: with (token, pair) = (100, 10), k = 1: 12 * 10 * 200 =
    # 24,000; k = 2: 6 * 14 * 240 = 20,160; k = 3: 4 * 18 * 280 = 20,160 (the smaller k wins the tie); k = 6: 24,000.
    assert best_piece_size([6, 6], 6, 4, 100, 10) == 2
    # Linear layers dominate: one row per group (k = 6: 2 * 30 * 1,300 = 78,000 against k = 3's 84,960).
    assert best_piece_size([6, 6], 6, 4, 1000, 10) == 6
    # Attention dominates: the best layout (k = 2: 118,440) saves under a tenth of 121,200, so none.
    assert best_piece_size([6, 6], 6, 4, 10, 100) == 1
    assert best_piece_size([1, 1], 6, 4, 100, 10) == 1


def test_a_large_group_is_laid_out_in_pieces(monkeypatch):
    # Six responses per prompt laid out 4 to a row: each prompt's group becomes two rows (4 and 2 responses), every
    # output equals the row's own pass. Where attention dominates, one pass over the rows.
    from align.models import shared_pass

    policy = PolicyModel()
    ids, mask = _groups(policy, group=6)
    B, T = ids.shape
    calls = _decoder_calls(policy.model.get_decoder())
    with torch.no_grad():
        alone = torch.cat(
            [policy.token_logprobs(ids[i : i + 1], mask[i : i + 1], response_length=5).logprobs for i in range(B)]
        )
        monkeypatch.setattr(shared_pass, "best_piece_size", lambda *args: 4)
        calls.clear()
        torch.testing.assert_close(
            policy.token_logprobs(ids, mask, response_length=5).logprobs, alone, atol=1e-5, rtol=1e-5
        )
        assert calls == [torch.Size([4, T - 5 + 4 * 4])]
        monkeypatch.undo()
        facts = shared_pass.decoder_facts(policy.model.get_decoder())
        monkeypatch.setattr(
            shared_pass,
            "decoder_facts",
            lambda decoder: shared_pass.DecoderFacts(
                facts.parameters, facts.cache_kwarg, token_flops=1, pair_flops=10**6
            ),
        )
        calls.clear()
        torch.testing.assert_close(
            policy.token_logprobs(ids, mask, response_length=5).logprobs, alone, atol=1e-5, rtol=1e-5
        )
        assert calls == [ids.shape]


def test_a_sliding_window_model_is_not_laid_out():
    policy = PolicyModel()
    decoder = policy.model.get_decoder()
    assert layout_mask_kind(decoder) == "bool"
    decoder.config.sliding_window = 4096
    assert layout_mask_kind(decoder) is None
    decoder.config.use_sliding_window = False
    assert layout_mask_kind(decoder) == "bool"


def _scored_everything(policy, ids, mask, R):
    """Log-probs, entropies, values, reference log-probs and every parameter gradient of one scoring pass."""
    policy.zero_grad(set_to_none=True)
    out = policy.token_logprobs(ids, mask, response_length=R, temperature=0.9, return_entropy=True, return_values=True)
    weights = torch.linspace(-1, 1, out.logprobs.numel()).view_as(out.logprobs)
    ((out.logprobs * weights).sum() + out.entropy.mean() + out.values.sum()).backward()
    with torch.no_grad():
        ref = policy.token_logprobs(ids, mask, response_length=R, reference=True).logprobs
        values = policy.values(ids, mask, response_length=R)
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return [out.logprobs.detach(), out.entropy.detach(), out.values.detach(), ref, values], grads


@pytest.mark.parametrize("path", ["one call", "prefix cache"])
@pytest.mark.parametrize("kind", ["shared", "separate"])
@pytest.mark.parametrize("lora", [False, True])
def test_a_prefix_every_prompt_starts_with_runs_once(path, kind, lora, monkeypatch):
    # Three different left-padded prompts that start alike ("sort:", as a chat template's system prompt would):
    # those tokens run once for the policy, its reference and the critic, in one call over a laid-out row or in a
    # pass whose keys and values the rows' continuations read. Every output and every gradient equals one pass
    # over the whole rows.
    from align.models import shared_pass

    torch.manual_seed(0)
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8) if lora else None, critic=CriticSettings(kind=kind))
    policy.setup_reference()
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    ids, mask = batch(policy, ("sort: b a", "sort: d c b a", "sort: c a b e f"))
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(5, policy.config.vocab_size, (3, 5), generator=g)
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    ids, mask = torch.cat([ids, responses], 1), torch.cat([mask, response_mask], 1)
    B, T = ids.shape
    P = T - 5
    starts = P - mask[:, :P].sum(1)  # each row's first real column: three different ones
    first = ids.gather(1, starts[:, None] + torch.arange(3))
    assert starts.unique().numel() == 3 and (first[:, :2] == first[0, :2]).all() and first[:, 2].unique().numel() == 3
    C = 2  # "sort", ":"
    decoders = [policy.base_model.get_decoder()] + ([policy.critic.backbone] if policy.critic.separate else [])
    calls = [_decoder_calls(d) for d in decoders]

    with monkeypatch.context() as plain_rows:  # no layout, and the tiny model is below the cache's threshold
        plain_rows.setattr(shared_pass, "layout_mask_kind", lambda decoder: None)
        plain, plain_grads = _scored_everything(policy, ids, mask, 5)
    assert all(c and all(shape == ids.shape for shape in c) for c in calls)
    for c in calls:
        c.clear()
    if path == "one call":
        monkeypatch.setattr(shared_pass, "best_piece_size", lambda *args: B)
    else:
        monkeypatch.setattr(shared_pass, "layout_mask_kind", lambda decoder: None)
        monkeypatch.setattr(shared_pass, "_MIN_SHARED_PREFIX_WORK", 0)
    shared, shared_grads = _scored_everything(policy, ids, mask, 5)
    for c in calls:
        if path == "one call":
            assert c and c == [torch.Size([1, C + B * (T - 1 - C)])] * len(c)
        else:
            assert c and c[0::2] == [torch.Size([1, C])] * (len(c) // 2)
            assert c[1::2] == [torch.Size([B, T - 1 - C])] * (len(c) // 2)
    for a, b in zip(shared, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert shared_grads.keys() == plain_grads.keys() and shared_grads
    for name in plain_grads:
        torch.testing.assert_close(shared_grads[name], plain_grads[name], atol=1e-5, rtol=1e-4, msg=name)


# ---------------------------------------------------------------- padding-free scoring


def _ragged(policy):
    """Rows of one short and one long left-padded prompt, each with right-padded responses of 6, 2, 4 and 1
    tokens: the short rows' real tokens fit two to a packed row."""
    ids, mask = batch(policy, ("sort: b a", "sort: d c b a e f g h i j"))
    prompts, prompt_mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)
    g = torch.Generator().manual_seed(1)
    responses = torch.randint(5, policy.config.vocab_size, (8, 6), generator=g)
    lengths = torch.tensor([6, 2, 4, 1] * 2)
    response_mask = (torch.arange(6) < lengths[:, None]).long()
    return torch.cat([prompts, responses], 1), torch.cat([prompt_mask, response_mask], 1), response_mask.bool()


@pytest.mark.parametrize("lora,kind", [(False, "shared"), (True, "shared"), (False, "separate")])
def test_padding_free_scoring_equals_the_padded_rows(lora, kind, monkeypatch):
    # Log-probs, entropies, values (shared head or separate critic) and every gradient of the real response tokens
    # are those of the padded rows, through align's chunked head and through the model's own logits; the padded
    # response positions read 0; and the rows really share packed rows.
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8) if lora else None, critic=CriticSettings(kind=kind))
    ids, mask, real = _ragged(policy)
    weights = torch.linspace(-1, 1, 48).view(8, 6)
    with torch.no_grad():
        for p in policy.critic.head.parameters():
            p.normal_(0.0, 0.1)  # a zero-initialised head would make the values' gradients trivial
    shapes = []
    decoder = policy.model.get_decoder() if not lora else policy.base_model.get_decoder()
    decoder.register_forward_pre_hook(lambda m, a, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True)

    def run(free):
        def scores(p):
            out = p.token_logprobs(
                ids,
                mask,
                response_length=6,
                temperature=0.9,
                return_entropy=True,
                return_values=True,
                padding_free=free,
            )
            outputs = [torch.where(real, x, 0.0) for x in out]
            loss = (outputs[0] * weights).sum() + outputs[1].sum() + outputs[2].sum()
            if free:
                assert all(bool((x[~real] == 0).all()) for x in out)
            return outputs, loss

        return scores

    results = {}
    for free in (False, True):
        for unsupported in (lambda model: None, lambda model: "forced for the test"):
            monkeypatch.setattr("align.models.scoring.chunked_head_unsupported", unsupported)
            policy.zero_grad(set_to_none=True)
            outputs, loss = run(free)(policy)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
            results[free, unsupported("x")] = ([o.detach() for o in outputs], grads)
    padded_outputs, padded_grads = results[False, None]
    for key, (outputs, grads) in results.items():
        for a, b in zip(outputs, padded_outputs):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=str(key))
        assert grads.keys() == padded_grads.keys() and grads
        for name in grads:  # float rounding, relative to each gradient's scale
            scale = max(1.0, float(padded_grads[name].abs().max()))
            torch.testing.assert_close(
                grads[name], padded_grads[name], atol=1e-5 * scale, rtol=1e-4, msg=f"{key} {name}"
            )
    assert shapes[-1][0] < ids.shape[0] and shapes[-1][1] == ids.shape[1]  # fewer rows, none longer
    values = policy.values(ids, mask, response_length=6, padding_free=True)
    torch.testing.assert_close(values, torch.where(real, results[False, None][0][2], 0.0), atol=1e-5, rtol=1e-5)


def test_padding_free_reference_pass_equals_the_padded_rows():
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8))
    policy.setup_reference()
    ids, mask, real = _ragged(policy)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn_like(p))  # the policy moves away from its reference
        padded = policy.token_logprobs(ids, mask, response_length=6, reference=True).logprobs
        free = policy.token_logprobs(ids, mask, response_length=6, reference=True, padding_free=True).logprobs
        trained = policy.token_logprobs(ids, mask, response_length=6, padding_free=True).logprobs
    torch.testing.assert_close(free, torch.where(real, padded, 0.0), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(free, trained)
