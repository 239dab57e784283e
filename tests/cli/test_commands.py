"""The ``align`` command line's table of commands (align.cli.commands): what it answers before the heavy packages load
(--help, --version, a misspelt command or option), and ``align --help`` listing every command."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import align
from align.cli.commands import COMMANDS
from align.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "lightning", "transformers", "jsonargparse")


def run_align(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "align", *args], capture_output=True, text=True, cwd=ROOT, check=False)


def test_version_is_the_package_version():
    done = run_align("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"align {align.__version__}"
    assert run_align("-V").stdout == done.stdout
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1) == align.__version__


@pytest.mark.parametrize("word, nearest", [("fitt", "fit"), ("evaluat", "evaluate"), ("train", None)])
def test_a_misspelt_command_names_the_nearest_and_every_command(word, nearest):
    done = run_align(word)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: '{word}' is not a command; ")
    assert ("did you mean" in line) == (nearest is not None)
    if nearest:
        assert f"did you mean '{nearest}'?" in line
    assert all(f"'{name}'" in line for name in COMMANDS)


def test_an_unknown_option_before_the_command_is_one_line():
    done = run_align("--bogus")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: '--bogus' is not an option") and all(f"'{name}'" in line for name in COMMANDS)


def test_python_dash_m_align_is_the_align_command():
    done = run_align("--help")
    assert done.returncode == 0 and "usage: align <command>" in done.stdout
    assert all(f"\n  {name} " in done.stdout for name in COMMANDS)


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["fitt"], ["--bogus"], ["test"]])
def test_help_version_and_argument_errors_import_no_heavy_package(args):
    """They are answered from the parsed command alone: none of torch, Lightning, transformers or jsonargparse is
    imported (which took seconds)."""
    code = (
        "import sys\nfrom align.cli.main import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_align_help_lists_every_command(capsys):
    main(["--help"])
    out = capsys.readouterr().out
    commands = [line.split()[0] for line in out.split("commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()]
    assert commands == list(COMMANDS) and {"fit", "validate", "export", "plot"} <= set(commands)
    assert "align plot RUN_DIR [RUN_DIR ...]" in out and "align export --ckpt_path CKPT --output_dir DIR" in out
