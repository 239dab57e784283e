"""Generation engines: a policy and token contexts in, sampled continuations with their log-probs out.

An engine is a class behind one small interface (:class:`GenerationEngine`), named by ``sampling.engine``: the short
names ``native`` and ``vllm``, or a ``class_path`` with the engine's own settings as ``init_args``::

    sampling:
      temperature: 0.7
      engine:
        class_path: align.rollout.vllm_engine.VLLMEngine
        init_args: {dtype: bfloat16, gpu_memory_utilization: 0.4}

:class:`SamplingConfig` says *what* is drawn (temperature, top-p, top-k, token limits, the correction of the
engine's log-probs) and is the same for every engine; an engine's constructor arguments say *how* it decodes. The
training and the held-out engines of a run share one engine object, each bound to its own sampling settings
(:meth:`GenerationEngine.bound`).

An engine opens a :meth:`~GenerationEngine.decoding` for a policy (whatever must be ready before tokens are drawn: an
up-to-date copy of the weights, a KV cache, eval mode) and calls it on left-padded contexts, as many times as a
rollout needs: once for single-turn prompts (:meth:`GenerationEngine.generate`, which also repeats each prompt
``group_size`` times, builds the response mask and decodes the texts), once per turn for multi-turn episodes
(:func:`align.rollout.episodes.play_episodes`), once per cut for partial rollouts (:mod:`align.rollout.partial`).
Nothing here scores or trains.

* ``native`` (:class:`NativeEngine`): align's own loop (:func:`align.rollout.sampling.sample`) over the model's
  computation; Llama-family models are decoded by :class:`~align.models.decoding.FastDecoder` (fused projections,
  LoRA merged into a per-rollout copy, a preallocated KV cache), other models through their own forward. The prompt
  of a group is encoded once and its KV cache repeated for the group's rows (``shared_prefill``).
* ``vllm`` (:class:`align.rollout.vllm_engine.VLLMEngine`): vLLM in the training process, the policy's weights (or
  LoRA adapter) sent to it before each rollout that follows an update. Its log-probs are not the trainer's
  (:attr:`GenerationEngine.exact_logprobs` false), so the sampler recomputes the trainer's and the update weighs
  the difference (``sampling.correction``).

A new engine (docs/architecture.md, "A generation engine") subclasses :class:`GenerationEngine` anywhere importable,
takes its settings as constructor arguments, implements :meth:`~GenerationEngine.decoding` (and
:meth:`~GenerationEngine.close` if it holds resources) and says what it can do
(:attr:`~GenerationEngine.exact_logprobs`,
:attr:`~GenerationEngine.stops_per_token`); the sampler, the episodes, held-out passes, the asynchronous source and
every RL module then use it unchanged.
"""

from __future__ import annotations

import copy
import importlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol

import torch

from align.core.masks import response_mask, truncated
from align.errors import AlignConfigError
from align.models.decoding import FastDecoder, decoder_for
from align.rollout.sampling import SampleOutput, left_pad, sample
from align.rollout.types import Rollout

__all__ = [
    "ENGINE_NAMES",
    "Decode",
    "EngineCorrection",
    "GenerationEngine",
    "HeldOutCorrection",
    "HeldOutSampling",
    "NativeEngine",
    "SamplingConfig",
    "engine_of",
    "make_engine",
]


def _check(ok: bool, key: str, expected: str, got) -> None:
    if not ok:
        raise AlignConfigError(f"{key}: expected {expected}, got {got!r}")


@dataclass
class EngineCorrection:
    """How an update corrects for the engine's log-probs differing from the trainer's (:mod:`align.core.mismatch`;
    docs/generation.md, "The sampler/trainer mismatch")."""

    where: ClassVar[str] = "model.sampling.correction"
    """The settings' place in a config, named by their errors."""

    mode: str = "auto"
    """``auto`` (``tis`` on an engine whose log-probs are not the trainer's, such as vLLM; ``none`` on the native
    engine, whose are), ``tis`` (truncated importance sampling), ``mis`` (masked importance sampling) or ``none``."""
    level: str = "token"
    """``token``: each token its own weight; ``sequence``: a row's product of ratios (for ``gspo``/``gmpo``)."""
    cap: float = 2.0
    """``tis``: the largest weight."""
    low: float = 0.5
    """``mis``: ratios below are masked."""
    high: float = 2.0
    """``mis``: ratios above are masked."""

    def __post_init__(self) -> None:
        key = self.where
        _check(self.mode in ("auto", "none", "tis", "mis"), f"{key}.mode", "auto, none, tis or mis", self.mode)
        _check(self.level in ("token", "sequence"), f"{key}.level", "token or sequence", self.level)
        _check(self.cap >= 1, f"{key}.cap", ">= 1", self.cap)
        _check(0 <= self.low <= 1, f"{key}.low", "a value in [0, 1]", self.low)
        _check(self.high >= 1, f"{key}.high", ">= 1", self.high)

    def resolve(self, exact_logprobs: bool) -> str:
        """The mode in effect for an engine whose log-probs are (``exact_logprobs``) or are not the trainer's."""
        if self.mode == "auto":
            return "none" if exact_logprobs else "tis"
        return self.mode


