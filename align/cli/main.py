"""Command line: ``align fit|validate --config ...`` (LightningCLI, :mod:`align.cli.lightning_cli`), and
``align export``, ``align plot``, ``align generate``, ``align evaluate`` and ``align chat`` (argparse;
:mod:`align.cli.generation`); ``align --help`` lists them (:data:`~align.cli.commands.COMMANDS`), ``align --version``
prints the version. ``python -m align`` is the same command.

The command is read before anything heavy is imported: ``--help``, ``--version`` and a first argument that is no
command are answered in a fraction of a second, and Lightning, torch and transformers load only for a command that
runs.

Every run is one folder, ``<default_root_dir>/version_N/`` (:mod:`align.cli.lightning_cli`). ``--config
align:<algorithm>/<name>.yaml`` names a config shipped inside the package (``align/configs``), so an installed
``align`` runs them without a checkout (:mod:`align.cli.arguments`).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from align.cli.commands import (
    COMMANDS,
    REMOVED_SUBCOMMANDS,
    TOP_LEVEL_OPTIONS,
    not_a_command,
    not_a_subcommand,
    top_level_help,
)


def export_main(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="align export", description="Write a merged Hugging Face model and tokenizer from an align checkpoint."
    )
    parser.add_argument("--ckpt_path", required=True, help="A checkpoint written by an align run (.ckpt).")
    parser.add_argument("--output_dir", required=True, help="Directory for the model and tokenizer.")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="Weight dtype.")
    ns = parser.parse_args(args)

    from align.cli.config_errors import guarded
    from align.models.export import export_checkpoint

    out = guarded(lambda: export_checkpoint(ns.ckpt_path, ns.output_dir, dtype=ns.dtype))
    print(f"exported to {out}")


def plot_main(args: list[str]) -> None:
    """``align plot RUN_DIR [RUN_DIR ...] [--output PATH] [--metrics NAME ...]`` (see
    :func:`align.cli.plots.main`)."""
    from align.cli.config_errors import guarded
    from align.cli.plots import main as plot

    guarded(lambda: plot(args))


def main(args: list[str] | None = None) -> None:
    """The ``align`` console script (and ``python -m align``)."""
    from_argv = args is None
    args = list(sys.argv[1:] if args is None else args)
    if args in ([], ["-h"], ["--help"]):
        return print(top_level_help())
    if args[0] in ("-V", "--version"):
        from align import __version__

        return print(f"align {__version__}")
    if args[0] in REMOVED_SUBCOMMANDS:
        return not_a_subcommand(args[0])
    if args[0] not in COMMANDS and args[0].partition("=")[0] not in TOP_LEVEL_OPTIONS:
        return not_a_command(args[0])
    # Lightning before the root logger's handler: its packages print their own lines (plain, once) only when the root
    # logger has none at import.
    import lightning.pytorch  # noqa: F401

    logging.basicConfig(level=os.environ.get("ALIGN_LOG_LEVEL", "WARNING"))
    from align.cli.quiet import quiet_known_noise

    quiet_known_noise()
    entry = COMMANDS.get(args[0], (None, None))[1]
    if entry is not None:
        module, _, function = entry.partition(":")
        return getattr(importlib.import_module(module), function)(args[1:])
    from align.cli.arguments import resolve_config_args
    from align.cli.config_errors import guarded
    from align.cli.lightning_cli import AlignCLI

    args = guarded(lambda: resolve_config_args(args))
    if from_argv:  # other ranks re-run ``sys.argv``; LightningCLI reads it when given no ``args``
        sys.argv = [sys.argv[0], *args]
    guarded(lambda: AlignCLI(args=None if from_argv else args))


if __name__ == "__main__":
    main()
