"""What every benchmark in this folder shares, so that each script holds only its own workload.

- **Machine:** torch threads, peak and current memory, the load average, and the dense matmul peak that model
  FLOP/s are compared against (fp32 on a CPU, bf16 on CUDA).
- **Device:** ``--device cpu`` (the default) or ``cuda`` and ``--precision`` (``32-true`` on a CPU, ``bf16-mixed``
  on CUDA by default), the same on both sides: Lightning's accelerator and precision for align, ``use_cpu`` and
  ``bf16`` for TRL; on CUDA each trial also reports its peak of allocated CUDA memory and the GPU's name.
- **Model:** ``--model`` (a local Hugging Face folder, a ``.gguf`` file or a packaged id such as
  ``smollm2-135m-instruct``) or the synthetic tiny Llama built from the size flags, saved once to a folder from
  which every trial process of both frameworks loads it.
- **Trials:** each trial runs in a fresh process of the benchmark's own script (``--child KIND``), so its peak
  memory belongs to one framework and nothing warms up across trials; kinds alternate (``align, trl, align, ...``)
  so that load drifts on a shared machine hit both alike.
- **Step meter:** wall and CPU seconds per training step after the warm-up, with named counts per step (tokens,
  pairs, seconds of a phase), fed by a Lightning callback on the align side and a ``TrainerCallback`` on TRL's.
  The align side counts what the module logs (``rollout/completion_tokens``, ``time/generation_s``), not its
  internals.
- **Report:** medians over trials, align/TRL ratios, the printed tables and the JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _device import add_device_args, device_memory, device_spec, device_sync, lightning_device, trl_device  # noqa: F401

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------------------------------------------
# machine


def set_threads(threads: int) -> None:
    """``threads`` intra-op torch threads and one inter-op thread, the same in every trial of either framework."""
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


def peak_rss_mb() -> float:
    """The process's peak resident memory so far (imports, model, activations; the benchmarks run on CPU)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def load_average() -> float:
    """The 1-minute load average: above the trials' thread count, other work shared the cores."""
    return os.getloadavg()[0]


def matmul_peak(spec: dict) -> dict:
    """Best GFLOP/s of square GEMMs, by wall and by CPU time: the machine's practical peak that a benchmark's model
    FLOP/s are a share of (a child kind, run between trials). On a CPU fp32 GEMMs of 1024-4096 at
    ``spec["threads"]`` threads; on CUDA (``spec["device"]``) bf16 GEMMs of 2048-8192, timed to the device's end."""
    import torch

    set_threads(spec["threads"])
    cuda = spec.get("device") == "cuda"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sizes = ((2048, 20), (4096, 20), (8192, 10)) if cuda else ((1024, 20), (2048, 10), (4096, 3))
    per_size, per_size_cpu = {}, {}
    for n, reps in sizes:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        c = torch.empty(n, n, device=device, dtype=dtype)
        torch.mm(a, b, out=c)  # warm up the library's buffers and threads
        sync()
        fastest = fastest_cpu = float("inf")
        for _ in range(reps):
            t, t_cpu = time.perf_counter(), time.process_time()
            torch.mm(a, b, out=c)
            sync()
            fastest = min(fastest, time.perf_counter() - t)
            fastest_cpu = min(fastest_cpu, time.process_time() - t_cpu)
        per_size[n] = 2 * n**3 / fastest / 1e9
        per_size_cpu[n] = 2 * n**3 / fastest_cpu / 1e9
    return {
        "gflops": max(per_size.values()),
        "gflops_per_cpu_s": max(per_size_cpu.values()),
        "gflops_by_size": per_size,
        "gflops_per_cpu_s_by_size": per_size_cpu,
    }


def training_flops_per_token(config, loss_fraction: float, mean_context: float, seq_len: int) -> dict:
    """Model FLOPs of one trained token (forward + backward = 3 x forward, a multiply-add = 2 FLOPs): the block
    linears on every token, the LM head only where a prediction is trained (``loss_fraction``), and attention over
    ``mean_context`` keys; also the conventional ``6 N + 12 L h seq_len`` figure."""
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


# ---------------------------------------------------------------------------------------------------------------
# model

MODEL_HELP = (
    "a real model instead of the synthetic tiny Llama: a local Hugging Face model folder, a .gguf file or "
    "a packaged model id such as smollm2-135m-instruct; both frameworks load the model and its tokenizer "
    "from the same resolved folder (the tiny-model size flags are then ignored)"
)

