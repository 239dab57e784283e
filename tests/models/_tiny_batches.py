"""Inputs and reference computations shared by the policy, scoring, shared-pass, reference and critic tests."""

import torch


def batch(policy, texts=("sort: b a", "sort: d c b a")):
    tok = policy.tokenizer
    tok.padding_side = "left"
    enc = tok(list(texts), return_tensors="pt", padding=True)
    tok.padding_side = "right"
    return enc["input_ids"], enc["attention_mask"]


def naive_logprobs(model, ids, mask, R):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp[:, -R:]


def paths_agree(policy, run, monkeypatch):
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
