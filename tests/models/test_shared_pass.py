"""Scoring passes that run shared prompt tokens once (``align.models.shared_pass``): every output and gradient equals
one pass over the whole rows, in one call over laid-out rows or through a prompt cache; which layout a model gets and
its piece size; and the hidden states handed to each row (:func:`align.models.shared_pass.rows_of`), whose gradient
is the same on every call at 2 threads."""

import pytest
import torch

from align.models import CriticSettings, LoraSettings, PolicyModel
from align.models.shared_pass import layout_mask_kind, rows_of

from ._tiny_batches import batch, paths_agree


def test_rows_of_is_the_indexed_positions():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)
    flat = torch.tensor([[5, 2], [2, 0]])  # (piece 1, position 2), (0, 2); (0, 2) again, (0, 0)
    expected = hidden[torch.tensor([[1, 0], [0, 0]]), torch.tensor([[2, 2], [2, 0]])]
    torch.testing.assert_close(rows_of(hidden, flat), expected)


def test_rows_of_sums_repeated_positions_the_same_way_on_every_call(two_threads):
    # 2048 rows x 30 positions x 64 wide, drawn from 2 x 3 positions: far above the 32768 elements from which
    # torch's CPU gradient of advanced indexing (hidden[piece, position]) adds repeats with atomics from both threads,
    # and long enough for the threads to overlap: with it, every call differed from the first.
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 40, 64, generator=g)
    flat = torch.randint(0, 2, (2048, 1), generator=g) * 40 + torch.randint(0, 3, (2048, 30), generator=g)
    upstream = torch.randn(2048, 30, 64, generator=g)

    def gradient() -> torch.Tensor:
        leaf = hidden.clone().requires_grad_()
        rows_of(leaf, flat).backward(upstream)
        return leaf.grad

    first = gradient()
    assert all(torch.equal(first, gradient()) for _ in range(8))
    summed = torch.zeros(80, 64, dtype=torch.float64).index_add_(0, flat.reshape(-1), upstream.reshape(-1, 64).double())
    torch.testing.assert_close(first, summed.float().view_as(hidden), atol=1e-2, rtol=1e-3)  # ~10000 terms each
    assert not torch.are_deterministic_algorithms_enabled()  # switched on for the sum only


# ---------------------------------------------------------------- shared prompts and prefixes


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

    paths_agree(policy, run, monkeypatch)
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
