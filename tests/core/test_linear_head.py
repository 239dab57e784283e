"""The output head and the log-softmax in one chunked pass (align.core.linear_head): pinned values, the full logits'
forward and backward, double backpropagation, and no vocabulary-sized tensor kept for the backward."""

import math

import pytest
import torch

from align.core.linear_head import linear_log_softmax
from align.core.logprobs import entropy_from_logits, selective_log_softmax


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
