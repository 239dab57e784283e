"""One GPU, checked in minutes: the tiny recipes with their learning thresholds, the ``gpu`` tests, and the GRPO,
DPO and SFT benchmarks against TRL on a random-init 0.4B Llama, as one table and one JSON file.

    python scripts/gpu_check.py --out gpu_check.json                        # on a machine with one GPU
    python scripts/gpu_check.py --device cpu --quick --out /tmp/check.json  # the same checks, small, on a CPU

It runs from a checkout (every step is ``python recipes/...``, ``python -m pytest``, ``python benchmarks/...`` with
the checkout on ``PYTHONPATH``; no installed ``align`` command is needed) and fits in ``--budget`` seconds (450 by
default): each step has a time box, a step that overruns is stopped and recorded as timed out, and the JSON file is
rewritten after every step, so a run cut short still leaves what it measured.

1. **environment**: versions, the GPU's name, and (for the benchmarks) its measured bf16 GEMM peak, the
   denominator of MFU.
2. **recipes** and **tests**, side by side (``--jobs``): ``recipes/grpo.py``, ``sft.py`` and ``dpo.py`` on the device
   under ``bf16-mixed`` with a fused AdamW, each held to its learning threshold (:data:`RECIPES`, the end-to-end
   tests' bars; ``--quick``: fewer steps and looser bars), and ``pytest -m gpu tests/gpu`` on the device.
3. **benchmarks**, one at a time: ``benchmarks/grpo.py`` (16 prompts x 8, 192 new tokens; ``grpo-async``: the same
   with rollouts one step ahead from a generator process on the same GPU, beside the synchronous step), ``dpo.py`` and
   ``sft.py`` (full fine-tune) with ``--device`` against TRL, all on one saved random-init Llama of :data:`SHAPE`
   (``--quick``: the benchmarks' tiny shape) with the SmolLM2 tokenizer when it is at hand (``--tokenizer``).

The table: per benchmark and framework, throughput, step time, generation share, MFU (over the measured GEMM peak),
peak memory (CUDA's on a GPU, else RSS) and align/TRL. Exit status 1 when a recipe misses its threshold, a test
fails, or a step crashed or ran out of time; else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # align from this checkout, installed or not
SHAPE = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=49152,
)
"""The benchmark model: a Llama of SmolLM2-360M's / Qwen2.5-0.5B's size class, about 0.4B parameters."""


@dataclass(frozen=True)
class Recipe:
    metric: str  # the held-out metric the recipe prints before and after
    rule: str  # the threshold, in words
    passes: Callable[[float, float], bool]  # (before, after) -> learned
    quick_args: tuple[str, ...] = ()
    quick_rule: str = ""
    quick_passes: Callable[[float, float], bool] | None = None


RECIPES = {
    # tests/e2e/test_recipes_grpo.py; 0.24 -> 0.56-0.59 on CPU and on an H200
    "grpo": Recipe(
        "val/reward_mean",
        "after - before >= 0.2",
        lambda b, a: a - b >= 0.2,
        ("--trainer.max_steps", "4"),
        "runs (4 steps are too few to learn)",
        lambda b, a: True,
    ),
    # 6.29 -> 0.012 on an H200 under bf16-mixed
    "sft": Recipe(
        "val/loss",
        "after <= 0.5",
        lambda b, a: a <= 0.5,
        ("--trainer.max_epochs", "1", "--trainer.max_steps", "30"),
        "after <= before - 1",
        lambda b, a: a <= b - 1,
    ),
    # tests/e2e/test_recipes_preference.py; 0.50 -> 0.955 on an H200
    "dpo": Recipe(
        "val/dpo_accuracy",
        "|before - 0.5| < 0.1 and after >= 0.85",
        lambda b, a: abs(b - 0.5) < 0.1 and a >= 0.85,
        ("--trainer.max_steps", "20"),
        "after > before",
        lambda b, a: a > b,
    ),
}


def held_out(stdout: str, metric: str) -> tuple[float, float] | None:
    """``(before, after)`` from the recipe's ``held-out <metric>: before -> after`` line, or None."""
    m = re.search(rf"^held-out {re.escape(metric)}: (\S+) -> (\S+)$", stdout, re.M)
    return (float(m.group(1)), float(m.group(2))) if m else None


