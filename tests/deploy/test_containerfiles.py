"""The images' recipes, ``deploy/Containerfile.*``, read as instructions: a pinned base, the package installed
from the checkout, a non-root user, and an entrypoint that runs ``align``; the ignore file keeps the build context
small without dropping what the images copy; the entrypoint passes align commands to align and runs anything else."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from _render import DEPLOY, ROOT

CONTAINERFILES = sorted(DEPLOY.glob("Containerfile.*"))


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined and comment lines dropped."""
    steps, current = [], ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        keyword, _, rest = current.strip().partition(" ")
        steps.append((keyword.upper(), " ".join(rest.split())))
        current = ""
    assert not current, f"{path.name}: ends inside a continued line"
    return steps


def arguments(steps, keyword: str) -> list[str]:
    return [rest for key, rest in steps if key == keyword]


def copy_sources(rest: str) -> list[str]:
    """What a ``COPY [--flag ...] SOURCE ... DEST`` copies."""
    return [word for word in rest.split()[:-1] if not word.startswith("--")]


def installs_checkout(command: str) -> bool:
    """Whether a shell command runs ``pip install`` on the build's working folder (``.`` or ``.[extras]``)."""
    words = shlex.split(command)
    return any(
        words[i : i + 2] == ["pip", "install"] and any(w == "." or w.startswith(".[") for w in words[i + 2 :])
        for i in range(len(words))
    )


def test_there_is_a_cuda_and_a_cpu_image():
    assert [p.name for p in CONTAINERFILES] == ["Containerfile.cpu", "Containerfile.cuda"]


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.name)
def test_the_base_is_pinned_to_a_release_or_a_digest(path):
    bases = arguments(instructions(path), "FROM")
    assert bases, path.name
    for base in bases:
        image = base.split()[0]
        tag = image.rpartition("/")[2].partition(":")[2]
        pinned = re.search(r"@sha256:[0-9a-f]{64}$", image) or re.match(r"\d+\.\d+\.\d+(-[\w.-]+)?$", tag)
        assert pinned and "latest" not in tag, f"{path.name}: FROM {image}: pin a release (x.y.z) tag or a digest"


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.name)
def test_the_image_installs_the_checkout_and_runs_as_a_user_who_is_not_root(path):
    steps = instructions(path)
    keywords = [key for key, _ in steps]
    copied = {source.rstrip("/") for key, rest in steps if key == "COPY" for source in copy_sources(rest)}
    assert {"pyproject.toml", "README.md", "LICENSE", "align"} <= copied  # LICENSE: pyproject.toml's license-files
    installs = [i for i, (key, rest) in enumerate(steps) if key == "RUN" and installs_checkout(rest)]
    assert installs, f"{path.name}: no `pip install .` of the checkout"
    assert installs[0] > max(i for i, (key, rest) in enumerate(steps) if key == "COPY" and "align" in rest.split())
    users = arguments(steps, "USER")
    assert users, f"{path.name}: no USER: the image would run as root"
    user = users[-1].split(":")[0]
    # numeric: Kubernetes' runAsNonRoot can check a uid, not a name
    assert user.isdigit() and int(user) != 0, f"{path.name}: USER {users[-1]}: expected a non-zero numeric uid"
    assert keywords.index("USER") > installs[0] and max(i for i, key in enumerate(keywords) if key == "USER") > max(
        i for i, key in enumerate(keywords) if key == "RUN"
    )


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.name)
def test_the_entrypoint_runs_align(path):
    steps = instructions(path)
    (entrypoint,) = arguments(steps, "ENTRYPOINT")
    entrypoint = json.loads(entrypoint)  # the exec form: signals reach the process
    (script,) = entrypoint
    copies = [rest.split() for key, rest in steps if key == "COPY" and rest.split()[-1] == script]
    assert copies and copies[-1][-2] == "deploy/entrypoint.sh", f"{path.name}: {script} is not deploy/entrypoint.sh"
    assert json.loads(arguments(steps, "CMD")[-1]) == ["--help"]


def test_the_cuda_image_carries_deepspeed_and_vllm():
    runs = " ".join(arguments(instructions(DEPLOY / "Containerfile.cuda"), "RUN"))
    assert re.search(r'pip install "?\.\[deepspeed\]"?', runs)
    assert re.search(r'"?vllm==(\$\{VLLM_VERSION\}|\d[\w.]*)"?', runs)
    assert re.search(r"ARG VLLM_VERSION=\d+\.\d+\.\d+", (DEPLOY / "Containerfile.cuda").read_text())


def test_the_ignore_file_keeps_what_the_images_copy():
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".git", "runs", "*.ckpt", "tests"} <= set(ignored)
    for path in CONTAINERFILES:
        for key, rest in instructions(path):
            if key != "COPY":
                continue
            for source in copy_sources(rest):
                assert (ROOT / source).exists(), f"{path.name}: COPY {source}: not in the checkout"
                parts = Path(source).parts
                prefixes = {"/".join(parts[:i]) for i in range(1, len(parts) + 1)}
                assert not prefixes & set(ignored), f".dockerignore drops {source}, which {path.name} copies"


# ------------------------------------------------------------------------------------------------ the entrypoint


@pytest.fixture
def stub_align(tmp_path) -> dict:
    """An environment whose ``align`` only says how it was called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "align"
    stub.write_text('#!/bin/sh\necho "align $*"\n')
    stub.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def entrypoint(env: dict, *args: str) -> str:
    proc = subprocess.run(
        [shutil.which("sh"), str(DEPLOY / "entrypoint.sh"), *args],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_entrypoint_runs_align_commands_and_any_other_program(stub_align):
    assert entrypoint(stub_align, "fit", "--config", "c.yaml") == "align fit --config c.yaml"
    assert entrypoint(stub_align, "export", "--ckpt_path", "x.ckpt") == "align export --ckpt_path x.ckpt"
    assert entrypoint(stub_align) == "align"  # align alone prints its help
    assert entrypoint(stub_align, "--help") == "align --help"
    assert entrypoint(stub_align, "echo", "vllm", "serve") == "vllm serve"


def test_the_entrypoint_knows_every_align_command():
    from align.cli.commands import COMMANDS

    text = (DEPLOY / "entrypoint.sh").read_text()
    (pattern,) = re.findall(r"^\s*([\w|*-]+)\) exec align", text, flags=re.MULTILINE)
    assert set(pattern.split("|")) - {"-*"} == set(COMMANDS)
    assert os.access(DEPLOY / "entrypoint.sh", os.X_OK)
