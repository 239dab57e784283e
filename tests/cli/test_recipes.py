import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from align.cli.commands import COMMANDS
from align.cli.lightning_cli import AlignCLI
from align.cli.main import main
from align.cli.recipes import run_recipe
from align.data import SFTDataModule
from align.hub.gguf import is_packaged
from align.modules import SFTModule

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def localise(node, tiny_model_dir):
    """Replace every hub model id in a config with a local tiny model (no hub access in tests). The real-model
    tier (``smollm2-135m-instruct``) is local and stays: its configs name layers the tiny model does not have."""
    if isinstance(node, dict):
        for key, value in node.items():
            if (
                key in ("model", "reference_model", "teacher", "tokenizer")
                and isinstance(value, str)
                and value != "tiny"
                and not is_packaged(value)
            ):
                node[key] = tiny_model_dir
            else:
                localise(value, tiny_model_dir)
    elif isinstance(node, list):
        for item in node:
            localise(item, tiny_model_dir)
    return node


def read_metrics(root: Path) -> list[dict]:
    files = list(root.rglob("metrics.csv"))
    assert len(files) == 1, files
    return list(csv.DictReader(open(files[0])))


@pytest.mark.parametrize(
    "config",
    [pytest.param(c, marks=[pytest.mark.slow] if "smollm2" in c.name else []) for c in CONFIGS],
    ids=lambda p: str(p.relative_to(ROOT / "configs")),
)
def test_every_config_parses_and_instantiates(config, tiny_model_dir, tmp_path):
    data = localise(yaml.safe_load(config.read_text()), tiny_model_dir)
    local = tmp_path / config.name
    local.write_text(yaml.safe_dump(data))
    cli = AlignCLI(
        args=[
            "--config",
            str(local),
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path),
        ],
        run=False,
    )
    if config.parent.name == "gym":  # classic RL: the module brings its environment, there is no data module
        assert cli.model.env.id and cli.datamodule is None and cli.model.total_steps > 0
    else:
        assert cli.model.policy is not None and cli.datamodule is not None
        assert cli.trainer.max_steps != 0


def test_print_config_round_trips(tmp_path):
    def printed(*args):
        out = subprocess.run(
            [sys.executable, str(ROOT / "recipes" / "sft.py"), *args, "--print_config"],
            capture_output=True,
            text=True,
            check=True,
            cwd=tmp_path,
        )
        return out.stdout

    first = printed("--model.init_args.policy.init_args.dtype", "bfloat16")
    assert "dtype: bfloat16" in first and "class_path: align.modules.SFTModule" in first
    saved = tmp_path / "printed.yaml"
    saved.write_text(first)
    assert printed("--config", str(saved)) == first


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


def test_unknown_yaml_key_is_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        run_recipe("sft", SFTModule, SFTDataModule, args=["--model.init_args.no_such_option", "1"])
    assert info.value.code != 0
    assert "no_such_option" in capsys.readouterr().err


