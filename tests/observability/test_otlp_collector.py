"""End to end against a real OTLP collector: rotel (a Rust collector shipped in the ``rotel`` wheel, dev extra).

A recipe runs a few steps through the CLI with ``--trainer.logger+=align.observability.OTLPLogger`` and
``--trainer.callbacks+=align.observability.OTelTracingCallback``; the collector's debug output must show the metric
names and values (equal to the CSV's) and the fit -> epoch -> step span tree (with GRPO's generation, scoring and
update sections under each step), over gRPC and over HTTP/protobuf.

``RUNS`` holds what is algorithm-specific (recipe classes, tiny overrides, the metrics to expect); ``CASES`` picks
the (algorithm, protocol) pairs: SFT over both transports, GRPO (rollouts, rewards, KL) over gRPC.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@dataclass
class Run:
    module: str  # import path of the LightningModule class
    datamodule: str
    args: list[str]
    metrics: list[str]  # Lightning metric names the run must export
    step_metric: str  # a metric copied onto step spans
    steps: int = 3
    sections: tuple[str, ...] = ()  # the module's Timer spans under each step span


RUNS = {
    "sft": Run(
        "align.modules.sft.SFTModule",
        "align.data.sft.SFTDataModule",
        ["--data.init_args.batch_size", "8", "--trainer.max_steps", "3"],
        metrics=["train/loss", "train/tokens_per_s"],
        step_metric="train/loss",
    ),
    "grpo": Run(
        "align.modules.grpo.GRPOModule",
        "align.data.prompts.PromptDataModule",
        [
            "--data.init_args.batch_size",
            "2",
            "--model.init_args.group_size",
            "2",
            "--model.init_args.sampling.max_new_tokens",
            "8",
            "--trainer.max_steps",
            "2",
        ],
        metrics=["train/loss", "train/kl", "rollout/reward_mean"],
        step_metric="rollout/reward_mean",
        steps=2,
        sections=("generation", "scoring", "update"),
    ),
}
CASES = [("sft", "grpc"), ("sft", "http/protobuf"), ("grpo", "grpc")]


def rotel_binary() -> str | None:
    found = shutil.which("rotel-agent")
    if found:
        return found
    try:
        import rotel
    except ImportError:
        return None
    path = Path(rotel.__file__).parent / "rotel-agent"
    return str(path) if path.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


@pytest.fixture
def collector(tmp_path):
    binary = rotel_binary()
    if binary is None:
        pytest.skip("the rotel collector is not installed (pip install -e '.[dev]' installs it)")
    grpc_port, http_port = free_port(), free_port()
    out = open(tmp_path / "collector.log", "w")
    cmd = [
        binary,
        "start",
        "--otlp-grpc-endpoint",
        f"127.0.0.1:{grpc_port}",
        "--otlp-http-endpoint",
        f"127.0.0.1:{http_port}",
        "--exporter",
        "blackhole",
        "--debug-log",
        "traces",
        "--debug-log",
        "metrics",
        "--debug-log-verbosity",
        "detailed",
        "--pid-file",
        str(tmp_path / "rotel.pid"),
        "--log-file",
        str(tmp_path / "rotel-agent.log"),
    ]
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    except OSError as err:  # wrong architecture or libc: the wheel's binary cannot run here
        pytest.skip(f"the rotel-agent binary cannot run on this platform: {err}")
    if not (wait_listening(grpc_port, proc) and wait_listening(http_port, proc)):
        proc.kill()
        text = (tmp_path / "collector.log").read_text()[-2000:]
        if proc.returncode not in (None, 0) and ("exec format" in text.lower() or "GLIBC" in text):
            pytest.skip(f"the rotel-agent binary cannot run on this platform: {text}")
        pytest.fail(f"rotel did not start listening: {text}")
    collector = Collector(proc, tmp_path / "collector.log", grpc_port, http_port)
    yield collector
    collector.stop()
    out.close()


class Collector:
    def __init__(self, proc, log_path: Path, grpc_port: int, http_port: int):
        self.proc, self.log_path, self.grpc_port, self.http_port = proc, log_path, grpc_port, http_port

    def endpoint(self, protocol: str) -> str:
        return f"127.0.0.1:{self.grpc_port}" if protocol == "grpc" else f"http://127.0.0.1:{self.http_port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def output(self) -> str:
        return self.log_path.read_text()


@dataclass
class Debug:
    """The parts of rotel's detailed debug output that the assertions need."""

    gauges: dict[str, list[tuple[float, dict]]] = field(default_factory=dict)  # metric name -> (value, resource)
    spans: list[dict] = field(default_factory=list)  # name, id, parent, trace, resource, attributes


_ATTR = re.compile(r"^\s*-> ([^:]+): (\w+)\((.*)\)\s*$")