# (command-line flag, config field) of the tiny Llama's size
TINY_SIZE_FLAGS = (
    ("hidden_size", "hidden_size"),
    ("layers", "num_hidden_layers"),
    ("intermediate", "intermediate_size"),
    ("heads", "num_attention_heads"),
    ("kv_heads", "num_key_value_heads"),
    ("vocab_size", "vocab_size"),
)


def add_model_args(
    parser: argparse.ArgumentParser,
    group=None,
    tiny_defaults: dict | None = None,
    model_options: Callable[[Any], None] | None = None,
) -> None:
    """``--model`` into ``group`` (else the parser), then ``model_options(group)`` (a benchmark's own model flags),
    then the tiny Llama's size flags. Without ``tiny_defaults`` an unset size flag keeps ``align.hub.tiny``'s
    default."""
    (group or parser).add_argument("--model", default=None, help=MODEL_HELP)
    if model_options is not None:
        model_options(group or parser)
    title = "tiny Llama size (the default model; ignored with --model"
    title += ")" if tiny_defaults else "; unset fields keep align.hub.tiny defaults)"
    tiny = parser.add_argument_group(title)
    for flag, _ in TINY_SIZE_FLAGS:
        tiny.add_argument("--" + flag.replace("_", "-"), type=int, default=(tiny_defaults or {}).get(flag))
    tiny.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer folder saved with the tiny Llama instead of the shipped tiny tokenizer (its "
        "vocabulary must fit --vocab-size; its special tokens become the model's)",
    )


def resolve_model_dir(name: str) -> str:
    """The local Hugging Face folder ``--model name`` names (:func:`align.models.loading.check_model_source`)."""
    from align.errors import AlignConfigError
    from align.models.loading import check_model_source

    try:
        folder = Path(check_model_source(name, what="--model"))
    except AlignConfigError as err:
        raise SystemExit(str(err)) from None
    if not (folder / "config.json").is_file():
        raise SystemExit(
            f"--model {name!r} resolved to {str(folder)!r}, which is not a local Hugging Face model "
            "folder (no config.json); pass a local folder, a .gguf file or a packaged model id such as "
            "smollm2-135m-instruct (leave --model out for the tiny model)"
        )
    return str(folder.resolve())


def model_config_and_parameters(folder: str):
    """``(config, parameter count)`` of the causal LM in ``folder``, counted on the meta device (no weights
    loaded; tied weights counted once, as ``sum(p.numel() for p in model.parameters())`` does)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, sum(p.numel() for p in model.parameters())


def tiny_overrides(ns) -> dict:
    """The tiny Llama's config fields the size flags set."""
    return {field: getattr(ns, flag) for flag, field in TINY_SIZE_FLAGS if getattr(ns, flag) is not None}


def prepare_model(ns, folder: Path, seed: int = 0, **config: Any) -> tuple[str, Any, int]:
    """``(folder, config, parameter count)`` of the model both frameworks load: the folder ``--model`` resolves
    to, or else a tiny random Llama (size flags, then ``config``) and the shipped tokenizer saved to ``folder``."""
    if ns.model:
        model_dir = resolve_model_dir(ns.model)
        return (model_dir, *model_config_and_parameters(model_dir))
    from align.hub.tiny import build_tiny_model, load_tiny_tokenizer

    tokenizer = load_tiny_tokenizer()
    if getattr(ns, "tokenizer", None):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ns.tokenizer)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        config = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            **config,
        }
    model = build_tiny_model(seed=seed, **tiny_overrides(ns), **config)
    if len(tokenizer) > model.config.vocab_size:
        raise SystemExit(
            f"--tokenizer {ns.tokenizer}: {len(tokenizer)} tokens do not fit --vocab-size {model.config.vocab_size}"
        )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), model.config, sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# trials in child processes


def add_child_args(parser: argparse.ArgumentParser, kinds) -> None:
    """The hidden flags with which :class:`Trials` starts the script as one trial."""
    parser.add_argument("--child", choices=sorted(kinds), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)


def run_if_child(ns, children: dict[str, Callable[[dict], dict]]) -> bool:
    """In a trial process (``--child``): run that kind on the spec, write its result, and return True."""
    if not ns.child:
        return False
    result = children[ns.child](json.loads(ns.spec.read_text()))
    ns.out.write_text(json.dumps(result))
    return True


