"""Reading datasets: local files, ``save_to_disk`` folders, the bundled tasks and the hub (docs/data.md).

* A local file is read by its extension: jsonl, json, parquet or csv. JSON lines are read line by line first,
  so that a malformed line, a non-object line or invalid UTF-8 fails with the file and line number; the other
  formats are read with ``datasets``. A file has one split, ``train``.
* A folder written by ``Dataset.save_to_disk`` (one split, ``train``) or ``DatasetDict.save_to_disk`` (its own
  splits) is read with ``datasets.load_from_disk``.
* A bundled file is named ``align:<task>/<kind>/<split>.jsonl`` (for example ``align:sort/sft/train.jsonl``).
* Any other name is a hub dataset, ``org/name`` or ``org/name:config`` (for example ``openai/gsm8k:main``).

A split may be sliced with the ``datasets`` syntax, for every kind of source: ``train[:10]``, ``train[10%:]``,
``train[:50%]+train[-5:]``. Rows keep the numbers they have in their source (from 1), so an error in
``train[100:]`` names the row as it is numbered in the file (for JSON lines, its line number).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

from align.errors import AlignDataError

BUNDLED_PREFIX = "align:"
ASSETS = Path(__file__).parent / "assets"
_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
LOCAL_SPLIT = "train"


class Rows(list):
    """A list of row dicts that also knows each row's number in its source (from 1), for error messages."""

    def __init__(self, rows=(), numbers=None):
        super().__init__(rows)
        self.numbers: list[int] = list(numbers) if numbers is not None else list(range(1, len(self) + 1))


def row_numbers(rows) -> Sequence[int]:
    """Each row's number in its source: the numbers :class:`Rows` carries, else 1, 2, ..."""
    return getattr(rows, "numbers", None) or range(1, len(rows) + 1)


def numbered(rows) -> list[tuple[int, dict]]:
    """``(row number in its source, row)`` pairs (:func:`row_numbers`)."""
    return list(zip(row_numbers(rows), rows))


def resolve(source: str) -> str:
    """Map ``align:...`` to the bundled file's path; leave other names as they are."""
    if source.startswith(BUNDLED_PREFIX):
        path = ASSETS / source[len(BUNDLED_PREFIX) :]
        if not path.exists():
            available = sorted(str(p.relative_to(ASSETS)) for p in ASSETS.rglob("*.jsonl"))
            raise AlignDataError(source, None, None, f"one of the bundled files {available}")
        return str(path)
    return source


def read_rows(source: str, split: str | None = LOCAL_SPLIT, split_key: str = "data.split") -> Rows:
    """Rows of ``source`` (see the module docstring) for ``split``, sliced when the split says so.

    ``split=None`` takes the source's natural held-out split: ``train`` for a file (its only one), ``validation``
    for a hub dataset or a ``DatasetDict`` folder. ``split_key`` is the setting named when the split is wrong.
    """
    path_str = resolve(source)
    path = Path(path_str).expanduser()
    suffix = path.suffix.lower()
    if path.is_dir():
        rows = _read_saved(path, source, split, split_key)
    elif path.exists():
        if suffix not in _EXTENSIONS:
            raise AlignDataError(
                source,
                None,
                None,
                f"a file ending in one of {sorted(_EXTENSIONS)}, or a folder written by Dataset.save_to_disk",
            )
        full = (
            _read_jsonl(path, source) if suffix == ".jsonl" else _read_with_datasets(path, source, _EXTENSIONS[suffix])
        )
        rows = _slice({LOCAL_SPLIT: full}, split or LOCAL_SPLIT, source, split_key)
    elif suffix in _EXTENSIONS or path_str.startswith((".", "/", "~")):
        raise AlignDataError(source, None, None, "an existing file (no such file)")
    else:
        rows = _read_hub(path_str, split or "validation")
    if not rows:
        raise AlignDataError(source, None, None, "at least one row (the dataset is empty)")
    return rows


_SPLIT_PART = re.compile(
    r"""^(?P<split>\w+(?:\.\w+)*)
    (?:\[(?:(?P<start>-?[\d_]+)(?P<start_pct>%)?)?:(?:(?P<stop>-?[\d_]+)(?P<stop_pct>%)?)?\])?
    (?:\((?P<rounding>[^)]*)\))?$""",
    re.X,
)


