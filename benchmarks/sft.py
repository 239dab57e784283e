"""SFT throughput and memory: ``align`` against TRL's ``SFTTrainer``, same model, data and settings, one run.

Usage::

    python benchmarks/sft.py                                   # small model, a few minutes on 2 CPU cores
    python benchmarks/sft.py --hidden-size 512 --layers 4 --intermediate 1536 --heads 8 --kv-heads 4
    python benchmarks/sft.py --trials 3 --steps 40 --json sft-bench.json
    python benchmarks/sft.py --no-trl                          # align and the matmul peak only
    python benchmarks/sft.py --model smollm2-135m-instruct --batch-size 2 --steps 6 --warmup 2 --threads 2

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
steps, AdamW (lr, betas, eps, weight decay, fused kernel), constant learning rate, gradient clipping at 1.0, fp32, no
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
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _model import MODEL_HELP, model_config_and_parameters, resolve_model_dir

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------------------------
# shared helpers (run in the parent and in the children)


def _peak_rss_mb() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _setup_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


def _load_examples(spec: dict):
    """The trial data as align ``Example``s (unpacked), tokenized with align's chat encoder."""
    from align.data.chat import ChatEncoder
    from align.data.io import read_rows
    from align.data.sft import tokenize_rows
    from align.hub import load_tokenizer

    tokenizer = load_tokenizer(spec["model_dir"])
    examples, _ = tokenize_rows(read_rows(spec["train_file"]), spec["train_file"], ChatEncoder(tokenizer),
                                max_length=spec["max_length"])
    return examples


