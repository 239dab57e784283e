"""Command line: ``align fit|validate|test|predict --config ...`` (LightningCLI) and ``align export``.

Every run writes its metrics to a CSV under the trainer's ``default_root_dir``; other loggers (for example
``align.observability.OTLPLogger``) are added alongside. Before and after ``fit`` the held-out set is
evaluated and the module's headline metrics are printed, so a run shows what it learned.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Literal

import lightning as L
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, Logger

import align.strategies  # noqa: F401  (registers the short names: --trainer.strategy fsdp2 / zero1..3 / zero3_offload)
from align.errors import AlignError

log = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
SUBCOMMANDS = ("fit", "validate", "test", "predict")
TRAINER_DEFAULTS = {"default_root_dir": "runs", "log_every_n_steps": 10, "num_sanity_val_steps": 0}


# Settings whose values are credentials: never written to the run directory's config.yaml.
SECRET_KEY = re.compile(r"^(headers|(hf_|auth_|access_|api_|bearer_)?token|(\w+_)?secret|password|passwd|(\w+_)?api_?key|"
                        r"authorization|credentials?)$", re.IGNORECASE)
REDACTED = "<redacted>"


def redact_secrets(value):
    """A copy of a parsed config with the values of secret-looking keys (OTLP ``headers``, ``token``,
    ``api_key``, ``password``...) replaced by ``<redacted>``."""
    from jsonargparse import Namespace

    def walk(v, key: str = ""):
        if SECRET_KEY.search(key) and v is not None and not isinstance(v, (bool, int, float)):
            return {k: REDACTED for k in v} if isinstance(v, dict) else REDACTED
        if isinstance(v, Namespace):
            out = Namespace()
            for k, item in vars(v).items():
                setattr(out, k, walk(item, k))
            return out
        if isinstance(v, dict):
            return {k: walk(item, str(k)) for k, item in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(walk(item) for item in v)
        return v

    return walk(value)


class RedactingSaveConfigCallback(SaveConfigCallback):
    """Lightning's config.yaml writer, with credentials redacted (pass them by environment variable, e.g.
    ``OTEL_EXPORTER_OTLP_HEADERS``, to re-run from the saved file)."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved:
            self.config = redact_secrets(self.config)
        super().setup(trainer, pl_module, stage)


class AlignCLI(LightningCLI):
    def __init__(self, model_class=None, datamodule_class=None, **kwargs):
        from align.modules.base import AlignModule

        # Frozen reference, reward and critic-initialising copies are kept in eval mode on purpose.
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("save_config_callback", RedactingSaveConfigCallback)
        kwargs.setdefault("trainer_defaults", dict(TRAINER_DEFAULTS))
        super().__init__(model_class or AlignModule, datamodule_class or L.LightningDataModule, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--eval_before_after", type=bool, default=True,
                            help="Evaluate the held-out set before and after fit and print the headline metrics.")
        parser.add_argument("--resume", type=Literal["never", "auto"], default="never",
                            help="auto: fit resumes from <default_root_dir>/checkpoints/last.ckpt when it exists "
                                 "(same as --ckpt_path last); never: only an explicit --ckpt_path resumes.")

    def _instantiate_trainer(self, config, callbacks):
        config = dict(config)
        root = config.get("default_root_dir") or "runs"
        _checkpoint_defaults(config, callbacks, root)
        logger = config.get("logger")
        if logger is not False:
            loggers: list[Logger] = [] if logger in (None, True) else list(logger) if isinstance(logger, (list, tuple)) else [logger]
            if not any(isinstance(lg, CSVLogger) for lg in loggers):
                loggers.insert(0, CSVLogger(save_dir=root, name=""))
            config["logger"] = loggers
        return super()._instantiate_trainer(config, callbacks)

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if subcommand == "fit" and kwargs.get("ckpt_path") is None and self.config[subcommand].get("resume") == "auto":
            kwargs["ckpt_path"] = "last"  # Lightning starts from scratch, with a warning, when there is none yet
        return kwargs

    def _headline(self, results: list[dict]) -> dict[str, float]:
        merged = {k: float(v) for r in results for k, v in r.items()}
        names = getattr(self.model, "headline_metrics", ()) or tuple(sorted(merged))
        return {k: merged[k] for k in names if k in merged}

    def _wants_eval(self) -> bool:
        return bool(self.config[self.subcommand].get("eval_before_after", True)) and self.datamodule is not None

    def before_fit(self) -> None:
        self._before = self._headline(self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)) \
            if self._wants_eval() else {}

    def after_fit(self) -> None:
        if not self._wants_eval() or self.trainer.interrupted:
            return
        after = self._headline(self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False))
        log_dir = self.trainer.log_dir  # a broadcast under several processes: every rank asks
        if self.trainer.is_global_zero:
            for name, value in after.items():
                before = self._before.get(name)
                shown = f"{before:.4f} -> {value:.4f}" if before is not None else f"{value:.4f}"
                print(f"held-out {name}: {shown}")
            print(f"run directory: {log_dir}")


