"""DPO throughput and memory: ``align`` against TRL's ``DPOTrainer``, same model, data, batch and LoRA, one run.
With ``--loss orpo`` against TRL's ``ORPOTrainer`` (``trl.experimental.orpo``), with ``--loss kto`` against
``KTOTrainer``.

Usage::

    python benchmarks/dpo.py                                    # tiny Llama, LoRA, a few minutes on 2 CPU cores
    python benchmarks/dpo.py --hidden-size 512 --layers 4 --intermediate 1536 --heads 8 --kv-heads 4
    python benchmarks/dpo.py --trials 3 --steps 40 --json dpo-bench.json
    python benchmarks/dpo.py --full                             # no LoRA: both sides keep a frozen reference copy
    python benchmarks/dpo.py --loss orpo                        # ORPO: reference-free on both sides
    python benchmarks/dpo.py --loss kto                         # KTO: each pair read as two unpaired examples
    python benchmarks/dpo.py --padding-free                     # align without padding (model.padding_free)
    python benchmarks/dpo.py --model smollm2-135m-instruct --batch-size 4 --steps 10 --warmup 2 --threads 2
    python benchmarks/dpo.py --device cuda --full --batch-size 16 --max-length 256   # one GPU, bf16 autocast

What happens:

1. A tiny Llama (``align.hub.tiny.build_tiny_model`` with the size flags) and the shipped tokenizer are saved to a
   temporary Hugging Face directory; both frameworks load it in float32. With ``--model`` (a local Hugging Face
   folder, a ``.gguf`` file or a packaged id such as ``smollm2-135m-instruct``) the size flags are ignored and both
   load that model and its tokenizer, in float32, from the one folder it resolves to.
2. Data: the bundled sorting preferences (``align:sort/preference/train.jsonl``), written as conversational rows
   (prompt = one user message, chosen/rejected = one assistant message each). Both frameworks apply the same chat
   template to them; the token counts each side fed to the model are reported.
3. Trials run in fresh subprocesses, alternating ``align, trl, align, trl, ...`` (``--trials`` each), so each
   process's peak memory belongs to one framework. Each trial trains ``--steps`` optimizer steps of ``--batch-size``
   pairs; the first ``--warmup`` are excluded. Timing runs from the end of the last warmup step to the end of the
   last step (data loading, both forward passes, backward, clipping and the optimizer included).
   With ``--loss kto`` each pair is written as two unpaired rows (chosen: desirable, rejected: undesirable) that
   both sides read, and a "pair" in the report is one example: ``--batch-size`` examples per step, each scored with
   its completion and with its mismatched KL completion on both sides.
4. Reported per framework: median pairs/s over trials and peak RSS of the trial process (``ru_maxrss``: imports,
   model and training); then align/TRL ratios.

Same on both sides: model and weights, data, batch size, max_length, LoRA (rank, alpha, dropout 0, every linear layer
of the decoder), the reference (with LoRA: the adapter-disabled policy, no copy, on both sides), sigmoid loss with
beta 0.1 (ORPO: lambda = beta; KTO: beta, both weights 1), live reference log-probs (no precomputation), AdamW (lr,
betas, eps, no weight decay), constant learning rate, gradient clipping at 1.0, fp32 (``--device cuda``: fp32 weights
under bf16 autocast unless ``--precision 32-true``), no gradient checkpointing, no evaluation, no checkpoints, metrics
logged every ``--log-every`` steps, ``--threads`` torch threads. Each framework's own choices are printed, not changed:
align scores only the response positions through the LM head (``logits_to_keep``) and runs chosen+rejected as one batch;
TRL runs its chunked fused LM head (which also computes entropy, mean logits and top-1 accuracy each step).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import _harness as h

# ---------------------------------------------------------------------------------------------------------------
# children


def dpo_result(meter: h.StepMeter, **extra) -> dict:
    """Pairs and tokens of the timed steps and their rates."""
    return dict(
        meter.result(),
        pairs=meter.total("pairs"),
        tokens=meter.total("tokens"),
        pairs_per_s=meter.rate("pairs"),
        step_median_pairs_per_s=meter.median_step_rate("pairs"),
        **extra,
    )


def build_module(spec: dict):
    """``(policy, DPO module)`` of an align trial: every setting the comparison fixes, in one place."""
    from functools import partial

    import torch

    from align.models import LoraSettings, PolicyModel
    from align.modules.dpo import DPOModule
    from align.modules.kto import KTOModule

    lora = (
        None
        if spec["full"]
        else LoraSettings(r=spec["lora_r"], alpha=spec["lora_alpha"], dropout=0.0, target_modules="all-linear")
    )
    policy = PolicyModel(model=spec["model_dir"], dtype="float32", lora=lora)
    optimizer = partial(torch.optim.AdamW, lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    free = spec.get("padding_free", False)
    if spec["loss"] == "kto":
        return policy, KTOModule(policy, optimizer=optimizer, beta=spec["beta"], padding_free=free)
    return policy, DPOModule(policy, optimizer=optimizer, loss_type=spec["loss"], beta=spec["beta"], padding_free=free)


def child_align(spec: dict) -> dict:
    h.set_threads(spec["threads"])
    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from align.data.preference import PreferenceDataModule, UnpairedDataModule

    meter = h.StepMeter(spec["warmup"], sync=h.device_sync(spec))
    L.seed_everything(spec["seed"], verbose=False)
    policy, module = build_module(spec)
    data = (UnpairedDataModule if spec["loss"] == "kto" else PreferenceDataModule)(
        train_files=spec["train_file"],
        val_files=None,
        max_length=spec["max_length"],
        batch_size=spec["batch_size"],
        shuffle=True,
    )
    trainer = L.Trainer(
        **h.lightning_device(spec),
        max_steps=spec["steps"],
        gradient_clip_val=1.0,
        logger=CSVLogger(spec["workdir"], name="align_logs"),
        log_every_n_steps=spec["log_every"],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=spec["workdir"],
        callbacks=[
            h.lightning_meter(
                meter, lambda trainer, module, batch: {"pairs": batch.num_pairs, "tokens": batch.num_tokens}
            )
        ],
    )
    trainer.fit(module, data)
    return dpo_result(
        meter, reference_copy=policy.ref_model is not None, threads=torch.get_num_threads(), **h.device_memory(spec)
    )


def child_trl(spec: dict) -> dict:
    h.set_threads(spec["threads"])
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    meter = h.StepMeter(spec["warmup"], sync=h.device_sync(spec))
    rows = [json.loads(line) for line in open(spec["train_file"])]
    dataset = Dataset.from_list(rows)
    Trainer, Config = {
        "sigmoid": (DPOTrainer, DPOConfig),
        "orpo": (ORPOTrainer, ORPOConfig),
        "kto": (KTOTrainer, KTOConfig),
    }[spec["loss"]]

    def counts(inputs) -> dict:
        if spec["loss"] == "sigmoid":
            return dict(pairs=inputs["input_ids"].shape[0] // 2, tokens=int(inputs["attention_mask"].sum()))
        if spec["loss"] == "orpo":
            return dict(
                pairs=inputs["chosen_input_ids"].shape[0],
                tokens=int(inputs["chosen_attention_mask"].sum() + inputs["rejected_attention_mask"].sum()),
            )
        return dict(
            pairs=inputs["input_ids"].shape[0],
            tokens=int(inputs["attention_mask"].sum() + inputs["KL_attention_mask"].sum()),
        )

    class CountingTrainer(Trainer):
        # Counting only: the batch is measured before TRL's own training step runs unchanged.
        def training_step(self, model, inputs, num_items_in_batch=None):
            meter.add(**counts(inputs))
            return super().training_step(model, inputs, num_items_in_batch)

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    peft_config = None
    if not spec["full"]:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=spec["lora_r"],
            lora_alpha=spec["lora_alpha"],
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
    per_loss = {
        "sigmoid": dict(loss_type=["sigmoid"], precompute_ref_log_probs=False),
        "orpo": dict(),
        "kto": dict(precompute_ref_log_probs=False),
    }[spec["loss"]]
    config = Config(
        output_dir=str(Path(spec["workdir"]) / "trl_out"),
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=1,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        optim="adamw_torch",
        max_grad_norm=1.0,
        **h.trl_device(spec),
        gradient_checkpointing=False,
        beta=spec["beta"],
        max_length=spec["max_length"],
        **per_loss,
        logging_steps=spec["log_every"],
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
        seed=spec["seed"],
    )
    trainer = CountingTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[h.trl_meter(meter)],
    )
    trainer.train()
    return dpo_result(
        meter,
        reference_copy=getattr(trainer, "ref_model", None) is not None,
        threads=torch.get_num_threads(),
        **h.device_memory(spec),
    )


CHILDREN = {"align": child_align, "trl": child_trl}

# ---------------------------------------------------------------------------------------------------------------
# parent


def write_data(path: Path, limit: int | None, unpaired: bool = False) -> int:
    from align.data.io import read_rows

    rows = [r for r in read_rows("align:sort/preference/train.jsonl") if r["chosen"] != r["rejected"]]
    rows = rows[:limit] if limit else rows
    if unpaired:  # each pair as two unpaired rows, as both frameworks convert pairs for KTO
        lines = [
            json.dumps(
                {
                    "prompt": [{"role": "user", "content": r["prompt"]}],
                    "completion": [{"role": "assistant", "content": r[key]}],
                    "label": key == "chosen",
                }
            )
            for r in rows
            for key in ("chosen", "rejected")
        ]
        path.write_text("\n".join(lines) + "\n")
        return len(lines)
    lines = [
        json.dumps(
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
        )
        for r in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def summarise(results: dict[str, list[dict]]) -> dict:
    summary = {}
    for kind, trials in results.items():
        summary[kind] = {
            "pairs_per_s": h.median(r["pairs_per_s"] for r in trials),
            "step_median_pairs_per_s": h.median(r["step_median_pairs_per_s"] for r in trials),
            "best_pairs_per_s": max(r["pairs_per_s"] for r in trials),
            "tokens_per_pair": trials[0]["tokens"] / max(trials[0]["pairs"], 1),
            "step_s": h.median(h.median(r["step_seconds"]) for r in trials),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in trials),
            **({"cuda_peak_mb": max(r["cuda_peak_mb"] for r in trials)} if "cuda_peak_mb" in trials[0] else {}),
        }
    if "trl" in summary:
        summary["ratio_align_over_trl"] = h.ratios(
            summary,
            (
                "pairs_per_s",
                "step_median_pairs_per_s",
                "best_pairs_per_s",
                "peak_rss_mb",
                *(("cuda_peak_mb",) if "cuda_peak_mb" in summary["align"] else ()),
            ),
        )
    return summary


def print_table(summary: dict, results: dict, args) -> None:
    h.print_ratio_table(
        summary,
        [
            ("pairs/s, median of trials", "pairs_per_s", "{:.1f}"),
            ("pairs/s, median step", "step_median_pairs_per_s", "{:.1f}"),
            ("pairs/s, best trial", "best_pairs_per_s", "{:.1f}"),
            ("tokens fed per pair", "tokens_per_pair", "{:.1f}"),
            ("peak RSS, MB", "peak_rss_mb", "{:.0f}"),
        ],
        width=32,
    )
    low, high = h.load_range(results)
    print(
        f"\n1-minute load average during trials: {low:.1f} to {high:.1f} ({args.threads} threads "
        "used; a higher load means other work shared the cores)"
    )
    for kind in (k for k in ("align", "trl") if k in summary):
        print(f"{kind}: reference copy kept: {results[kind][0]['reference_copy']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def model_options(g) -> None:
        g.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights and of training")
        g.add_argument("--full", action="store_true", help="train every weight (no LoRA); both keep a reference copy")
        g.add_argument("--lora-r", type=int, default=8)
        g.add_argument("--lora-alpha", type=int, default=16)

    h.add_model_args(p, group=p.add_argument_group("model"), model_options=model_options)
    g = p.add_argument_group("data and training")
    g.add_argument("--batch-size", type=int, default=8, help="pairs per optimizer step")
    g.add_argument("--max-length", type=int, default=64)
    g.add_argument("--steps", type=int, default=30, help="optimizer steps per trial")
    g.add_argument("--warmup", type=int, default=5, help="steps excluded from timing")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--beta", type=float, default=0.1)
    g.add_argument(
        "--loss",
        choices=("sigmoid", "orpo", "kto"),
        default="sigmoid",
        help="DPO (DPOTrainer), ORPO (ORPOTrainer) or KTO (KTOTrainer, each pair read as two examples)",
    )
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument(
        "--padding-free",
        action="store_true",
        help="align scores each batch with its sequences laid end to end (model.padding_free); TRL padded",
    )
    g.add_argument("--rows", type=int, default=None, help="use only the first N pairs")
    g = p.add_argument_group("run")
    g.add_argument("--trials", type=int, default=2, help="trials per framework, alternating")
    g.add_argument("--threads", type=int, default=os.cpu_count())
    g.add_argument("--no-trl", dest="trl", action="store_false", help="skip the TRL trials")
    h.add_device_args(g)
    g.add_argument("--json", type=Path, default=None, help="write the results here")
    g.add_argument("--verbose", action="store_true", help="show the trials' own output")
    h.add_child_args(p, CHILDREN)
    args = p.parse_args(argv)
    if h.run_if_child(args, CHILDREN):
        return 0

    with tempfile.TemporaryDirectory(prefix="dpo-bench-") as tmp:
        tmp = Path(tmp)
        model_dir, _, n_params = h.prepare_model(args, tmp / "model", seed=args.seed)
        overrides = h.tiny_overrides(args)
        model_name = (
            f"{args.model} ({model_dir})" if args.model else f"tiny Llama {overrides or '(align.hub.tiny defaults)'}"
        )
        n_rows = write_data(tmp / "pairs.jsonl", args.rows, unpaired=args.loss == "kto")
        spec = dict(
            model_dir=model_dir,
            train_file=str(tmp / "pairs.jsonl"),
            threads=args.threads,
            seed=args.seed,
            full=args.full,
            lora_r=args.lora_r,
            lora_alpha=args.lora_alpha,
            batch_size=args.batch_size,
            max_length=args.max_length,
            steps=args.steps,
            warmup=args.warmup,
            lr=args.lr,
            beta=args.beta,
            loss=args.loss,
            log_every=args.log_every,
            workdir=str(tmp / "work"),
            padding_free=args.padding_free,
            **h.device_spec(args),
        )
        print(
            f"model: {model_name}, {n_params / 1e6:.2f}M parameters; "
            f"{'full fine-tuning' if args.full else f'LoRA r={args.lora_r} alpha={args.lora_alpha}'}; {n_rows} "
            f"{'examples' if args.loss == 'kto' else 'pairs'}; loss {args.loss}; batch {args.batch_size}; "
            f"{args.steps} steps ({args.warmup} warmup); {args.threads} threads"
            f"{'; align padding-free' if args.padding_free else ''}"
        )

        def report(trial: int, kind: str, r: dict) -> None:
            print(
                f"trial {trial} {kind:5s}: {r['pairs_per_s']:7.1f} pairs/s, peak RSS "
                f"{r['peak_rss_mb']:.0f} MB, process {r['process_seconds']:.0f} s",
                flush=True,
            )

        results = h.Trials(__file__, spec, tmp, threads=args.threads, verbose=args.verbose).alternate(
            ["align", "trl"] if args.trl else ["align"], args.trials, report
        )
    summary = summarise(results)
    print_table(summary, results, args)
    h.write_json(
        args.json,
        {
            "model": args.model or "tiny",
            "parameters": n_params,
            "args": {k: str(v) for k, v in vars(args).items()},
            "summary": summary,
            "trials": results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