def judge_recipe(name: str, stdout: str, rc: int, quick: bool) -> dict:
    """A recipe step's verdict: ``status`` ok or failed, the before/after values and the rule it was held to."""
    recipe = RECIPES[name]
    rule, passes = (recipe.quick_rule, recipe.quick_passes) if quick else (recipe.rule, recipe.passes)
    values = held_out(stdout, recipe.metric)
    out = {"metric": recipe.metric, "rule": rule, "before": None, "after": None}
    if rc != 0 or values is None:
        return {**out, "status": "failed", "why": f"exit {rc}" if rc else f"no 'held-out {recipe.metric}' line"}
    why = {} if (ok := passes(*values)) else {"why": f"{recipe.metric} {values[0]} -> {values[1]}: not {rule}"}
    return {**out, "before": values[0], "after": values[1], "status": "ok" if ok else "failed", **why}


def judge_tests(junit: Path, rc: int) -> dict:
    """The pytest step's verdict from its JUnit XML: ok when tests ran and none failed or was skipped."""
    if not junit.is_file():
        return {"status": "failed", "why": f"pytest exit {rc}, no report"}
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in suite.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    ok = rc == 0 and counts["tests"] > 0 and not (counts["failures"] or counts["errors"] or counts["skipped"])
    return {
        **counts,
        "failed": failed[:20],
        "status": "ok" if ok else "failed",
        **({} if ok else {"why": f"pytest exit {rc}: {counts}"}),
    }


# ---------------------------------------------------------------------------------------------------------------
# steps in child processes, time-boxed


@dataclass
class Step:
    name: str
    command: list[str]
    box: float  # seconds this step may take
    env: dict | None = None
    proc: subprocess.Popen | None = None
    started: float = 0.0
    log: Path | None = None


def environment(threads: int, device: str) -> dict:
    """The child processes' environment: offline, this checkout first on ``PYTHONPATH``, ``threads`` threads."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS=str(threads),
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    env["ALIGN_TEST_DEVICE"] = device  # the gpu tests run there; without that device they fail instead of skipping
    return env


def run_steps(
    steps: list[Step], jobs: int, deadline: float, workdir: Path, done: Callable[[Step, int, str], None]
) -> None:
    """Run ``steps``, at most ``jobs`` at a time; each is stopped (its whole process group) when its box or the
    ``deadline`` passes. ``done(step, rc, output)`` after each; rc is None for a step stopped or never started."""
    waiting, running = list(steps), []
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                step = waiting.pop(0)
                if deadline - time.monotonic() < 5:
                    done(step, None, "not started: out of time")
                    continue
                step.log = workdir / f"{step.name.replace('/', '-')}.log"
                step.started = time.monotonic()
                with step.log.open("w") as log:
                    step.proc = subprocess.Popen(
                        step.command,
                        cwd=REPO,
                        env=step.env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                running.append(step)
            time.sleep(0.2)
            for step in list(running):
                rc = step.proc.poll()
                over = time.monotonic() > min(step.started + step.box, deadline)
                if rc is None and not over:
                    continue
                if rc is None:
                    _stop(step.proc)
                running.remove(step)
                done(step, rc, step.log.read_text(errors="replace"))
    finally:  # interrupted: no step outlives the check
        for step in running:
            _stop(step.proc)


def _stop(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and every process it started (its own session)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---------------------------------------------------------------------------------------------------------------
# the benchmark model and the table


def find_tokenizer(choice: str) -> str | None:
    """``--tokenizer``: a folder, ``tiny`` (None: the shipped tiny tokenizer), or ``auto``: the SmolLM2 tokenizer
    of a converted SmolLM2 in align's cache when there is one."""
    if choice != "auto":
        return None if choice == "tiny" else choice
    from align.hub.gguf import cache_root

    found = sorted((cache_root() / "models").glob("SmolLM2-*/tokenizer.json"))
    return str(found[0].parent) if found else None


def save_model(folder: Path, shape: dict, tokenizer: str | None, max_positions: int) -> dict:
    """One random-init Llama of ``shape`` and its tokenizer, saved for every benchmark; its config as a dict."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import _harness as h

    ns = argparse.Namespace(model=None, tokenizer=tokenizer, **{flag: None for flag, _ in h.TINY_SIZE_FLAGS})
    _, config, n_params = h.prepare_model(ns, folder, max_position_embeddings=max_positions, **shape)
    return {**{k: getattr(config, k) for k in (*SHAPE, "max_position_embeddings")}, "parameters": n_params}


def flops_per_token(config: dict, loss_fraction: float, mean_context: float) -> float:
    """Training FLOPs per token (``benchmarks/_harness.training_flops_per_token``)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import _harness as h

    return h.training_flops_per_token(argparse.Namespace(**config), loss_fraction, mean_context, 0)["flops_per_token"]


