"""SFT throughput and memory: ``align`` against TRL's ``SFTTrainer``, same model, data and settings, one run.

Usage::

    python benchmarks/sft.py                                   # small model, a few minutes on 2 CPU cores
    python benchmarks/sft.py --hidden-size 512 --layers 4 --intermediate 1536 --heads 8 --kv-heads 4
    python benchmarks/sft.py --trials 3 --steps 40 --json sft-bench.json
    python benchmarks/sft.py --no-trl                          # align and the matmul peak only
    python benchmarks/sft.py --model smollm2-135m-instruct --batch-size 2 --steps 6 --warmup 2 --threads 2
    python benchmarks/sft.py --device cuda --max-length 1024 --batch-size 16   # one GPU, bf16 autocast, bf16 GEMM peak

What happens:

1. A tiny Llama (``align.hub.tiny.build_tiny_model`` with the size flags) and the shipped tokenizer are saved to a
   temporary Hugging Face directory. Both frameworks load the model from there, in float32. With ``--model`` (a local
   Hugging Face folder, a ``.gguf`` file or a packaged id such as ``smollm2-135m-instruct``) the size flags are
   ignored and both load that model and its tokenizer, in float32, from the one folder it resolves to.
2. Training data: the bundled sort task (``align:sort/sft/train.jsonl``); ``--turns K`` joins K consecutive problems
   into one K-turn conversation so documents are longer. It is written as ``messages`` jsonl. ``align`` reads that
   file through ``SFTDataModule``; TRL receives the very same token ids and labels (tokenized once with align's
   ``ChatEncoder``), so tokenization and chat-template differences cannot enter the comparison. Loss is on the
   assistant tokens only in both.
3. Trials run in fresh subprocesses, alternating ``align, trl, align, trl, ...`` (``--trials`` each), with a dense
   fp32 matmul probe before the first and after every pair. Each trial trains ``--steps`` optimizer steps; the first
   ``--warmup`` are excluded. Timing runs from the end of the last warmup step to the end of the last step
   (data loading, forward, backward, clipping and optimizer included) and counts the real (non-pad) tokens fed to the
   model in those steps, the same way on both sides.
4. Reported per framework: tokens/s (median over trials of each trial's tokens / seconds; also the median step and
   the best trial), tokens per CPU-second of the trial process, the share of model input positions that are real
   tokens (align pads each packed row to the longest in its batch; TRL flattens the batch, so it has no padding),
   and peak RSS (``ru_maxrss`` of the trial process, which includes imports and the model); then align/TRL ratios;
   the matmul peak (best GFLOP/s of 1024-4096 square fp32 GEMMs at the same thread count, over all probes); and
   each side's model FLOP/s as a fraction of that peak.

Other work on the machine slows the trials down unevenly. The 1-minute load average is printed: a load well above
``--threads`` means the numbers are depressed and noisy, and only the align/TRL ratios of alternated trials are worth
comparing. With ``--threads 1`` the CPU-time figures (tokens per CPU-second, and the fraction of the matmul peak on a
CPU-time basis) are nearly independent of such load; with more threads, CPU time also counts threads spinning while
they wait for each other.

Model FLOPs per real token (forward + backward = 3 x forward, multiply-add = 2 FLOPs), stated in the output:

    6 * N_layers                         N_layers: weights of every linear layer in the decoder blocks
  + 6 * V * h * (loss tokens / tokens)   LM head, counted only where a prediction is trained (completion positions)
  + 12 * L * h_attn * c                  attention scores and values, c = mean causal context per token (keys each
                                         token attends to inside its own document), h_attn = heads * head_dim

Norms, activations, softmax and the optimizer are not counted. The conventional 6 * N (LM head on every token) +
12 * L * h * seq_len figure is in the JSON as well (``flops_per_token_conventional``).

Settings that are the same on both sides: model and weights, token ids and labels, max_length, packing (align's
first-fit-decreasing packer; TRL ``packing=True`` with its default ``bfd`` strategy), per-device batch size, optimizer
steps, AdamW (lr, betas, eps, weight decay, fused kernel), constant learning rate, gradient clipping at 1.0, fp32
(``--device cuda``: fp32 weights under bf16 autocast unless ``--precision 32-true``), no
gradient checkpointing (``SFTConfig`` turns it on by default, and bf16 too: both are set off here), no evaluation, no
checkpoints, no progress bar, metrics logged every ``--log-every`` steps (align: a CSV logger; TRL: its in-memory log
history with ``report_to=none``), shuffled rows, ``--threads`` torch threads (and ``OMP_NUM_THREADS``).
What differs is each framework's own design and is printed: the attention layout (align: one row per packed sequence
with a block-diagonal mask from the position ids, padded to the batch's longest row; TRL: padding-free, the whole
batch flattened into one row whose block-diagonal mask spans all of it), the output head (align: logits only where a
token is trained; TRL: its fused chunked head over every position off Triton devices, with entropy and top-1
accuracy each step), and the packer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import _harness as h

# ---------------------------------------------------------------------------------------------------------------
# children


def _load_examples(spec: dict):
    """The trial data as align ``Example``s (unpacked), tokenized with align's chat encoder."""
    from align.data.chat import ChatEncoder
    from align.data.io import read_rows
    from align.data.sft import tokenize_rows
    from align.hub import load_tokenizer

    tokenizer = load_tokenizer(spec["model_dir"])
    examples, _ = tokenize_rows(
        read_rows(spec["train_file"]), spec["train_file"], ChatEncoder(tokenizer), max_length=spec["max_length"]
    )
    return examples


