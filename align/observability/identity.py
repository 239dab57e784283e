"""Who exports: the run's id (shared by every rank of a run), the process's rank, and the OTLP resource naming
them (``service.instance.id``, ``align.run_id``, ``align.rank``, the algorithm and the model).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.resources import Resource

RUN_ID_ENV = "ALIGN_RUN_ID"


def current_rank() -> int:
    """The global rank: Lightning's once the strategy set it, else the launcher's environment, else 0."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", None)
    if rank is not None:
        return int(rank)
    for key in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "LOCAL_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def default_run_id() -> str:
    """``ALIGN_RUN_ID`` when set, else a new ``YYYYmmdd-HHMMSS-xxxxxx``.

    Under Lightning's DDP launcher the worker processes are started from rank 0's environment after the logger is
    built, so rank 0 publishes its id in ``ALIGN_RUN_ID`` for them; the tracing callback also broadcasts it.
    """
    env = os.environ.get(RUN_ID_ENV)
    if env and os.environ.get("LOCAL_RANK", "0") != "0":
        return env  # a launched worker: take rank 0's
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def publish_run_id(run_id: str) -> None:
    if os.environ.get("LOCAL_RANK", "0") == "0":
        os.environ[RUN_ID_ENV] = run_id


def build_resource(
    *,
    run_id: str,
    rank: int,
    service_name: str | None,
    resource_attributes: Mapping[str, Any] | None,
    algorithm: str | None,
    model_name: str | None,
) -> Resource:
    """``service.name`` ``align`` < ``OTEL_RESOURCE_ATTRIBUTES``/``OTEL_SERVICE_NAME`` (read by the SDK) < arguments
    < the run's identity."""
    from align.observability.attributes import attribute_value

    attrs: dict[str, Any] = {k: attribute_value(v) for k, v in (resource_attributes or {}).items()}
    if service_name:
        attrs["service.name"] = service_name
    attrs.update({"service.instance.id": f"{run_id}-rank{rank}", "align.run_id": run_id, "align.rank": rank})
    if algorithm:
        attrs["align.algorithm"] = algorithm
    if model_name:
        attrs["align.model"] = model_name
    resource = Resource.create(attrs)
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "align"}))
    return resource