def benchmark_rows(name: str, result: dict, config: dict, peak: float | None) -> list[dict]:
    """The table rows (align, TRL) of one benchmark's JSON. MFU: GRPO, the update's model FLOPs (each update token
    trained once) over the update's time; DPO, 8 N per token fed (policy forward and backward, reference
    forward); SFT, the benchmark's own count (its ``fraction_of_matmul_peak``)."""
    rows = []
    if name.startswith("grpo"):
        for kind, m in result["medians"].items():
            update_s = m["step_s"] * m["update_share"]
            tokens = m.get("update_tokens_per_step")
            rows_per_step = result["settings"]["prompts"] * result["settings"]["group"]
            # the mean causal context: half a row's length
            fpt = (
                flops_per_token(config, m["completion_tokens_per_step"] / tokens, tokens / (2 * rows_per_step))
                if tokens
                else None
            )
            mfu = fpt * tokens / update_s / peak if (fpt and peak and update_s > 0) else None
            rows.append(
                dict(
                    benchmark=name,
                    framework=kind,
                    throughput=m["tokens_per_s"],
                    unit="completion tok/s",
                    step_s=m["step_s"],
                    generation_share=m["generation_share"],
                    mfu=mfu,
                    memory_mb=m.get("cuda_peak_mb", m["peak_rss_mb"]),
                )
            )
        ratio = result.get("ratios", {}).get("throughput_align_over_trl")
    else:
        summary = result["summary"]
        for kind in (k for k in ("align", "trl") if k in summary):
            m = summary[kind]
            if name == "dpo":
                tps = m["pairs_per_s"] * m["tokens_per_pair"]
                n = 8 * (flops_per_token(config, 1.0, 0.0) / 6)  # 6 (N + V h) per token -> 8 (N + V h)
                mfu = tps * n / peak if peak else None
            else:
                tps, mfu = m["tokens_per_s"], m["fraction_of_matmul_peak"]
            rows.append(
                dict(
                    benchmark=name,
                    framework=kind,
                    throughput=tps,
                    unit="tok/s",
                    step_s=m["step_s"],
                    generation_share=None,
                    mfu=mfu,
                    memory_mb=m.get("cuda_peak_mb", m["peak_rss_mb"]),
                )
            )
        key = "pairs_per_s" if name == "dpo" else "tokens_per_s"
        ratio = summary.get("ratio_align_over_trl", {}).get(key)
    for row in rows:
        row["align_over_trl"] = ratio if row["framework"] == "align" else None
    return rows


def table(report: dict) -> str:
    """The report as text: the GPU, the steps' verdicts and the benchmark rows."""
    env = report.get("environment", {})
    peak = (
        f"GEMM peak {env['gemm_peak_tflops']:.3g} TFLOP/s ({env['gemm']})"
        if env.get("gemm_peak_tflops")
        else "GEMM peak not measured"
    )
    lines = [
        f"device: {env.get('gpu') or report['device']}; torch {env.get('torch')}, CUDA {env.get('cuda')}; {peak}",
        "",
    ]
    for step in report["steps"]:
        detail = step.get("why") or (
            f"{step['metric']} {step['before']} -> {step['after']} ({step['rule']})" if "metric" in step else ""
        )
        if step.get("tests"):
            detail = (
                f"{step['tests']} tests, {step['failures']} failed, {step['errors']} errors, {step['skipped']} skipped"
            )
        lines.append(f"{step['name']:18s}{step['status']:>10s}{step['seconds']:8.0f} s  {detail}")
    memory = "CUDA peak MB" if report["device"] == "cuda" else "peak RSS MB"
    lines += [
        "",
        f"{'benchmark':11s}{'':6s}{'throughput':>12s}{'':18s}{'step s':>8s}{'gen %':>7s}{'MFU':>7s}"
        f"{memory:>14s}{'align/TRL':>11s}",
    ]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in report["benchmarks"]:
        lines.append(
            f"{r['benchmark']:11s}{r['framework']:6s}{r['throughput']:12.1f} {r['unit']:17s}"
            f"{r['step_s']:8.2f}{fmt(r['generation_share'], '.0%'):>7s}{fmt(r['mfu'], '.1%'):>7s}"
            f"{r['memory_mb']:14.0f}{fmt(r['align_over_trl'], '.2f'):>10s}"
            f"{'x' if r['align_over_trl'] else ''}"
        )
    return "\n".join(lines)


def write(path: Path | None, report: dict) -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")  # replaced in one step: a reader never sees half a file
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# the run

