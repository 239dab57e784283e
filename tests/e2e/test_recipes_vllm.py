"""The GRPO recipe on the vLLM engine as a user runs it: two DDP processes on the CPU, each with its own engine over
the ranks' process group, the engine-mismatch metrics in the run's CSV, and a clean exit."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow
pytest.importorskip("vllm", exc_type=ImportError)


@pytest.mark.timeout(1200)
def test_grpo_on_the_vllm_engine_under_two_process_ddp(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "grpo.py"),
            "--model.init_args.sampling.engine",
            "vllm",
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "ddp",
            "--trainer.accelerator",
            "cpu",
            "--trainer.max_steps",
            "3",
            "--trainer.limit_val_batches",
            "1",
            "--data.init_args.val_batch_size",
            "4",
            "--trainer.default_root_dir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=1100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out val/reward_mean:" in proc.stdout
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    steps = [r for r in rows if r.get("rollout/engine_kl")]
    assert len(steps) == 3 and all(float(r["rollout/engine_kl"]) < 1e-5 for r in steps)
    assert all(float(r["rollout/correction_clipped_frac"]) == 0 for r in steps)
    assert "Traceback" not in proc.stderr  # the engines shut down before the process group is released
