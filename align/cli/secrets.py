"""Credentials never land in a run folder: the ``config.yaml`` a run writes has the values of secret-looking settings
(OTLP ``headers``, ``token``, ``api_key``, ``password``, ...) replaced by ``<redacted>``; pass them by environment
variable (``OTEL_EXPORTER_OTLP_HEADERS``, ``OPENAI_API_KEY``, ...) to re-run from the saved file."""

from __future__ import annotations

import re

from lightning.pytorch.cli import SaveConfigCallback

__all__ = ["REDACTED", "SECRET_KEY", "RedactingSaveConfigCallback", "redact_secrets"]

# Settings whose values are credentials: never written to the run directory's config.yaml.
SECRET_KEY = re.compile(
    r"^(headers|(hf_|auth_|access_|api_|bearer_)?token|(\w+_)?secret|password|passwd|(\w+_)?api_?key|"
    r"authorization|credentials?)$",
    re.IGNORECASE,
)
REDACTED = "<redacted>"


def redact_secrets(value):
    """A copy of a parsed config with the values of secret-looking keys (OTLP ``headers``, ``token``,
    ``api_key``, ``password``...) replaced by ``<redacted>``."""
    from jsonargparse import Namespace

    def walk(v, key: str = ""):
        if SECRET_KEY.search(key) and v is not None and not isinstance(v, (bool, int, float)):
            return {k: REDACTED for k in v} if isinstance(v, dict) else REDACTED
        if isinstance(v, Namespace):
            out = Namespace()
            for k, item in vars(v).items():
                setattr(out, k, walk(item, k))
            return out
        if isinstance(v, dict):
            return {k: walk(item, str(k)) for k, item in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(walk(item) for item in v)
        return v

    return walk(value)


class RedactingSaveConfigCallback(SaveConfigCallback):
    """Lightning's config.yaml writer, with credentials redacted (pass them by environment variable, e.g.
    ``OTEL_EXPORTER_OTLP_HEADERS``, to re-run from the saved file)."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved:
            self.config = redact_secrets(self.config)
        super().setup(trainer, pl_module, stage)
