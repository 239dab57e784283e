"""The ``align`` commands: :data:`COMMANDS` says what each does (``align --help``) and where its entry point is.

This module imports nothing heavy: ``align --help``, ``align --version`` and a misspelt command are answered from it
before Lightning, torch or transformers are imported (:func:`align.cli.main.main`).
"""

from __future__ import annotations

import difflib
import sys

from align.cli.arguments import CONFIG_DIR

# The ``align`` commands: what each does (for ``align --help``) and, beside LightningCLI's ``fit`` and
# ``validate``, the ``module:function`` of its entry point (imported when the command runs).
COMMANDS = {
    "fit": ("train: align fit --config align:grpo/tiny.yaml [--model.<setting> VALUE ...]", None),
    "validate": ("evaluate a config's held-out set: align validate --config FILE [--ckpt_path CKPT]", None),
    "export": (
        "write a merged Hugging Face model folder from a checkpoint: align export --ckpt_path CKPT --output_dir DIR",
        "align.cli.main:export_main",
    ),
    "plot": (
        "draw runs' curves into a PNG: align plot RUN_DIR [RUN_DIR ...] [--output PNG] [--metrics NAME ...]",
        "align.cli.main:plot_main",
    ),
    "generate": (
        "sample completions of a prompt file: align generate --model CKPT|DIR|ID --prompts FILE --output OUT.jsonl",
        "align.cli.generation:generate_main",
    ),
    "evaluate": (
        "rewards, accuracy, pass@k and win rate on a prompt file: align evaluate --model CKPT --prompts "
        "FILE --rewards FN",
        "align.cli.generation:evaluate_main",
    ),
    "chat": ("talk to a model in the terminal: align chat --model CKPT|DIR|ID", "align.cli.generation:chat_main"),
}


REMOVED_SUBCOMMANDS = ("test", "predict")
"""LightningCLI subcommands ``align`` does not offer: the modules have no ``test_step``/``predict_step``;
``align evaluate`` and ``align generate`` do that work."""

# Options LightningCLI takes before the subcommand (``align --config FILE fit``, a config with a block per
# subcommand); any other option there is an error.
TOP_LEVEL_OPTIONS = ("-c", "--config", "--print_config")


def top_level_help() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: align <command> [options]  |  align --version", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (what, _) in COMMANDS.items()]
    lines += [
        "",
        "align <command> --help lists a command's options; for fit and validate, --model.help CLASS and "
        "--data.help CLASS list a class's settings. Shipped configs: align:<algorithm>/<name>.yaml "
        f"({', '.join(sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir()))}).",
    ]
    return "\n".join(lines)


def not_a_subcommand(name: str) -> None:
    print(
        f"error: 'align {name}' is not a command; use 'align evaluate' for held-out rewards and accuracy, or "
        "'align generate' for completions of a prompt file (docs/generation.md)",
        file=sys.stderr,
    )
    raise SystemExit(2)


def not_a_command(name: str) -> None:
    """``error: ...`` on one line for a first argument that is no command (``align fitt``, ``align --bogus``),
    with the nearest command and every command to choose from; exit status 2, as argparse's."""
    close = difflib.get_close_matches(name, list(COMMANDS), n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    what = "a command" if not name.startswith("-") else "an option align takes before its command"
    print(
        f"error: '{name}' is not {what}; {hint}choose a command from {', '.join(repr(c) for c in COMMANDS)} "
        "(align --help says what each does)",
        file=sys.stderr,
    )
    raise SystemExit(2)
