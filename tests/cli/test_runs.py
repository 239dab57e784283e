"""One folder per run (``<root>/version_N/`` with config, metrics and checkpoints), ``--resume auto``, the
held-out "before" of a continued run, shipped configs by name, and the command line's one-line config errors."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from align.cli.arguments import CONFIG_DIR, resolve_config_args
from align.cli.main import main
from align.cli.recipes import run_recipe
from align.cli.runs import RunLogger, latest_run, run_of_checkpoint
from align.data import SFTDataModule
from align.data.prompts import PromptDataModule
from align.errors import AlignConfigError
from align.modules import SFTModule
from align.modules.grpo import GRPOModule
from align.trainer.checkpointing import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[2]
QUIET = [
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.enable_model_summary",
    "false",
    "--trainer.log_every_n_steps",
    "1",
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


# ------------------------------------------------------------------------------------------------ run folders
def test_two_runs_in_one_root_each_keep_their_own_folder_and_last_checkpoint(tmp_path, capsys):
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "1", "--eval_before_after", "false")
    sft(root, "--trainer.max_steps", "2", "--eval_before_after", "false")
    out = capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["version_0", "version_1"]  # no shared <root>/checkpoints
    for version, steps in ((0, 1), (1, 2)):
        run = root / f"version_{version}"
        assert {"config.yaml", "metrics.csv", "checkpoints", "curves.png"} <= {p.name for p in run.iterdir()}
        assert global_step(run / "checkpoints" / "last.ckpt") == steps
        assert not list((run / "checkpoints").glob("last-v*.ckpt"))
    # The end of fit names the folder and the checkpoint to export.
    assert f"run directory: {root / 'version_1'}" in out
    assert f"curves: {root / 'version_1' / 'curves.png'}" in out
    assert f"last checkpoint: {root / 'version_1' / 'checkpoints' / 'last.ckpt'}" in out


def test_resume_auto_continues_the_latest_run_in_its_folder_with_the_true_before(tmp_path, capsys):
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "2", "--resume", "auto")
    first = capsys.readouterr().out
    assert f"resume: no earlier run with a checkpoint under {root}; starting version_0" in first
    sft(root, "--trainer.max_steps", "4", "--resume", "auto")
    second = capsys.readouterr().out
    assert f"resume: continuing {root / 'version_0'} from {root / 'version_0' / 'checkpoints' / 'last.ckpt'}" in second
    assert sorted(p.name for p in root.iterdir()) == ["version_0"]
    assert global_step(root / "version_0" / "checkpoints" / "last.ckpt") == 4
    # "before" is the untrained model's loss, kept in the checkpoint, not the loss of the weights it resumed from.
    assert before_after(second)[0] == before_after(first)[0]
    assert before_after(second)[1] < before_after(first)[1]
    # One metrics file for the whole run: the first launch's rows stay, the second's are appended.
    steps = [int(r["step"]) for r in val_rows(root / "version_0")]
    assert steps == [0, 2, 4], steps


def test_ckpt_path_inside_a_run_folder_continues_that_run_and_another_roots_starts_a_new_one(tmp_path, capsys):
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "1", "--eval_before_after", "false")
    sft(root, "--trainer.max_steps", "1", "--eval_before_after", "false")
    sft(
        root,
        "--trainer.max_steps",
        "2",
        "--eval_before_after",
        "false",
        "--ckpt_path",
        str(root / "version_0" / "checkpoints" / "last.ckpt"),
    )
    assert sorted(p.name for p in root.iterdir()) == ["version_0", "version_1"]
    assert global_step(root / "version_0" / "checkpoints" / "last.ckpt") == 2
    assert global_step(root / "version_1" / "checkpoints" / "last.ckpt") == 1
    # A checkpoint from elsewhere starts a new run of this root from those weights.
    other = tmp_path / "other"
    sft(
        other,
        "--trainer.max_steps",
        "3",
        "--eval_before_after",
        "false",
        "--ckpt_path",
        str(root / "version_1" / "checkpoints" / "last.ckpt"),
    )
    assert global_step(other / "version_0" / "checkpoints" / "last.ckpt") == 3


def test_a_resumed_run_whose_checkpoint_has_no_before_says_it_was_resumed(tmp_path, capsys):
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "1", "--eval_before_after", "false")
    capsys.readouterr()
    sft(root, "--trainer.max_steps", "2", "--resume", "auto")
    line = held_out(capsys.readouterr().out)
    assert "->" not in line and "(resumed from" in line, line


def test_a_run_without_validation_data_still_names_its_folder_and_checkpoint(tmp_path, capsys):
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "1", "--data.init_args.val_files", "null")
    out = capsys.readouterr().out
    assert "held-out" not in out
    assert f"run directory: {root / 'version_0'}" in out and "last checkpoint:" in out


def test_the_final_validation_is_not_repeated_after_fit(tmp_path, capsys):
    """A validation that ran after the last step already measured the final weights: its numbers are printed."""
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2")
    after = before_after(capsys.readouterr().out)[1]
    rows = val_rows(root / "version_0")
    assert len(rows) == 2, rows  # before fit, and the one in training; none after
    assert float(rows[-1]["val/loss"]) == pytest.approx(after, abs=5e-5)


def test_a_save_writes_one_full_checkpoint_and_last_ckpt_is_the_same_file(tmp_path):
    """The default checkpoint callback keeps the step's checkpoint and ``last.ckpt``: one file on disk (a hard
    link), and a run continued from it keeps writing ``last.ckpt`` (no ``last-v1.ckpt``)."""
    root = tmp_path / "runs"
    sft(root, "--trainer.max_steps", "2", "--eval_before_after", "false")
    folder = root / "version_0" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert os.path.samefile(folder / "epoch=0-step=2.ckpt", folder / "last.ckpt")
    sft(root, "--trainer.max_steps", "4", "--eval_before_after", "false", "--resume", "auto")
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert os.path.samefile(folder / "epoch=0-step=4.ckpt", folder / "last.ckpt")
    assert global_step(folder / "last.ckpt") == 4


def test_validate_prints_the_held_out_metrics_and_makes_no_run_folder(tmp_path, capsys):
    root = tmp_path / "runs"
    for _ in range(2):
        run_recipe("sft", SFTModule, SFTDataModule, args=["validate", *QUIET, "--trainer.default_root_dir", str(root)])
    out = capsys.readouterr().out
    assert not root.exists() or not list(root.iterdir())
    assert "Validate metric" not in out and "DataLoader 0" not in out  # Lightning's table
    lines = [line for line in out.splitlines() if line.startswith(("held-out", "weights:"))]
    assert [line.split(":")[0] for line in lines] == ["held-out val/loss", "held-out val/ppl", "weights"] * 2
    assert lines[-1] == "weights: the config's model (no --ckpt_path)"


def test_a_run_that_fails_before_its_first_step_leaves_no_folder_holding_only_its_config(tmp_path, monkeypatch):
    (tmp_path / "boom_reward.py").write_text("def exact(completions, **kw):\n    raise RuntimeError('boom')\n")
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs"
    with pytest.raises(SystemExit):
        run_recipe(
            "grpo",
            GRPOModule,
            PromptDataModule,
            args=[
                *QUIET,
                "--trainer.default_root_dir",
                str(root),
                "--trainer.max_steps",
                "1",
                "--data.init_args.val_files",
                "null",
                "--data.init_args.batch_size",
                "2",
                "--model.init_args.group_size",
                "2",
                "--model.init_args.sampling.max_new_tokens",
                "4",
                "--model.init_args.rewards",
                '[{"fn": "boom_reward.exact"}]',
            ],
        )
    assert not list(root.glob("version_*"))
    # A folder with anything else in it is kept, and a continued run's folder is never removed.
    from align.cli.lightning_cli import _remove_if_empty

    (root / "version_3").mkdir(parents=True)
    for name in ("config.yaml", "notes.txt"):
        (root / "version_3" / name).write_text("x")
    _remove_if_empty(str(root / "version_3"), its_setup_files=True)
    (root / "version_4").mkdir()
    (root / "version_4" / "config.yaml").write_text("x")
    _remove_if_empty(str(root / "version_4"), its_setup_files=False)
    assert sorted(p.name for p in root.iterdir()) == ["version_3", "version_4"]
    _remove_if_empty(str(root / "version_4"), its_setup_files=True)
    assert sorted(p.name for p in root.iterdir()) == ["version_3"]


# ------------------------------------------------------------------------------------------------ pieces
def test_latest_run_skips_folders_without_a_checkpoint(tmp_path):
    assert latest_run(tmp_path / "missing") is None
    for version, files in ((0, ["last.ckpt"]), (1, ["epoch=0-step=3.ckpt"]), (2, []), (10, [])):
        (tmp_path / f"version_{version}" / "checkpoints").mkdir(parents=True)
        for name in files:
            (tmp_path / f"version_{version}" / "checkpoints" / name).write_bytes(b"x")
    (tmp_path / "version_x").mkdir()
    run = latest_run(tmp_path)
    assert (run.version, run.checkpoint.name) == (1, "epoch=0-step=3.ckpt")  # version_10 and 2 have none yet
    assert run_of_checkpoint(tmp_path, tmp_path / "version_0" / "checkpoints" / "last.ckpt") == 0
    assert run_of_checkpoint(tmp_path / "elsewhere", tmp_path / "version_0" / "checkpoints" / "last.ckpt") is None
    assert run_of_checkpoint(tmp_path, tmp_path / "model.ckpt") is None


def test_run_logger_appends_to_a_continued_runs_metrics(tmp_path):
    first = RunLogger(str(tmp_path))
    first.log_metrics({"train/loss": 1.0}, step=0)
    first.save()
    assert first.version == 0
    continued = RunLogger(str(tmp_path), version=0, append=True)
    continued.log_metrics({"train/loss": 0.5, "val/loss": 0.7}, step=1)  # a new column rewrites the header
    continued.save()
    rows = list(csv.DictReader(open(tmp_path / "version_0" / "metrics.csv")))
    assert [(r["step"], r["train/loss"], r["val/loss"]) for r in rows] == [("0", "1.0", ""), ("1", "0.5", "0.7")]
    assert RunLogger(str(tmp_path)).version == 1  # a new run does not touch it


def test_shipped_configs_are_named_by_align_prefix():
    path = str(CONFIG_DIR / "grpo" / "tiny.yaml")
    assert resolve_config_args(["fit", "--config", "align:grpo/tiny.yaml", "--model.x", "align:y"]) == [
        "fit",
        "--config",
        path,
        "--model.x",
        "align:y",
    ]
    assert resolve_config_args(["--config=align:grpo/tiny.yaml"]) == [f"--config={path}"]
    with pytest.raises(AlignConfigError, match=r"--config: 'align:grpo/nope.yaml' is not a shipped config"):
        resolve_config_args(["--config", "align:grpo/nope.yaml"])
    # The checkout's configs/ is the same folder as the package's: one copy.
    assert (ROOT / "configs").resolve() == CONFIG_DIR.resolve()


def test_align_fit_runs_a_shipped_config_by_name(tmp_path, capsys):
    main(
        [
            "fit",
            "--config",
            "align:sft/tiny.yaml",
            "--trainer.max_steps",
            "1",
            "--eval_before_after",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path),
            *QUIET,
        ]
    )
    assert global_step(tmp_path / "version_0" / "checkpoints" / "last.ckpt") == 1


def test_unknown_shipped_config_and_checkpointing_conflict_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "align:sft/nope.yaml"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --config: 'align:sft/nope.yaml'") and "\n" not in err
    with pytest.raises(SystemExit) as info:
        sft(
            tmp_path,
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.callbacks+=align.trainer.checkpointing.AlignCheckpoint",
        )
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: trainer.enable_checkpointing: false, but trainer.callbacks holds AlignCheckpoint")
    assert not any("Traceback" in line for line in err)


@pytest.mark.slow
def test_ddp_ranks_agree_on_one_run_folder_and_resume_it(tmp_path):
    """``--trainer.devices 2`` re-runs the recipe for rank 1: both ranks must use rank 0's version_N, fresh or
    resumed, and no stray folder appears."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")

    def launch(*args: str) -> str:
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "recipes" / "sft.py"),
                "--trainer.accelerator",
                "cpu",
                "--trainer.devices",
                "2",
                "--trainer.strategy",
                "ddp",
                "--trainer.default_root_dir",
                str(tmp_path),
                "--eval_before_after",
                "false",
                *QUIET,
                *args,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    (tmp_path / "version_0").mkdir()  # an earlier run: rank 0 starts version_1, and rank 1 must not pick version_2
    (tmp_path / "version_0" / "metrics.csv").write_text("step\n")
    launch("--trainer.max_steps", "1")
    out = launch("--trainer.max_steps", "2", "--resume", "auto")
    assert "resume: continuing" in out
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("version_")) == ["version_0", "version_1"]
    assert global_step(tmp_path / "version_1" / "checkpoints" / "last.ckpt") == 2
    assert f"run directory: {tmp_path / 'version_1'}" in out  # the resumed run reports the folder it continued
    assert out.count("curves: ") == 1 and (tmp_path / "version_1" / "curves.png").is_file()  # rank 0 draws it


