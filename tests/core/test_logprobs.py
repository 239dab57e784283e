import math

import pytest
import torch

import align.core.logprobs as lp
from align.core.logprobs import entropy_from_logits, linear_log_softmax, selective_log_softmax


def _reference_logps(logits, index):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------- selective_log_softmax


def test_selective_log_softmax_pinned():
    # softmax([0, log 3]) = [1/4, 3/4]
    logits = torch.tensor([[0.0, math.log(3.0)]])
    out = selective_log_softmax(logits, torch.tensor([1]))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([math.log(0.75)]))
    torch.testing.assert_close(selective_log_softmax(logits, torch.tensor([0])), torch.tensor([math.log(0.25)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selective_log_softmax_matches_log_softmax_gather_full_precision(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 37, generator=g)).to(dtype).requires_grad_()
    index = torch.randint(0, 37, (3, 5), generator=g)
    out = selective_log_softmax(logits, index)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = torch.log_softmax(ref_logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, ref)
    weights = torch.randn(3, 5, generator=g, dtype=dtype)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_selective_log_softmax_low_precision(dtype, monkeypatch):
    # Small chunks so that several chunks are exercised in forward and backward.
    monkeypatch.setattr(lp, "_CHUNK_ELEMENTS", 64)
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 7, 29, generator=g)).to(dtype).requires_grad_()
    index = torch.randint(0, 29, (2, 7), generator=g)
    out = selective_log_softmax(logits, index)
    assert out.dtype == torch.float32
    ref_logits = logits.detach().clone().requires_grad_()
    ref = _reference_logps(ref_logits, index)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    weights = torch.randn(2, 7, generator=g)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), atol=1e-2, rtol=1e-2)


def test_selective_log_softmax_low_precision_is_accurate_against_float64():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2)).bfloat16()
    index = torch.arange(4)
    exact = torch.log_softmax(logits.double(), -1)[torch.arange(4), index]
    torch.testing.assert_close(selective_log_softmax(logits, index).double(), exact, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_temperature_divides_after_the_upcast_as_the_sampler_does(dtype, monkeypatch):
    # The sampler (align.rollout.sampling.sample) computes log_softmax(logits.float() / T). Dividing the low-precision
    # logits first rounds them: with bf16 at T = 0.7 that moved log-probs by ~1e-2 here. Several chunks run.
    monkeypatch.setattr(lp, "_CHUNK_ELEMENTS", 64)
    g = torch.Generator().manual_seed(4)
    logits = (4 * torch.randn(3, 5, 29, generator=g)).to(dtype).requires_grad_()
    index = torch.randint(0, 29, (3, 5), generator=g)
    sampler = torch.log_softmax(logits.detach().float() / 0.7, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    out = selective_log_softmax(logits, index, temperature=0.7)
    torch.testing.assert_close(out, sampler, atol=2e-6, rtol=0)
    if dtype == torch.bfloat16:
        rounded = selective_log_softmax(logits.detach() / 0.7, index)
        assert (rounded - sampler).abs().max() > 1e-3, "the test must tell the two orders apart"
    ref_logits = logits.detach().clone().requires_grad_()
    ref = torch.log_softmax(ref_logits.float() / 0.7, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    weights = torch.randn(3, 5, generator=g)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_entropy_at_a_temperature_upcasts_first(dtype):
    g = torch.Generator().manual_seed(5)
    logits = (4 * torch.randn(6, 29, generator=g)).to(dtype).requires_grad_()
    logp = torch.log_softmax(logits.detach().float() / 0.6, -1)
    torch.testing.assert_close(
        entropy_from_logits(logits, chunk_size=4, temperature=0.6), -(logp.exp() * logp).sum(-1), atol=2e-6, rtol=0
    )
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, chunk_size=2, temperature=0.6), (x,))
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, torch.tensor([0, 2, 5]), temperature=1.7), (x,))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, t: selective_log_softmax(x, torch.zeros(2, dtype=torch.long), temperature=t),
        lambda x, t: entropy_from_logits(x, temperature=t),
    ],
)
@pytest.mark.parametrize("t", [0.0, -1.0])
def test_temperature_must_be_positive(fn, t):
    with pytest.raises(ValueError, match="temperature must be > 0"):
        fn(torch.zeros(2, 3), t)