def split_ranges(spec: str, sizes: dict[str, int]) -> list[tuple[str, int, int]]:
    """``(split, start, stop)`` of each ``+``-joined part of a split spec in the ``datasets`` syntax
    (``train``, ``train[10:]``, ``train[:-5%]``, ``train[:20%](pct1_dropremainder)+test[5:]``), given each split's
    size. The same ranges as ``datasets.ReadInstruction.from_spec(spec).to_absolute(sizes)``, without importing
    ``datasets`` (and pandas and pyarrow with it) to read a local file. Raises ``ValueError`` on a malformed spec
    or an unknown split."""
    out, first = [], None
    for part in re.split(r"\s*\+\s*", spec):
        m = _SPLIT_PART.match(part)
        if m is None:
            raise ValueError(f"unrecognised split {part!r}")
        percent = bool(m["start_pct"] or m["stop_pct"])
        if m["rounding"] is not None and (not percent or m["rounding"] not in ("closest", "pct1_dropremainder")):
            raise ValueError(f"rounding {m['rounding']!r} (closest or pct1_dropremainder, on percent slices only)")
        rounding = (m["rounding"] or "closest") if percent else None
        first = first or (percent, rounding)
        if first[0] and percent and rounding != first[1]:
            raise ValueError("parts with different roundings")
        if m["split"] not in sizes:
            raise ValueError(f"unknown split {m['split']!r}")
        n = sizes[m["split"]]
        bounds = [None if m[key] is None else int(m[key]) for key in ("start", "stop")]
        if percent:
            if any(b is not None and abs(b) > 100 for b in bounds):
                raise ValueError("percent boundaries within -100 and 100")
            if rounding == "pct1_dropremainder" and n < 100:
                raise ValueError("pct1_dropremainder on a split of fewer than 100 rows")
            scale = (
                (lambda b: int(round(b * n / 100.0)))  # noqa: B023
                if rounding == "closest"
                else (lambda b: b * math.trunc(n / 100.0))  # noqa: B023
            )
            bounds = [None if b is None else scale(b) for b in bounds]
        start, stop = 0 if bounds[0] is None else bounds[0], n if bounds[1] is None else bounds[1]
        start, stop = (min(max(n + b, 0) if b < 0 else b, n) for b in (start, stop))
        out.append((m["split"], start, stop))
    return out


def _slice(splits: dict, spec: str, source: str, split_key: str) -> Rows:
    """The rows ``spec`` selects from ``splits`` (name -> list of rows or ``datasets.Dataset``), numbered as in
    their split."""
    try:
        parts = split_ranges(spec, {name: len(rows) for name, rows in splits.items()})
    except ValueError:
        example = next(iter(splits))
        what = (
            f"the split '{LOCAL_SPLIT}' (a file has no other)"
            if set(splits) == {LOCAL_SPLIT}
            else f"one of the splits {sorted(splits)}"
        )
        raise AlignDataError(
            source,
            None,
            split_key,
            f"{what}, optionally sliced in the datasets syntax "
            f"('{example}[:10]', '{example}[10%:]', '{example}[:50%]')",
            spec,
        ) from None
    out = Rows()
    out.numbers = []
    for name, start, stop in parts:
        rows = splits[name]
        out.extend(rows[start:stop] if isinstance(rows, list) else rows.select(range(start, stop)).to_list())
        out.numbers.extend(row_numbers(rows)[start:stop])
    return out


def _read_jsonl(path: Path, source: str) -> Rows:
    """Rows numbered by their line (blank lines are skipped, so row N is line N of the file)."""
    rows = Rows()
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise AlignDataError(
                    source, lineno, None, "UTF-8 text", f"invalid byte at column {err.start + 1}"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise AlignDataError(
                    source, lineno, None, f"one JSON object per line ({err.msg} at column {err.colno})"
                ) from None
            if not isinstance(row, dict):
                raise AlignDataError(source, lineno, None, "a JSON object", row)
            rows.append(row)
            rows.numbers.append(lineno)
    return rows


def _read_with_datasets(path: Path, source: str, builder: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # noqa: BLE001 - the loaders raise many types; all mean the file is unreadable
        raise AlignDataError(source, None, None, f"a readable {builder} file ({type(err).__name__}: {err})") from None
    return ds.to_list()


def _read_saved(path: Path, source: str, split: str | None, split_key: str) -> Rows:
    """A folder written by ``Dataset.save_to_disk`` (split ``train``) or ``DatasetDict.save_to_disk``."""
    import datasets

    if not ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        raise AlignDataError(
            source,
            None,
            None,
            "a .jsonl, .json, .parquet or .csv file, or a folder written by "
            "Dataset.save_to_disk or DatasetDict.save_to_disk (no dataset_dict.json or state.json "
            "in this folder)",
        )
    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001
        raise AlignDataError(
            source, None, None, f"a readable save_to_disk folder ({type(err).__name__}: {err})"
        ) from None
    if isinstance(saved, datasets.DatasetDict):
        return _slice(dict(saved), split or "validation", source, split_key)
    return _slice({LOCAL_SPLIT: saved}, split or LOCAL_SPLIT, source, split_key)


def _read_hub(name: str, split: str) -> Rows:
    """A hub dataset ``org/name``, or ``org/name:config`` for one with several configs (``openai/gsm8k:main``).
    ``datasets`` applies the split's slice itself."""
    import datasets

    repo, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(repo, config or None, split=split)
    except Exception as err:  # noqa: BLE001
        raise AlignDataError(
            name,
            None,
            None,
            f"a local file or a reachable hub dataset with split '{split}' ({type(err).__name__}: {err})",
        ) from None
    return Rows(ds.to_list())
