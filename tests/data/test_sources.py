"""Where rows come from (split slicing, save_to_disk folders) and which rows validate a run."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from align.data.io import read_rows, split_ranges
from align.data.preference import PreferenceDataModule
from align.data.prompts import PromptDataModule
from align.data.sft import SFTDataModule
from align.errors import AlignConfigError, AlignDataError
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


SFT_ROWS = [{"prompt": f"sort: {c} a", "completion": f"a {c}"} for c in "bcdefghijklmnopqrstu"]
PAIRS = [{"prompt": f"sort: {c} a", "chosen": f"a {c}", "rejected": f"{c} a"} for c in "bcdefghijklmnopqrstu"]
PROMPTS = [{"prompt": f"sort: {c} a", "answer": f"a {c}"} for c in "bcdefghijklmnopqrstu"]
MODULES = [
    (SFTDataModule, SFT_ROWS, "align:sort/sft"),
    (PreferenceDataModule, PAIRS, "align:sort/preference"),
    (PromptDataModule, PROMPTS, "align:sort/prompts"),
]


def setup_module_(cls, tokenizer, caplog, **kwargs):
    dm = cls(**kwargs)
    dm.set_tokenizer(tokenizer)
    with caplog.at_level(logging.INFO):
        dm.setup("fit")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("validation:")]
    caplog.clear()
    assert len(lines) == 1
    return dm, lines[0]


@pytest.mark.parametrize("cls, rows, bundled", MODULES, ids=["sft", "preference", "prompts"])
def test_validation_data_is_the_bundled_tasks_or_held_out_of_the_users_never_another_tasks(
    tmp_path, tokenizer, caplog, cls, rows, bundled
):
    dm, line = setup_module_(cls, tokenizer, caplog)
    assert line == f"validation: {bundled}/validation.jsonl (bundled with the training task)"
    assert len(dm.val_set) == len(read_rows(f"{bundled}/validation.jsonl"))

    path = write(tmp_path / "my.jsonl", rows)
    dm, line = setup_module_(cls, tokenizer, caplog, train_files=path, val_size=4, seed=3)
    assert line.startswith(f"validation: 4 of 20 rows held out of {path} (data.val_size 4, data.seed 3); 4 rows make")
    assert (len(dm.train_set), len(dm.val_set)) == (16, 4)
    again, _ = setup_module_(cls, tokenizer, caplog, train_files=path, val_size=4, seed=3)
    other, _ = setup_module_(cls, tokenizer, caplog, train_files=path, val_size=4, seed=4)
    rows_of = lambda d: sorted(e.row if hasattr(e, "row") else repr(e) for e in d.val_set.examples)  # noqa: E731
    assert rows_of(again) == rows_of(dm) != rows_of(other)

    dm, line = setup_module_(cls, tokenizer, caplog, train_files=path)  # the default, a fraction: 5% of 20
    # is one row: raised to a fifth of the data (the minimum of 8 rows would leave too little to train on), and said
    assert (len(dm.train_set), len(dm.val_set)) == (16, 4)
    assert line == (
        f"validation: 4 of 20 rows held out of {path} (data.val_size 0.05, raised to 4 rows (at least 8, at "
        "most a fifth of the data), data.seed 0); 4 rows make a noisy held-out number: give "
        "data.val_files or a larger data.val_size for a steadier one"
    )

    dm, line = setup_module_(cls, tokenizer, caplog, train_files=path, val_size=0)
    assert line == "validation: none (data.val_size is 0)" and dm.val_set is None and dm.val_dataloader() == []
    for empty in (None, []):
        dm, line = setup_module_(cls, tokenizer, caplog, train_files=path, val_files=empty)
        assert line == "validation: none (data.val_files is null)" and dm.val_set is None and len(dm.train_set) == 20

    val = write(tmp_path / "v.jsonl", rows[:3])
    dm, line = setup_module_(cls, tokenizer, caplog, train_files=path, val_files=val)
    assert line == f"validation: {val} (data.val_files)" and (len(dm.train_set), len(dm.val_set)) == (20, 3)


def test_held_out_rows_never_train_and_a_too_small_file_says_what_to_do(tmp_path, tokenizer, caplog):
    path = write(tmp_path / "my.jsonl", SFT_ROWS)
    whole, _ = setup_module_(SFTDataModule, tokenizer, caplog, train_files=path, val_files=None)
    dm, _ = setup_module_(SFTDataModule, tokenizer, caplog, train_files=path, val_size=5)
    train = {tuple(e.input_ids) for e in dm.train_set.examples}
    held = {tuple(e.input_ids) for e in dm.val_set.examples}
    assert (
        len(held) == 5 and not train & held and train | held == {tuple(e.input_ids) for e in whole.train_set.examples}
    )
    packed, _ = setup_module_(SFTDataModule, tokenizer, caplog, train_files=path, val_size=5, packing=True)
    assert sum(e.loss_tokens for e in packed.val_set.examples) == sum(e.loss_tokens for e in dm.val_set.examples)
    with pytest.raises(AlignDataError, match=r"my.jsonl: expected more than the 20 rows data.val_size=20 holds out"):
        setup_module_(SFTDataModule, tokenizer, caplog, train_files=path, val_size=20)
    one = write(tmp_path / "one.jsonl", SFT_ROWS[:1])
    dm, line = setup_module_(SFTDataModule, tokenizer, caplog, train_files=one)  # a fraction of one row: none
    assert line == f"validation: none ({one} has 1 row, too few to hold out data.val_size 0.05)"
    assert dm.val_set is None and len(dm.train_set) == 1
    with pytest.raises(
        AlignConfigError,
        match=r"^data\.val_size: expected a row count >= 0 or a fraction between 0 "
        r"and 1, got 1\.5$",
    ):
        SFTDataModule(val_size=1.5)


@pytest.mark.parametrize("module", [SFTDataModule, PreferenceDataModule, PromptDataModule])
@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(batch_size=0), r"^data\.batch_size: expected an integer >= 1, got 0$"),
        (dict(val_batch_size=0), r"^data\.val_batch_size: expected an integer >= 1 or null \(batch_size\), got 0$"),
        (dict(num_workers=-1), r"^data\.num_workers: expected an integer >= 0, got -1$"),
        (dict(val_size=-2), r"^data\.val_size: expected a row count >= 0 or a fraction between 0 and 1, got -2$"),
    ],
)
def test_bad_loader_settings_fail_on_one_line_naming_the_setting(module, settings, message):
    with pytest.raises(AlignConfigError, match=message):
        module(**settings)


@pytest.mark.parametrize(
    "module, settings, message",
    [
        (SFTDataModule, dict(max_length=1), r"^data\.max_length: expected an integer >= 2 \(tokens\), got 1$"),
        (
            PreferenceDataModule,
            dict(max_length=64, max_prompt_length=64),
            r"^data\.max_prompt_length: expected an integer >= 1 \(tokens\) or null, below max_length=64, got 64$",
        ),
        (
            PromptDataModule,
            dict(max_prompt_length=0),
            r"^data\.max_prompt_length: expected an integer >= 1 \(tokens\) or "
            r"null, got 0$",
        ),
    ],
)
def test_bad_length_limits_fail_on_one_line_naming_the_setting(module, settings, message):
    with pytest.raises(AlignConfigError, match=message):
        module(**settings)


def test_a_module_without_a_tokenizer_or_a_policy_says_which_setting_gives_one():
    with pytest.raises(
        AlignConfigError,
        match=r"^data\.tokenizer: expected a tokenizer path, or a module with a "
        r"policy to take it from, got None$",
    ):
        SFTDataModule().setup("fit")


def test_validate_stage_reads_only_the_validation_file(tokenizer, caplog):
    dm = SFTDataModule()
    dm.set_tokenizer(tokenizer)
    dm.setup("validate")
    assert dm.train_set is None and len(dm.val_set) > 0
    val = dm.val_set
    dm.setup("fit")
    assert len(dm.train_set) > 1000 and dm.val_set is val  # chosen once


def test_sft_recipe_on_a_users_file_holds_out_its_rows_and_never_reads_the_sort_tasks_validation(tmp_path):
    """The recipe's default config with only ``--data.train_files`` changed (issue #17, item 1)."""
    path = write(tmp_path / "my.jsonl", SFT_ROWS)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    # Any read of the bundled validation file fails the run: the test proves it is never opened.
    guard = tmp_path / "sitecustomize.py"
    guard.write_text(
        "import builtins, io\n_open = io.open\n"
        "def guarded(file, *a, **k):\n"
        "    if str(file).endswith('sort/sft/validation.jsonl'):\n"
        "        raise SystemExit('read the sort task validation file')\n"
        "    return _open(file, *a, **k)\n"
        "builtins.open = io.open = guarded\n"
    )
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    result = subprocess.run(
        [
            sys.executable,
            "recipes/sft.py",
            "--data.train_files",
            path,
            "--data.val_size",
            "4",
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert f"validation: 4 of 20 rows held out of {path} (data.val_size 4, data.seed 0); 4 rows make" in out
    assert "held-out val/loss:" in out and "sort/sft/validation" not in out


def test_a_fraction_holds_out_at_least_eight_rows_but_not_past_a_fifth():
    from align.data.base import held_out_count

    assert [held_out_count(0.05, rows) for rows in (1, 4, 20, 40, 100, 1000)] == [1, 1, 4, 8, 8, 50]
    assert held_out_count(3, 100) == 3  # a count is taken as given
