"""The command line: fit/validate, generate/evaluate/chat, export, plot, run folders and one-line config errors."""

from typing import Any


def __getattr__(name: str) -> Any:  # ``from align.cli import run_recipe`` (the recipes) without eager imports
    if name == "run_recipe":
        import importlib

        return importlib.import_module("align.cli.recipes").run_recipe
    raise AttributeError(f"module 'align.cli' has no attribute {name!r}")
