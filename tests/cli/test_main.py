"""The ``align`` command (align.cli.main): a run on bad data exits non-zero on one line naming the file, row and
field, and writes no checkpoint."""

import json

import pytest

from align.cli.recipes import run_recipe
from align.data import SFTDataModule
from align.modules import SFTModule


def bad_file(tmp_path, bad_line: str) -> str:
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "sort: b a", "completion": "a b"})
    path.write_text(f"{good}\n{good}\n{bad_line}\n")
    return str(path)


@pytest.mark.parametrize(
    "bad_line, expected",
    [
        ("not json", "row 3: expected one JSON object per line"),
        (json.dumps({"prompt": "sort: b a"}), "row 3: expected a row with the fields"),
        (
            json.dumps({"prompt": "sort: b a", "completion": ""}),
            "row 3: field 'completion': expected a non-empty string",
        ),
        (json.dumps({"prompt": ["x"], "completion": "a"}), "row 3: field 'prompt[0]'"),
        (json.dumps({"prompt": "sort: b a", "completion": 3}), "row 3: field 'completion': expected a string"),
        (json.dumps({"prompt": "sort: " + "a " * 100, "completion": "a"}), "row 3: expected at most max_length=64"),
    ],
)
def test_bad_data_exits_nonzero_with_file_row_field_and_writes_no_checkpoint(tmp_path, capsys, bad_line, expected):
    path = bad_file(tmp_path, bad_line)
    with pytest.raises(SystemExit) as info:
        run_recipe(
            "sft",
            SFTModule,
            SFTDataModule,
            args=[
                "--data.train_files",
                path,
                "--trainer.default_root_dir",
                str(tmp_path / "run"),
                "--trainer.max_steps",
                "2",
            ],
        )
    assert info.value.code != 0
    err = capsys.readouterr().err
    assert path in err and expected in err
    assert not list(tmp_path.rglob("*.ckpt"))
