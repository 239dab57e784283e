"""The GRPO recipe with rollouts one step ahead as a user runs it: two DDP processes on the CPU, each rank with its
own generator placed by one local Ray, every update within the staleness bound, and a clean exit."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow
pytest.importorskip("ray")


@pytest.mark.timeout(900)
def test_grpo_with_an_asynchronous_source_under_two_process_ddp(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "grpo.py"),
            "--config",
            str(ROOT / "configs/grpo/tiny-async.yaml"),
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "ddp",
            "--data.init_args.batch_size",
            "8",
            "--trainer.max_steps",
            "3",
            "--trainer.limit_val_batches",
            "1",
            "--data.init_args.val_batch_size",
            "4",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out val/reward_mean:" in proc.stdout
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    steps = [r for r in rows if r.get("rollout/staleness")]
    assert [float(r["rollout/staleness"]) for r in steps] == [0.0, 1.0, 1.0]
    assert all(float(r["rollout/engine_kl"]) > 0 for r in steps[1:])
    assert "Traceback" not in proc.stderr