class Trials:
    """Trials of one benchmark, each in a fresh process of ``script`` reading ``spec`` (a JSON file under
    ``workdir``); every result gains ``process_seconds`` and ``load`` (the 1-minute load average at its end)."""

    def __init__(
        self,
        script: str,
        spec: dict,
        workdir: Path,
        threads: int | None = None,
        verbose: bool = False,
        cwd: Path = REPO,
    ):
        self.script = str(Path(script).resolve())
        self.workdir, self.threads, self.verbose, self.cwd = workdir, threads, verbose, cwd
        self.spec_path = workdir / "spec.json"
        self.spec_path.write_text(json.dumps(spec))
        self.count = 0

    def run(self, kind: str) -> dict:
        self.count += 1
        out = self.workdir / f"{kind}-{self.count}.json"
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONWARNINGS="ignore",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        )
        if self.threads:
            env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, self.script, "--child", kind, "--spec", str(self.spec_path), "--out", str(out)],
            env=env,
            cwd=str(self.cwd),
            capture_output=not self.verbose,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"{kind} trial failed (exit {proc.returncode}):\n{(proc.stderr or '')[-4000:]}")
        result = json.loads(out.read_text())
        result.update(process_seconds=time.perf_counter() - started, load=load_average())
        return result

    def alternate(
        self, kinds, trials: int, report: Callable[[int, str, dict], None], between: Callable[[], None] | None = None
    ) -> dict[str, list[dict]]:
        """``trials`` rounds of one trial per kind, in order; ``report(trial, kind, result)`` after each (trial
        counts from 1) and ``between()`` after each round."""
        results: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for trial in range(1, trials + 1):
            for kind in kinds:
                results[kind].append(self.run(kind))
                report(trial, kind, results[kind][-1])
            if between is not None:
                between()
        return results


# ---------------------------------------------------------------------------------------------------------------
# step meter


class StepMeter:
    """Wall, process-CPU and thread-CPU seconds of each step after the first ``warmup``, each measured from the
    last mark (the step's own start where the trainer reports one, else the previous step's end), and named counts
    per step: what :meth:`add` gathered during the step plus what :meth:`end` is given."""

    def __init__(self, warmup: int, sync: Callable[[], None] | None = None):
        self.warmup = warmup
        self.sync = sync  # waits for the device's queued work before the clock is read (CUDA)
        self.steps_ended = 0
        self.step_seconds: list[float] = []
        self.step_cpu_seconds: list[float] = []
        self.step_thread_cpu_seconds: list[float] = []
        self.step_counts: list[dict[str, float]] = []
        self.load_avg: list[float] = []
        self.pre_train_rss_mb: float | None = None
        self._pending: dict[str, float] = {}
        self._mark = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float]:
        return time.perf_counter(), time.process_time(), time.thread_time()

    @property
    def timing(self) -> bool:
        """Whether the step under way is timed (past the warm-up)."""
        return self.steps_ended >= self.warmup

    def start(self) -> None:
        """Training starts: the memory and load before it, and the first mark."""
        self.pre_train_rss_mb = current_rss_mb()
        self.load_avg.append(load_average())
        self.begin()

    def begin(self) -> None:
        """A step starts (its time then excludes what ran between steps)."""
        if self.sync is not None:
            self.sync()
        self._mark = self._now()

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            self._pending[name] = self._pending.get(name, 0) + value

    def end(self, read: Callable[[], dict] | None = None, **counts: float) -> None:
        """A step ends: its seconds and ``counts``, and what ``read()`` returns, called after the clock stopped
        (reading metrics is the benchmark's cost, not the step's)."""
        if self.sync is not None:
            self.sync()
        now = self._now()
        self.add(**counts, **(read() if read else {}))
        if self.timing:
            self.step_seconds.append(now[0] - self._mark[0])
            self.step_cpu_seconds.append(now[1] - self._mark[1])
            self.step_thread_cpu_seconds.append(now[2] - self._mark[2])
            self.step_counts.append(self._pending)
        self._pending = {}
        self.steps_ended += 1
        self._mark = now

    @property
    def seconds(self) -> float:
        return sum(self.step_seconds)

    def per_step(self, name: str) -> list[float]:
        return [counts.get(name, 0) for counts in self.step_counts]

    def total(self, name: str) -> float:
        return sum(self.per_step(name))

    def rate(self, name: str) -> float:
        """``name`` per second over the timed steps."""
        return self.total(name) / self.seconds if self.seconds > 0 else float("nan")

    def median_step_rate(self, name: str) -> float:
        """The median over timed steps of each step's ``name`` per second."""
        rates = [n / s for n, s in zip(self.per_step(name), self.step_seconds) if s > 0]
        return statistics.median(rates) if rates else float("nan")

    def result(self) -> dict:
        """The timings every benchmark reports, with the load average at the start and now."""
        return dict(
            timed_steps=len(self.step_seconds),
            seconds=self.seconds,
            cpu_seconds=sum(self.step_cpu_seconds),
            step_seconds=self.step_seconds,
            step_cpu_seconds=self.step_cpu_seconds,
            step_thread_cpu_seconds=self.step_thread_cpu_seconds,
            load_avg=[*self.load_avg, load_average()],
            pre_train_rss_mb=self.pre_train_rss_mb,
            peak_rss_mb=peak_rss_mb(),
        )


