"""GRPO step throughput and memory: ``align`` against TRL's ``GRPOTrainer``, same model, prompts and settings.

Usage::

    python benchmarks/grpo.py                          # tiny Llama, 8 prompts x 4 completions, 32 new tokens
    python benchmarks/grpo.py --lora --trials 3 --json grpo-bench.json
    python benchmarks/grpo.py --hidden-size 256 --layers 4 --prompts 16 --group 8
    python benchmarks/grpo.py --device cuda --hidden-size 896 --layers 24 --heads 14 --kv-heads 2 \
        --intermediate 4864 --vocab-size 49152 --prompts 16 --group 8 --max-new-tokens 192   # one GPU, bf16 autocast
    python benchmarks/grpo.py --model smollm2-135m-instruct --prompts 4 --group 4 --max-new-tokens 32 --threads 2
    python benchmarks/grpo.py --estimator rloo          # align's advantages.estimator: rloo vs TRL's RLOOTrainer
    python benchmarks/grpo.py --level sequence          # GSPO: policy_loss gspo vs importance_sampling_level
    python benchmarks/grpo.py --engine vllm             # align on vLLM and on its own decoder, TRL on generate
    python benchmarks/grpo.py --engine vllm --trl-vllm  # ... and TRL with use_vllm=True (colocate)
    python benchmarks/grpo.py --staleness 1             # align's rollouts one step ahead, and synchronous (sync)

What happens:

1. A tiny random Llama (``align.hub.tiny.build_tiny_model`` with the size flags) and the shipped tokenizer are
   saved to a temporary Hugging Face directory; both frameworks load it from there in float32. With ``--model`` (a
   local Hugging Face folder, a ``.gguf`` file or a packaged id such as ``smollm2-135m-instruct``) the size flags are
   ignored and both load that model and its tokenizer, in float32, from the one folder it resolves to.
2. Prompts: the first ``--prompts`` bundled sort prompts, as one user message each (both apply the same chat
   template). Reward: the same plain function on both sides (``length_reward``: longer completions score higher,
   so there is a learning signal in every group).
3. Trials run in fresh subprocesses, alternating ``align, trl, align, trl, ...``. Each trial runs ``--steps`` full
   GRPO steps (generation, reward scoring, one policy update); the first ``--warmup`` are excluded.
4. Reported per framework: completion tokens per second of full steps (completion tokens generated / wall time of
   the step; align: the logged ``rollout/completion_tokens``), the share of the step spent generating (align: the
   logged ``time/generation_s``; TRL: ``_generate_and_score_completions``,
   which also scores rewards) and updating, the tokens an update reads (prompts and completions), and the
   process's peak RSS (``ru_maxrss``: imports, model and activations); with ``--device cuda`` also the peak of
   allocated CUDA memory. Then the align/TRL ratios.

Settings that are the same on both sides: model and weights, prompts, group size (``num_generations``), new-token
limit (``max_completion_length``), temperature 1, no top-k/top-p, one policy iteration per rollout
(``num_iterations`` = mu = 1), one optimizer step per rollout (no minibatching or accumulation), beta = 0 (no
reference model), clip 0.2, token-mean loss over the step (TRL ``loss_type="dapo"``), AdamW (torch's fused kernel,
TRL's default) with a constant learning rate, gradient clipping at 1.0, fp32 (``--device cuda``: fp32 weights
under bf16 autocast unless ``--precision 32-true``), LoRA on or off (r 16, alpha 32, all
linear layers), ``--threads`` torch threads, no checkpoints, no evaluation. Each framework keeps its own generation
loop: align its KV-cache sampler that stops when all rows are done, through
:class:`align.models.decoding.FastDecoder` (``--no-fast-decoder``: through the model's own forward, to see what the
decoder contributes); TRL ``transformers.generate``.

Variants (the rest as above):

* ``--engine vllm``: align samples with its vLLM engine (``sampling.engine: vllm``, float32, the correction on, so
  each step also recomputes the trainer's log-probs: ``time/correction_s``, counted in the update's share) in the
  trials named ``align``, and with its own decoder in those named ``native``; ``--trl-vllm`` adds TRL's
  ``use_vllm=True, vllm_mode="colocate"`` (trials ``trl-vllm``). The ratio printed is align (vLLM) over TRL
  (``generate``), then vLLM over native.
* ``--staleness K``: align's rollouts come from an asynchronous source ``K`` batches ahead (``model.source:
  AsyncSource``, a generator process placed by a local Ray) in the trials named ``align``, and from the inline source
  in those named ``sync``. Generation then overlaps the update: its share can pass 100% minus the update's, and the
  share ``trainer_idle`` is the part of the step spent waiting for the rollout. The pipeline's first ``K`` batches
  take no update: they are inside the warm-up when ``--warmup`` >= ``K``. Ratios printed: align over TRL, then
  asynchronous over synchronous.
* ``--estimator rloo``: align's ``advantages.estimator: rloo`` against TRL's ``RLOOTrainer`` (``RLOOConfig``, no
  advantage normalisation). TRL's RLOO clips one ratio per sequence (of summed log-probs) and averages per
  sequence; on policy the ratio is 1 either way, so both take the same REINFORCE step up to the loss weighting.
* ``--level sequence`` (GSPO): align's ``policy_loss.name: gspo`` with ``loss_aggregation: seq_mean`` against
  ``GRPOConfig(importance_sampling_level="sequence", loss_type="grpo")``, the per-sequence mean that GSPO's paper
  and TRL's documentation pair it with.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _harness as h

PHASES = ("generation",)


def length_reward(prompts, completions, **kwargs):
    """Longer completions (up to 40 characters) score higher: every group has reward variance."""
    return [min(len(c), 40) / 40.0 for c in completions]


# ---------------------------------------------------------------------------------------------------------------
# children


def build_module(spec: dict):
    """The GRPO module of an align trial: every setting the comparison fixes, in one place."""
    import torch

    from align.models.loading import LoraSettings
    from align.models.policy import PolicyModel
    from align.modules.grpo import GRPOModule
    from align.modules.options import ClipRange, GroupAdvantages, KLPenalty, PolicyLoss, Updates
    from align.rollout.engine import NativeEngine, SamplingConfig

    lora = LoraSettings(r=16, alpha=32) if spec["lora"] else None
    source = None
    if spec.get("staleness") is not None:
        from align.rollout.async_source import AsyncSource

        source = AsyncSource(max_staleness=spec["staleness"])
    return GRPOModule(
        policy=PolicyModel(spec["model_dir"], lora=lora, gradient_checkpointing=spec["gradient_checkpointing"]),
        rewards=[length_reward],
        group_size=spec["group"],
        sampling=SamplingConfig(
            max_new_tokens=spec["max_new_tokens"],
            temperature=1.0,
            engine=(
                NativeEngine(fast_decoder=spec["fast_decoder"])
                if spec.get("engine", "native") == "native"
                else spec["engine"]
            ),
        ),
        kl=KLPenalty(coef=0.0),
        clip=ClipRange(low=0.2),
        policy_loss=PolicyLoss(name="gspo" if spec["level"] == "sequence" else "clip"),
        advantages=GroupAdvantages(estimator=spec["estimator"]),
        updates=Updates(
            epochs=1,
            minibatches=1,
            max_grad_norm=1.0,
            loss_aggregation="seq_mean" if spec["level"] == "sequence" else "token_mean",
        ),
        log_entropy=False,
        source=source,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True),
    )


def run_align(spec: dict) -> dict:
    h.set_threads(spec["threads"])
    phases = PHASES + (("trainer_idle",) if spec.get("staleness") is not None else ())
    module = build_module(spec)
    try:
        return h.rl_align_trial(spec, module, phases, max_steps=spec["steps"])
    finally:
        module.source.close()


def run_sync(spec: dict) -> dict:
    return run_align({**spec, "staleness": None})


def run_native(spec: dict) -> dict:
    return run_align({**spec, "engine": "native"})


def run_trl_vllm(spec: dict) -> dict:
    return run_trl({**spec, "trl_vllm": True})


def run_trl(spec: dict) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    h.set_threads(spec["threads"])
    n = spec["prompts"] * spec["group"]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p}]} for p in h.sort_prompts(spec["prompts"])] * spec["steps"]
    )
    common = dict(
        output_dir=str(Path(spec["workdir"]) / "trl"),
        per_device_train_batch_size=n,
        num_generations=spec["group"],
        max_completion_length=spec["max_new_tokens"],
        max_steps=spec["steps"],
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        optim="adamw_torch_fused",
        max_grad_norm=1.0,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        gradient_accumulation_steps=1,
        temperature=1.0,
        top_p=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        **h.trl_device(spec),
        seed=0,
        dataloader_num_workers=0,
        shuffle_dataset=False,
        disable_tqdm=True,
        gradient_checkpointing=spec["gradient_checkpointing"],  # TRL's own default is on; align's is off
    )
    if spec.get("trl_vllm"):
        common.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=False)
    if spec["estimator"] == "rloo":
        trainer_class, config = RLOOTrainer, RLOOConfig(**common, normalize_advantages=False)
    else:
        sequence = spec["level"] == "sequence"
        trainer_class, config = (
            GRPOTrainer,
            GRPOConfig(**common, loss_type="grpo" if sequence else "dapo", importance_sampling_level=spec["level"]),
        )
    peft_config = None
    if spec["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    trainer = trainer_class(
        model=spec["model_dir"],
        reward_funcs=length_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    meter = h.StepMeter(spec["warmup"], sync=h.device_sync(spec))
    original = trainer._generate_and_score_completions

    def timed(inputs):
        start = time.perf_counter()
        out = original(inputs)
        prompt_mask = out.get("prompt_mask")
        meter.add(
            generation_s=time.perf_counter() - start,
            tokens=int(out["completion_mask"].sum()),
            prompt_tokens=int(prompt_mask.sum()) if prompt_mask is not None else 0,
        )
        return out

    trainer._generate_and_score_completions = timed
    trainer.add_callback(h.trl_meter(meter, interval="step"))
    trainer.train()
    return h.rl_step_summary(meter, PHASES, h.device_memory(spec))


CHILDREN = {"align": run_align, "trl": run_trl, "native": run_native, "trl-vllm": run_trl_vllm, "sync": run_sync}

# ---------------------------------------------------------------------------------------------------------------
# parent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument(
        "--no-fast-decoder",
        dest="fast_decoder",
        action="store_false",
        help="align samples through the model's own forward instead of its FastDecoder",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass, on both sides (TRL's default; off by default "
        "here, as in align)",
    )
    parser.add_argument(
        "--estimator",
        choices=("grpo", "rloo"),
        default="grpo",
        help="rloo: align's advantages.estimator rloo against TRL's RLOOTrainer",
    )
    parser.add_argument(
        "--level",
        choices=("token", "sequence"),
        default="token",
        help="sequence: GSPO's ratio (policy_loss.name gspo / importance_sampling_level), per-sequence mean",
    )
    parser.add_argument(
        "--engine",
        choices=("native", "vllm"),
        default="native",
        help="vllm: align samples with its vLLM engine, and also runs with its own decoder (native)",
    )
    parser.add_argument(
        "--staleness",
        type=int,
        default=None,
        help="align's rollouts from an asynchronous source this many batches ahead; also runs align "
        "synchronously (sync)",
    )
    parser.add_argument(
        "--trl-vllm", action="store_true", help="with --engine vllm: also TRL with use_vllm=True in colocate mode"
    )
    h.add_device_args(parser)
    h.add_model_args(parser, tiny_defaults=h.RL_TINY_DEFAULTS)
    parser.add_argument("--json", type=Path, default=None)
    h.add_child_args(parser, CHILDREN)
    ns = parser.parse_args(argv)
    if h.run_if_child(ns, CHILDREN):
        return
    if ns.staleness is not None and ns.warmup < ns.staleness:
        parser.error(
            f"--staleness {ns.staleness}: the pipeline's first {ns.staleness} batches take no update; use "
            f"--warmup {ns.staleness} or more"
        )
    if ns.estimator == "rloo" and ns.level == "sequence":
        parser.error("--estimator rloo compares with TRL's RLOOTrainer, whose ratio is its own: use --level token")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, model_name, n_params = h.rl_model(ns, tmp)
        print(f"model: {model_name}, {n_params / 1e6:.2f}M parameters, from {model_dir}", flush=True)
        spec = {
            "model_dir": model_dir,
            "workdir": tmp,
            "prompts": ns.prompts,
            "group": ns.group,
            "max_new_tokens": ns.max_new_tokens,
            "steps": ns.steps + ns.warmup,
            "warmup": ns.warmup,
            "lora": ns.lora,
            "threads": ns.threads,
            "fast_decoder": ns.fast_decoder,
            "estimator": ns.estimator,
            "level": ns.level,
            "gradient_checkpointing": ns.gradient_checkpointing,
            "engine": ns.engine,
            **h.device_spec(ns),
            **({"staleness": ns.staleness} if ns.staleness is not None else {}),
        }
        kinds = (
            ("align", "trl")
            if ns.engine == "native"
            else ("align", "native", "trl") + (("trl-vllm",) if ns.trl_vllm else ())
        )
        if ns.staleness is not None:
            kinds = ("align", "sync") + kinds[1:]
        results = h.Trials(__file__, spec, Path(tmp), threads=ns.threads).alternate(
            kinds, ns.trials, lambda trial, kind, res: h.print_rl_trial(trial, kind, res, PHASES)
        )

    name = {"rloo": "RLOO"}.get(ns.estimator, "GSPO" if ns.level == "sequence" else "GRPO")
    h.rl_report(
        ns,
        f"\n{name} full step, {model_name} ({n_params / 1e6:.2f}M parameters), {ns.prompts} prompts x "
        f"{ns.group} completions, {ns.max_new_tokens} new tokens, LoRA {'on' if ns.lora else 'off'}, "
        f"{spec['device']} {spec['precision']}, {ns.threads} threads, align fast decoder "
        f"{'on' if ns.fast_decoder else 'off'}, gradient checkpointing "
        f"{'on' if ns.gradient_checkpointing else 'off'}, align engine {ns.engine}"
        f"{f', align max_staleness {ns.staleness}' if ns.staleness is not None else ''}, medians of "
        f"{ns.trials} trials:",
        results,
        model_dir,
        n_params,
        PHASES,
    )
    if ns.staleness is not None:
        med = h.medians(results)
        print(
            f"step time ratio asynchronous (max_staleness {ns.staleness})/synchronous: "
            f"{med['align']['step_s'] / med['sync']['step_s']:.2f}x; asynchronous steps waited for their rollout "
            f"{med['align']['trainer_idle_share']:.0%} of the time, and generation ran "
            f"{med['align']['generation_share']:.0%} of it, overlapping the update"
        )
    if ns.engine == "vllm":
        med = h.medians(results)
        print(
            f"throughput ratio align vLLM/native: {med['align']['tokens_per_s'] / med['native']['tokens_per_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