PROBE = """
import json, platform, sys
from importlib.metadata import distributions
sys.path.insert(0, "benchmarks")
import torch
import _harness as h

installed = {(d.metadata["Name"] or "").lower(): d.version for d in distributions()}
device, threads, peak = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "peak"
out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "cuda_available": torch.cuda.is_available(),
       **{n: installed.get(n) for n in ("lightning", "transformers", "peft", "trl", "accelerate", "datasets",
                                         "pytest")}}
if device == "cuda":
    out["gpu"] = torch.cuda.get_device_name()
if peak:  # the denominator of the benchmarks' MFU
    out["gemm_peak_tflops"] = h.matmul_peak({"threads": threads, "device": device})["gflops"] / 1e3
    out["gemm"] = "bf16 GEMM" if device == "cuda" else f"fp32 GEMM, {threads} threads"
print("PROBE " + json.dumps(out))
"""

# (benchmark, its arguments on a GPU, in --quick mode, time box on a GPU, in --quick mode)
BENCHMARKS = {
    "grpo": (
        ["--prompts", "16", "--group", "8", "--max-new-tokens", "192", "--steps", "2", "--warmup", "1"],
        ["--prompts", "4", "--group", "2", "--max-new-tokens", "8", "--steps", "2", "--warmup", "1"],
        170,
        300,
    ),
    "grpo-async": (
        ["--prompts", "16", "--group", "8", "--max-new-tokens", "192", "--steps", "3", "--staleness", "1"],
        ["--prompts", "4", "--group", "2", "--max-new-tokens", "8", "--steps", "2", "--staleness", "1"],
        200,
        300,
    ),
    "dpo": (
        ["--full", "--batch-size", "16", "--max-length", "256", "--steps", "8", "--warmup", "3"],
        ["--full", "--rows", "64", "--batch-size", "4", "--steps", "3", "--warmup", "1"],
        110,
        300,
    ),
    "sft": (
        ["--max-length", "1024", "--batch-size", "8", "--steps", "8", "--warmup", "3"],
        ["--batch-size", "2", "--steps", "3", "--warmup", "1"],
        110,
        300,
    ),
}


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="fewer steps, looser bars, the benchmarks' tiny shape")
    p.add_argument("--out", type=Path, default=None, help="the JSON report (rewritten after every step)")
    p.add_argument("--budget", type=float, default=None, help="seconds for everything (450 on cuda, 900 on cpu)")
    p.add_argument("--phases", default="recipes,tests,benchmarks", help="which of recipes, tests, benchmarks")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    p.add_argument(
        "--tokenizer",
        default="auto",
        help="the benchmark model's tokenizer: a folder, tiny, or auto "
        "(SmolLM2's from align's cache when converted there)",
    )
    p.add_argument("--jobs", type=int, default=None, help="recipes and tests at once (4 on cuda, 1 on cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (4 on cuda, 1 on cpu)")
    p.add_argument("--workdir", type=Path, default=None, help="logs, run folders and the model (default: a temp dir)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.budget = args.budget or (450.0 if cuda else 900.0)
    args.jobs = args.jobs or (4 if cuda else 1)
    args.threads = args.threads or (4 if cuda else 1)
    for name, known in (
        ("phases", ("recipes", "tests", "benchmarks")),
        ("recipes", RECIPES),
        ("benchmarks", BENCHMARKS),
    ):
        chosen = [x for x in getattr(args, name).split(",") if x]
        if not set(chosen) <= set(known):
            p.error(f"--{name}: expected some of {','.join(known)}, got {getattr(args, name)!r}")
        setattr(args, name, chosen)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = environment(args.threads, args.device)
    report = {
        "device": args.device,
        "quick": args.quick,
        "budget_s": args.budget,
        "workdir": str(workdir),
        "environment": {},
        "steps": [],
        "benchmarks": [],
        "model": None,
    }

    def record(step: Step, rc, output: str, **verdict) -> dict:
        seconds = time.monotonic() - step.started if step.started else 0.0
        if rc is None and step.proc is not None:
            verdict = {"status": "timed out", "why": f"stopped after {seconds:.0f} s (box {step.box:.0f} s)"}
        elif rc is None:
            verdict = {"status": "skipped", "why": output}
        entry = {
            "name": step.name,
            "seconds": seconds,
            "rc": rc,
            "command": " ".join(step.command[1:]),
            "log": str(step.log) if step.log else None,
            **verdict,
        }
        if entry["status"] != "ok":
            entry["tail"] = output[-3000:]
        report["steps"].append(entry)
        write(args.out, report)
        print(
            f"{step.name}: {entry['status']} in {seconds:.0f} s" + (f" ({entry['why']})" if entry.get("why") else ""),
            flush=True,
        )
        return entry

    def probed(step, rc, output):
        line = next((line for line in output.splitlines() if line.startswith("PROBE ")), None)
        if rc == 0 and line:
            report["environment"] = json.loads(line[len("PROBE ") :])
        record(step, rc, output, status="ok" if rc == 0 and line else "failed")

    peak = "peak" if "benchmarks" in args.phases else "no-peak"
    run_steps(
        [Step("environment", [sys.executable, "-c", PROBE, args.device, str(args.threads), peak], 90, env)],
        1,
        deadline,
        workdir,
        probed,
    )

    steps = []
    if "recipes" in args.phases:
        accelerator = "gpu" if args.device == "cuda" else "cpu"
        for name in args.recipes:
            command = [
                sys.executable,
                f"recipes/{name}.py",
                "--trainer.accelerator",
                accelerator,
                "--trainer.precision",
                "bf16-mixed",
                "--model.optimizer.init_args.fused",
                "true",
                "--trainer.enable_progress_bar",
                "false",
                "--trainer.default_root_dir",
                str(workdir / name),
                *(RECIPES[name].quick_args if args.quick else ()),
            ]
            steps.append(Step(f"recipe/{name}", command, 300 if args.quick else 170, env))
    if "tests" in args.phases:
        junit = workdir / "gpu-tests.xml"
        steps.append(
            Step(
                "tests/gpu",
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "tests/gpu",
                    "-m",
                    "gpu",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "--junitxml",
                    str(junit),
                ],
                400 if args.quick else 170,
                env,
            )
        )

    def finished(step, rc, output):
        if rc is None:
            return record(step, rc, output)
        if step.name.startswith("recipe/"):
            return record(step, rc, output, **judge_recipe(step.name.split("/")[1], output, rc, args.quick))
        if "No module named pytest" in output:
            return record(
                step,
                rc,
                output,
                status="failed",
                why="pytest is not installed (carry its wheels: pytest, pluggy, iniconfig)",
            )
        return record(step, rc, output, **judge_tests(workdir / "gpu-tests.xml", rc))

    run_steps(steps, args.jobs, deadline, workdir, finished)

    if "benchmarks" in args.phases and args.benchmarks:
        run_benchmarks(args, env, deadline, workdir, report, record)
    print("\n" + table(report) + (f"\n\nwrote {args.out}" if args.out else ""))
    write(args.out, report)
    return 0 if all(s["status"] == "ok" for s in report["steps"]) else 1