def test_a_run_that_fails_before_writing_leaves_no_folder(tmp_path):
    """Bad data stops the run before anything is written: no empty ``version_0`` is left, so the next run is
    ``version_0``."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "sort: b a"}\n')
    root = tmp_path / "runs"
    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                "--model",
                "SFTModule",
                "--data",
                "SFTDataModule",
                "--data.train_files",
                str(bad),
                "--trainer.default_root_dir",
                str(root),
                "--trainer.max_steps",
                "1",
            ]
        )
    assert not root.exists() or list(root.iterdir()) == []


def test_a_run_that_fails_midway_still_draws_its_curves(tmp_path, monkeypatch):
    """The picture of a failed run shows what it logged up to the failure (Lightning flushes the CSV first)."""
    original = SFTModule.training_step

    def failing(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            raise RuntimeError("boom")
        return original(self, batch, batch_idx)

    monkeypatch.setattr(SFTModule, "training_step", failing)
    with pytest.raises(RuntimeError, match="boom"):
        sft(tmp_path, "--trainer.max_steps", "4", "--eval_before_after", "false")
    assert (tmp_path / "version_0" / "curves.png").is_file()


def test_a_nested_setting_set_to_null_on_the_command_line_becomes_a_one_field_block():
    assert resolve_config_args(
        [
            "fit",
            "--model.kl.estimator",
            "null",
            "--model.init_args.scores.clip=null",
            "--model.policy.init_args.lora",
            "null",
            "--model.group_size",
            "null",
            "--trainer.max_steps",
            "null",
            "--model.kl.coef",
            "0",
        ]
    ) == [
        "fit",
        "--model.kl",
        '{"estimator": null}',
        "--model.init_args.scores",
        '{"clip": null}',
        "--model.policy",
        '{"lora": null}',
        "--model.group_size",
        "null",
        "--trainer.max_steps",
        "null",
        "--model.kl.coef",
        "0",
    ]


def test_null_reaches_a_nested_field_and_leaves_its_neighbours(capsys):
    from align.cli.recipes import run_recipe
    from align.data.prompts import PromptDataModule
    from align.modules.ppo import PPOModule

    with pytest.raises(SystemExit):
        run_recipe(
            "ppo",
            PPOModule,
            PromptDataModule,
            args=[
                "fit",
                "--model.evaluation.accuracy_reward",
                "null",
                "--model.scores.missing_eos_penalty",
                "null",
                "--print_config",
            ],
        )
    printed = capsys.readouterr().out
    assert "accuracy_reward: null" in printed and "missing_eos_penalty: null" in printed
    assert "accuracy_threshold: 1.0" in printed and "whiten: true" in printed  # the shipped config's neighbours


def test_an_accuracy_no_held_out_completion_could_reach_gives_its_place_to_the_rewards_mean(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "half_reward.py").write_text("def half(completions, **kw):\n    return [0.5 for c in completions]\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "sort: b a"}\n{"prompt": "sort: c a"}\n')
    monkeypatch.chdir(tmp_path)
    run_recipe(
        "grpo",
        GRPOModule,
        PromptDataModule,
        args=[
            *QUIET,
            "--trainer.default_root_dir",
            str(tmp_path / "runs"),
            "--trainer.max_steps",
            "1",
            "--data.init_args.train_files",
            "p.jsonl",
            "--data.init_args.val_files",
            "p.jsonl",
            "--data.init_args.batch_size",
            "2",
            "--model.init_args.group_size",
            "2",
            "--model.init_args.sampling.max_new_tokens",
            "4",
            "--model.init_args.rewards",
            '[{"fn": "half_reward.half"}]',
            "--model.init_args.eval_rewards",
            "[]",
        ],
    )
    out = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(out) if line.startswith("held-out val/"))
    assert out[first : first + 4] == [
        "held-out val/reward_mean: 0.5000 -> 0.5000",
        "held-out val/accuracy: 0.0000 -> 0.0000",
        "held-out val/reward/half: 0.5000 -> 0.5000",
        "  val/accuracy is 0 by construction: no held-out completion reached half >= 1 (highest 0.5000; "
        "model.evaluation.accuracy_threshold sets it); read val/reward/half, the reward's mean, instead",
    ]