def sft_result(meter: h.StepMeter, **extra) -> dict:
    """Real tokens, trained (loss) tokens and model input positions of the timed steps, and their rates."""
    return dict(
        meter.result(),
        tokens=meter.total("tokens"),
        loss_tokens=meter.total("loss_tokens"),
        positions=meter.total("positions"),
        tokens_per_s=meter.rate("tokens"),
        step_median_tokens_per_s=meter.median_step_rate("tokens"),
        step_tokens=meter.per_step("tokens"),
        **extra,
    )


def build_module(spec: dict):
    """``(policy, SFT module)`` of an align trial: every setting the comparison fixes, in one place."""
    from functools import partial

    import torch

    from align.models import PolicyModel
    from align.modules import SFTModule

    policy = PolicyModel(model=spec["model_dir"], dtype="float32")
    optimizer = partial(
        torch.optim.AdamW,
        lr=spec["lr"],
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=spec["weight_decay"],
        fused=spec["fused_adamw"],
    )
    return policy, SFTModule(policy, optimizer=optimizer)


def child_align(spec: dict) -> dict:
    h.set_threads(spec["threads"])
    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from align.data import SFTDataModule

    meter = h.StepMeter(spec["warmup"], sync=h.device_sync(spec))

    def counts(trainer, module, batch):
        return {
            "tokens": batch.num_tokens,
            "loss_tokens": int((batch.labels[:, 1:] != -100).sum()),
            "positions": batch.input_ids.numel(),
        }

    L.seed_everything(spec["seed"], verbose=False)
    policy, module = build_module(spec)
    data = SFTDataModule(
        train_files=spec["train_file"],
        val_files=None,
        max_length=spec["max_length"],
        batch_size=spec["batch_size"],
        packing=True,
        completion_only=True,
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
        callbacks=[h.lightning_meter(meter, counts)],
        default_root_dir=spec["workdir"],
    )
    trainer.fit(module, data)
    return sft_result(
        meter,
        attn_implementation=policy.config._attn_implementation,
        rows=len(data.train_set),
        threads=torch.get_num_threads(),
        **h.device_memory(spec),
    )


def child_trl(spec: dict) -> dict:
    h.set_threads(spec["threads"])
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    meter = h.StepMeter(spec["warmup"], sync=h.device_sync(spec))
    examples = _load_examples(spec)
    dataset = Dataset.from_dict(
        {"input_ids": [ex.input_ids for ex in examples], "labels": [ex.labels for ex in examples]}
    )

    class CountingSFTTrainer(SFTTrainer):
        # Counting only: the batch is measured before TRL's own training step runs unchanged.
        def training_step(self, model, inputs, num_items_in_batch=None):
            mask = inputs.get("attention_mask")
            meter.add(
                tokens=int(mask.sum()) if mask is not None else inputs["input_ids"].numel(),
                loss_tokens=int((inputs["labels"][:, 1:] != -100).sum()),
                positions=inputs["input_ids"].numel(),
            )
            return super().training_step(model, inputs, num_items_in_batch)

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    config = SFTConfig(
        output_dir=str(Path(spec["workdir"]) / "trl_out"),
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=1,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=spec["weight_decay"],
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        optim="adamw_torch_fused" if spec["fused_adamw"] else "adamw_torch",
        max_grad_norm=1.0,
        **h.trl_device(spec),
        gradient_checkpointing=False,
        max_length=spec["max_length"],
        packing=True,
        packing_strategy="bfd",
        logging_steps=spec["log_every"],
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
        seed=spec["seed"],
    )
    trainer = CountingSFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[h.trl_meter(meter)]
    )
    trainer.train()
    return sft_result(
        meter,
        attn_implementation=model.config._attn_implementation,
        rows=len(trainer.train_dataset),
        padding_free=bool(trainer.padding_free),
        optim=getattr(config.optim, "value", str(config.optim)),
        threads=torch.get_num_threads(),
        **h.device_memory(spec),
    )


