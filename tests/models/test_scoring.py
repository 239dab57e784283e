"""Scoring: align's chunked head, the model's own forward and the padding-free path give the same numbers."""

import pytest
import torch

from align.models import CriticSettings, LoraSettings, PolicyModel

from ._tiny_batches import batch, naive_logprobs, paths_agree


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

    paths_agree(policy, run, monkeypatch)


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

    paths_agree(policy, run, monkeypatch)


@pytest.mark.parametrize("head", ["chunks", "one chunk", "model forward"])
def test_chunked_head_keeps_no_vocabulary_sized_tensor(head, monkeypatch):
    # What autograd saves for the backward of a scoring pass: with the chunked head over several chunks, no
    # activation has a vocabulary dimension; when the scored positions fit in one chunk, that chunk's (B * R, V)
    # log-probabilities are kept instead of recomputed; through the model's own forward, (B, R, V) logits and more.
    import align.core.linear_head as linear_head
    import align.models.scoring as scoring

    if head == "model forward":
        monkeypatch.setattr(scoring, "chunked_head_unsupported", lambda model: "forced for the test")
    if head == "chunks":
        monkeypatch.setattr(linear_head, "rows_per_chunk", lambda vocab: 2)
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
