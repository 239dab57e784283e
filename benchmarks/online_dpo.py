"""Online DPO step throughput and memory: ``align`` against TRL's ``OnlineDPOTrainer`` (``trl.experimental``), same
model, prompts and settings.

Usage::

    python benchmarks/online_dpo.py                    # tiny Llama, 8 prompts x 2 completions, 32 new tokens
    python benchmarks/online_dpo.py --trials 2 --threads 1 --json online-dpo-bench.json
    python benchmarks/online_dpo.py --lora --prompts 16

What happens:

1. A tiny random Llama (``align.hub.tiny.build_tiny_model`` with the size flags) and the shipped tokenizer are saved
   to a temporary Hugging Face directory; both frameworks load it from there in float32 (``--model``: a real model,
   as in ``benchmarks/grpo.py``).
2. Prompts: the first ``--prompts`` bundled sort prompts, as one user message each. Ranking: the same plain reward
   function on both sides (``length_reward``, the completion's length in characters, so that ties are rare; align
   leaves a tied pair out of the loss, TRL trains on it).
3. Trials run in fresh subprocesses, alternating ``align, trl, align, trl, ...``. Each trial runs ``--steps`` full
   online DPO steps (two completions per prompt, reward scoring, reference and policy passes, one optimizer step);
   the first ``--warmup`` are excluded.
4. Reported per framework: pairs per second of full steps (prompts / step time), completion tokens per second,
   the share of the step spent generating (align: ``time/generation_s``; TRL: its ``_generate``), and the process's
   peak RSS (``ru_maxrss``). Then the align/TRL ratios.

Same on both sides: model and weights, prompts, 2 completions per prompt, new-token limit, temperature 1, no
top-k/top-p, sigmoid loss with beta 0.1, summed response log-probs at temperature 1, the reference (a frozen copy;
with ``--lora`` the adapter-disabled policy on both sides), one optimizer step per batch, AdamW (torch's fused
kernel, TRL's default) with a constant learning rate, gradient clipping at 1.0, fp32, ``--threads`` torch threads,
no checkpoints, no evaluation. Each framework keeps its own generation loop (align: its KV-cache sampler with the
fast decoder; TRL: ``transformers.generate``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _harness as h

PHASES = ("generation",)


def length_reward(prompts, completions, **kwargs):
    """The completion's length in characters: two completions rarely tie."""
    return [float(len(c)) for c in completions]


# ---------------------------------------------------------------------------------------------------------------
# children


def build_module(spec: dict):
    """The online DPO module of an align trial: every setting the comparison fixes, in one place."""
    import torch

    from align.models.loading import LoraSettings
    from align.models.policy import PolicyModel
    from align.modules.online_dpo import OnlineDPOModule
    from align.modules.options import Updates
    from align.rollout.engine import SamplingConfig

    lora = LoraSettings(r=16, alpha=32) if spec["lora"] else None
    return OnlineDPOModule(
        policy=PolicyModel(spec["model_dir"], lora=lora),
        rewards=[length_reward],
        group_size=2,
        beta=0.1,
        loss_type="sigmoid",
        sampling=SamplingConfig(max_new_tokens=spec["max_new_tokens"], temperature=1.0),
        updates=Updates(max_grad_norm=1.0),
        log_entropy=False,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True),
    )


def with_pairs(res: dict, prompts: int) -> dict:
    return dict(res, pairs_per_s=prompts / res["step_s"])


def run_align(spec: dict) -> dict:
    h.set_threads(spec["threads"])
    return with_pairs(h.rl_align_trial(spec, build_module(spec), PHASES, max_steps=spec["steps"]), spec["prompts"])


def run_trl(spec: dict) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    h.set_threads(spec["threads"])
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p}]} for p in h.sort_prompts(spec["prompts"])] * spec["steps"]
    )
    config = OnlineDPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"),
        per_device_train_batch_size=spec["prompts"],
        max_new_tokens=spec["max_new_tokens"],
        max_steps=spec["steps"],
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        optim="adamw_torch_fused",
        max_grad_norm=1.0,
        beta=[0.1],
        loss_type="sigmoid",
        gradient_accumulation_steps=1,
        temperature=1.0,
        top_p=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        **h.trl_device(spec),
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=False,  # as align (TRL's own default is on)
    )
    peft_config = None
    if spec["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    trainer = OnlineDPOTrainer(
        model=spec["model_dir"],
        reward_funcs=length_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    meter = h.StepMeter(spec["warmup"], sync=h.device_sync(spec))
    original = trainer._generate

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        meter.add(generation_s=time.perf_counter() - start, tokens=int(out[3].sum()))  # out[3]: completion_mask
        return out

    trainer._generate = timed
    trainer.add_callback(h.trl_meter(meter, interval="step"))
    trainer.train()
    return with_pairs(h.rl_step_summary(meter, PHASES, h.device_memory(spec)), spec["prompts"])


CHILDREN = {"align": run_align, "trl": run_trl}

# ---------------------------------------------------------------------------------------------------------------
# parent


def report(trial: int, kind: str, res: dict) -> None:
    h.print_rl_trial(trial, kind, res, PHASES)
    print(f"  {res['pairs_per_s']:.1f} pairs/s", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    h.add_rl_step_args(parser, CHILDREN)
    ns = parser.parse_args(argv)
    if h.run_if_child(ns, CHILDREN):
        return

    with tempfile.TemporaryDirectory() as tmp:
        spec, model_name, n_params = h.rl_step_spec(ns, tmp, group=2)
        results = h.Trials(__file__, spec, Path(tmp), threads=ns.threads).alternate(("align", "trl"), ns.trials, report)
        model_dir = spec["model_dir"]

    med = h.medians(results)
    pair_ratio = h.ratios(med, ("pairs_per_s",)) if "trl" in med else {}
    h.rl_report(
        ns,
        f"\nOnline DPO full step, {model_name} ({n_params / 1e6:.2f}M parameters), {ns.prompts} prompts x 2 "
        f"completions, {ns.max_new_tokens} new tokens, LoRA {'on' if ns.lora else 'off'}, {ns.threads} "
        f"threads, medians of {ns.trials} trials:",
        results,
        model_dir,
        n_params,
        PHASES,
        pairs_per_s={fw: m["pairs_per_s"] for fw, m in med.items()},
        pairs_ratio=pair_ratio,
    )
    for fw, m in med.items():
        print(f"{fw:8s}{m['pairs_per_s']:10.1f} pairs/s")
    if pair_ratio:
        print(f"pairs/s ratio align/TRL: {next(iter(pair_ratio.values())):.2f}x")


if __name__ == "__main__":
    main()