@dataclass
class SamplingConfig:
    """How completions are drawn, whatever the engine."""

    where: ClassVar[str] = "model.sampling"
    """The settings' place in a config, named by their errors."""

    max_new_tokens: int = 32
    """Longest response in tokens; a response that reaches it without a stop token is truncated."""
    temperature: float = 1.0
    """Softmax temperature for sampling and for the recorded log-probs; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches ``top_p`` (1 = off)."""
    top_k: int = 0
    """Draw from the ``top_k`` most likely tokens only (0 = off)."""
    min_new_tokens: int = 0
    """Stop tokens are forbidden before this many tokens have been generated."""
    engine: str | GenerationEngine = "native"
    """The generation engine: ``native`` (align's own decoding loop), ``vllm``, or a ``class_path`` of a
    :class:`~align.rollout.engine.GenerationEngine` with its settings as ``init_args`` (docs/engines.md)."""
    correction: EngineCorrection = field(default_factory=EngineCorrection)
    """The importance correction of training rollouts for the engine's log-probs (``mode: auto``: on for vLLM)."""

    def __post_init__(self) -> None:
        key = self.where
        _check(self.max_new_tokens >= 1, f"{key}.max_new_tokens", ">= 1", self.max_new_tokens)
        _check(self.temperature >= 0, f"{key}.temperature", ">= 0 (0: greedy)", self.temperature)
        _check(0 < self.top_p <= 1, f"{key}.top_p", "a value in (0, 1]", self.top_p)
        _check(self.top_k >= 0, f"{key}.top_k", ">= 0 (0: off)", self.top_k)
        _check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            f"{key}.min_new_tokens",
            f"a value in [0, max_new_tokens = {self.max_new_tokens}]",
            self.min_new_tokens,
        )
        if isinstance(self.engine, str):
            engine_class(self.engine, f"{key}.engine")  # a misspelt name fails here, not at the first rollout


@dataclass
class HeldOutCorrection(EngineCorrection):
    """The correction settings of held-out sampling (``evaluation.sampling.correction``); held-out completions are
    scored, never trained on, so only the settings' checks apply."""

    where: ClassVar[str] = "model.evaluation.sampling.correction"


@dataclass
class HeldOutSampling(SamplingConfig):
    """How held-out completions are drawn (``evaluation.sampling``): the training engine unless ``engine`` names one."""

    where: ClassVar[str] = "model.evaluation.sampling"

    engine: str | GenerationEngine | None = None  # type: ignore[assignment]  # widened: null is the training engine
    """The generation engine; null: the training engine (``sampling.engine``, with its settings)."""
    correction: HeldOutCorrection = field(default_factory=HeldOutCorrection)
    """Checked as the training correction is; held-out completions are never trained on."""