def run_benchmarks(args, env, deadline, workdir, report, record) -> None:
    """The model saved once, then each benchmark against TRL on it, one at a time."""
    started = time.monotonic()
    tokenizer = find_tokenizer(args.tokenizer) if not args.quick else None
    shape = (
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 192,
        }
        if args.quick
        else dict(SHAPE)
    )
    model_dir = workdir / "model"
    try:
        config = save_model(model_dir, shape, tokenizer, max_positions=512 if args.quick else 2048)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - recorded as the benchmarks' failure, the report kept
        report["steps"].append(
            {
                "name": "benchmark/model",
                "status": "failed",
                "seconds": time.monotonic() - started,
                "rc": None,
                "why": f"{type(err).__name__}: {err}",
            }
        )
        write(args.out, report)
        return
    report["model"] = {
        **config,
        "tokenizer": tokenizer or "the shipped tiny tokenizer",
        "folder": str(model_dir),
        "seconds": time.monotonic() - started,
    }
    write(args.out, report)
    peak = (report["environment"].get("gemm_peak_tflops") or 0) * 1e12 or None
    for name in args.benchmarks:
        full, quick, box, quick_box = BENCHMARKS[name]
        out = workdir / f"bench-{name}.json"
        script = f"benchmarks/{name.partition('-')[0]}.py"
        command = [
            sys.executable,
            script,
            "--device",
            args.device,
            "--precision",
            "bf16-mixed",
            "--model",
            str(model_dir),
            "--trials",
            "1",
            "--threads",
            str(args.threads),
            "--json",
            str(out),
            *(quick if args.quick else full),
        ]

        def done(step, rc, output, name=name, out=out):
            if rc != 0 or not out.is_file():
                why = f"exit {rc}" if rc else f"exit 0 without {out.name}"
                return record(step, rc, output, **({} if rc is None else {"status": "failed", "why": why}))
            result = json.loads(out.read_text())
            report["benchmarks"] += benchmark_rows(name, result, config, peak)
            record(step, rc, output, status="ok")

        run_steps(
            [Step(f"benchmark/{name}", command, quick_box if args.quick else box, env)], 1, deadline, workdir, done
        )


if __name__ == "__main__":
    sys.exit(main())