def parse_debug(text: str) -> Debug:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    debug = Debug()
    resource: dict = {}
    section = None
    metric = None
    span: dict | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("ResourceMetrics #", "ResourceSpans #")):
            resource, section, metric, span = {}, "resource", None, None
        elif stripped == "Resource attributes:":
            section = "resource"
        elif stripped.startswith(("ScopeMetrics #", "ScopeSpans #")):
            section = None
        elif stripped.startswith("-> Name:"):
            metric = stripped.split(":", 1)[1].strip()
            section = "metric"
        elif stripped.startswith("Value:") and metric is not None:
            debug.gauges.setdefault(metric, []).append((float(stripped.split(":", 1)[1]), dict(resource)))
        elif stripped.startswith("Span #"):
            span = {"resource": dict(resource), "attributes": {}}
            debug.spans.append(span)
            section = "span"
        elif span is not None and section == "span" and re.match(r"^(Trace ID|Parent ID|ID|Name)\s+:", stripped):
            key, _, value = stripped.partition(":")
            span[key.strip().lower().replace(" ", "_")] = value.strip()
        elif stripped == "Attributes:" and span is not None:
            section = "span_attributes"
        elif (m := _ATTR.match(line)) and section in ("resource", "span_attributes"):
            key, kind, value = m.groups()
            target = resource if section == "resource" else span["attributes"]
            target[key] = value
    return debug


def csv_metrics(root: Path) -> list[dict]:
    files = list(root.rglob("metrics.csv"))
    assert len(files) == 1, files
    return list(csv.DictReader(open(files[0])))


def run_recipe_with_otlp(algorithm: str, protocol: str, endpoint: str, root: Path, run_id: str) -> None:
    """The documented CLI forms, in a fresh interpreter as a user would run them."""
    spec = RUNS[algorithm]
    code = (
        "import sys; from align.cli.recipes import run_recipe; from importlib import import_module\n"
        "def load(p):\n    m, _, c = p.rpartition('.'); return getattr(import_module(m), c)\n"
        f"run_recipe({algorithm!r}, load({spec.module!r}), load({spec.datamodule!r}), args=sys.argv[1:])\n"
    )
    args = [
        "--trainer.logger+=align.observability.OTLPLogger",
        f"--trainer.logger.endpoint={endpoint}",
        f"--trainer.logger.protocol={protocol}",
        f"--trainer.logger.run_id={run_id}",
        "--trainer.logger.export_interval=60",
        "--trainer.callbacks+=align.observability.OTelTracingCallback",
        f"--trainer.callbacks.endpoint={endpoint}",
        f"--trainer.callbacks.protocol={protocol}",
        "--trainer.default_root_dir",
        str(root),
        "--trainer.log_every_n_steps",
        "1",
        "--eval_before_after",
        "false",
        *spec.args,
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([os.sys.executable, "-c", code, *args], check=True, cwd=root, env=env, timeout=600)


@pytest.mark.parametrize("algorithm, protocol", CASES)
def test_recipe_exports_metrics_and_traces_to_a_real_collector(collector, tmp_path, protocol, algorithm):
    spec = RUNS[algorithm]
    run_id = f"it-{algorithm}-{protocol.split('/')[0]}"
    root = tmp_path / "run"
    root.mkdir()
    run_recipe_with_otlp(algorithm, protocol, collector.endpoint(protocol), root, run_id)

    rows = csv_metrics(root)  # the CSV logger stays alongside the OTLP logger
    deadline = time.monotonic() + 10
    while True:  # the collector prints asynchronously
        debug = parse_debug(collector.output())
        if (
            {"fit", "step"} <= {s.get("name") for s in debug.spans}
            and all(f"align.{m}".replace("/", ".") in debug.gauges for m in spec.metrics)
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)

    for name in spec.metrics:
        exported = debug.gauges.get(f"align.{name}".replace("/", "."))
        assert exported, f"{name} did not reach the collector over {protocol}"
        last_csv = [float(r[name]) for r in rows if r.get(name)][-1]
        assert exported[-1][0] == pytest.approx(last_csv, rel=1e-6)
        resource = exported[-1][1]
        assert resource["align.run_id"] == run_id and resource["align.algorithm"] == algorithm
        assert resource["service.instance.id"] == f"{run_id}-rank0"
    assert "align.step" in debug.gauges and "align.run.info" in debug.gauges

    spans = [s for s in debug.spans if s["resource"].get("align.run_id") == run_id]
    by_id = {s["id"]: s for s in spans}
    names = [s["name"] for s in spans]
    assert names.count("fit") == 1 and names.count("epoch") >= 1 and names.count("step") == spec.steps, names
    for step in (s for s in spans if s["name"] == "step"):
        epoch = by_id[step["parent_id"]]
        assert epoch["name"] == "epoch" and by_id[epoch["parent_id"]]["name"] == "fit"
        assert metric_attr(spec.step_metric) in step["attributes"]
        assert "align.batch.size" in step["attributes"]
        assert sorted(s["name"] for s in spans if s.get("parent_id") == step["id"]) == sorted(spec.sections)
    if list(root.rglob("*.ckpt")):  # ModelCheckpoint saved (SFT's config does; GRPO's saves after validation only)
        assert "checkpoint_save" in names


def metric_attr(name: str) -> str:
    return f"align.{name}".replace("/", ".")
