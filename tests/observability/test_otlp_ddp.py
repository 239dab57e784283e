"""Under DDP every rank exports as its own service instance, with one run id shared by all ranks."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import sys
    import lightning as L
    sys.path.insert(0, {here!r})
    from _toy import ToyRLModule
    from align.observability import OTelTracingCallback, OTLPLogger

    endpoint = sys.argv[1]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
                        default_root_dir=sys.argv[2],
                        logger=OTLPLogger(endpoint=endpoint, export_interval=60),
                        callbacks=[OTelTracingCallback(endpoint=endpoint, export_interval=60)])
    trainer.fit(ToyRLModule())
""")


def test_each_rank_is_its_own_service_instance(receiver, tmp_path):
    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT.format(here=str(Path(__file__).parent)))
    env = {k: v for k, v in os.environ.items() if k != "ALIGN_RUN_ID"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    subprocess.run(
        [sys.executable, str(script), receiver.endpoint("grpc"), str(tmp_path)],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )

    spans = receiver.spans()
    fits = [s for s in spans if s.name == "fit"]
    assert len(fits) == 2
    run_ids = {s.resource["align.run_id"] for s in spans}
    assert len(run_ids) == 1, run_ids
    run_id = run_ids.pop()
    assert {s.resource["service.instance.id"] for s in fits} == {f"{run_id}-rank0", f"{run_id}-rank1"}
    assert {s.attributes["align.rank"] for s in fits} == {0, 1}
    points = [p for p in receiver.points() if p.metric == "align.train.kl"]
    assert {p.attributes["align.rank"] for p in points} == {0, 1}
    assert {p.attributes["align.run_id"] for p in points} == {run_id}
