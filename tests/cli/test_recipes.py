"""The recipes (align.cli.recipes): every shipped config parses and instantiates, the SFT recipe end to end, the
subcommand as the first argument only, the gym recipe's config replacing its default, and the recipes' --help."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from align.cli.lightning_cli import AlignCLI
from align.cli.recipes import run_recipe
from align.data import SFTDataModule
from align.hub.gguf import is_packaged
from align.modules import SFTModule

from ._commands import printed_config, read_metrics

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


def test_gym_recipe_config_replaces_its_default(tmp_path, capsys, monkeypatch):
    """recipes/gym.py's configs name different modules: a --config replaces the default PPO config instead of
    being layered on it, so no PPO setting (its linear learning-rate decay) leaks into DQN."""
    from align.gym import ClassicRLModule

    monkeypatch.chdir(tmp_path)
    gym = dict(default_config="ppo-cartpole.yaml", layered=False)  # as recipes/gym.py calls it
    default = printed_config(capsys, "gym", ClassicRLModule, None, **gym)
    assert "class_path: align.gym.PPOGymModule" in default and "lr_schedule: linear" in default
    dqn = printed_config(
        capsys, "gym", ClassicRLModule, None, "--config", str(ROOT / "configs" / "gym" / "dqn-cartpole.yaml"), **gym
    )
    assert "class_path: align.gym.DQNGymModule" in dqn and "lr_schedule: constant" in dqn


def test_recipe_help_lists_the_model_and_data_settings_with_defaults(capsys):
    run_recipe("sft", SFTModule, SFTDataModule, args=["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    for setting in (
        "--model.policy",
        "--model.optimizer",
        "--data.train_files",
        "--data.max_length",
        "--data.batch_size",
    ):
        assert setting in out, setting
    assert "default:" in out and "--model.optimizer.lr 1e-4" in out and "fit --help" in out


def test_gym_recipe_help_shows_its_default_module_and_no_data(capsys):
    from align.gym import ClassicRLModule

    run_recipe("gym", ClassicRLModule, None, args=["--help"], default_config="ppo-cartpole.yaml", layered=False)
    out = capsys.readouterr().out
    assert (
        "Runs PPOGymModule (fit)" in out
        and "align:gym/ppo-cartpole.yaml" in out
        and "align:gym/dqn-cartpole.yaml" in out
    )
    for setting in ("--model.updates.epochs", "--model.env.id", "--model.env.num_envs", "--model.total_steps"):
        assert setting in out, setting
    assert "--data." not in out and "it replaces the default" in out
