"""What every data module shares (``align.data.base``): which rows validate a run (the bundled task's validation file,
rows held out of the user's, or none), and the checks of the loader settings and length limits."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from align.data.io import read_rows
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


@pytest.mark.slow
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