CHILDREN = {"matmul": h.matmul_peak, "align": child_align, "trl": child_trl}

# ---------------------------------------------------------------------------------------------------------------
# parent


def write_data(path: Path, turns: int) -> int:
    """The bundled sort rows as ``turns``-turn conversations (one problem per user/assistant pair)."""
    from align.data.io import read_rows

    rows = read_rows("align:sort/sft/train.jsonl")
    lines = []
    for start in range(0, len(rows) - turns + 1, turns):
        messages = []
        for row in rows[start : start + turns]:
            messages += [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["completion"]},
            ]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def data_stats(spec: dict) -> dict:
    examples = _load_examples(spec)
    lengths = [len(ex.input_ids) for ex in examples]
    tokens = sum(lengths)
    return {
        "documents": len(examples),
        "tokens": tokens,
        "mean_length": tokens / len(examples),
        "loss_fraction": sum(ex.loss_tokens for ex in examples) / tokens,
        # keys a token attends to, averaged over tokens: sum_n n(n+1)/2 / sum_n n
        "mean_context": sum(n * (n + 1) / 2 for n in lengths) / tokens,
    }


def fastest_quarter(trials: list[dict]) -> float:
    """tokens/s over the fastest quarter of all timed steps: an estimate of the speed when nothing else runs."""
    steps = sorted((s, n) for r in trials for s, n in zip(r["step_seconds"], r["step_tokens"]) if s > 0)
    steps = steps[: max(1, len(steps) // 4)]
    return sum(n for _, n in steps) / sum(s for s, _ in steps)


def summary_cpu(trials: list[dict]) -> float:
    return h.median([r["tokens"] / r["cpu_seconds"] for r in trials])


def summarise(results: dict[str, list[dict]], flops_per_token: float, peak: float, peak_cpu: float) -> dict:
    summary = {}
    for kind, trials in results.items():
        tps = h.median([r["tokens_per_s"] for r in trials])
        summary[kind] = {
            "tokens_per_s": tps,
            "step_median_tokens_per_s": h.median([r["step_median_tokens_per_s"] for r in trials]),
            "best_tokens_per_s": max(r["tokens_per_s"] for r in trials),
            "fastest_quarter_tokens_per_s": fastest_quarter(trials),
            "loss_tokens_per_s": h.median([r["loss_tokens"] / r["seconds"] for r in trials]),
            "tokens_per_cpu_s": summary_cpu(trials),
            "real_fraction_of_positions": h.median([r["tokens"] / r["positions"] for r in trials]),
            "step_s": h.median(h.median(r["step_seconds"]) for r in trials),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in trials),
            **({"cuda_peak_mb": max(r["cuda_peak_mb"] for r in trials)} if "cuda_peak_mb" in trials[0] else {}),
            "pre_train_rss_mb": max(r["pre_train_rss_mb"] for r in trials),
            "training_rss_mb": h.median([r["peak_rss_mb"] - r["pre_train_rss_mb"] for r in trials]),
            "model_gflops": tps * flops_per_token / 1e9,
            "fraction_of_matmul_peak": tps * flops_per_token / peak,
            "fraction_of_matmul_peak_fastest_quarter": fastest_quarter(trials) * flops_per_token / peak,
            "fraction_of_matmul_peak_cpu_time": summary_cpu(trials) * flops_per_token / peak_cpu,
        }
    if "trl" in summary:
        summary["ratio_align_over_trl"] = h.ratios(
            summary,
            (
                "tokens_per_s",
                "step_median_tokens_per_s",
                "best_tokens_per_s",
                "fastest_quarter_tokens_per_s",
                "tokens_per_cpu_s",
                "peak_rss_mb",
                "pre_train_rss_mb",
                "training_rss_mb",
                *(("cuda_peak_mb",) if "cuda_peak_mb" in summary["align"] else ()),
            ),
        )
    return summary


def print_table(summary, peak, n_probes, args, flops, stats, results) -> None:
    h.print_ratio_table(
        summary,
        [
            ("tokens/s, median of trials", "tokens_per_s", "{:.0f}"),
            ("tokens/s, median step", "step_median_tokens_per_s", "{:.0f}"),
            ("tokens/s, best trial", "best_tokens_per_s", "{:.0f}"),
            ("tokens/s, fastest quarter of steps", "fastest_quarter_tokens_per_s", "{:.0f}"),
            ("trained (loss) tokens/s", "loss_tokens_per_s", "{:.0f}"),
            ("tokens per CPU-second", "tokens_per_cpu_s", "{:.0f}"),
            ("real tokens / model positions", "real_fraction_of_positions", "{:.1%}"),
            ("peak RSS, MB", "peak_rss_mb", "{:.0f}"),
            ("RSS when training starts, MB", "pre_train_rss_mb", "{:.0f}"),
            ("peak RSS minus that, MB", "training_rss_mb", "{:.0f}"),
            ("model GFLOP/s", "model_gflops", "{:.1f}"),
            ("fraction of matmul peak", "fraction_of_matmul_peak", "{:.1%}"),
            ("  same, fastest quarter of steps", "fraction_of_matmul_peak_fastest_quarter", "{:.1%}"),
            ("  same, CPU-time basis", "fraction_of_matmul_peak_cpu_time", "{:.1%}"),
        ],
        width=34,
    )
    gemm = "bf16 GEMM on the GPU" if args.device == "cuda" else f"fp32 GEMM, {args.threads} threads"
    print(
        f"\nmatmul peak: {peak / 1e9:.1f} GFLOP/s (best {gemm}, over {n_probes} probes); "
        f"align SFT reaches {summary['align']['fraction_of_matmul_peak']:.1%} of it over whole trials, "
        f"{summary['align']['fraction_of_matmul_peak_fastest_quarter']:.1%} in its fastest quarter of steps"
    )
    print(
        f"model FLOPs per token: {flops['flops_per_token'] / 1e6:.2f}M = 6 x {flops['n_layers_linear'] / 1e6:.3f}M "
        f"(block linears) + 6 x {flops['n_lm_head'] / 1e6:.3f}M x {stats['loss_fraction']:.2f} (LM head, trained "
        f"positions) + 12 x L x h x {stats['mean_context']:.1f} (attention, mean causal context)"
    )
    low, high = h.load_range(results)
    print(
        f"1-minute load average during trials: {low:.1f} to {high:.1f} "
        f"({args.threads} threads used; a load above that means other work shared the cores)"
    )
    if "trl" in results:
        t, a = results["trl"][0], results["align"][0]
        print(
            f"align: packed rows ({a['rows']} of them) with a block-diagonal mask from position ids, "
            f"attention={a['attn_implementation']}, AdamW fused={args.fused_adamw}"
        )
        print(
            f"trl:   packing=True/bfd ({t['rows']} rows), padding_free={t['padding_free']} (batch flattened to one "
            f"row), attention={t['attn_implementation']}, optim={t['optim']}"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("model")
    h.add_model_args(
        p,
        group=g,
        model_options=lambda g: g.add_argument(
            "--seed", type=int, default=0, help="seed of the tiny model's weights and of training"
        ),
    )
    g = p.add_argument_group("data and training")
    g.add_argument("--turns", type=int, default=4, help="sort problems per conversation")
    g.add_argument("--max-length", type=int, default=256, help="packed row length")
    g.add_argument("--batch-size", type=int, default=8, help="packed rows per optimizer step")
    g.add_argument("--steps", type=int, default=20, help="optimizer steps per trial")
    g.add_argument("--warmup", type=int, default=4, help="steps excluded from timing")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument(
        "--no-fused-adamw",
        dest="fused_adamw",
        action="store_false",
        help="plain AdamW on both sides instead of torch's fused kernel (TRL's default)",
    )
    g.add_argument("--log-every", type=int, default=10, help="metric logging interval on both sides")
    g = p.add_argument_group("run")
    g.add_argument("--trials", type=int, default=2, help="trials per framework, alternating")
    g.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads in every trial")
    g.add_argument("--no-trl", dest="trl", action="store_false", help="skip the TRL trials")
    h.add_device_args(g)
    g.add_argument("--json", type=Path, default=None, help="write the results here")
    g.add_argument("--verbose", action="store_true", help="show the trials' own output")
    h.add_child_args(p, CHILDREN)
    args = p.parse_args(argv)
    if h.run_if_child(args, CHILDREN):
        return 0
    if args.warmup < 1 or args.steps <= args.warmup:
        p.error("need 1 <= --warmup < --steps")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="align-bench-sft-") as tmp:
        tmp = Path(tmp)
        model_dir, config, n_params = h.prepare_model(
            args, tmp / "model", seed=args.seed, max_position_embeddings=max(args.max_length, 256)
        )
        model_name = f"{args.model} ({model_dir})" if args.model else "tiny Llama"
        if args.max_length > config.max_position_embeddings:
            p.error(
                f"--max-length {args.max_length} is longer than the model's max_position_embeddings "
                f"{config.max_position_embeddings}"
            )
        conversations = write_data(tmp / "train.jsonl", args.turns)
        spec = dict(
            model_dir=model_dir,
            train_file=str(tmp / "train.jsonl"),
            workdir=str(tmp),
            max_length=args.max_length,
            batch_size=args.batch_size,
            steps=args.steps,
            warmup=args.warmup,
            lr=args.lr,
            weight_decay=args.weight_decay,
            fused_adamw=args.fused_adamw,
            log_every=args.log_every,
            threads=args.threads,
            seed=args.seed,
            **h.device_spec(args),
        )
        stats = data_stats(spec)
        flops = h.training_flops_per_token(config, stats["loss_fraction"], stats["mean_context"], args.max_length)
        print(
            f"model: {model_name}, hidden {config.hidden_size}, {config.num_hidden_layers} layers, intermediate "
            f"{config.intermediate_size}, heads {config.num_attention_heads}/{config.num_key_value_heads}, vocab "
            f"{config.vocab_size}, {n_params / 1e6:.2f}M parameters"
        )
        print(
            f"data: {conversations} conversations of {args.turns} sort problems, mean {stats['mean_length']:.1f} "
            f"tokens, {100 * stats['loss_fraction']:.0f}% trained; packed to {args.max_length}, batch "
            f"{args.batch_size}; {args.steps} steps ({args.warmup} warmup) x {args.trials} trials; "
            f"{args.threads} threads",
            flush=True,
        )

        trials = h.Trials(__file__, spec, tmp, threads=args.threads, verbose=args.verbose)
        probes: list[dict] = []

        def probe():
            probes.append(trials.run("matmul"))
            print(f"  matmul peak probe: {probes[-1]['gflops']:.1f} GFLOP/s", flush=True)

        def report(trial: int, kind: str, r: dict) -> None:
            print(
                f"  trial {trial} {kind:5s}: {r['tokens_per_s']:9.0f} tokens/s, peak RSS "
                f"{r['peak_rss_mb']:.0f} MB, load {max(r['load_avg']):.1f} ({r['process_seconds']:.0f} s in all)",
                flush=True,
            )

        probe()
        results = trials.alternate(["align", "trl"] if args.trl else ["align"], args.trials, report, between=probe)

    peak = max(pr["gflops"] for pr in probes) * 1e9
    peak_cpu = max(pr["gflops_per_cpu_s"] for pr in probes) * 1e9
    summary = summarise(results, flops["flops_per_token"], peak, peak_cpu)
    print_table(summary, peak, len(probes), args, flops, stats, results)

    if args.json:
        h.write_json(
            args.json,
            {
                "settings": {k: v for k, v in vars(args).items() if k not in ("child", "spec", "out", "json")},
                "model": {
                    "name": args.model or "tiny",
                    "hidden_size": config.hidden_size,
                    "layers": config.num_hidden_layers,
                    "intermediate_size": config.intermediate_size,
                    "heads": config.num_attention_heads,
                    "kv_heads": config.num_key_value_heads,
                    "vocab_size": config.vocab_size,
                    "parameters": n_params,
                },
                "data": stats,
                "flops": flops,
                "matmul_probes": probes,
                "matmul_peak_flops": peak,
                "matmul_peak_flops_per_cpu_s": peak_cpu,
                "trials": results,
                "summary": summary,
            },
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