def lightning_meter(meter: StepMeter, counts: Callable | None = None, interval: str = "end_to_end"):
    """A Lightning callback that feeds ``meter``; ``counts(trainer, module, batch) -> {name: value}`` at each
    step's end. ``interval``: ``"step"`` times each training batch from its start hook to its end hook;
    ``"end_to_end"`` from the previous batch's end (data loading and logging included); ``"start_to_start"`` from
    one batch's start hook to the next one's (or to the end of training): every hook of the step, the logger calls
    after ``on_train_batch_end`` included. Place it first among the callbacks."""
    import lightning as L

    class MeterCallback(L.Callback):
        first = True

        def on_train_start(self, trainer, pl_module):
            meter.start()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if interval == "step" or (interval == "start_to_start" and self.first):
                meter.begin()
            elif interval == "start_to_start":
                meter.end()
            self.first = False

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if interval != "start_to_start":
                meter.end(read=(lambda: counts(trainer, pl_module, batch)) if counts else None)

        def on_train_end(self, trainer, pl_module):
            if interval == "start_to_start":
                meter.end()

    return MeterCallback()


def logged(pl_module, **names: str) -> dict[str, float]:
    """``{count: value}`` of the RL module's metrics of this step (``last_metrics``: every step, whether or not
    the step writes a log row), ``names`` mapping count -> metric name."""
    return {count: float(pl_module.last_metrics[metric]) for count, metric in names.items()}


def trl_meter(meter: StepMeter, interval: str = "end_to_end"):
    """A transformers ``TrainerCallback`` that feeds ``meter``, with ``interval`` as in :func:`lightning_meter`
    (``"step"``: from ``on_step_begin``, which TRL's GRPO trainer calls; ``"end_to_end"``: from the previous step's
    end). The counts come from the trial's own wrappers, through :meth:`StepMeter.add`."""
    from transformers import TrainerCallback

    class MeterCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            meter.start()

        def on_step_begin(self, args, state, control, **kwargs):
            if interval == "step":
                meter.begin()

        def on_step_end(self, args, state, control, **kwargs):
            meter.end()

    return MeterCallback()


# ---------------------------------------------------------------------------------------------------------------
# report


