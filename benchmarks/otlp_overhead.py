"""Step-time overhead of OTLP export: ``OTLPLogger`` + ``OTelTracingCallback`` (+ the CSV logger) against the CSV
logger alone, on a tiny run. Target: at most 2% on the median step time.

Usage::

    python benchmarks/otlp_overhead.py                       # SFT on the tiny model, rotel collector, 5+5 trials
    python benchmarks/otlp_overhead.py --trials 7 --steps 60 --json otlp-overhead.json
    python benchmarks/otlp_overhead.py --collector down      # the collector's port is closed: the failure path
    python benchmarks/otlp_overhead.py --config configs/grpo/tiny.yaml --steps 10 --warmup 2 \\
        --override=--data.init_args.batch_size=4 --override=--model.init_args.group_size=4

What happens:

1. If ``--collector rotel`` (default), a rotel collector (the ``rotel`` wheel of the dev extra) listens on free
   localhost ports and discards what it receives (``--exporter blackhole``). ``--collector down`` points the exporters
   at a closed port instead.
2. Trials run in fresh subprocesses, alternating ``csv, otlp, csv, otlp, ...`` (``--trials`` each), so load drifts
   on a shared machine hit both arms alike. Each trial builds the module and data module from class paths (any
   ``AlignModule``: SFT by default, GRPO/PPO by ``--module`` or ``--config``), trains ``--warmup + --steps`` steps, and
   times the interval between consecutive ``on_train_batch_start`` hooks of a callback placed first: forward, backward,
   optimizer, every other callback and every logger call of the step are inside it. Warmup steps are excluded.
3. ``csv`` trials have Lightning's CSVLogger (what every align run has). ``otlp`` trials add ``OTLPLogger`` and
   ``OTelTracingCallback`` with their defaults except the endpoint, and log every step (``--log-every 1`` is the worst
   case; align's configs log every 10 steps).
4. Reported: per arm, the median over trials of each trial's median step time, and the overhead in percent; the
   pooled medians over all timed steps as a cross-check; the same for CPU time per step, of the whole trainer
   process (training thread plus the export threads) and of the training thread alone. CPU time is what to read on
   a loaded shared machine: other processes stretch wall time but not this process's CPU time. Finally the time the
   training thread spends inside the OTLP logger's and callback's own methods (wrapped with a timer), per step and
   as a share of the CSV-only step: the direct cost, immune to run-to-run noise. The machine load is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness as h


def _load(path: str):
    from importlib import import_module

    module, _, name = path.rpartition(".")
    return getattr(import_module(module), name)


# ---------------------------------------------------------------------------------------------------------------
# one trial (child process)


def run_trial(spec: dict, arm: str) -> dict:
    h.set_threads(spec["threads"])
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    L.seed_everything(0, verbose=False)
    root = tempfile.mkdtemp(prefix=f"{arm}-", dir=spec["workdir"])
    # Wall time, CPU time of the whole process (training and export threads) and of the training thread.
    meter = h.StepMeter(spec["warmup"])
    hook_time = [0.0]  # seconds the training thread spent inside the OTLP logger's and callback's methods
    loggers = [CSVLogger(save_dir=root, name="")]
    callbacks = [h.lightning_meter(meter, interval="start_to_start")]
    if arm == "otlp":
        from align.observability import OTelTracingCallback, OTLPLogger

        logger = OTLPLogger(endpoint=spec["endpoint"], protocol=spec["protocol"])
        tracer = OTelTracingCallback(endpoint=spec["endpoint"], protocol=spec["protocol"])
        for obj, names in (
            (logger, ("log_metrics", "log_hyperparams")),
            (
                tracer,
                (
                    "on_train_batch_start",
                    "on_train_batch_end",
                    "on_train_epoch_start",
                    "on_train_epoch_end",
                    "open_span",
                ),
            ),
        ):
            for name in names:
                if hasattr(obj, name):
                    setattr(obj, name, _timed(getattr(obj, name), hook_time, meter))
        loggers.append(logger)
        callbacks.append(tracer)
    if spec["config"]:  # a recipe YAML (e.g. configs/grpo/tiny.yaml) and dotted overrides, as the CLI reads them
        from align.cli.lightning_cli import AlignCLI

        cli = AlignCLI(args=["--config", spec["config"], *spec["overrides"], "--trainer.logger", "false"], run=False)
        module, data = cli.model, cli.datamodule
    else:
        module = _load(spec["module"])(**spec["module_args"])
        data = _load(spec["datamodule"])(**spec["data_args"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=spec["warmup"] + spec["steps"],
        logger=loggers,
        callbacks=callbacks,
        log_every_n_steps=spec["log_every"],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
    )
    trainer.fit(module, data)
    out = {
        "arm": arm,
        "step_times": meter.step_seconds,
        "median": statistics.median(meter.step_seconds),
        "median_process_cpu": statistics.median(meter.step_cpu_seconds),
        "median_thread_cpu": statistics.median(meter.step_thread_cpu_seconds),
        "hook_s_per_step": hook_time[0] / max(len(meter.step_seconds), 1),
    }
    if arm == "otlp":
        out["dropped"] = {"metrics": loggers[1].dropped, "spans": callbacks[1].dropped}
    return out


def _timed(fn, acc: list, meter: h.StepMeter):
    """``fn``, adding its seconds to ``acc[0]`` in timed steps."""

    def wrapper(*args, **kwargs):
        if not meter.timing:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - start

    return wrapper


CHILDREN = {"csv": lambda spec: run_trial(spec, "csv"), "otlp": lambda spec: run_trial(spec, "otlp")}

# ---------------------------------------------------------------------------------------------------------------
# the parent: collector, alternating trials, report


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rotel(tmp: Path):
    binary = shutil.which("rotel-agent")
    if binary is None:
        try:
            import rotel

            binary = str(Path(rotel.__file__).parent / "rotel-agent")
        except ImportError:
            sys.exit("the rotel collector is not installed: pip install -e '.[dev]' (or run with --collector down)")
    grpc_port, http_port = free_port(), free_port()
    proc = subprocess.Popen(
        [
            binary,
            "start",
            "--otlp-grpc-endpoint",
            f"127.0.0.1:{grpc_port}",
            "--otlp-http-endpoint",
            f"127.0.0.1:{http_port}",
            "--exporter",
            "blackhole",
            "--pid-file",
            str(tmp / "rotel.pid"),
            "--log-file",
            str(tmp / "rotel.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", grpc_port), timeout=0.2):
                return proc, grpc_port, http_port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("rotel did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", default="align.modules.sft.SFTModule", help="LightningModule class path")
    parser.add_argument("--module-args", default="{}", help="JSON init args of the module")
    parser.add_argument("--datamodule", default="align.data.sft.SFTDataModule", help="LightningDataModule class path")
    parser.add_argument("--data-args", default='{"batch_size": 8, "max_length": 64}', help="JSON init args")
    parser.add_argument("--config", default=None, help="build module and data from this recipe YAML instead")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="a CLI override for --config, e.g. --override=--model.init_args.group_size=4 (repeatable)",
    )
    parser.add_argument("--trials", type=int, default=5, help="trials per arm (alternating)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per trial")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--log-every", type=int, default=1, help="Trainer log_every_n_steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per trial")
    parser.add_argument("--protocol", default="grpc", choices=["grpc", "http/protobuf"])
    parser.add_argument("--collector", default="rotel", choices=["rotel", "down"])
    parser.add_argument("--json", default=None, help="write the results here")
    h.add_child_args(parser, CHILDREN)
    args = parser.parse_args()
    if h.run_if_child(args, CHILDREN):
        return

    if args.config:
        args.config = str(Path(args.config).resolve())  # trials run in a temporary directory
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the collector when terminated
    tmp = Path(tempfile.mkdtemp(prefix="otlp-bench-"))
    proc = None
    if args.collector == "rotel":
        proc, grpc_port, http_port = start_rotel(tmp)
        endpoint = f"127.0.0.1:{grpc_port}" if args.protocol == "grpc" else f"http://127.0.0.1:{http_port}"
    else:
        endpoint = f"127.0.0.1:{free_port()}" if args.protocol == "grpc" else f"http://127.0.0.1:{free_port()}"
    load_before = os.getloadavg()
    spec = {
        "config": args.config,
        "overrides": args.override,
        "module": args.module,
        "module_args": json.loads(args.module_args),
        "datamodule": args.datamodule,
        "data_args": json.loads(args.data_args),
        "steps": args.steps,
        "warmup": args.warmup,
        "log_every": args.log_every,
        "threads": args.threads,
        "endpoint": endpoint,
        "protocol": args.protocol,
        "workdir": str(tmp),
    }

    def report(trial: int, arm: str, result: dict) -> None:
        extra = (
            f"  in OTLP code {result['hook_s_per_step'] * 1e6:6.0f} us/step  dropped {result['dropped']}"
            if "dropped" in result
            else ""
        )
        print(
            f"trial {trial - 1} {arm:4s}: median step {result['median'] * 1e3:8.2f} ms  process CPU "
            f"{result['median_process_cpu'] * 1e3:8.2f} ms  training-thread CPU "
            f"{result['median_thread_cpu'] * 1e3:8.2f} ms{extra}",
            flush=True,
        )

    try:
        results = h.Trials(__file__, spec, tmp, threads=args.threads, cwd=tmp).alternate(
            ("csv", "otlp"), args.trials, report
        )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()

    med = {arm: statistics.median(r["median"] for r in rs) for arm, rs in results.items()}
    cpu = {arm: statistics.median(r["median_process_cpu"] for r in rs) for arm, rs in results.items()}
    tcpu = {arm: statistics.median(r["median_thread_cpu"] for r in rs) for arm, rs in results.items()}
    hook = statistics.median(r["hook_s_per_step"] for r in results["otlp"])
    hook_pct = hook / med["csv"] * 100
    cpu_overhead = (cpu["otlp"] / cpu["csv"] - 1) * 100
    tcpu_overhead = (tcpu["otlp"] / tcpu["csv"] - 1) * 100
    pooled = {arm: statistics.median(t for r in rs for t in r["step_times"]) for arm, rs in results.items()}
    overhead = (med["otlp"] / med["csv"] - 1) * 100
    pooled_overhead = (pooled["otlp"] / pooled["csv"] - 1) * 100
    print(
        f"\n{args.config or args.module}, {args.trials} trials x {args.steps} timed steps per arm, log every "
        f"{args.log_every} step(s), {args.protocol} to {'rotel' if proc else 'a closed port'}"
    )
    print(
        f"median step time  csv: {med['csv'] * 1e3:.2f} ms   csv+otlp: {med['otlp'] * 1e3:.2f} ms   "
        f"overhead: {overhead:+.2f}%  (target <= 2%)"
    )
    print(
        f"pooled medians    csv: {pooled['csv'] * 1e3:.2f} ms   csv+otlp: {pooled['otlp'] * 1e3:.2f} ms   "
        f"overhead: {pooled_overhead:+.2f}%"
    )
    print(
        f"process CPU/step  csv: {cpu['csv'] * 1e3:.2f} ms   csv+otlp: {cpu['otlp'] * 1e3:.2f} ms   "
        f"overhead: {cpu_overhead:+.2f}%  (all threads of the trainer: training and export)"
    )
    print(
        f"thread CPU/step   csv: {tcpu['csv'] * 1e3:.2f} ms   csv+otlp: {tcpu['otlp'] * 1e3:.2f} ms   "
        f"overhead: {tcpu_overhead:+.2f}%  (the training thread only)"
    )
    print(
        f"in the OTLP logger's and callback's code on the training thread: {hook * 1e6:.0f} us/step = "
        f"{hook_pct:.2f}% of the CSV-only median step (export itself runs on background threads)"
    )
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (on {os.cpu_count()} cores)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "median_step_s": med,
                    "overhead_pct": overhead,
                    "pooled_median_step_s": pooled,
                    "pooled_overhead_pct": pooled_overhead,
                    "otlp_code_s_per_step": hook,
                    "otlp_code_pct": hook_pct,
                    "median_process_cpu_s": cpu,
                    "process_cpu_overhead_pct": cpu_overhead,
                    "median_thread_cpu_s": tcpu,
                    "thread_cpu_overhead_pct": tcpu_overhead,
                    "load_before": load_before,
                    "load_after": load_after,
                    "trials": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
