"""Where rows come from (``align.data.io``): local files and their split slices with the row numbers of the file,
``save_to_disk`` folders, other file formats, and the errors of unreadable files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from align.data.io import read_rows, split_ranges
from align.data.sft import SFTDataModule
from align.errors import AlignDataError
from align.hub.tiny import load_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tiny_tokenizer()


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def numbers(tmp_path, n=10):
    return write(tmp_path / "n.jsonl", [{"i": i} for i in range(n)])


@pytest.mark.parametrize(
    "split, values, rows",
    [
        ("train", list(range(10)), list(range(1, 11))),
        ("train[:3]", [0, 1, 2], [1, 2, 3]),
        ("train[80%:]", [8, 9], [9, 10]),
        ("train[:50%]", [0, 1, 2, 3, 4], [1, 2, 3, 4, 5]),
        ("train[-2:]+train[:1]", [8, 9, 0], [9, 10, 1]),
    ],
)
def test_local_files_slice_their_train_split_and_keep_row_numbers(tmp_path, split, values, rows):
    got = read_rows(numbers(tmp_path), split)
    assert [r["i"] for r in got] == values and got.numbers == rows


@pytest.mark.parametrize("split", ["validation", "test[:2]", "train[a:b]"])
def test_a_local_file_has_only_the_train_split(tmp_path, split):
    path = numbers(tmp_path)
    with pytest.raises(AlignDataError) as info:
        read_rows(path, split, "data.val_split")
    assert str(info.value).startswith(f"{path}: field 'data.val_split': expected the split 'train'")
    assert repr(split) in str(info.value)


SPECS = [
    "train",
    "train[:3]",
    "train[3:]",
    "train[-2:]",
    "train[:-2]",
    "train[2:1]",
    "train[5:500]",
    "train[-500:2]",
    "train[1_0:]",
    "train[:]",
    "train[10%:]",
    "train[:50%]",
    "train[-33%:]",
    "train[:-5%]",
    "train[33%:67%]",
    "train[:100%]",
    "train[-100%:]",
    "train[:10%](closest)",
    "train[:20%](pct1_dropremainder)",
    "train[-20%:](pct1_dropremainder)",
    "test[:2] + train[-3:]",
    "train[:10%]+test[50%:]",
    "train[:10%](pct1_dropremainder)+test[:5]",
    "a.b[1:]",
    "train[:101%]",
    "train[:3](closest)",
    "train[:5%](nearest)",
    "train[:5%]+test[:5%](pct1_dropremainder)",
    "validation",
    "train[a:b]",
    "train[1:2:3]",
    "train[:1]+",
    "",
    "train[:5%](pct1_dropremainder)",
]


@pytest.mark.parametrize("sizes", [{"train": 7, "test": 130, "a.b": 3}, {"train": 250, "test": 99, "a.b": 0}])
@pytest.mark.parametrize("spec", SPECS)
def test_split_ranges_are_those_of_datasets_read_instructions(spec, sizes):
    import datasets

    try:
        expected = [(p.splitname, p.from_, p.to) for p in datasets.ReadInstruction.from_spec(spec).to_absolute(sizes)]
    except (ValueError, AssertionError):
        expected = ValueError
    if expected is ValueError:
        with pytest.raises(ValueError):
            split_ranges(spec, sizes)
    else:
        assert split_ranges(spec, sizes) == expected


@pytest.mark.slow
def test_reading_a_json_lines_file_does_not_import_datasets(tmp_path):
    # datasets brings pandas and pyarrow: about 80 MB of resident memory and seconds of start-up per run.
    path = numbers(tmp_path)
    code = (
        f"import sys; from align.data.io import read_rows; rows = read_rows({path!r}, 'train[2:]+train[:10%]'); "
        "print(len(rows), 'datasets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["9", "False"]


def test_errors_in_a_slice_name_the_row_as_numbered_in_the_file(tmp_path, tokenizer):
    rows = [{"prompt": f"sort: {c} a", "completion": f"a {c}"} for c in "bcdef"] + [
        {"prompt": "sort: a", "completion": ""}
    ]
    dm = SFTDataModule(train_files=write(tmp_path / "d.jsonl", rows), split="train[4:]", val_files=None)
    dm.set_tokenizer(tokenizer)
    with pytest.raises(AlignDataError, match=r"d.jsonl: row 6: field 'completion'"):
        dm.setup("fit")


def test_save_to_disk_folders_are_sources(tmp_path):
    import datasets

    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(6)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:4]), "test": datasets.Dataset.from_list(rows[4:])}
    ).save_to_disk(str(tmp_path / "dict"))
    assert read_rows(str(tmp_path / "one")) == rows
    assert read_rows(str(tmp_path / "one"), "train[-2:]") == rows[4:]
    assert read_rows(str(tmp_path / "dict"), "train[:1]") == rows[:1]
    assert read_rows(str(tmp_path / "dict"), "test") == rows[4:]
    with pytest.raises(
        AlignDataError, match=r"dict: field 'data.split': expected one of the splits \['test', 'train'\]"
    ):
        read_rows(str(tmp_path / "dict"), "validation")
    with pytest.raises(AlignDataError, match=r"dict: field 'data.split': expected one of the splits"):
        read_rows(str(tmp_path / "dict"), None)  # a DatasetDict's default held-out split is 'validation'
    (tmp_path / "plain").mkdir()
    with pytest.raises(AlignDataError, match="plain: expected .* a folder written by Dataset.save_to_disk"):
        read_rows(str(tmp_path / "plain"))


GOOD = {"prompt": "sort: b a", "completion": "a b"}


def test_non_utf8_and_empty_files(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9", "completion": "x"}\n')
    with pytest.raises(AlignDataError, match=r"row 1: expected UTF-8 text"):
        read_rows(str(path))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(AlignDataError, match="the dataset is empty"):
        read_rows(str(empty))
    with pytest.raises(AlignDataError, match="no such file"):
        read_rows(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("suffix", ["parquet", "csv", "json"])
def test_other_file_formats_load(tmp_path, suffix):
    import pandas as pd

    rows = [GOOD, {"prompt": "sort: c b", "completion": "b c"}]
    path = tmp_path / f"data.{suffix}"
    frame = pd.DataFrame(rows)
    {
        "parquet": frame.to_parquet,
        "csv": lambda p: frame.to_csv(p, index=False),
        "json": lambda p: frame.to_json(p, orient="records"),
    }[suffix](path)
    assert read_rows(str(path)) == rows
