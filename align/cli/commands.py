"""The ``align`` commands: :data:`COMMANDS` says what each does (``align --help``) and where its entry point is."""

from __future__ import annotations

import sys

from align.cli.arguments import CONFIG_DIR

# The ``align`` commands: what each does (for ``align --help``) and, beside LightningCLI's ``fit`` and
# ``validate``, the ``module:function`` of its entry point (imported when the command runs).
COMMANDS = {
    "fit": ("train: align fit --config align:grpo/tiny.yaml [--model.<setting> VALUE ...]", None),
    "validate": ("evaluate a config's held-out set: align validate --config FILE [--ckpt_path CKPT]", None),
    "export": ("write a merged Hugging Face model folder from a checkpoint: align export --ckpt_path CKPT "
               "--output_dir DIR", "align.cli.main:export_main"),
    "plot": ("draw runs' curves into a PNG: align plot RUN_DIR [RUN_DIR ...] [--output PNG] [--metrics NAME ...]",
             "align.cli.main:plot_main"),
    "generate": ("sample completions of a prompt file: align generate --model CKPT|DIR|ID --prompts FILE "
                 "--output OUT.jsonl", "align.cli.generation:generate_main"),
    "evaluate": ("rewards, accuracy, pass@k and win rate on a prompt file: align evaluate --model CKPT --prompts "
                 "FILE --rewards FN", "align.cli.generation:evaluate_main"),
    "chat": ("talk to a model in the terminal: align chat --model CKPT|DIR|ID", "align.cli.generation:chat_main"),
}


def top_level_help() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: align <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (what, _) in COMMANDS.items()]
    lines += ["", "align <command> --help lists a command's options; for fit and validate, --model.help CLASS and "
              "--data.help CLASS list a class's settings. Shipped configs: align:<algorithm>/<name>.yaml "
              f"({', '.join(sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir()))})."]
    return "\n".join(lines)


def not_a_subcommand(name: str) -> None:
    print(f"error: 'align {name}' is not a command; use 'align evaluate' for held-out rewards and accuracy, or "
          "'align generate' for completions of a prompt file (docs/generation.md)", file=sys.stderr)
    raise SystemExit(2)
