"""The vLLM generation engine (``sampling.engine: vllm``, or its ``class_path``
``align.rollout.vllm_engine.VLLMEngine`` with settings): rollouts decoded by vLLM in the training process, with the
policy's weights sent to it whenever they changed.

* **Colocated, one per process** (:mod:`align.rollout.vllm_colocated`). The engine is created on the first rollout,
  in the training process (vLLM's in-process engine core), and shared by every :class:`VLLMEngine` of the process
  with the same model shape and settings: the training and the held-out engines of a run, and the tests of a test
  session. Under DDP each rank has its own, over the ranks' existing process group (vLLM's ``external_launcher``),
  and samples its own prompts.
* **Weights follow the policy.** Before each rollout the engine compares the policy's parameters with those it last
  received (each parameter's identity and in-place version counter, which every optimizer step and checkpoint load
  bumps) and sends what changed: the full weights in checkpoint form, layer by layer, through the worker's own
  ``reload_weights``; with LoRA only the adapter, as a new adapter version (the base weights stay), or, with
  ``lora: merged`` (the default on a CPU), the weights with the adapter added. The prefix cache
  is reset after every weight update, or a cached prompt would keep the old weights' keys and values.
* **Log-probs.** Each sampled token's log-prob is vLLM's ``processed_logprobs``: after temperature, top-k and top-p,
  the behaviour policy the tokens were really drawn from. They are not the trainer's: the sampler recomputes the
  trainer's and weighs the update (:mod:`align.core.mismatch`, ``sampling.correction``).
* **Sleep.** On a GPU with ``sleep``, the engine releases its KV cache (and, with full fine-tuning,
  its weights, which the next rollout sends anyway) between rollouts, so the update has the memory.

Not supported: a quantized (QLoRA) base, which vLLM cannot take from a bitsandbytes model; DoRA or other non-plain
adapters; DeepSpeed ZeRO-3 (its partitioned weights); models vLLM does not implement. Each fails on one line at the
first rollout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from align.errors import AlignConfigError
from align.rollout.engine import Decode, GenerationEngine
from align.rollout.sampling import SampleOutput
from align.rollout.vllm_colocated import close_engines, engine_for

__all__ = ["VLLMEngine", "close_engines"]


@dataclass(eq=False)
class VLLMEngine(GenerationEngine):
    """Decodes with vLLM in this process. Its settings are its own (``sampling.engine.init_args``); the engine runs
    in the training process and shares its devices (colocated)."""

    exact_logprobs = False

    dtype: str = "auto"
    """The engine's weights and activations: ``auto`` (the policy's dtype), ``float32``, ``bfloat16`` or ``float16``.
    Below float32 its log-probs drift from the trainer's (``rollout/engine_kl``), which the correction weighs."""
    kv_cache_gb: int = 1
    """KV cache size in whole GiB on a CPU (``VLLM_CPU_KVCACHE_SPACE``); on a GPU ``gpu_memory_utilization`` applies."""
    gpu_memory_utilization: float = 0.3
    """Share of the GPU's memory the engine may take for weights and KV cache (the rest is the trainer's)."""
    max_model_len: int | None = None
    """Longest context (prompt and response) a request may reach; null: the longest a rollout can need, capped by
    the model's ``max_position_embeddings``."""
    tensor_parallel_size: int = 1
    """Devices each engine splits the model over (GPU only)."""
    enforce_eager: bool = True
    """Run without CUDA graphs or compilation (faster start; false captures graphs on a GPU)."""
    max_num_seqs: int = 256
    """Most sequences the engine decodes at once."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of a shared prompt (a group's rows); reset at every weight update."""
    lora: str = "auto"
    """How a LoRA policy's adapter reaches the engine: ``adapter`` (a new adapter version per update, the base
    weights sent once; vLLM's LoRA kernels), ``merged`` (the base weights with the adapter added, sent whole at every
    update; decoding at the base model's speed) or ``auto``: ``adapter`` on a GPU, ``merged`` on a CPU, where vLLM's
    LoRA path decoded SmolLM2 about 5x slower than its base."""
    sleep: bool = True
    """On a GPU, release the KV cache and weights while the trainer updates (vLLM's sleep mode) and wake for the
    next rollout; ignored where the platform has no sleep mode (CPU)."""
    seed: int = 0
    """The engine's own seed."""
    request_seeds: bool = True
    """Give each request a seed drawn from the rollout's generator, so a run at a fixed seed samples the same
    completions again; false leaves sampling to the engine's own generator (vLLM samples seeded requests one by one,
    which costs a few kernel launches per row and step on a GPU)."""

    def __post_init__(self) -> None:
        super().__init__()
        key = "model.sampling.engine"
        for name, ok, expected in (
            ("dtype", self.dtype in ("auto", "float32", "bfloat16", "float16"), "auto, float32, bfloat16 or float16"),
            ("kv_cache_gb", self.kv_cache_gb >= 1, ">= 1"),
            ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "a value in (0, 1]"),
            ("lora", self.lora in ("auto", "adapter", "merged"), "auto, adapter or merged"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, ">= 1"),
            ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
        ):
            if not ok:
                raise AlignConfigError(f"{key}.{name}: expected {expected}, got {getattr(self, name)!r}")

    @contextmanager
    def decoding(self, policy, capacity: int) -> Iterator[Decode]:
        # The engine's tensors are created and written in inference mode: a first rollout may come from a held-out
        # pass (Lightning validates in inference mode) and later ones from training (no_grad only), and inference
        # tensors refuse in-place writes outside it.
        with torch.inference_mode():
            handle = engine_for(policy, self, capacity)
            self.decoding_metrics = handle.sync(policy)
        s, stop = self.sampling, self.stop_ids(policy.tokenizer)
        pad = policy.tokenizer.pad_token_id

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
            # No collective runs inside vLLM's decoding, so ranks may stop at different steps (sync_stop unused).
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
            seeds = (
                torch.randint(0, 2**31 - 1, (len(rows),), generator=generator).tolist()
                if self.request_seeds
                else [None] * len(rows)
            )
            params = [
                SamplingParams(
                    n=1,
                    temperature=s.temperature,
                    top_p=s.top_p,
                    top_k=s.top_k,
                    max_tokens=max_new_tokens,
                    min_tokens=min_new_tokens,
                    stop_token_ids=stop,
                    logprobs=0,
                    seed=seed,
                    detokenize=False,
                )
                for seed in seeds
            ]
            outputs = handle.llm.generate(
                [TokensPrompt(prompt_token_ids=r) for r in rows],  # type: ignore[typeddict-item]  # NotRequired: 3.11+
                params,
                use_tqdm=False,
                lora_request=handle.adapter,
            )
            return _as_sample_output(outputs, pad, input_ids.device)

        try:
            yield decode
        finally:
            handle.sleep()

    def close(self) -> None:
        """Engines are shared by the process; :meth:`shutdown` (:func:`close_engines`) releases them."""

    @classmethod
    def shutdown(cls) -> None:
        close_engines()


def _as_sample_output(outputs, pad_token_id: int, device) -> SampleOutput:
    """vLLM's request outputs -> ``(B, T)`` response ids (pad after the end) and their log-probs (0 there)."""
    completions = [o.outputs[0] for o in outputs]
    width = max(1, max(len(c.token_ids) for c in completions))
    ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((len(completions), width), dtype=torch.float32)
    for row, c in enumerate(completions):
        tokens = list(c.token_ids)
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logprobs[row, : len(tokens)] = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, tokens)])
    return SampleOutput(ids.to(device), logprobs.to(device), width)
