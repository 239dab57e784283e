"""Generation engines: a policy and token contexts in, sampled continuations with their log-probs out.

An engine is a class behind one small interface (:class:`GenerationEngine`), chosen by name with
``sampling.engine`` from :data:`ENGINES`. It opens a :meth:`~GenerationEngine.decoding` for a policy (whatever must be
ready before tokens are drawn: an up-to-date copy of the weights, a KV cache, eval mode) and calls it on left-padded
contexts, as many times as a rollout needs: once for single-turn prompts (:meth:`GenerationEngine.generate`, which
also repeats each prompt ``group_size`` times, builds the response mask and decodes the texts), once per turn for
multi-turn episodes (:func:`align.rollout.episodes.play_episodes`). Nothing here scores or trains.

* ``vllm`` (:class:`align.rollout.vllm_engine.VLLMEngine`): vLLM in the training process, the policy's weights (or
  LoRA adapter) sent to it before each rollout that follows an update. Its log-probs are not the trainer's
  (:attr:`GenerationEngine.exact_logprobs` false), so the sampler recomputes the trainer's and the update weighs
  the difference (``sampling.correction``).
* ``native`` (:class:`NativeEngine`): align's own loop (:func:`align.rollout.sampling.sample`) over the model's
  computation; Llama-family models are decoded by :class:`~align.models.decoding.FastDecoder` (fused projections,
  LoRA merged into a per-rollout copy, a preallocated KV cache), other models through their own forward. The prompt
  of a group is encoded once and its KV cache repeated for the group's rows (``sampling.shared_prefill``).

A new engine (docs/architecture.md, "Add a generation engine") subclasses :class:`GenerationEngine`, implements
:meth:`~GenerationEngine.decoding` (and :meth:`~GenerationEngine.close` if it holds resources), and adds a row to
:data:`ENGINES`; the sampler, the episodes and every RL module then use it unchanged.
"""

from __future__ import annotations

import importlib
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Protocol, Sequence

import torch

from align.core.masks import response_mask, truncated
from align.models.decoding import FastDecoder, decoder_for
from align.rollout.sampling import SampleOutput, SamplingConfig, left_pad, sample
from align.rollout.types import Rollout

__all__ = ["ENGINES", "Decode", "GenerationEngine", "NativeEngine", "make_engine"]


class Decode(Protocol):
    """One decoding call of an open engine: left-padded ``(B, P)`` contexts -> :class:`SampleOutput` of ``(B, T)``."""

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 min_new_tokens: int = 0, generator: Optional[torch.Generator] = None,
                 sync_stop: Optional[Callable[[bool], bool]] = None, shared_prefix: int = 1) -> SampleOutput: ...


