"""Pure helpers shared by the OTLP logger and the tracing callback: metric names, attribute values, redaction.

Nothing here imports opentelemetry, so these are cheap to import and to test.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "[REDACTED]"

# Whole words (after splitting on separators and camelCase) that mark a key as holding a secret. Plurals such as
# ``tokens`` in ``max_new_tokens`` are deliberately not matched: they count things, they are not credentials.
SECRET_WORDS = frozenset(
    {
        "token",
        "key",
        "apikey",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "authorization",
        "auth",
        "secret",
        "api",
        "credential",
        "credentials",
        "bearer",
        "cookie",
        "signature",
        "private",
    }
)
# Values that are secrets whatever their key is called (bearer/basic auth, hub and common provider tokens).
_SECRET_VALUE = re.compile(r"^(bearer|basic)\s+\S+|^(hf|sk|ghp|gho|glpat|xox[abp])[-_][A-Za-z0-9_-]{16,}", re.I)
_WORD_SPLIT = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])")
_INVALID_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")
MAX_VALUE_CHARS = 512
MAX_ATTRIBUTES = 256


@functools.lru_cache(maxsize=4096)  # called for every logged value: the regex runs once per name
def metric_name(name: str, prefix: str = "align") -> str:
    """The OTLP instrument name of a Lightning metric: ``train/kl`` -> ``align.train.kl``.

    ``/`` becomes ``.``; any character outside ``[A-Za-z0-9_.-]`` becomes ``_``; the prefix (if any) is joined with
    ``.``. A name that would not start with a letter gets an ``m_`` in front (OTel instrument names must).
    """
    body = _INVALID_NAME_CHARS.sub("_", name.strip().replace("/", "."))
    full = f"{prefix}.{body}" if prefix else body
    if not full[:1].isalpha():
        full = f"m_{full}"
    return full[:255]


def is_secret_key(key: str) -> bool:
    """True when any word of any component of a (dotted) key is a secret word, e.g. ``hf_token``, ``apiKey``."""
    words = (w.lower() for w in _WORD_SPLIT.split(str(key)) if w)
    return any(w in SECRET_WORDS for w in words)


def looks_secret(value: Any) -> bool:
    """True for string values that are credentials whatever their key (``Bearer ...``, ``hf_...``, ``sk-...``)."""
    return isinstance(value, str) and bool(_SECRET_VALUE.match(value.strip()))


def attribute_value(value: Any) -> str | bool | int | float | list:
    """An OTel-compatible attribute value: primitives pass, homogeneous primitive lists pass, the rest is ``str``."""
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value[:MAX_VALUE_CHARS]
    if isinstance(value, (list, tuple)) and value and len(value) <= 64:
        kinds = {type(v) for v in value}
        if len(kinds) == 1 and kinds <= {bool, int, float, str}:
            return [v[:MAX_VALUE_CHARS] if isinstance(v, str) else v for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # 0-d tensors and numpy scalars
        return attribute_value(value.item())
    return str(value)[:MAX_VALUE_CHARS]


def flatten(params: Mapping[str, Any] | None, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Nested mappings (and ``class_path``/``init_args`` configs, namespaces, dataclasses) to one flat dict."""
    out: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if hasattr(node, "__dataclass_fields__") and not isinstance(node, type):
            node = {f: getattr(node, f) for f in node.__dataclass_fields__}
        elif hasattr(node, "__dict__") and type(node).__name__ in ("Namespace", "AttributeDict"):
            node = vars(node)
        if isinstance(node, Mapping) and node:
            for key, value in node.items():
                walk(value, f"{path}{sep}{key}" if path else str(key))
        else:
            out[path or "value"] = node

    if params:
        walk(params, prefix)
    return out


def redact(params: Mapping[str, Any]) -> dict[str, Any]:
    """Replace the value of every secret-looking key (or secret-looking value) with ``[REDACTED]``."""
    return {k: (REDACTED if is_secret_key(k) or looks_secret(v) else v) for k, v in params.items()}


def hparam_attributes(params: Mapping[str, Any] | None, prefix: str = "hparam") -> dict[str, Any]:
    """Hyperparameters as span/metric attributes: flattened, redacted, OTel-typed, at most ``MAX_ATTRIBUTES``."""
    flat = redact({k: v for k, v in flatten(params).items() if not k.startswith("_")})
    items = sorted(flat.items())[:MAX_ATTRIBUTES]
    return {f"{prefix}.{k}" if prefix else k: attribute_value(v) for k, v in items if v is not None}


def algorithm_of(module: Any) -> str | None:
    """``SFTModule`` -> ``sft``, ``GRPOModule`` -> ``grpo``; None when there is no module."""
    if module is None:
        return None
    name = type(module).__name__
    return (name[: -len("Module")] if name.endswith("Module") and len(name) > 6 else name).lower()


def model_name_of(module: Any) -> str | None:
    """The policy's model id or path (``PolicyModel.spec["model"]``) when the module has one."""
    spec = getattr(getattr(module, "policy", None), "spec", None)
    if isinstance(spec, Mapping) and spec.get("model") is not None:
        return str(spec["model"])
    return None


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(name, p) for p in patterns)


def batch_attributes(batch: Any) -> dict[str, Any]:
    """Batch size and token counts without a device sync: ``num_tokens`` when the batch carries it, else the
    attention mask's sum only for CPU tensors, else the padded size."""
    out: dict[str, Any] = {}
    if isinstance(batch, (list, tuple)) and batch and hasattr(batch[0], "shape") and len(batch[0].shape) >= 1:
        return {"align.batch.size": int(batch[0].shape[0])}
    get = (lambda k: batch.get(k)) if isinstance(batch, dict) else (lambda k: getattr(batch, k, None))
    input_ids = get("input_ids")
    if input_ids is not None and hasattr(input_ids, "shape") and len(input_ids.shape) >= 1:
        out["align.batch.size"] = int(input_ids.shape[0])
        out["align.batch.padded_tokens"] = int(input_ids.numel())
    prompt_ids = get("prompt_ids")
    if isinstance(prompt_ids, list):  # RL prompt batches: unpadded id lists
        out["align.batch.size"] = len(prompt_ids)
        out["align.batch.prompt_tokens"] = sum(len(p) for p in prompt_ids)
    if (
        "align.batch.size" not in out
        and hasattr(batch, "__len__")
        and not isinstance(batch, (dict, str))
        and not hasattr(batch, "shape")
    ):
        out["align.batch.size"] = len(batch)
    num_tokens = get("num_tokens")
    if isinstance(num_tokens, int):
        out["align.batch.tokens"] = num_tokens
    else:
        mask = get("attention_mask")
        if mask is not None and getattr(getattr(mask, "device", None), "type", None) == "cpu":
            out["align.batch.tokens"] = int(mask.sum())
    return out
