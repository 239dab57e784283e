"""``recipes/<algorithm>.py``: :func:`run_recipe` runs :class:`~align.cli.lightning_cli.AlignCLI` over the shipped
``align:<algorithm>/tiny.yaml`` (``fit`` unless another subcommand comes first), and :func:`recipe_help` is a
recipe's ``--help``: its model's and data's settings, and the common trainer settings.
"""

from __future__ import annotations

import sys
from pathlib import Path

from align.cli.arguments import CONFIG_DIR, SHIPPED, resolve_config_args
from align.cli.commands import REMOVED_SUBCOMMANDS, not_a_subcommand
from align.cli.config_errors import guarded
from align.cli.lightning_cli import SUBCOMMANDS, TRAINER_DEFAULTS, AlignCLI


def _with_subcommand(args: list[str]) -> list[str]:
    """Recipes run ``fit`` when no subcommand is given. A subcommand comes first: a later ``test`` is a value
    (``--data.split test``), not a subcommand."""
    if args[:1] and args[0] in (*SUBCOMMANDS, "-h", "--help"):
        return args
    return ["fit", *args]


def run_recipe(
    algorithm: str,
    model_class,
    datamodule_class,
    args: list[str] | None = None,
    default_config: str = "tiny.yaml",
    layered: bool = True,
) -> AlignCLI | None:
    """Entry point of ``recipes/<algorithm>.py``: the shipped ``align:<algorithm>/<default_config>`` is the default
    config. ``layered``: a ``--config`` is applied on top of it; otherwise a ``--config`` replaces it (a recipe whose
    configs name different modules: settings of one module's default must not leak into another's). Returns the
    CLI, or None after printing the recipe's help (``-h``, ``--help``)."""
    raw = list(sys.argv[1:] if args is None else args)
    if raw[:1] and raw[0] in REMOVED_SUBCOMMANDS:
        not_a_subcommand(raw[0])
    default = CONFIG_DIR / algorithm / default_config
    use_default = default.exists() and (layered or not any(a == "--config" or a.startswith("--config=") for a in raw))
    parser_kwargs = {sub: {"default_config_files": [str(default)]} for sub in SUBCOMMANDS} if use_default else {}
    trainer_defaults = dict(TRAINER_DEFAULTS, default_root_dir=f"runs/{algorithm}")
    if raw in (["-h"], ["--help"]):  # "fit --help" stays the full list, trainer settings included

        def make():
            return AlignCLI(
                model_class, datamodule_class, args=None, parser_kwargs=parser_kwargs, trainer_defaults=trainer_defaults
            )

        print(recipe_help(algorithm, model_class, datamodule_class, make, default_config, layered))
        return None
    args = guarded(lambda: resolve_config_args(_with_subcommand(raw)))
    # The arguments travel in ``sys.argv``, not ``args``: with ``--trainer.devices N`` Lightning starts the other
    # ranks by re-running this script with ``sys.argv``, and they must see the same subcommand and overrides.
    sys.argv = [sys.argv[0], *args]
    return guarded(
        lambda: AlignCLI(
            model_class, datamodule_class, args=None, parser_kwargs=parser_kwargs, trainer_defaults=trainer_defaults
        )
    )


COMMON_TRAINER_SETTINGS = (
    "max_steps",
    "log_every_n_steps",
    "val_check_interval",
    "default_root_dir",
    "devices",
    "strategy",
    "precision",
    "accumulate_grad_batches",
    "enable_progress_bar",
)


def recipe_help(
    algorithm: str, model_class, datamodule_class, make_cli, default_config: str = "tiny.yaml", layered: bool = True
) -> str:
    """``recipes/<algorithm>.py --help``: how to run it, then every setting of its model and data classes with
    defaults and descriptions (jsonargparse's ``--model.help``/``--data.help``), and the common trainer settings.
    A recipe whose default config names a subclass of ``model_class`` (classic RL) shows that subclass; one without
    a data class shows no data settings."""
    import contextlib
    import importlib
    import io

    import yaml

    default = CONFIG_DIR / algorithm / default_config
    named = (
        ((yaml.safe_load(default.read_text()) or {}).get("model") or {}).get("class_path") if default.exists() else None
    )
    if named and "." in named:
        module_name, _, class_name = named.rpartition(".")
        model_class = getattr(importlib.import_module(module_name), class_name, model_class)

    def class_help(group: str, cls) -> str:
        out = io.StringIO()
        argv, sys.argv = sys.argv, [sys.argv[0], "fit", f"--{group}.help", f"{cls.__module__}.{cls.__qualname__}"]
        try:
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                make_cli()
        finally:
            sys.argv = argv
        text = out.getvalue()
        body = text.split("\n\n", 2)[-1] if "Help for" in text else text  # drop the usage block
        return body.split(":\n", 1)[-1] if body.startswith("<class") else body

    script = Path(sys.argv[0]).name or f"{algorithm}.py"
    model = f"{model_class.__module__}.{model_class.__qualname__}"
    trainer = ", ".join(COMMON_TRAINER_SETTINGS)
    configs = ", ".join(
        f"{SHIPPED}{p.relative_to(CONFIG_DIR)}" for p in sorted((CONFIG_DIR / algorithm).glob("*.yaml"))
    )
    how = (
        "settings on the command line override it"
        if layered
        else "it replaces the default (each names its own module), and settings on the command line override it"
    )
    lines = [
        f"usage: {script} [--config FILE] [--print_config] [--model.<setting> VALUE]"
        + (" [--data.<setting> VALUE]" if datamodule_class is not None else "")
        + " [--trainer.<setting> VALUE]",
        "",
        f"Runs {model_class.__name__} (fit). With no arguments it trains on the shipped config "
        f"{SHIPPED}{algorithm}/{default_config}; --config takes a YAML file (or {SHIPPED}<algorithm>/<name>.yaml), and "
        f"{how}. --print_config prints the resolved config. Shipped: {configs}.",
        "Nested settings take their short form: --model.optimizer.lr 1e-4 sets model.init_args.optimizer."
        "init_args.lr"
        + (
            ", --model.policy.model NAME the model to load."
            if datamodule_class is not None
            else ", --model.env.id NAME the environment."
        ),
        "",
        f"model settings ({model}), as --model.<setting> or under model.init_args in YAML:",
        class_help("model", model_class).rstrip(),
    ]
    if datamodule_class is not None:
        data = f"{datamodule_class.__module__}.{datamodule_class.__qualname__}"
        lines += [
            "",
            f"data settings ({data}), as --data.<setting> or under data.init_args in YAML:",
            class_help("data", datamodule_class).rstrip(),
        ]
    lines += [
        "",
        f"trainer settings (Lightning's Trainer), as --trainer.<setting>; the common ones: {trainer}. "
        f"All of them: {script} fit --help",
    ]
    return "\n".join(lines)