def median(values) -> float:
    """The median of the values that are not NaN (NaN if none)."""
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def medians(results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per kind, the median over trials of every number the trials report."""
    return {
        kind: {
            k: median(r[k] for r in trials)
            for k, v in trials[0].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        for kind, trials in results.items()
    }


def ratios(summary: dict[str, dict], keys) -> dict[str, float]:
    """align's value over TRL's for each key."""
    return {key: summary["align"][key] / summary["trl"][key] for key in keys}


def print_ratio_table(summary: dict[str, dict], rows, width: int) -> None:
    """One row per ``(label, key, format)``, one column per framework, and align/TRL when both ran."""
    kinds = [k for k in ("align", "trl") if k in summary]
    print()
    print(f"{'':{width}s}" + "".join(f"{k:>12s}" for k in kinds) + (f"{'align/trl':>12s}" if len(kinds) == 2 else ""))
    for label, key, fmt in rows:
        line = f"{label:{width}s}" + "".join(f"{fmt.format(summary[k][key]):>12s}" for k in kinds)
        if len(kinds) == 2:
            line += f"{summary['align'][key] / summary['trl'][key]:>11.2f}x"
        print(line)


def load_range(results: dict[str, list[dict]]) -> tuple[float, float]:
    """The lowest and highest 1-minute load average the trials saw."""
    loads = [x for trials in results.values() for r in trials for x in r.get("load_avg", [r["load"]])]
    return min(loads), max(loads)


def write_json(path: Path | str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2, default=str))


# ---------------------------------------------------------------------------------------------------------------
# RL step benchmarks (grpo.py, ppo.py)

RL_TINY_DEFAULTS = {"hidden_size": 64, "layers": 2, "intermediate": 192, "heads": 4, "kv_heads": 2}


def sort_prompts(n: int) -> list[str]:
    """The first ``n`` bundled sort-task training prompts."""
    from align.data.io import read_rows

    return [r["prompt"] for r in read_rows("align:sort/prompts/train.jsonl")[:n]]


def write_prompts(spec: dict) -> str:
    """The benchmark's prompts as a prompt-data jsonl file in the trial's work folder."""
    path = Path(spec["workdir"]) / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in sort_prompts(spec["prompts"])))
    return str(path)


def rl_model(ns, tmp: str) -> tuple[str, str, int]:
    """``(folder, description, parameter count)`` of the policy both frameworks load (:func:`prepare_model`)."""
    model_dir, config, n_params = prepare_model(ns, Path(tmp) / "model")
    if ns.model:
        return model_dir, ns.model, n_params
    return (
        model_dir,
        (
            f"tiny (hidden {ns.hidden_size}, {ns.layers} layers, intermediate {ns.intermediate}, "
            f"heads {ns.heads}/{ns.kv_heads}, vocabulary {config.vocab_size})"
        ),
        n_params,
    )


def add_rl_step_args(parser: argparse.ArgumentParser, children, prompts: int = 8, max_new_tokens: int = 32) -> None:
    """The flags of an RL step benchmark: batch, new tokens, steps, warm-up, trials, LoRA, threads, the model,
    ``--json`` and the child flags."""
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    add_device_args(parser)
    add_model_args(parser, tiny_defaults=RL_TINY_DEFAULTS)
    parser.add_argument("--json", type=Path, default=None)
    add_child_args(parser, children)


def rl_step_spec(ns, tmp: str, **extra) -> tuple[dict, str, int]:
    """``(spec, model name, parameters)``: the model prepared (:func:`rl_model`) and announced, and the trial spec
    of the flags of :func:`add_rl_step_args` plus ``extra``."""
    model_dir, model_name, n_params = rl_model(ns, tmp)
    print(f"model: {model_name}, {n_params / 1e6:.2f}M parameters, from {model_dir}", flush=True)
    spec = {
        "model_dir": model_dir,
        "workdir": tmp,
        "prompts": ns.prompts,
        "max_new_tokens": ns.max_new_tokens,
        "steps": ns.steps + ns.warmup,
        "warmup": ns.warmup,
        "lora": ns.lora,
        "threads": ns.threads,
        **device_spec(ns),
        **extra,
    }
    return spec, model_name, n_params


def rl_align_trial(spec: dict, module, phases: tuple[str, ...], max_steps: int) -> dict:
    """Train ``module`` on the benchmark's prompts (one batch of ``spec["prompts"]`` per rollout) for
    ``max_steps`` optimizer steps and summarise its rollouts (:func:`rl_step_summary`): each training step timed
    from its start to its end, with the completion tokens and phase seconds (``time/<phase>_s``) it logged."""
    import lightning as L

    from align.data.prompts import PromptDataModule

    data = PromptDataModule(train_files=write_prompts(spec), val_files=None, batch_size=spec["prompts"], shuffle=False)
    meter = StepMeter(spec["warmup"], sync=device_sync(spec))
    names = {"tokens": "rollout/completion_tokens", **{f"{p}_s": f"time/{p}_s" for p in phases}}

    def counts(trainer, pl_module, batch) -> dict:
        if names["tokens"] not in pl_module.last_metrics:  # a step without an update (a source filling up)
            return {}
        # The prompt tokens the update reads beside the completions: each prompt once per completion.
        prompt_tokens = sum(len(ids) for ids in batch.prompt_ids) * pl_module.group_size
        return {**logged(pl_module, **names), "prompt_tokens": prompt_tokens}

    callback = lightning_meter(meter, counts, interval="step")
    trainer = L.Trainer(
        max_steps=max_steps,
        **lightning_device(spec),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        max_epochs=-1,
    )
    trainer.fit(module, datamodule=data)
    return rl_step_summary(meter, phases, device_memory(spec))


def rl_step_summary(meter: StepMeter, phases: tuple[str, ...], extra: dict | None = None) -> dict:
    """Throughput of full steps: completion tokens/s, median step time, the share of each phase
    (``<phase>_share``) and of the rest (``update_share``), the tokens an update reads (prompts and completions,
    when the trial counted ``prompt_tokens``), the peak RSS, and ``extra`` (:func:`device_memory`)."""
    shares = {f"{p}_share": meter.total(f"{p}_s") / meter.seconds for p in phases}
    prompt_tokens = meter.per_step("prompt_tokens")
    return {
        "tokens_per_s": meter.rate("tokens"),
        "step_s": statistics.median(meter.step_seconds),
        **shares,
        "update_share": 1.0 - sum(shares.values()),
        "completion_tokens_per_step": statistics.mean(meter.per_step("tokens")),
        **(
            {"update_tokens_per_step": statistics.mean(p + t for p, t in zip(prompt_tokens, meter.per_step("tokens")))}
            if any(prompt_tokens)
            else {}
        ),
        "peak_rss_mb": peak_rss_mb(),
        **(extra or {}),
    }


def print_rl_trial(trial: int, kind: str, res: dict, phases: tuple[str, ...]) -> None:
    split = ", ".join(f"{p} {res[f'{p}_share']:.0%}" for p in (*phases, "update"))
    print(
        f"trial {trial} {kind:5s}: {res['tokens_per_s']:8.1f} completion tok/s, step {res['step_s']:.2f} s "
        f"({split}), peak RSS {res['peak_rss_mb']:.0f} MB, load {res['load']:.1f}",
        flush=True,
    )


def rl_report(
    ns, title: str, results: dict[str, list[dict]], model_dir: str, n_params: int, phases: tuple[str, ...], **extra
) -> None:
    """Print the medians per framework and, when TRL ran, the align/TRL ratios; write them, the trials and
    ``extra`` to ``--json``."""
    med = medians(results)
    columns = {"generation": ("gen %", 8), "scoring": ("score %", 9)}
    cuda = all("cuda_peak_mb" in m for m in med.values())
    print(title)
    print(
        f"{'':8s}{'tok/s':>10s}{'step s':>9s}"
        + "".join(f"{columns[p][0]:>{columns[p][1]}s}" for p in phases)
        + f"{'update %':>10s}{'peak RSS MB':>13s}"
        + (f"{'CUDA peak MB':>14s}" if cuda else "")
    )
    for fw, m in med.items():
        print(
            f"{fw:8s}{m['tokens_per_s']:10.1f}{m['step_s']:9.2f}"
            + "".join(f"{m[f'{p}_share']:{columns[p][1]}.0%}" for p in phases)
            + f"{m['update_share']:10.0%}{m['peak_rss_mb']:13.0f}"
            + (f"{m['cuda_peak_mb']:14.0f}" if cuda else "")
        )
    result = {}
    if "trl" in med:
        names = ("throughput", "peak_rss", "cuda_peak")[: 3 if cuda else 2]
        keys = ("tokens_per_s", "peak_rss_mb", "cuda_peak_mb")[: len(names)]
        result = {f"{name}_align_over_trl": value for name, value in zip(names, ratios(med, keys).values())}
        print(
            f"throughput ratio align/TRL: {result['throughput_align_over_trl']:.2f}x; "
            f"peak memory ratio align/TRL: {result['peak_rss_align_over_trl']:.2f}"
            + (f"; CUDA peak ratio align/TRL: {result['cuda_peak_align_over_trl']:.2f}" if cuda else "")
        )
    write_json(
        ns.json,
        {
            "model": ns.model or "tiny",
            "model_dir": model_dir if ns.model else None,
            "parameters": n_params,
            "settings": vars(ns) | {"json": str(ns.json)},
            "trials": results,
            "medians": med,
            "ratios": result,
            **extra,
        },
    )
