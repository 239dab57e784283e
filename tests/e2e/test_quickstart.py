"""The documented commands work as printed: the SFT quickstart (docs/quickstart.md: train, the run folder it names,
export, load the export) and the resume of docs/reliability.md, run verbatim in a fresh working directory, each
training command with a few steps only."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = (ROOT / "docs" / "quickstart.md").read_text()
RELIABILITY = (ROOT / "docs" / "reliability.md").read_text()
SFT_DATA = ROOT / "align" / "data" / "assets" / "sort" / "sft"
FEW_STEPS = ["--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false"]

pytestmark = pytest.mark.slow


def commands(page: str, section: str) -> list[str]:
    """Every command line of the ```bash blocks under the heading ``## <section>`` of a docs page."""
    body = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", page, re.S | re.M)
    assert body, f"no section '{section}'"
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", body.group(1), re.S):
        for line in block.splitlines():
            line = re.sub(
                r"\s+#.*$", "", line
            ).strip()  # trailing comments; '#' inside quotes is not preceded by a space
            if line and not line.startswith("#"):
                lines.append(line)
    assert lines, f"section '{section}' has no commands"
    return lines


def argv(command: str) -> list[str]:
    """The command as the test runs it: ``align`` is the console script (``python -m align.cli.main``), and training
    commands get a few steps only."""
    words = shlex.split(command)
    if words[0] == "align":
        words = [sys.executable, "-m", "align.cli.main", *words[1:]]
    elif words[0] == "python":
        words = [sys.executable, *words[1:]]
    if any(w.startswith("recipes/") for w in words) or words[3:4] == ["fit"]:
        words += FEW_STEPS
    return words


def run_verbatim(command: str, cwd: Path, *extra: str) -> str:
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    proc = subprocess.run([*argv(command), *extra], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-3000:])
    return proc.stdout


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A user's working directory with the checkout's recipes/ and configs/, and the data files the quickstart's
    own-data example names."""
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    for name, src in (("my_data.jsonl", "train.jsonl"), ("my_val.jsonl", "validation.jsonl")):
        rows = (SFT_DATA / src).read_text().splitlines()[:16]
        (tmp_path / name).write_text("\n".join(rows) + "\n")
        assert all(json.loads(r) for r in rows)
    return tmp_path


def test_sft_quickstart_commands_work_as_printed(workdir):
    outputs = [run_verbatim(c, workdir) for c in commands(QUICKSTART, "SFT")]
    # The first run is the one the quickstart shows: its folder, then the export of its last checkpoint.
    printed = re.search(r"^run directory: (\S+)$", QUICKSTART, re.M).group(1)
    assert f"run directory: {printed}" in outputs[0], outputs[0][-2000:]
    export = next(c for c in commands(QUICKSTART, "SFT") if c.startswith("align export"))
    ckpt = shlex.split(export)[shlex.split(export).index("--ckpt_path") + 1]
    assert ckpt.startswith(printed + "/") and (workdir / ckpt).is_file()
    assert (workdir / "exported" / "config.json").is_file()
    # Every training command started its own run folder.
    trained = [c for c in commands(QUICKSTART, "SFT") if "recipes/" in c or c.startswith("align fit")]
    assert len(list((workdir / printed).parent.glob("version_*"))) == len(trained)


def test_reliability_resume_commands_work_as_printed(workdir):
    _, last, auto = commands(RELIABILITY, "Resuming a run")  # a first launch, then its two ways of continuing
    assert last.endswith("--ckpt_path last") and auto == last.replace("--ckpt_path last", "--resume auto")
    words = shlex.split(last)
    root = workdir / words[words.index("--trainer.default_root_dir") + 1]
    assert "starting version_0" in run_verbatim(last, workdir)  # nothing to resume yet: a fresh run
    # The same command again continues that run, in its own folder; so does --resume auto.
    assert f"resume: continuing {root.relative_to(workdir) / 'version_0'}" in run_verbatim(
        last, workdir, "--trainer.max_steps", "3"
    )
    assert "resume: continuing" in run_verbatim(auto, workdir, "--trainer.max_steps", "4")
    assert sorted(p.name for p in root.glob("version_*")) == ["version_0"]
