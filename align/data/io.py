"""Reading dataset files: jsonl, json, parquet and csv through ``datasets``, the bundled task, or the hub.

JSON lines are read line by line first so that a malformed line, a non-object line or invalid UTF-8 fails
with the file and line number; the other formats are read with ``datasets`` and rows are numbered from 1.
A bundled file is named ``align:<task>/<kind>/<split>.jsonl`` (for example ``align:sort/sft/train.jsonl``); a hub
dataset with several configs is named ``org/name:config`` (for example ``openai/gsm8k:main``).
"""

from __future__ import annotations

import json
from pathlib import Path

from align.errors import AlignDataError

BUNDLED_PREFIX = "align:"
ASSETS = Path(__file__).parent / "assets"
_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def resolve(source: str) -> str:
    """Map ``align:...`` to the bundled file's path; leave other names as they are."""
    if source.startswith(BUNDLED_PREFIX):
        path = ASSETS / source[len(BUNDLED_PREFIX):]
        if not path.exists():
            available = sorted(str(p.relative_to(ASSETS)) for p in ASSETS.rglob("*.jsonl"))
            raise AlignDataError(source, None, None, f"one of the bundled files {available}")
        return str(path)
    return source


def read_rows(source: str, split: str = "train") -> list[dict]:
    """Rows of a local file (by extension) or a hub dataset (name plus ``split``) as dicts."""
    path_str = resolve(source)
    path = Path(path_str).expanduser()
    suffix = path.suffix.lower()
    if path.exists():
        if path.is_dir():
            raise AlignDataError(source, None, None, "a .jsonl, .json, .parquet or .csv file, not a directory")
        if suffix not in _EXTENSIONS:
            raise AlignDataError(source, None, None, f"a file ending in one of {sorted(_EXTENSIONS)}")
        rows = _read_jsonl(path, source) if suffix == ".jsonl" else _read_with_datasets(path, source, _EXTENSIONS[suffix])
    elif suffix in _EXTENSIONS or path_str.startswith((".", "/", "~")):
        raise AlignDataError(source, None, None, "an existing file (no such file)")
    else:
        rows = _read_hub(path_str, split)
    if not rows:
        raise AlignDataError(source, None, None, "at least one row (the dataset is empty)")
    return rows


def _read_jsonl(path: Path, source: str) -> list[dict]:
    rows = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise AlignDataError(source, lineno, None, "UTF-8 text", f"invalid byte at column {err.start + 1}") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise AlignDataError(source, lineno, None, f"one JSON object per line ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise AlignDataError(source, lineno, None, "a JSON object", row)
            rows.append(row)
    return rows


def _read_with_datasets(path: Path, source: str, builder: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # noqa: BLE001 - the loaders raise many types; all mean the file is unreadable
        raise AlignDataError(source, None, None, f"a readable {builder} file ({type(err).__name__}: {err})") from None
    return ds.to_list()


def _read_hub(name: str, split: str) -> list[dict]:
    """A hub dataset ``org/name``, or ``org/name:config`` for one with several configs (``openai/gsm8k:main``)."""
    import datasets

    repo, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(repo, config or None, split=split)
    except Exception as err:  # noqa: BLE001
        raise AlignDataError(
            name, None, None, f"a local file or a reachable hub dataset with split '{split}' ({type(err).__name__}: {err})"
        ) from None
    return ds.to_list()
