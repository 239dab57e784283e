"""A plain (non-editable) install carries the recipes' default configs: ``align fit --config align:...`` and a
recipe's built-in default work from the installed package alone, away from the checkout."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``pip install --target`` of a copy of the checkout (the build writes into its source tree)."""
    base = tmp_path_factory.mktemp("install")
    source = base / "src"
    shutil.copytree(
        ROOT,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git",
            "runs",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            ".hypothesis",
            "tests",
            "benchmarks",
        ),
    )
    target = base / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def run_installed(target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(target), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_wheel_ships_every_config(installed):
    shipped = sorted(
        p.relative_to(installed / "align" / "configs") for p in (installed / "align" / "configs").rglob("*.yaml")
    )
    assert shipped == sorted(p.relative_to(ROOT / "configs") for p in (ROOT / "configs").rglob("*.yaml"))
    assert not (installed / "align" / "configs").is_symlink()


def test_align_fit_trains_from_a_shipped_config_without_a_checkout(installed, tmp_path):
    where = run_installed(installed, tmp_path, "-c", "import align; print(align.__file__)")
    assert where.stdout.strip().startswith(str(installed)), where  # the installed copy, not the checkout's
    proc = run_installed(
        installed,
        tmp_path,
        "-m",
        "align.cli.main",
        "fit",
        "--config",
        "align:sft/tiny.yaml",
        "--trainer.max_steps",
        "1",
        "--trainer.log_every_n_steps",
        "1",
        "--eval_before_after",
        "false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "sft" / "version_0"  # the shipped config's default_root_dir, under the working directory
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "metrics.csv").is_file()
    assert "train/loss" in (run / "metrics.csv").read_text()


def test_a_recipe_finds_its_default_config_in_the_installed_package(installed, tmp_path):
    script = tmp_path / "my_recipe.py"  # a recipe script outside any checkout
    script.write_text(
        "from align.cli import run_recipe\nfrom align.data import SFTDataModule\n"
        "from align.modules import SFTModule\n\nrun_recipe('sft', SFTModule, SFTDataModule)\n"
    )
    proc = run_installed(
        installed, tmp_path, str(script), "--trainer.max_steps", "1", "--eval_before_after", "false", "--print_config"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "class_path: align.modules.SFTModule" in proc.stdout and "default_root_dir: runs/sft" in proc.stdout
