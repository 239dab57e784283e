"""GRPO step throughput and memory: ``align`` against TRL's ``GRPOTrainer``, same model, prompts and settings.

Usage::

    python benchmarks/grpo.py                          # tiny Llama, 8 prompts x 4 completions, 32 new tokens
    python benchmarks/grpo.py --lora --trials 3 --json grpo-bench.json
    python benchmarks/grpo.py --hidden-size 256 --layers 4 --prompts 16 --group 8
    python benchmarks/grpo.py --model smollm2-135m-instruct --prompts 4 --group 4 --max-new-tokens 32 --threads 2

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
   the step), the share of the step spent generating (align: ``RolloutEngine``; TRL: ``_generate_and_score_completions``,
   which also scores rewards) and updating, and the process's peak RSS (``ru_maxrss``: imports, model and
   activations; the benchmark has no GPU). Then the align/TRL ratios.

Settings that are the same on both sides: model and weights, prompts, group size (``num_generations``), new-token
limit (``max_completion_length``), temperature 1, no top-k/top-p, one policy iteration per rollout (``num_iterations``
= mu = 1), one optimizer step per rollout (no minibatching or accumulation), beta = 0 (no reference model), clip
0.2, token-mean loss over the step (TRL ``loss_type="dapo"``), AdamW with a constant learning rate, gradient
clipping at 1.0, fp32, LoRA on or off (r 16, alpha 32, all linear layers), ``--threads`` torch threads, no
checkpoints, no evaluation. Each framework keeps its own generation loop: align its KV-cache sampler that stops
when all rows are done, through :class:`align.models.decoding.FastDecoder` (``--no-fast-decoder``: through the
model's own forward, to see what the decoder contributes); TRL ``transformers.generate``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _rl_harness import add_model_args, prepare_model, run_child, sort_prompts, step_summary


def length_reward(prompts, completions, **kwargs):
    """Longer completions (up to 40 characters) score higher: every group has reward variance."""
    return [min(len(c), 40) / 40.0 for c in completions]


# ---------------------------------------------------------------------------------------------------------------
# children


def run_align(spec: dict) -> dict:
    import lightning as L
    import torch

    from align.data.prompts import PromptDataModule
    from align.models.loading import LoraSettings
    from align.models.policy import PolicyModel
    from align.modules.grpo import GRPOModule
    from align.rollout import SamplingConfig

    torch.set_num_threads(spec["threads"])
    workdir = Path(spec["workdir"])
    data_file = workdir / "prompts.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in sort_prompts(spec["prompts"])))
    lora = LoraSettings(r=16, alpha=32) if spec["lora"] else None
    module = GRPOModule(
        policy=PolicyModel(spec["model_dir"], lora=lora), rewards=[length_reward], group_size=spec["group"],
        sampling=SamplingConfig(max_new_tokens=spec["max_new_tokens"], temperature=1.0,
                                fast_decoder=spec["fast_decoder"]), beta=0.0,
        max_grad_norm=1.0, log_entropy=False,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0),
    )
    data = PromptDataModule(train_files=str(data_file), val_files=None, batch_size=spec["prompts"], shuffle=False)
    steps, gens, tokens = [], [], []

    class Meter(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append(time.perf_counter() - self.t)
            gens.append(pl_module.timings["time/generation_s"])
            tokens.append(pl_module._last_tokens)

    original = module.rollout

    def counting_rollout(batch, group_size=1, engine=None):
        rollout = original(batch, group_size, engine)
        module._last_tokens = int(rollout.response_mask.sum())
        return rollout

    module.rollout = counting_rollout
    trainer = L.Trainer(max_steps=spec["steps"], accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Meter()], max_epochs=-1)
    trainer.fit(module, datamodule=data)
    return step_summary(steps, tokens, spec["warmup"], generation=gens)


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    n = spec["prompts"] * spec["group"]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in sort_prompts(spec["prompts"])] * spec["steps"])
    config = GRPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"), per_device_train_batch_size=n, num_generations=spec["group"],
        max_completion_length=spec["max_new_tokens"], max_steps=spec["steps"], learning_rate=1e-5,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, beta=0.0, num_iterations=1,
        epsilon=0.2, loss_type="dapo", gradient_accumulation_steps=1, temperature=1.0, top_p=1.0,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0,
        dataloader_num_workers=0, shuffle_dataset=False, disable_tqdm=True,
    )
    peft_config = None
    if spec["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=length_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    steps, gens, tokens = [], [], []
    original = trainer._generate_and_score_completions

    def timed(inputs):
        start = time.perf_counter()
        out = original(inputs)
        gens.append(time.perf_counter() - start)
        tokens.append(int(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = timed

    class Meter(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            steps.append(time.perf_counter() - self.t)

    trainer.add_callback(Meter())
    trainer.train()
    return step_summary(steps, tokens, spec["warmup"], generation=gens)


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
    parser.add_argument("--no-fast-decoder", dest="fast_decoder", action="store_false",
                        help="align samples through the model's own forward instead of its FastDecoder")
    parser.add_argument("--threads", type=int, default=2)
    add_model_args(parser)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", choices=["align", "trl"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)

    if ns.child:
        spec = json.loads(ns.spec)
        result = run_align(spec) if ns.child == "align" else run_trl(spec)
        print(json.dumps(result))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, model_name, n_params = prepare_model(ns, tmp)
        print(f"model: {model_name}, {n_params / 1e6:.2f}M parameters, from {model_dir}", flush=True)
        spec = {"model_dir": str(model_dir), "workdir": tmp, "prompts": ns.prompts, "group": ns.group,
                "max_new_tokens": ns.max_new_tokens, "steps": ns.steps + ns.warmup, "warmup": ns.warmup,
                "lora": ns.lora, "threads": ns.threads, "fast_decoder": ns.fast_decoder}
        results: dict[str, list[dict]] = {"align": [], "trl": []}
        for trial in range(ns.trials):
            for framework in ("align", "trl"):
                res = run_child(__file__, framework, spec)
                res["load"] = os.getloadavg()[0]
                results[framework].append(res)
                print(f"trial {trial + 1} {framework:5s}: {res['tokens_per_s']:8.1f} completion tok/s, step "
                      f"{res['step_s']:.2f} s (generation {res['generation_share']:.0%}), peak RSS "
                      f"{res['peak_rss_mb']:.0f} MB, load {res['load']:.1f}", flush=True)

    med = {fw: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for fw, rs in results.items()}
    print(f"\nGRPO full step, {model_name} ({n_params / 1e6:.2f}M parameters), {ns.prompts} prompts x {ns.group} "
          f"completions, {ns.max_new_tokens} new tokens, "
          f"LoRA {'on' if ns.lora else 'off'}, {ns.threads} threads, "
          f"align fast decoder {'on' if ns.fast_decoder else 'off'}, medians of {ns.trials} trials:")
    print(f"{'':8s}{'tok/s':>10s}{'step s':>9s}{'gen %':>8s}{'update %':>10s}{'peak RSS MB':>13s}")
    for fw in ("align", "trl"):
        m = med[fw]
        print(f"{fw:8s}{m['tokens_per_s']:10.1f}{m['step_s']:9.2f}{m['generation_share']:8.0%}"
              f"{m['update_share']:10.0%}{m['peak_rss_mb']:13.0f}")
    ratios = {"throughput_align_over_trl": med["align"]["tokens_per_s"] / med["trl"]["tokens_per_s"],
              "peak_rss_align_over_trl": med["align"]["peak_rss_mb"] / med["trl"]["peak_rss_mb"]}
    print(f"throughput ratio align/TRL: {ratios['throughput_align_over_trl']:.2f}x; "
          f"peak memory ratio align/TRL: {ratios['peak_rss_align_over_trl']:.2f}")
    if ns.json:
        ns.json.write_text(json.dumps({"model": ns.model or "tiny", "model_dir": str(model_dir) if ns.model else None,
                                       "parameters": n_params,
                                       "settings": vars(ns) | {"json": str(ns.json)}, "trials": results,
                                       "medians": med, "ratios": ratios}, indent=2, default=str))


if __name__ == "__main__":
    main()
