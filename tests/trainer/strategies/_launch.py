"""Run ``_worker.py`` as a 2-process CPU job with ``torchrun`` (gloo) and read what each rank wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def launch(strategy: str, out: Path, timeout: float = 600) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(HERE / "_worker.py"),
        strategy,
        str(out),
    ]
    log = out / "job.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=out)
    if proc.returncode != 0:
        tail = log.read_text()[-6000:]
        raise AssertionError(f"{strategy}: the 2-process job failed (exit {proc.returncode}); end of {log}:\n{tail}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
