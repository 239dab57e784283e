"""PPO modules and hand-made rollouts shared by the PPO, actor-critic and critic-pass tests."""

import torch
from _helpers import PROMPTS, length_reward

from align.core.masks import response_mask, truncated
from align.data.chat import ChatEncoder
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.options import Updates
from align.modules.ppo import PPOModule
from align.rollout.engine import SamplingConfig
from align.rollout.types import Rollout


def row_reward(prompts, completions, **kw):
    """Scores 3, 5, 7, ... by row: each row's terminal reward is recognisable."""
    return [3.0 + 2 * i for i in range(len(completions))]


def make_module(policy=None, **kw):
    defaults = {
        "policy": policy or PolicyModel("tiny", seed=2, critic=CriticSettings()),
        "rewards": [length_reward],
        "sampling": SamplingConfig(max_new_tokens=6),
        "group_size": 2,
        "updates": Updates(max_grad_norm=None),
        "log_entropy": False,
    }
    return PPOModule(**{**defaults, **kw})


def hand_rollout(policy, responses, max_new_tokens):
    """A rollout of the given response ids (already padded) for the first len(responses) prompts."""
    tok = policy.tokenizer
    enc = ChatEncoder(tok)
    prompts = [enc.prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS[: len(responses)]]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    response_ids = torch.tensor(responses)
    mask = response_mask(response_ids, tok.eos_token_id)
    is_truncated = truncated(response_ids, tok.eos_token_id) & (response_ids.shape[1] >= max_new_tokens)
    logprobs = policy.token_logprobs(
        torch.cat([prompt_ids, response_ids], 1),
        torch.cat([prompt_mask, mask.long()], 1),
        response_length=response_ids.shape[1],
    ).logprobs.detach()
    logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    texts = tok.batch_decode(torch.where(mask, response_ids, tok.pad_token_id).tolist(), skip_special_tokens=True)
    return Rollout(
        prompt_ids,
        prompt_mask,
        response_ids,
        mask,
        logprobs,
        is_truncated,
        texts,
        torch.arange(len(responses)),
        1,
        0.0,
        {},
    )
