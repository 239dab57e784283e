"""The documentation: the site builds with ``mkdocs build --strict`` (a broken link or anchor, a page missing from the
nav, a snippet or a docstring cross reference that does not resolve is an error; mkdocs.yml), every layer of the
package has its API page, and the relative links of README.md and CONTRIBUTING.md, which GitHub renders and the
site does not check, point at files and headings that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs tools come with the dev extra")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            "mkdocs.yml",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    problems = [line for line in proc.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0, "\n".join(problems) or proc.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "core" / "index.html").is_file()


def nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_layer_has_an_api_page_in_the_nav():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)  # BaseLoader: no python tags
    pages = nav_pages(config["nav"])
    layers = sorted(p.parent.name for p in (ROOT / "align").glob("*/__init__.py"))
    for layer in layers:
        page = f"api/{layer}.md"
        assert page in pages, (
            f"align/{layer}/ has no API page in the nav of mkdocs.yml (docs/{page}: ::: align.{layer})"
        )
        assert f"::: align.{layer}\n" in (ROOT / "docs" / page).read_text(), (
            f"docs/{page} does not render align.{layer}"
        )


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (the site's slugs are the same: mkdocs.yml's toc)."""
    from pymdownx.slugs import slugify

    slug = slugify(case="lower")
    anchors: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6} (.+)", line)
        if heading:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "").strip()
            base = anchor = slug(text, "-")
            n = 0
            while anchor in anchors:
                n += 1
                anchor = f"{base}-{n}"
            anchors.add(anchor)
    return anchors


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md"])
def test_the_relative_links_of_the_root_pages_resolve(name):
    pytest.importorskip("pymdownx", reason="the docs tools come with the dev extra")
    text = (ROOT / name).read_text()
    links = [
        target
        for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.DOTALL))
        if not re.match(r"[a-z]+:", target)
    ]
    assert links, f"{name} links to nothing"
    for target in links:
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else ROOT / name
        assert file.exists(), f"{name}: link to {target}: no file {path}"
        if anchor:
            assert anchor in github_anchors(file.read_text()), f"{name}: link to {target}: no heading #{anchor}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = 'pip install -e ".[dev]" && pip uninstall -y torchvision torchaudio torchcodec && python -m pytest'
    assert f"```bash\n{command}\n```" in readme
    assert command in (ROOT / ".ci" / "run").read_text()
    assert "```bash\npip install -e . && python recipes/grpo.py\n```" in readme