class _Meter:
    """Tokens and wall time of the timed (post-warmup) steps, measured from one step end to the next."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.tokens = self.loss_tokens = self.positions = 0
        self.step_seconds: list[float] = []
        self.step_tokens: list[int] = []
        self.step_cpu_seconds: list[float] = []
        self.last = self.last_cpu = None
        self.pre_train_rss_mb = None
        self.load = []

    def start(self) -> None:
        self.pre_train_rss_mb = _current_rss_mb()
        self.load.append(os.getloadavg()[0])

    def step_done(self, step: int, tokens: int, loss_tokens: int, positions: int) -> None:
        """``step`` counts optimizer steps from 1; called after the optimizer step. ``positions``: the model's
        input positions, padding included."""
        now, now_cpu = time.perf_counter(), time.process_time()
        if step > self.warmup:
            self.tokens += tokens
            self.loss_tokens += loss_tokens
            self.positions += positions
            self.step_seconds.append(now - self.last)
            self.step_cpu_seconds.append(now_cpu - self.last_cpu)
            self.step_tokens.append(tokens)
        self.last, self.last_cpu = now, now_cpu

    def result(self, **extra) -> dict:
        self.load.append(os.getloadavg()[0])
        seconds = sum(self.step_seconds)
        rates = [n / s for n, s in zip(self.step_tokens, self.step_seconds)]
        return dict(tokens=self.tokens, loss_tokens=self.loss_tokens, positions=self.positions,
                    timed_steps=len(self.step_seconds),
                    seconds=seconds, tokens_per_s=self.tokens / seconds if seconds > 0 else float("nan"),
                    step_median_tokens_per_s=statistics.median(rates) if rates else float("nan"),
                    cpu_seconds=sum(self.step_cpu_seconds), step_seconds=self.step_seconds,
                    step_cpu_seconds=self.step_cpu_seconds, step_tokens=self.step_tokens, load_avg=self.load,
                    pre_train_rss_mb=self.pre_train_rss_mb, peak_rss_mb=_peak_rss_mb(), **extra)


# ---------------------------------------------------------------------------------------------------------------
# children


def child_matmul(spec: dict) -> dict:
    import torch

    _setup_threads(spec["threads"])
    per_size, per_size_cpu = {}, {}
    for n, reps in ((1024, 20), (2048, 10), (4096, 3)):
        a, b = torch.randn(n, n), torch.randn(n, n)
        c = torch.empty(n, n)
        torch.mm(a, b, out=c)  # warm up MKL's buffers and threads
        fastest = fastest_cpu = float("inf")
        for _ in range(reps):
            t, t_cpu = time.perf_counter(), time.process_time()
            torch.mm(a, b, out=c)
            fastest = min(fastest, time.perf_counter() - t)
            fastest_cpu = min(fastest_cpu, time.process_time() - t_cpu)
        per_size[n] = 2 * n**3 / fastest / 1e9
        per_size_cpu[n] = 2 * n**3 / fastest_cpu / 1e9
    return {"gflops": max(per_size.values()), "gflops_per_cpu_s": max(per_size_cpu.values()),
            "gflops_by_size": per_size, "gflops_per_cpu_s_by_size": per_size_cpu}


def child_align(spec: dict) -> dict:
    _setup_threads(spec["threads"])
    from functools import partial

    import lightning as L
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from align.data import SFTDataModule
    from align.models import PolicyModel
    from align.modules import SFTModule

    meter = _Meter(spec["warmup"])

    class Timer(L.Callback):
        def on_train_start(self, trainer, pl_module):
            meter.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss_tokens = int((batch.labels[:, 1:] != -100).sum())
            meter.step_done(trainer.global_step, batch.num_tokens, loss_tokens, batch.input_ids.numel())

    L.seed_everything(spec["seed"], verbose=False)
    policy = PolicyModel(model=spec["model_dir"], dtype="float32")
    optimizer = partial(torch.optim.AdamW, lr=spec["lr"], betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=spec["weight_decay"], fused=spec["fused_adamw"])
    module = SFTModule(policy, optimizer=optimizer)
    data = SFTDataModule(train_files=spec["train_file"], val_files=None, max_length=spec["max_length"],
                         batch_size=spec["batch_size"], packing=True, completion_only=True, shuffle=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_steps=spec["steps"], gradient_clip_val=1.0,
        logger=CSVLogger(spec["workdir"], name="align_logs"), log_every_n_steps=spec["log_every"],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer()],
        default_root_dir=spec["workdir"],
    )
    trainer.fit(module, data)
    return meter.result(attn_implementation=policy.config._attn_implementation,
                        rows=len(data.train_set), threads=torch.get_num_threads())


def child_trl(spec: dict) -> dict:
    _setup_threads(spec["threads"])
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    meter = _Meter(spec["warmup"])
    examples = _load_examples(spec)
    dataset = Dataset.from_dict({"input_ids": [ex.input_ids for ex in examples],
                                 "labels": [ex.labels for ex in examples]})
    counts = {"tokens": 0, "loss_tokens": 0, "positions": 0}

    class CountingSFTTrainer(SFTTrainer):
        # Counting only: the batch is measured before TRL's own training step runs unchanged.
        def training_step(self, model, inputs, num_items_in_batch=None):
            mask = inputs.get("attention_mask")
            counts["tokens"] += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
            counts["loss_tokens"] += int((inputs["labels"][:, 1:] != -100).sum())
            counts["positions"] += inputs["input_ids"].numel()
            return super().training_step(model, inputs, num_items_in_batch)

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            meter.start()

        def on_step_end(self, args, state, control, **kwargs):
            meter.step_done(state.global_step, counts["tokens"], counts["loss_tokens"], counts["positions"])
            counts.update(tokens=0, loss_tokens=0, positions=0)

    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    config = SFTConfig(
        output_dir=str(Path(spec["workdir"]) / "trl_out"), max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=spec["weight_decay"],
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        optim="adamw_torch_fused" if spec["fused_adamw"] else "adamw_torch", max_grad_norm=1.0,
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True,
        max_length=spec["max_length"], packing=True, packing_strategy="bfd",
        logging_steps=spec["log_every"], report_to="none", disable_tqdm=True,
        save_strategy="no", eval_strategy="no", dataloader_num_workers=0, seed=spec["seed"],
    )
    trainer = CountingSFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                                 callbacks=[Timer()])
    trainer.train()
    return meter.result(attn_implementation=model.config._attn_implementation, rows=len(trainer.train_dataset),
                        padding_free=bool(trainer.padding_free), optim=getattr(config.optim, "value", str(config.optim)),
                        threads=torch.get_num_threads())


CHILDREN = {"matmul": child_matmul, "align": child_align, "trl": child_trl}

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
            messages += [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def model_overrides(args) -> dict:
    overrides = {}
    for flag, field in (("hidden_size", "hidden_size"), ("layers", "num_hidden_layers"),
                        ("intermediate", "intermediate_size"), ("heads", "num_attention_heads"),
                        ("kv_heads", "num_key_value_heads")):
        value = getattr(args, flag)
        if value is not None:
            overrides[field] = value
    overrides["max_position_embeddings"] = max(args.max_length, 256)
    return overrides


def save_model(model_dir: Path, seed: int, overrides: dict):
    from align.hub.tiny import build_tiny_model, load_tiny_tokenizer

    model = build_tiny_model(seed=seed, **overrides)
    model.save_pretrained(model_dir, safe_serialization=True)
    load_tiny_tokenizer().save_pretrained(model_dir)
    return model.config, sum(p.numel() for p in model.parameters())


def flops_per_token(config, loss_fraction: float, mean_context: float, seq_len: int) -> dict:
    h, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    attn_linear = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o and k, v
    mlp_linear = 3 * h * config.intermediate_size
    n_layers = L * (attn_linear + mlp_linear)
    attention = 12 * L * heads * head_dim
    return {
        "n_layers_linear": n_layers,
        "n_lm_head": V * h,
        "flops_per_token": 6 * n_layers + 6 * V * h * loss_fraction + attention * mean_context,
        "flops_per_token_conventional": 6 * (n_layers + V * h) + attention * seq_len,
    }


def data_stats(spec: dict) -> dict:
    examples = _load_examples(spec)
    lengths = [len(ex.input_ids) for ex in examples]
    tokens = sum(lengths)
    return {"documents": len(examples), "tokens": tokens, "mean_length": tokens / len(examples),
            "loss_fraction": sum(ex.loss_tokens for ex in examples) / tokens,
            # keys a token attends to, averaged over tokens: sum_n n(n+1)/2 / sum_n n
            "mean_context": sum(n * (n + 1) / 2 for n in lengths) / tokens}


def run_child(kind: str, spec_path: Path, out_path: Path, threads: int, verbose: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--spec", str(spec_path),
           "--out", str(out_path)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=not verbose, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or "")[-4000:] if not verbose else ""
        raise SystemExit(f"{kind} trial failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(out_path.read_text())
    result["process_seconds"] = time.perf_counter() - started
    return result


def _median(values):
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def fastest_quarter(trials: list[dict]) -> float:
    """tokens/s over the fastest quarter of all timed steps: an estimate of the speed when nothing else runs."""
    steps = sorted((s, n) for r in trials for s, n in zip(r["step_seconds"], r["step_tokens"]) if s > 0)
    steps = steps[: max(1, len(steps) // 4)]
    return sum(n for _, n in steps) / sum(s for s, _ in steps)


def summary_cpu(trials: list[dict]) -> float:
    return _median([r["tokens"] / r["cpu_seconds"] for r in trials])


def summarise(results: dict[str, list[dict]], flops_per_token: float, peak: float, peak_cpu: float) -> dict:
    summary = {}
    for kind, trials in results.items():
        tps = _median([r["tokens_per_s"] for r in trials])
        summary[kind] = {
            "tokens_per_s": tps,
            "step_median_tokens_per_s": _median([r["step_median_tokens_per_s"] for r in trials]),
            "best_tokens_per_s": max(r["tokens_per_s"] for r in trials),
            "fastest_quarter_tokens_per_s": fastest_quarter(trials),
            "loss_tokens_per_s": _median([r["loss_tokens"] / r["seconds"] for r in trials]),
            "tokens_per_cpu_s": summary_cpu(trials),
            "real_fraction_of_positions": _median([r["tokens"] / r["positions"] for r in trials]),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in trials),
            "pre_train_rss_mb": max(r["pre_train_rss_mb"] for r in trials),
            "training_rss_mb": _median([r["peak_rss_mb"] - r["pre_train_rss_mb"] for r in trials]),
            "model_gflops": tps * flops_per_token / 1e9,
            "fraction_of_matmul_peak": tps * flops_per_token / peak,
            "fraction_of_matmul_peak_fastest_quarter": fastest_quarter(trials) * flops_per_token / peak,
            "fraction_of_matmul_peak_cpu_time": summary_cpu(trials) * flops_per_token / peak_cpu,
        }
    if "trl" in summary:
        summary["ratio_align_over_trl"] = {
            key: summary["align"][key] / summary["trl"][key]
            for key in ("tokens_per_s", "step_median_tokens_per_s", "best_tokens_per_s",
                        "fastest_quarter_tokens_per_s", "tokens_per_cpu_s",
                        "peak_rss_mb", "pre_train_rss_mb", "training_rss_mb")
        }
    return summary


def print_table(summary, peak, n_probes, args, flops, stats, results) -> None:
    kinds = [k for k in ("align", "trl") if k in summary]
    print()
    print(f"{'':34s}" + "".join(f"{k:>12s}" for k in kinds) + (f"{'align/trl':>12s}" if len(kinds) == 2 else ""))
    rows = [("tokens/s, median of trials", "tokens_per_s", "{:.0f}"),
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
            ("  same, CPU-time basis", "fraction_of_matmul_peak_cpu_time", "{:.1%}")]
    for name, key, fmt in rows:
        line = f"{name:34s}" + "".join(f"{fmt.format(summary[k][key]):>12s}" for k in kinds)
        if len(kinds) == 2:
            line += f"{summary['align'][key] / summary['trl'][key]:>11.2f}x"
        print(line)
    print(f"\nmatmul peak: {peak / 1e9:.1f} GFLOP/s (best fp32 GEMM over {n_probes} probes, {args.threads} threads); "
          f"align SFT reaches {summary['align']['fraction_of_matmul_peak']:.1%} of it over whole trials, "
          f"{summary['align']['fraction_of_matmul_peak_fastest_quarter']:.1%} in its fastest quarter of steps")
    print(f"model FLOPs per token: {flops['flops_per_token'] / 1e6:.2f}M = 6 x {flops['n_layers_linear'] / 1e6:.3f}M "
          f"(block linears) + 6 x {flops['n_lm_head'] / 1e6:.3f}M x {stats['loss_fraction']:.2f} (LM head, trained "
          f"positions) + 12 x L x h x {stats['mean_context']:.1f} (attention, mean causal context)")
    loads = [x for v in results.values() for r in v for x in r["load_avg"]]
    print(f"1-minute load average during trials: {min(loads):.1f} to {max(loads):.1f} "
          f"({args.threads} threads used; a load above that means other work shared the cores)")
    if "trl" in results:
        t, a = results["trl"][0], results["align"][0]
        print(f"align: packed rows ({a['rows']} of them) with a block-diagonal mask from position ids, "
              f"attention={a['attn_implementation']}, AdamW fused={args.fused_adamw}")
        print(f"trl:   packing=True/bfd ({t['rows']} rows), padding_free={t['padding_free']} (batch flattened to one "
              f"row), attention={t['attn_implementation']}, optim={t['optim']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights and of training")
    g = p.add_argument_group("tiny Llama size (the default model; ignored with --model; unset fields keep "
                             "align.hub.tiny defaults)")
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--layers", type=int, default=None)
    g.add_argument("--intermediate", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--kv-heads", type=int, default=None)
    g = p.add_argument_group("data and training")
    g.add_argument("--turns", type=int, default=4, help="sort problems per conversation")
    g.add_argument("--max-length", type=int, default=256, help="packed row length")
    g.add_argument("--batch-size", type=int, default=8, help="packed rows per optimizer step")
    g.add_argument("--steps", type=int, default=20, help="optimizer steps per trial")
    g.add_argument("--warmup", type=int, default=4, help="steps excluded from timing")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--no-fused-adamw", dest="fused_adamw", action="store_false",
                   help="plain AdamW on both sides instead of torch's fused kernel (TRL's default)")
    g.add_argument("--log-every", type=int, default=10, help="metric logging interval on both sides")
    g = p.add_argument_group("run")
    g.add_argument("--trials", type=int, default=2, help="trials per framework, alternating")
    g.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads in every trial")
    g.add_argument("--no-trl", dest="trl", action="store_false", help="skip the TRL trials")
    g.add_argument("--json", type=Path, default=None, help="write the results here")
    g.add_argument("--verbose", action="store_true", help="show the trials' own output")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        spec = json.loads(args.spec.read_text())
        args.out.write_text(json.dumps(CHILDREN[args.child](spec)))
        return 0
    if args.warmup < 1 or args.steps <= args.warmup:
        p.error("need 1 <= --warmup < --steps")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="align-bench-sft-") as tmp:
        tmp = Path(tmp)
        if args.model:
            model_dir = resolve_model_dir(args.model)
            config, n_params = model_config_and_parameters(model_dir)
            model_name = f"{args.model} ({model_dir})"
            if args.max_length > config.max_position_embeddings:
                p.error(f"--max-length {args.max_length} is longer than the model's max_position_embeddings "
                        f"{config.max_position_embeddings}")
        else:
            model_dir = str(tmp / "model")
            config, n_params = save_model(tmp / "model", args.seed, model_overrides(args))
            model_name = "tiny Llama"
        conversations = write_data(tmp / "train.jsonl", args.turns)
        spec = dict(model_dir=model_dir, train_file=str(tmp / "train.jsonl"), workdir=str(tmp),
                    max_length=args.max_length, batch_size=args.batch_size, steps=args.steps, warmup=args.warmup,
                    lr=args.lr, weight_decay=args.weight_decay, fused_adamw=args.fused_adamw,
                    log_every=args.log_every, threads=args.threads, seed=args.seed)
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps(spec))
        stats = data_stats(spec)
        flops = flops_per_token(config, stats["loss_fraction"], stats["mean_context"], args.max_length)
        print(f"model: {model_name}, hidden {config.hidden_size}, {config.num_hidden_layers} layers, intermediate "
              f"{config.intermediate_size}, heads {config.num_attention_heads}/{config.num_key_value_heads}, vocab "
              f"{config.vocab_size}, {n_params / 1e6:.2f}M parameters")
        print(f"data: {conversations} conversations of {args.turns} sort problems, mean {stats['mean_length']:.1f} "
              f"tokens, {100 * stats['loss_fraction']:.0f}% trained; packed to {args.max_length}, batch "
              f"{args.batch_size}; {args.steps} steps ({args.warmup} warmup) x {args.trials} trials; "
              f"{args.threads} threads", flush=True)

        order = ["align", "trl"] if args.trl else ["align"]
        results: dict[str, list[dict]] = {k: [] for k in order}
        probes: list[dict] = []
        counter = 0

        def probe():
            nonlocal counter
            counter += 1
            r = run_child("matmul", spec_path, tmp / f"matmul{counter}.json", args.threads, args.verbose)
            probes.append(r)
            print(f"  matmul peak probe: {r['gflops']:.1f} GFLOP/s", flush=True)

        probe()
        for trial in range(args.trials):
            for kind in order:
                r = run_child(kind, spec_path, tmp / f"{kind}{trial}.json", args.threads, args.verbose)
                results[kind].append(r)
                print(f"  trial {trial + 1} {kind:5s}: {r['tokens_per_s']:9.0f} tokens/s, peak RSS "
                      f"{r['peak_rss_mb']:.0f} MB, load {max(r['load_avg']):.1f} ({r['process_seconds']:.0f} s in all)",
                      flush=True)
            probe()

    peak = max(pr["gflops"] for pr in probes) * 1e9
    peak_cpu = max(pr["gflops_per_cpu_s"] for pr in probes) * 1e9
    summary = summarise(results, flops["flops_per_token"], peak, peak_cpu)
    print_table(summary, peak, len(probes), args, flops, stats, results)

    if args.json:
        args.json.write_text(json.dumps({
            "settings": {k: v for k, v in vars(args).items() if k not in ("child", "spec", "out", "json")},
            "model": {"name": args.model or "tiny", "hidden_size": config.hidden_size, "layers": config.num_hidden_layers,
                      "intermediate_size": config.intermediate_size, "heads": config.num_attention_heads,
                      "kv_heads": config.num_key_value_heads, "vocab_size": config.vocab_size, "parameters": n_params},
            "data": stats, "flops": flops, "matmul_probes": probes, "matmul_peak_flops": peak,
            "matmul_peak_flops_per_cpu_s": peak_cpu,
            "trials": results, "summary": summary,
        }, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
