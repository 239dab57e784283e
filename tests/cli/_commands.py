"""Helpers shared by the command-line tests (and ``tests/rollout/test_generation.py``): running a command or the SFT
recipe in this process, the one error line of a command that fails, reading what a run printed and wrote."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from align.cli.main import main
from align.cli.recipes import run_recipe
from align.data import SFTDataModule
from align.modules import SFTModule
from align.trainer.checkpointing import AtomicCheckpointIO

QUIET = [
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.log_every_n_steps",
    "1",
]
# Prompt rows of every form the generation commands read: a string, an extra id column, chat messages.
ROWS = [
    {"prompt": "sort: d a c b", "answer": "a b c d"},
    {"prompt": "sort: b a", "answer": "a b", "id": 7},
    {"prompt": [{"role": "user", "content": "sort: e c a"}], "answer": "a c e"},
    {"prompt": "sort: j e f g", "answer": "e f g j"},
]


def sft(root: Path, *args: str) -> None:
    run_recipe("sft", SFTModule, SFTDataModule, args=[*QUIET, "--trainer.default_root_dir", str(root), *args])


def global_step(path: Path) -> int:
    return AtomicCheckpointIO().load_checkpoint(path)["global_step"]


def held_out(out: str, name: str = "val/loss") -> str:
    return next(line for line in out.splitlines() if line.startswith(f"held-out {name}:"))


def before_after(out: str, name: str = "val/loss") -> tuple[float, float]:
    before, after = held_out(out, name).split(":", 1)[1].split("->")
    return float(before), float(after)


def val_rows(run_dir: Path) -> list[dict]:
    return [r for r in csv.DictReader(open(run_dir / "metrics.csv")) if r.get("val/loss")]


def read_metrics(root: Path) -> list[dict]:
    files = list(root.rglob("metrics.csv"))
    assert len(files) == 1, files
    return list(csv.DictReader(open(files[0])))


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def run(capsys, *args) -> tuple[str, str]:
    """What ``align <args>`` prints, run in this process: (stdout, stderr)."""
    main(list(args))
    captured = capsys.readouterr()
    return captured.out, captured.err


def fails(capsys, *args) -> str:
    """The one stderr line of a command that must exit 2."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, lines
    return lines[0]


def printed_config(capsys, recipe: str, module, datamodule, *args: str, **kwargs) -> str:
    """What ``python recipes/<recipe>.py <args> --print_config`` prints, run in this process."""
    with pytest.raises(SystemExit) as exit:
        run_recipe(recipe, module, datamodule, args=[*args, "--print_config"], **kwargs)
    assert not exit.value.code
    return capsys.readouterr().out