class GenerationEngine:
    """Draws continuations of token contexts from a policy with the settings ``sampling`` (temperature, top-p, top-k,
    token limits). Subclasses implement :meth:`decoding`."""

    exact_logprobs = True
    """Whether the log-probs it records are the trainer's own (computed as :mod:`align.models.scoring` does); if
    not, the sampler recomputes them for training rollouts and weighs the update (``sampling.correction``)."""

    def __init__(self, sampling: SamplingConfig | None = None, **overrides):
        """``overrides`` replace fields of ``sampling`` (e.g. ``NativeEngine(temperature=0)``)."""
        base = sampling or SamplingConfig()
        self.sampling = SamplingConfig(**{**base.__dict__, **overrides})
        self.decoding_metrics: dict[str, float] = {}
        """What the last :meth:`decoding` did besides decoding (an engine's weight sync: ``time/engine_sync_s``)."""

    def stop_ids(self, tokenizer) -> list[int]:
        """The tokens that end a response (kept in it)."""
        return [tokenizer.eos_token_id]

    def decoding(self, policy, capacity: int):
        """A context manager that readies ``policy`` for decoding contexts of up to ``capacity`` tokens (prompt and
        new tokens) and yields a :class:`Decode`; leaving it restores the policy (training mode) and frees what it
        held."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine holds across rollouts (nothing for the native engine)."""

    @torch.no_grad()
    def generate(self, policy, prompt_ids: Sequence[Sequence[int]], group_size: int = 1,
                 generator: Optional[torch.Generator] = None, sync_stop: Optional[Callable[[bool], bool]] = None,
                 ) -> Rollout:
        """``group_size`` completions for each prompt (lists of token ids, chat template applied), as a
        :class:`Rollout` whose groups are consecutive rows. ``sync_stop``: see :func:`align.rollout.sampling.sample`
        (``align.trainer.strategies.generation_context`` provides it when needed)."""
        s = self.sampling
        ids, mask, prompt_index = self.contexts(policy, prompt_ids, group_size)
        started = time.perf_counter()
        self.decoding_metrics = {}
        with self.decoding(policy, ids.shape[1] + s.max_new_tokens) as decode:
            out = decode(ids, mask, max_new_tokens=s.max_new_tokens, min_new_tokens=s.min_new_tokens,
                         generator=generator, sync_stop=sync_stop, shared_prefix=group_size if s.shared_prefill else 1)
        return self.rollout_of(policy, ids, mask, prompt_index, group_size, out, time.perf_counter() - started)

    def contexts(self, policy, prompt_ids: Sequence[Sequence[int]], group_size: int,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The left-padded ``(N, P)`` contexts and mask of ``group_size`` rows per prompt on the policy's device,
        and each row's prompt index ``(N,)`` (on the CPU)."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        device = next(policy.parameters()).device
        ids, mask = left_pad(prompt_ids, policy.tokenizer.pad_token_id)
        prompt_index = torch.arange(len(prompt_ids)).repeat_interleave(group_size)  # (N,)
        return ids[prompt_index].to(device), mask[prompt_index].to(device), prompt_index

    def rollout_of(self, policy, ids: torch.Tensor, mask: torch.Tensor, prompt_index: torch.Tensor, group_size: int,
                   out: SampleOutput, seconds: float) -> Rollout:
        """The :class:`Rollout` of contexts ``ids``/``mask`` and the tokens ``out`` decoded for them in ``seconds``:
        response mask through the first stop token, truncation, texts and the rollout's metrics."""
        tok, s = policy.tokenizer, self.sampling
        stop = self.stop_ids(tok)
        seconds = max(seconds, 1e-9)
        # The decoding loop runs in inference mode; clones are ordinary tensors that training may use.
        out = SampleOutput(out.response_ids.clone(), out.logprobs.clone(), out.steps)
        resp_mask = response_mask(out.response_ids, stop)  # (N, R)
        is_truncated = truncated(out.response_ids, stop) & (out.response_ids.shape[1] >= s.max_new_tokens)
        texts = tok.batch_decode(torch.where(resp_mask, out.response_ids, tok.pad_token_id).tolist(),
                                 skip_special_tokens=True)
        lengths = resp_mask.sum(dim=1).float()
        metrics = {
            # The tokens sampled in this rollout, so throughput can be summed over steps and ranks.
            "rollout/completion_tokens": float(lengths.sum()),
            "rollout/tokens_per_s": float(lengths.sum()) / seconds,
            "rollout/response_length": float(lengths.mean()),
            "rollout/truncated_frac": float(is_truncated.float().mean()),
            **self.decoding_metrics,
        }
        return Rollout(ids, mask, out.response_ids, resp_mask, out.logprobs, is_truncated, texts,
                       prompt_index.to(ids.device), group_size, seconds, metrics)


class NativeEngine(GenerationEngine):
    """align's own decoding loop on the policy's weights in this process (``sampling.engine: native``)."""

    @contextmanager
    def decoding(self, policy, capacity: int) -> Iterator[Decode]:
        was_training = policy.training
        policy.eval()  # no dropout while sampling, as when scoring
        try:
            model = policy.model
            if self.sampling.fast_decoder:
                model = decoder_for(model, capacity=capacity)
            s = self.sampling

            def decode(input_ids, attention_mask, *, max_new_tokens, min_new_tokens=0, generator=None,
                       sync_stop=None, shared_prefix=1) -> SampleOutput:
                if isinstance(model, FastDecoder):
                    model.capacity = input_ids.shape[1] + max_new_tokens
                return sample(model, input_ids, attention_mask, eos_token_id=self.stop_ids(policy.tokenizer),
                              pad_token_id=policy.tokenizer.pad_token_id, max_new_tokens=max_new_tokens,
                              temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_new_tokens=min_new_tokens,
                              generator=generator, sync_stop=sync_stop, shared_prefix=shared_prefix)

            yield decode
        finally:
            policy.train(was_training)


ENGINES: dict[str, type[GenerationEngine] | str] = {"native": NativeEngine,
                                                    "vllm": "align.rollout.vllm_engine:VLLMEngine"}
"""The generation engines by name (``sampling.engine``): a class, or the ``module:Class`` path of one whose module is
imported only when it is chosen (``vllm``'s imports vLLM)."""


def make_engine(sampling: SamplingConfig | None = None, **overrides) -> GenerationEngine:
    """The engine ``sampling.engine`` names, with ``sampling`` (fields replaced by ``overrides``)."""
    sampling = SamplingConfig(**{**(sampling or SamplingConfig()).__dict__, **overrides})
    if sampling.engine not in ENGINES:
        raise ValueError(f"sampling.engine must be one of {sorted(ENGINES)}, got {sampling.engine!r}")
    engine = ENGINES[sampling.engine]
    if isinstance(engine, str):
        module, _, name = engine.partition(":")
        engine = getattr(importlib.import_module(module), name)
    return engine(sampling)