def test_selective_log_softmax_shape_mismatch():
    with pytest.raises(ValueError, match="index shape"):
        selective_log_softmax(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


# ---------------------------------------------------------------- entropy


def test_entropy_pinned():
    # uniform over 4 tokens: log 4; a near one-hot row: ~0; [0, log 3]: -(1/4 log 1/4 + 3/4 log 3/4)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]])
    expected = torch.tensor([math.log(4.0), 0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])
    torch.testing.assert_close(entropy_from_logits(logits), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_matches_reference_with_grad(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(3, 4, 11, generator=g)).to(dtype).requires_grad_()
    ent = entropy_from_logits(logits, chunk_size=5)
    assert ent.shape == (3, 4) and ent.dtype == torch.float32
    ref_logits = logits.detach().clone().requires_grad_()
    logp = torch.log_softmax(ref_logits.float(), -1)
    ref = -(logp.exp() * logp).sum(-1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ent, ref, atol=1e-5, rtol=1e-5)
    weights = torch.randn(3, 4, generator=g)
    (ent * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), atol=tol, rtol=tol)


def test_entropy_gradcheck_float64():
    logits = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, chunk_size=2), (logits,))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_of_small_logits_equals_the_chunked_computation(temperature):
    """Logits of up to 2^16 float32/64 elements (classic RL's few actions) skip the chunked autograd function;
    values, gradients and second derivatives are the same as through it."""
    from align.core.logprobs import _ChunkedEntropy

    g = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(5, 4, generator=g, dtype=torch.float64)).requires_grad_()
    weights = torch.randn(5, generator=g, dtype=torch.float64)
    small = entropy_from_logits(logits, temperature=temperature)
    chunked = _ChunkedEntropy.apply(logits, 2, temperature)
    torch.testing.assert_close(small, chunked, rtol=1e-12, atol=1e-12)
    grads = [torch.autograd.grad((e * weights).sum(), logits)[0] for e in (small, chunked)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: _ChunkedEntropy.apply(x, 2, temperature), (logits,))
    assert torch.autograd.gradgradcheck(lambda x: entropy_from_logits(x, temperature=temperature), (logits,))
    big = torch.zeros(2, 1 << 16)  # over the limit: chunked, and still log V
    torch.testing.assert_close(entropy_from_logits(big), torch.full((2,), 16 * math.log(2.0)))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_of_small_logits_equal_gather_minus_logsumexp(temperature):
    """Small float logits take log_softmax + gather; values and gradients are those of gather - logsumexp."""
    g = torch.Generator().manual_seed(8)
    logits = (3 * torch.randn(6, 3, generator=g, dtype=torch.float64)).requires_grad_()
    index = torch.tensor([0, 2, 1, 1, 0, 2])
    x = logits / temperature
    reference = x.gather(-1, index[:, None]).squeeze(-1) - torch.logsumexp(x, -1)
    ours = selective_log_softmax(logits, index, temperature)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    weights = torch.randn(6, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad((y * weights).sum(), logits)[0] for y in (ours, reference)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
    big = torch.zeros(2, 1 << 16)  # over the limit: gather - logsumexp, still -log V
    torch.testing.assert_close(selective_log_softmax(big, torch.tensor([0, 5])), torch.full((2,), -16 * math.log(2.0)))


def test_entropy_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(torch.zeros(2, 3), chunk_size=0)


# ---------------------------------------------------------------- low-precision kernels


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: selective_log_softmax(x, torch.zeros(x.shape[:-1], dtype=torch.long)),
        lambda x: entropy_from_logits(x, chunk_size=3),
    ],
)
def test_low_precision_kernels_save_no_float32_vocabulary_tensor(fn):
    # What autograd keeps for backward: the bf16 logits and per-row float32 values only.
    logits = torch.randn(4, 8, 64).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(logits)
    assert saved
    for t in saved:
        assert not (t.dtype == torch.float32 and t.numel() >= logits.numel()), (t.dtype, t.shape)
    out.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()


