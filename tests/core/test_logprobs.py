import math

import pytest
import torch

import align.core.logprobs as lp
from align.core.logprobs import entropy_from_logits, selective_log_softmax


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