def _checkpoint_defaults(config: dict, callbacks: list, root: str) -> None:
    """Checkpoints go to ``<root>/checkpoints`` (not a per-run version folder) so ``--ckpt_path last`` finds them
    from a new process; they are written atomically (``align.checkpointing``). Without a configured checkpoint
    callback, an :class:`~align.checkpointing.AlignCheckpoint` saves ``last.ckpt`` at the end of every epoch."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from align.checkpointing import AlignCheckpoint, default_checkpoint_dir

    configured = config.get("callbacks")
    configured = [] if configured is None else list(configured) if isinstance(configured, (list, tuple)) else [configured]
    checkpoints = [cb for cb in [*configured, *callbacks] if isinstance(cb, ModelCheckpoint)]
    for cb in checkpoints:
        if cb.dirpath is None:
            cb.dirpath = os.path.realpath(default_checkpoint_dir(root))
    if not checkpoints and config.get("enable_checkpointing") is not False:
        configured.append(AlignCheckpoint(dirpath=os.path.realpath(default_checkpoint_dir(root))))
        config["callbacks"] = configured


def _with_subcommand(args: list[str]) -> list[str]:
    """Recipes run ``fit`` when no subcommand is given."""
    if any(a in SUBCOMMANDS for a in args) or any(a in ("-h", "--help") for a in args[:1]):
        return args
    return ["fit", *args]


def run_recipe(algorithm: str, model_class, datamodule_class, args: list[str] | None = None) -> AlignCLI:
    """Entry point of ``recipes/<algorithm>.py``: ``configs/<algorithm>/tiny.yaml`` is the default config."""
    args = _with_subcommand(list(sys.argv[1:] if args is None else args))
    default = CONFIG_DIR / algorithm / "tiny.yaml"
    parser_kwargs = {sub: {"default_config_files": [str(default)]} for sub in SUBCOMMANDS} if default.exists() else {}
    trainer_defaults = dict(TRAINER_DEFAULTS, default_root_dir=f"runs/{algorithm}")
    # The arguments travel in ``sys.argv``, not ``args``: with ``--trainer.devices N`` Lightning starts the other
    # ranks by re-running this script with ``sys.argv``, and they must see the same subcommand and overrides.
    sys.argv = [sys.argv[0], *args]
    return _guarded(lambda: AlignCLI(model_class, datamodule_class, args=None, parser_kwargs=parser_kwargs,
                                     trainer_defaults=trainer_defaults))


def _guarded(fn):
    try:
        return fn()
    except AlignError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except ValueError as err:
        # jsonargparse re-raises errors from class instantiation as a ValueError caused by the original one.
        cause = err.__cause__
        while cause is not None and not isinstance(cause, AlignError):
            cause = cause.__cause__
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr)
        raise SystemExit(2) from None


def export_main(args: list[str]) -> None:
    import argparse

    from align.models.export import export_checkpoint

    parser = argparse.ArgumentParser(prog="align export", description="Write a merged Hugging Face model and "
                                     "tokenizer from an align checkpoint.")
    parser.add_argument("--ckpt_path", required=True, help="A checkpoint written by an align run (.ckpt).")
    parser.add_argument("--output_dir", required=True, help="Directory for the model and tokenizer.")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="Weight dtype.")
    ns = parser.parse_args(args)
    out = _guarded(lambda: export_checkpoint(ns.ckpt_path, ns.output_dir, dtype=ns.dtype))
    print(f"exported to {out}")


def main(args: list[str] | None = None) -> None:
    """The ``align`` console script."""
    args = list(sys.argv[1:] if args is None else args)
    logging.basicConfig(level=os.environ.get("ALIGN_LOG_LEVEL", "WARNING"))
    if args[:1] == ["export"]:
        return export_main(args[1:])
    _guarded(lambda: AlignCLI(args=args))


if __name__ == "__main__":
    main()