class Decode(Protocol):
    """One decoding call of an open engine: left-padded ``(B, P)`` contexts -> :class:`SampleOutput` of ``(B, T)``."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        generator: torch.Generator | None = None,
        sync_stop: Callable[[bool], bool] | None = None,
        shared_prefix: int = 1,
    ) -> SampleOutput: ...


class GenerationEngine:
    """Draws continuations of token contexts from a policy. An engine object holds its own settings (its
    constructor's arguments); :meth:`bound` gives a copy that draws with given :class:`SamplingConfig` settings
    (``self.sampling``). Subclasses implement :meth:`decoding`."""

    exact_logprobs: ClassVar[bool] = True
    """Whether the log-probs it records are the trainer's own (computed as :mod:`align.models.scoring` does); if
    not, the sampler recomputes them for training rollouts and weighs the update (``sampling.correction``)."""
    stops_per_token: ClassVar[bool] = False
    """Whether its :class:`Decode` calls ``sync_stop`` after every token and stops when told to: what partial rollouts
    (``source.interrupt``, cut at a weight update) and lock-step decoding across ranks (ZeRO-3) need."""

    def __init__(self) -> None:
        self.sampling = SamplingConfig()
        """What it draws (:meth:`bound` sets it)."""
        self.decoding_metrics: dict[str, float] = {}
        """What the last :meth:`decoding` did besides decoding (an engine's weight sync: ``time/engine_sync_s``)."""

    def bound(self, sampling: SamplingConfig) -> GenerationEngine:
        """A copy of this engine (its settings and whatever it shares across copies) that draws with ``sampling``."""
        engine = copy.copy(self)
        engine.sampling, engine.decoding_metrics = sampling, {}
        return engine

    def stop_ids(self, tokenizer) -> list[int]:
        """The tokens that end a response (kept in it)."""
        return [tokenizer.eos_token_id]

    def decoding(self, policy, capacity: int):
        """A context manager that readies ``policy`` for decoding contexts of up to ``capacity`` tokens (prompt and
        new tokens) and yields a :class:`Decode`; leaving it restores the policy (training mode) and frees what it
        held. It may set :attr:`decoding_metrics` (what it did besides decoding: ``time/engine_sync_s``)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine holds across rollouts (nothing for the native engine)."""

    @classmethod
    def shutdown(cls) -> None:
        """Release what engines of this class hold for the whole process (vLLM's in-process engines), at exit,
        before the trainer releases the process group (the module arranges it)."""

    @torch.no_grad()
    def generate(
        self,
        policy,
        prompt_ids: Sequence[Sequence[int]],
        group_size: int = 1,
        generator: torch.Generator | None = None,
        sync_stop: Callable[[bool], bool] | None = None,
    ) -> Rollout:
        """``group_size`` completions for each prompt (lists of token ids, chat template applied), as a
        :class:`Rollout` whose groups are consecutive rows. ``sync_stop``: see :func:`align.rollout.sampling.sample`
        (``align.trainer.strategies.generation_context`` provides it when needed)."""
        s = self.sampling
        ids, mask, prompt_index = self.contexts(policy, prompt_ids, group_size)
        started = time.perf_counter()
        self.decoding_metrics = {}
        with self.decoding(policy, ids.shape[1] + s.max_new_tokens) as decode:
            out = decode(
                ids,
                mask,
                max_new_tokens=s.max_new_tokens,
                min_new_tokens=s.min_new_tokens,
                generator=generator,
                sync_stop=sync_stop,
                shared_prefix=group_size,
            )
        return self.rollout_of(policy, ids, mask, prompt_index, group_size, out, time.perf_counter() - started)

    def contexts(
        self,
        policy,
        prompt_ids: Sequence[Sequence[int]],
        group_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The left-padded ``(N, P)`` contexts and mask of ``group_size`` rows per prompt on the policy's device,
        and each row's prompt index ``(N,)`` (on the CPU)."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        device = next(policy.parameters()).device
        ids, mask = left_pad(prompt_ids, policy.tokenizer.pad_token_id)
        prompt_index = torch.arange(len(prompt_ids)).repeat_interleave(group_size)  # (N,)
        return ids[prompt_index].to(device), mask[prompt_index].to(device), prompt_index

    def rollout_of(
        self,
        policy,
        ids: torch.Tensor,
        mask: torch.Tensor,
        prompt_index: torch.Tensor,
        group_size: int,
        out: SampleOutput,
        seconds: float,
    ) -> Rollout:
        """The :class:`Rollout` of contexts ``ids``/``mask`` and the tokens ``out`` decoded for them in ``seconds``:
        response mask through the first stop token, truncation, texts and the rollout's metrics."""
        tok, s = policy.tokenizer, self.sampling
        stop = self.stop_ids(tok)
        seconds = max(seconds, 1e-9)
        # The decoding loop runs in inference mode; clones are ordinary tensors that training may use.
        out = SampleOutput(out.response_ids.clone(), out.logprobs.clone(), out.steps)
        resp_mask = response_mask(out.response_ids, stop)  # (N, R)
        is_truncated = truncated(out.response_ids, stop) & (out.response_ids.shape[1] >= s.max_new_tokens)
        texts = tok.batch_decode(
            torch.where(resp_mask, out.response_ids, tok.pad_token_id).tolist(), skip_special_tokens=True
        )
        lengths = resp_mask.sum(dim=1).float()
        metrics = {
            # The tokens sampled in this rollout, so throughput can be summed over steps and ranks.
            "rollout/completion_tokens": float(lengths.sum()),
            "rollout/tokens_per_s": float(lengths.sum()) / seconds,
            "rollout/response_length": float(lengths.mean()),
            "rollout/truncated_frac": float(is_truncated.float().mean()),
            **self.decoding_metrics,
        }
        return Rollout(
            ids,
            mask,
            out.response_ids,
            resp_mask,
            out.logprobs,
            is_truncated,
            texts,
            prompt_index.to(ids.device),
            group_size,
            seconds,
            metrics,
        )


class NativeEngine(GenerationEngine):
    """align's own decoding loop on the policy's weights in this process (``sampling.engine: native``)."""

    stops_per_token = True

    def __init__(self, fast_decoder: bool = True, shared_prefill: bool = True):
        """
        Args:
            fast_decoder: Decode Llama-family models with :class:`align.models.decoding.FastDecoder` (same logits,
                fewer operations per token); false, or a model it does not cover, samples through the model's own
                forward.
            shared_prefill: Encode each prompt once for its whole group and repeat its KV cache for the group's
                completions (the same numbers as encoding every copy, up to float rounding); false encodes every copy.
        """
        super().__init__()
        self.fast_decoder, self.shared_prefill = fast_decoder, shared_prefill

    @contextmanager
    def decoding(self, policy, capacity: int) -> Iterator[Decode]:
        was_training = policy.training
        policy.eval()  # no dropout while sampling, as when scoring
        try:
            model = policy.model
            if self.fast_decoder:
                model = decoder_for(model, capacity=capacity)
            s = self.sampling

            def decode(
                input_ids,
                attention_mask,
                *,
                max_new_tokens,
                min_new_tokens=0,
                generator=None,
                sync_stop=None,
                shared_prefix=1,
            ) -> SampleOutput:
                if isinstance(model, FastDecoder):
                    model.capacity = input_ids.shape[1] + max_new_tokens
                return sample(
                    model,
                    input_ids,
                    attention_mask,
                    eos_token_id=self.stop_ids(policy.tokenizer),
                    pad_token_id=policy.tokenizer.pad_token_id,
                    max_new_tokens=max_new_tokens,
                    temperature=s.temperature,
                    top_k=s.top_k,
                    top_p=s.top_p,
                    min_new_tokens=min_new_tokens,
                    generator=generator,
                    sync_stop=sync_stop,
                    shared_prefix=shared_prefix if self.shared_prefill else 1,
                )

            yield decode
        finally:
            policy.train(was_training)


ENGINE_NAMES: dict[str, str] = {
    "native": "align.rollout.engine.NativeEngine",
    "vllm": "align.rollout.vllm_engine.VLLMEngine",
}
"""Short names of ``sampling.engine``: the class paths they stand for (imported only when chosen: ``vllm``'s module
imports vLLM)."""


def engine_class(name: str, key: str = "model.sampling.engine") -> type[GenerationEngine]:
    """The engine class ``name`` names: a short name of :data:`ENGINE_NAMES` or an import path
    (``package.module.Class``); one line naming ``key`` when it names none."""
    path = ENGINE_NAMES.get(name, name)
    module, _, attr = path.rpartition(".")
    expected = f"{', '.join(ENGINE_NAMES)} or the import path of a GenerationEngine subclass"
    if not module:
        raise AlignConfigError(f"{key}: expected {expected}, got {name!r}")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise AlignConfigError(f"{key}: expected {expected}, got {name!r} ({type(err).__name__}: {err})") from None
    if not (isinstance(cls, type) and issubclass(cls, GenerationEngine)):
        raise AlignConfigError(f"{key}: {name!r} is not a subclass of align.rollout.engine.GenerationEngine")
    return cls


def engine_of(spec: str | GenerationEngine) -> GenerationEngine:
    """The engine ``spec`` names: itself when it is one, else its class (:func:`engine_class`) with its default
    settings."""
    return spec if isinstance(spec, GenerationEngine) else engine_class(spec)()


def make_engine(sampling: SamplingConfig | None = None, **overrides) -> GenerationEngine:
    """The engine ``sampling.engine`` names, bound to ``sampling`` with ``overrides`` replacing its fields
    (``make_engine(temperature=0)``: the native engine, greedy)."""
    sampling = replace(sampling or SamplingConfig(), **overrides) if overrides else (sampling or SamplingConfig())
    return engine_of(sampling.engine).bound(sampling)
