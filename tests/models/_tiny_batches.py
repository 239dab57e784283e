"""Inputs and a reference computation shared by the policy, scoring, reference and critic tests."""

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