# ----------------------------------------------------------------------------
# linear_log_softmax: the output head and the log-softmax, chunked over rows
# ----------------------------------------------------------------------------


def _head_case(dtype, bias=True, n=(3, 7), hidden=5, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*n, hidden, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    idx = torch.randint(0, vocab, n, generator=g)
    return h, w, b, idx


def test_linear_log_softmax_pinned():
    # One row, H = 1, V = 2: logits (2, 0) -> log p(0) = 2 - log(e^2 + 1); entropy of (s, 1 - s) with s = sigmoid(2).
    h = torch.tensor([[1.0]])
    w = torch.tensor([[2.0], [0.0]])
    logp, ent = linear_log_softmax(h, w, torch.tensor([0]), return_entropy=True)
    s = 1 / (1 + math.exp(-2.0))
    assert logp.item() == pytest.approx(2 - math.log(math.exp(2) + 1), abs=1e-6)
    assert ent.item() == pytest.approx(-(s * math.log(s) + (1 - s) * math.log(1 - s)), abs=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 4, 21, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_log_softmax_equals_the_full_logits_forward_and_backward(chunk_rows, temperature, bias):
    # The plain computation: full (..., V) logits, then the existing kernels. Same upstream gradients on both.
    h, w, b, idx = _head_case(torch.float64, bias=bias)
    g = torch.Generator().manual_seed(1)
    up_lp = torch.randn(idx.shape, generator=g, dtype=torch.float64)
    up_ent = torch.randn(idx.shape, generator=g, dtype=torch.float64)
    logits = torch.nn.functional.linear(h, w, b)
    ref_lp = selective_log_softmax(logits, idx, temperature)
    ref_ent = entropy_from_logits(logits, temperature=temperature)
    ref_grads = torch.autograd.grad((ref_lp * up_lp).sum() + (ref_ent * up_ent).sum(), [h, w] + ([b] if bias else []))
    lp_, ent = linear_log_softmax(
        h, w, idx, bias=b, temperature=temperature, return_entropy=True, chunk_rows=chunk_rows
    )
    grads = torch.autograd.grad((lp_ * up_lp).sum() + (ent * up_ent).sum(), [h, w] + ([b] if bias else []))
    torch.testing.assert_close(lp_, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_linear_log_softmax_gradcheck_float64():
    h, w, b, idx = _head_case(torch.float64, n=(2, 3), hidden=3, vocab=4)

    def fn(h, w, b):
        lp_, ent = linear_log_softmax(h, w, idx, bias=b, temperature=0.8, return_entropy=True, chunk_rows=4)
        return lp_, ent

    assert torch.autograd.gradcheck(fn, (h, w, b))
    # Second order too: TRPO's Fisher-vector products differentiate the gradient of the log-probs again.
    assert torch.autograd.gradgradcheck(fn, (h, w, b))


def test_linear_log_softmax_logprobs_only_and_frozen_head():
    # A frozen head (LoRA, the reference) gets no gradient and costs no weight-gradient matmul; the entropy's
    # absence leaves the log-prob gradient as it is with it unused.
    h, w, b, idx = _head_case(torch.float64, bias=False)
    w = w.detach()
    lp_, ent = linear_log_softmax(h, w, idx)
    assert ent is None
    lp_.sum().backward()
    ref_h = h.detach().clone().requires_grad_()
    selective_log_softmax(ref_h @ w.t(), idx).sum().backward()
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=0, atol=1e-12)


def test_linear_log_softmax_float32_matches_float64():
    h, w, b, idx = _head_case(torch.float64, n=(4, 9), hidden=16, vocab=300)
    want = selective_log_softmax(torch.nn.functional.linear(h, w, b), idx)
    got, _ = linear_log_softmax(h.float(), w.float(), idx, bias=b.float(), chunk_rows=5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)


def test_linear_log_softmax_keeps_no_vocabulary_sized_tensor_for_backward():
    h, w, b, idx = _head_case(torch.float32, n=(4, 16), hidden=8, vocab=512)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lp_, ent = linear_log_softmax(h, w, idx, bias=b, return_entropy=True, chunk_rows=8)
    big = [t.shape for t in saved if t.numel() >= idx.numel() * 512 and t is not w]
    assert saved and not [s for s in big if s != w.shape], big
    (lp_.sum() + ent.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (h, w, b))


def test_linear_log_softmax_keeps_one_chunk_of_log_probs_when_the_rows_fit_in_one():
    # Every row in one chunk: the forward keeps that chunk's log-probabilities, (N, V), for the backward instead of
    # recomputing the logits there. A second backward through the same graph finds them unchanged.
    h, w, b, idx = _head_case(torch.float64, n=(4, 16), hidden=8, vocab=512)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lp_, ent = linear_log_softmax(h, w, idx, bias=b, temperature=0.7, return_entropy=True, chunk_rows=64)
    big = [t for t in saved if t.numel() >= idx.numel() * 512 and t is not w]
    assert [t.shape for t in big] == [(64, 512)]
    torch.testing.assert_close(
        big[0], torch.log_softmax(torch.nn.functional.linear(h, w, b) / 0.7, -1).reshape(64, 512), rtol=0, atol=1e-12
    )
    loss = (lp_ * torch.linspace(-1, 1, 64).view(4, 16)).sum() + 0.3 * ent.sum()
    first = torch.autograd.grad(loss, [h, w, b], retain_graph=True)
    second = torch.autograd.grad(loss, [h, w, b])
    logits = torch.nn.functional.linear(h, w, b)
    ref = (
        selective_log_softmax(logits, idx, 0.7) * torch.linspace(-1, 1, 64).view(4, 16)
    ).sum() + 0.3 * entropy_from_logits(logits, temperature=0.7).sum()
    for got_1, got_2, want in zip(first, second, torch.autograd.grad(ref, [h, w, b])):
        torch.testing.assert_close(got_1, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(got_2, want, rtol=0, atol=1e-12)
    # A frozen head (LoRA): the hidden states alone need a gradient, and the chunk is kept for theirs.
    saved.clear()
    frozen_w = w.detach()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lp_, _ = linear_log_softmax(h, frozen_w, idx, chunk_rows=64)
    assert [t.shape for t in saved if t.numel() >= idx.numel() * 512 and t is not frozen_w] == [(64, 512)]
    (grad_h,) = torch.autograd.grad(lp_.sum(), [h])
    (want_h,) = torch.autograd.grad(selective_log_softmax(h @ frozen_w.t(), idx).sum(), [h])
    torch.testing.assert_close(grad_h, want_h, rtol=0, atol=1e-12)

    # No graph recorded (a reference or rollout pass under no_grad, with a head that trains): nothing is kept,
    # so the forward makes no extra copy of the chunk.
    def copies(grad: bool) -> list:
        seen, original = [], torch.Tensor.sub
        with torch.set_grad_enabled(grad), pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.Tensor, "sub", lambda self, *a, **k: seen.append(self.shape) or original(self, *a, **k))
            linear_log_softmax(h, w, idx, bias=b, chunk_rows=64)
        return seen

    assert copies(True) == [(64, 512)]  # the logits shifted into a new buffer: they become the kept log-probs
    assert copies(False) == []  # shifted in place


def test_linear_log_softmax_gradcheck_in_one_chunk():
    h, w, b, idx = _head_case(torch.float64, n=(2, 3), hidden=3, vocab=4)
    for want_entropy in (True, False):

        def fn(h, w, b):
            lp_, ent = linear_log_softmax(h, w, idx, bias=b, temperature=0.8, return_entropy=want_entropy)  # noqa: B023
            return (lp_, ent) if want_entropy else lp_  # noqa: B023

        assert torch.autograd.gradcheck(fn, (h, w, b))


def test_linear_log_softmax_rejects_bad_shapes():
    h, w, b, idx = _head_case(torch.float32)
    with pytest.raises(ValueError, match="index shape"):
        linear_log_softmax(h, w, idx[:, :2])
    with pytest.raises(ValueError, match="weight must be"):
        linear_log_softmax(h, w.t(), idx)
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_log_softmax(h, w, idx, chunk_rows=0)