def test_align_fit_writes_csv_curves_tensorboard_checkpoint_and_export_loads(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path / "run"
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "sft" / "tiny.yaml"),
            "--trainer.max_steps",
            "6",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.default_root_dir",
            str(root),
            "--trainer.logger+=lightning.pytorch.loggers.TensorBoardLogger",
        ]
    )
    out = capsys.readouterr().out
    assert "held-out val/loss:" in out
    rows = read_metrics(root)
    assert any(r["train/loss"] for r in rows) and any(r["val/loss"] for r in rows)
    # The picture of the run, drawn from the complete CSV (the final validation included), in the run folder.
    curves = root / "version_0" / "curves.png"
    assert f"curves: {curves}" in out.splitlines()
    assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # TensorBoard's event files sit in the run folder too, next to metrics.csv.
    assert list((root / "version_0").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in root.iterdir()) == ["version_0"]
    ckpt = next(root.rglob("*.ckpt"))
    main(["export", "--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "hf")])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "sort: c b a"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert model.generate(**prompt, max_new_tokens=4, do_sample=False).shape[1] > prompt["input_ids"].shape[1]


@pytest.mark.slow
def test_sft_recipe_end_to_end(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "sft.py"), "--trainer.default_root_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("held-out val/loss:"))
    before, after = (float(x) for x in line.split(":")[1].split("->"))
    assert after < 0.25 * before
    rows = read_metrics(tmp_path)
    assert any(r["train/loss"] for r in rows) and any(r["train/tokens_per_s"] for r in rows)


def test_recipe_subcommand_is_the_first_argument_only():
    from align.cli.recipes import _with_subcommand

    assert _with_subcommand([]) == ["fit"]
    assert _with_subcommand(["--data.split", "test"]) == ["fit", "--data.split", "test"]
    assert _with_subcommand(["--trainer.max_steps", "3", "validate"])[0] == "fit"
    assert _with_subcommand(["validate", "--ckpt_path", "x.ckpt"]) == ["validate", "--ckpt_path", "x.ckpt"]
    assert _with_subcommand(["--help"]) == ["--help"]


def tensorboard_loggers(cli):
    from lightning.pytorch.loggers import TensorBoardLogger

    return [lg for lg in cli.trainer.loggers if isinstance(lg, TensorBoardLogger)]


def test_tensorboard_logger_without_save_dir_writes_into_the_run_folder(tmp_path):
    from align.cli.arguments import resolve_config_args

    (tmp_path / "version_0").mkdir()  # an earlier run: this one is version_1
    args = ["--config", str(ROOT / "configs" / "sft" / "tiny.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    for form in (
        ["--trainer.logger+=lightning.pytorch.loggers.TensorBoardLogger"],
        ["--trainer.logger+", "TensorBoardLogger", "--trainer.logger.name", "ignored"],
    ):
        cli = AlignCLI(args=resolve_config_args([*args, *form]), run=False)
        (tb,) = tensorboard_loggers(cli)
        assert cli.trainer.loggers[0].log_dir == tb.log_dir == str(tmp_path / "version_1")


def test_tensorboard_logger_in_yaml_with_or_without_a_save_dir_of_its_own(tmp_path):
    config = yaml.safe_load((ROOT / "configs" / "sft" / "tiny.yaml").read_text())
    tb = "lightning.pytorch.loggers.TensorBoardLogger"
    config["trainer"]["logger"] = [
        {"class_path": tb, "init_args": {"save_dir": "align:run"}},
        {"class_path": tb, "init_args": {"save_dir": str(tmp_path / "tb")}},
    ]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    cli = AlignCLI(
        args=["--config", str(tmp_path / "c.yaml"), "--trainer.default_root_dir", str(tmp_path / "r")], run=False
    )
    in_run, own = tensorboard_loggers(cli)
    assert in_run.log_dir == str(tmp_path / "r" / "version_0")
    assert own.log_dir == str(tmp_path / "tb" / "lightning_logs" / "version_0")  # Lightning's own layout


def test_missing_tensorboard_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    for name in ("tensorboard", "tensorboardX"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(SystemExit) as info:
        main(
            [
                "fit",
                "--config",
                str(ROOT / "configs" / "sft" / "tiny.yaml"),
                "--trainer.default_root_dir",
                str(tmp_path),
                "--trainer.logger+=lightning.pytorch.loggers.TensorBoardLogger",
            ]
        )
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "pip install 'align[tensorboard]'" in err[0], err
    assert not list(tmp_path.iterdir())


def test_a_failure_to_draw_the_curves_is_one_warning_not_a_failed_run(tmp_path, monkeypatch, caplog):
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger

    import align.cli.plots as plots

    logger = CSVLogger(tmp_path, name="", version=0)
    logger.log_metrics({"train/loss": 1.0}, step=0)  # buffered, not yet on disk
    cli = object.__new__(AlignCLI)
    cli.trainer = SimpleNamespace(loggers=[logger])
    assert cli._write_curves() == str(tmp_path / "version_0" / "curves.png")  # the buffered row was flushed
    monkeypatch.setattr(plots, "plot_runs", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no font\nmore")))
    assert cli._write_curves() is None
    (record,) = [r for r in caplog.records if "curves" in r.getMessage()]
    assert record.levelname == "WARNING" and record.getMessage() == "curves: not written: RuntimeError: no font"


def test_align_help_lists_every_command(capsys):
    main(["--help"])
    out = capsys.readouterr().out
    commands = [line.split()[0] for line in out.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()]
    assert commands == list(COMMANDS) and {"fit", "validate", "export", "plot"} <= set(commands)
    assert "align plot RUN_DIR [RUN_DIR ...]" in out and "align export --ckpt_path CKPT --output_dir DIR" in out


def test_gym_recipe_config_replaces_its_default(tmp_path):
    """recipes/gym.py's configs name different modules: a --config replaces the default PPO config instead of
    being layered on it, so no PPO setting (its linear learning-rate decay) leaks into DQN."""

    def printed(*args):
        return subprocess.run(
            [sys.executable, str(ROOT / "recipes" / "gym.py"), *args, "--print_config"],
            capture_output=True,
            text=True,
            check=True,
            cwd=tmp_path,
        ).stdout

    default = printed()
    assert "class_path: align.gym.PPOGymModule" in default and "lr_schedule: linear" in default
    dqn = printed("--config", str(ROOT / "configs" / "gym" / "dqn-cartpole.yaml"))
    assert "class_path: align.gym.DQNGymModule" in dqn and "lr_schedule: constant" in dqn
