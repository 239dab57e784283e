"""Who exports (align.observability.identity): the process's rank, the run's id (new, or rank 0's for a launched
worker) and the OTLP resource naming them; under DDP every rank exports as its own service instance, with one run id
shared by all ranks."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from align.observability.identity import (
    RUN_ID_ENV,
    build_resource,
    current_rank,
    default_run_id,
    publish_run_id,
)

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


@pytest.mark.slow
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


@pytest.fixture
def no_launcher(monkeypatch):
    """No rank from Lightning or a launcher; no run id published."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    monkeypatch.delattr(rank_zero_only, "rank", raising=False)
    for key in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "LOCAL_RANK", RUN_ID_ENV):
        monkeypatch.delenv(key, raising=False)
    return rank_zero_only


def test_the_rank_is_lightnings_then_the_launchers_then_zero(no_launcher, monkeypatch):
    assert current_rank() == 0
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert current_rank() == 1
    monkeypatch.setenv("SLURM_PROCID", "5")  # ahead of LOCAL_RANK
    assert current_rank() == 5
    monkeypatch.setenv("RANK", "x")  # not a number: skipped
    assert current_rank() == 5
    monkeypatch.setenv("RANK", "3")
    assert current_rank() == 3
    monkeypatch.setattr(no_launcher, "rank", 2, raising=False)  # once the strategy set it
    assert current_rank() == 2


def test_a_run_id_is_new_on_rank_0_and_rank_0s_in_a_launched_worker(no_launcher, monkeypatch):
    first, second = default_run_id(), default_run_id()
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", first) and first != second
    publish_run_id(first)  # rank 0 publishes its id for the workers it launches
    assert os.environ[RUN_ID_ENV] == first
    assert default_run_id() != first  # rank 0 (no LOCAL_RANK) never takes an id from its environment
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert default_run_id() == first  # a launched worker takes rank 0's
    publish_run_id("other")  # and publishes nothing
    assert os.environ[RUN_ID_ENV] == first


def test_the_resource_names_the_run_and_rank_over_what_the_settings_say(monkeypatch):
    resource = build_resource(
        run_id="r1",
        rank=3,
        service_name=None,
        resource_attributes={"team": "rl", "align.rank": 9, "tags": {"a": 1}},
        algorithm="grpo",
        model_name="tiny-sort",
    ).attributes
    assert resource["service.name"] == "align"  # nothing named it
    assert resource["service.instance.id"] == "r1-rank3" and resource["align.run_id"] == "r1"
    assert resource["align.rank"] == 3  # the run's identity wins over a resource attribute
    assert resource["team"] == "rl" and resource["tags"] == "{'a': 1}"  # values as OTel attributes
    assert resource["align.algorithm"] == "grpo" and resource["align.model"] == "tiny-sort"
    bare = build_resource(
        run_id="r2", rank=0, service_name=None, resource_attributes=None, algorithm=None, model_name=None
    ).attributes
    assert "align.algorithm" not in bare and "align.model" not in bare
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    named = dict(run_id="r3", rank=0, resource_attributes=None, algorithm=None, model_name=None)
    assert build_resource(service_name=None, **named).attributes["service.name"] == "from-env"
    assert build_resource(service_name="mine", **named).attributes["service.name"] == "mine"  # the argument wins
