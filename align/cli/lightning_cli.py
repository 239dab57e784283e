"""``align fit|validate`` (LightningCLI): :class:`AlignCLI` and its run folders.

Every run is one folder, ``<default_root_dir>/version_N/``, holding its ``config.yaml`` (credentials redacted),
``metrics.csv``, ``checkpoints/`` and, once ``fit`` ends, ``curves.png`` (``align.cli.plots``); other loggers (for
example ``align.observability.OTLPLogger``) are added alongside, and a TensorBoardLogger given no ``save_dir``
writes its event files into the run folder too. ``--resume auto`` continues the newest run of the root in its own
folder. Before and after ``fit`` the held-out set is evaluated and the module's headline metrics are printed, so a
run shows what it learned.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.model_helpers import is_overridden

import align.trainer.strategies  # noqa: F401  (registers the short names: --trainer.strategy fsdp2 / zero1..3 / zero3_offload)
from align.cli.arguments import RUN_FOLDER
from align.cli.config_errors import AlignArgumentParser
from align.cli.quiet import parameter_count, quiet_known_noise
from align.cli.runs import RunLogger, RunRecord, latest_run, next_version, run_of_checkpoint
from align.cli.secrets import RedactingSaveConfigCallback
from align.errors import AlignConfigError
from align.trainer.progress import say

log = logging.getLogger(__name__)

SUBCOMMANDS = ("fit", "validate")
# Lightning's model table is off (its FLOPs column reads 0 for align's modules); a run prints
# :func:`align.cli.quiet.parameter_count` instead, and ``--trainer.enable_model_summary true`` brings the table back.
TRAINER_DEFAULTS = {
    "default_root_dir": "runs",
    "log_every_n_steps": 10,
    "num_sanity_val_steps": 0,
    "enable_model_summary": False,
}


TENSORBOARD_EXTRA = "pip install 'align[tensorboard]'"


class AlignCLI(LightningCLI):
    def __init__(self, model_class=None, datamodule_class=None, **kwargs):
        from align.modules.base import TrainingModule

        quiet_known_noise()
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("save_config_callback", RedactingSaveConfigCallback)
        kwargs.setdefault("trainer_defaults", dict(TRAINER_DEFAULTS))
        kwargs.setdefault("parser_class", AlignArgumentParser)
        super().__init__(model_class or TrainingModule, datamodule_class, **kwargs)

    def init_parser(self, **kwargs):
        from align.cli.commands import COMMANDS

        others = ", ".join(f"align {name}" for name, (_, entry) in COMMANDS.items() if entry is not None)
        kwargs.setdefault(
            "description",
            "Train with a config (fit), or evaluate its held-out set (validate). Other "
            f"commands: {others}; each takes --help, and align --help says what each does.",
        )
        return super().init_parser(**kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate`` only (:data:`~align.cli.commands.REMOVED_SUBCOMMANDS`)."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k in SUBCOMMANDS}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--eval_before_after",
            type=bool,
            default=True,
            help="Evaluate the held-out set before and after fit and print the headline metrics.",
        )
        parser.add_argument(
            "--resume",
            type=Literal["never", "auto"],
            default="never",
            help="auto: fit continues the newest run under <default_root_dir> (version_N/checkpoints/"
            "last.ckpt, same as --ckpt_path last) in its own folder, or starts version_0 when "
            "there is none; never: only an explicit --ckpt_path resumes.",
        )

    def _instantiate_trainer(self, config, callbacks):
        config = dict(config)
        root = str(config.get("default_root_dir") or "runs")
        version = self._choose_run(root)
        self.record = RunRecord()
        callbacks = [self.record, *callbacks]
        _checkpoint_defaults(config, callbacks)
        _progress_bar_default(config, callbacks)
        logger = config.get("logger")
        self._fresh_run = self.subcommand == "fit" and version is None
        if self.subcommand == "validate" and logger in (None, True):
            # A held-out evaluation is printed, not a run: no version_N folder, no config.yaml, no metrics.csv.
            config["logger"], logger, self.save_config_callback = False, False, None
        if logger is not False:
            loggers: list[Logger] = (
                [] if logger in (None, True) else list(logger) if isinstance(logger, (list, tuple)) else [logger]
            )
            csv_loggers = [lg for lg in loggers if isinstance(lg, CSVLogger)]
            if not csv_loggers:
                csv_loggers = [RunLogger(root, version=version, append=version is not None)]
            # Lightning names the checkpoint folder after the first logger's version: the run's CSV logger.
            others = [_into_run_folder(lg, csv_loggers[0]) for lg in loggers if lg is not csv_loggers[0]]
            config["logger"] = [csv_loggers[0], *others]
        return super()._instantiate_trainer(config, callbacks)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        _require_tensorboard(config.get("trainer", {}).get("logger"))

    def _choose_run(self, root: str) -> int | None:
        """The ``version_N`` a ``fit`` continues (``None``: a new run) and the checkpoint it starts from.

        ``--resume auto`` and ``--ckpt_path last`` continue the newest run under ``root`` that has a checkpoint;
        an explicit ``--ckpt_path`` inside ``root/version_N/checkpoints/`` continues run N; any other checkpoint
        (say, another root's) starts a new run from it. Every rank reads the same folders before any of them
        writes, so all agree."""
        self._ckpt_path = None
        if self.subcommand != "fit":
            return None
        settings = self.config["fit"]
        ckpt_path, resume = settings.get("ckpt_path"), settings.get("resume")
        if ckpt_path == "last" or (ckpt_path is None and resume == "auto"):
            run = latest_run(root)
            if run is None:
                _say(f"resume: no earlier run with a checkpoint under {root}; starting version_{next_version(root)}")
                return None
            _say(f"resume: continuing {run.directory} from {run.checkpoint}")
            _continuing_a_run()
            self._ckpt_path = str(run.checkpoint)
            return run.version
        self._ckpt_path = ckpt_path
        if ckpt_path is None or ckpt_path in ("best", "hpc", "registry") or "://" in str(ckpt_path):
            return None
        version = run_of_checkpoint(root, ckpt_path)
        if version is not None:
            _continuing_a_run()
        return version

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            # The logger's own folder, not ``trainer.log_dir``: that one is a collective, and other ranks may be gone.
            loggers = getattr(self.trainer, "loggers", None) or []
            run_dir = loggers[0].log_dir if loggers and isinstance(loggers[0], CSVLogger) else None
            _remove_if_empty(run_dir, its_setup_files=getattr(self, "_fresh_run", False))
            if subcommand == "fit" and self.trainer.is_global_zero:
                self._write_curves()  # the curves up to the failure; Lightning has flushed the CSV
            raise

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if subcommand == "validate":
            kwargs["verbose"] = False  # after_validate prints the metrics, one line each
        if subcommand == "fit":
            # "last" is resolved here: Lightning would look for it in the new run's (empty) checkpoint folder.
            kwargs["ckpt_path"] = self._ckpt_path
        return kwargs

    def _headline(self, results: Sequence[Mapping[str, float]]) -> dict[str, float]:
        merged = {k: float(v) for r in results for k, v in r.items()}
        names = getattr(self.model, "headline_metrics", ()) or tuple(sorted(merged))
        reward = getattr(self.model, "accuracy_reward", None)  # kept for the accuracy's stand-in, see after_fit
        names = (*names, f"val/reward/{reward}") if isinstance(reward, str) else names
        return {k: merged[k] for k in names if k in merged}

    def _printed(self, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """The headline metrics to print, each with a note for the line below it (empty: none). An accuracy that
        no held-out completion could reach (its reward never got to the threshold) is followed by the accuracy
        reward's mean, whose note says why to read that instead."""
        stand_in = _accuracy_stand_in(self.model)
        listed = getattr(self.model, "headline_metrics", ()) or tuple(metrics)
        out: dict[str, str] = {}
        for name in metrics:
            if name in listed and name not in out:
                out[name] = ""
            if stand_in is not None and name == "val/accuracy" and stand_in[0] in metrics:
                out[stand_in[0]] = stand_in[1]
        return list(out.items())

    def _wants_eval(self) -> bool:
        """Evaluate before and after fit unless switched off or there is nothing to evaluate on (no data module,
        or one without validation data: it returns no loader, or an empty one)."""
        # Classic RL modules evaluate on their own environment, with no data module.
        source = self.datamodule if self.datamodule is not None else self.model
        return (
            bool(self.config[self.subcommand].get("eval_before_after", True))
            and source is not None
            and is_overridden("val_dataloader", source)
            and is_overridden("validation_step", self.model)
        )

    def _validate(self, when: str) -> dict[str, float]:
        """The held-out headline metrics, announced (``held-out pass <when> ...``) once there is data to run on."""
        self.record.announce, self.record.announced = f"held-out pass {when}", False
        start = time.perf_counter()
        try:
            results = self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False) or []
        finally:
            self.record.announce = None
        if self.record.announced:
            say(f"held-out pass {when}: done in {time.perf_counter() - start:.1f} s")
        return self._headline(results)

    def before_fit(self) -> None:
        log_dir = self.trainer.log_dir  # a broadcast under several processes: every rank asks
        if log_dir is not None:
            say(f"run directory: {log_dir}")
        from lightning.pytorch.callbacks import ModelSummary

        callbacks = self.trainer.callbacks  # type: ignore[attr-defined]  # Lightning sets it outside the class
        if not any(isinstance(cb, ModelSummary) for cb in callbacks):
            say(parameter_count(self.model))
        # A continued run takes its "before" from the checkpoint (RunRecord): its starting weights are trained.
        if self._wants_eval() and self._ckpt_path is None:
            self.record.before = self._validate("before training")
            if self.record.before:
                shown = [name for name, _ in self._printed(self.record.before)]
                say("held-out before training: " + ", ".join(f"{k} {self.record.before[k]:.4f}" for k in shown))

    def after_fit(self) -> None:
        if self.trainer.interrupted:
            if self.trainer.is_global_zero:
                self._write_curves()
            return
        after = self._final_metrics() if self._wants_eval() else {}
        log_dir = self.trainer.log_dir  # a broadcast under several processes: every rank asks
        if not self.trainer.is_global_zero:
            return
        before = self.record.before
        for name, note in self._printed(after):
            value = after[name]
            if before is not None and name in before:
                print(f"held-out {name}: {before[name]:.4f} -> {value:.4f}")
            elif self._ckpt_path is not None:
                print(f"held-out {name}: {value:.4f} (resumed from {self._ckpt_path}, which holds no earlier value)")
            else:
                print(f"held-out {name}: {value:.4f}")
            if note:
                print(f"  {note}")
        if log_dir is not None:
            print(f"run directory: {log_dir}")
        curves = self._write_curves()
        if curves is not None:
            print(f"curves: {curves}")
        last = _last_checkpoint_path(self.trainer)
        if last:
            print(f"last checkpoint: {last}")

    def after_validate(self) -> None:
        """``align validate``: the held-out metrics, one line each, and which weights they are of."""
        if not self.trainer.is_global_zero:
            return
        metrics = {
            k: float(v) for k, v in self.trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1
        }
        if not metrics:
            print("held-out: nothing to evaluate (the config has no validation data)")
            return
        weights = self.config["validate"].get("ckpt_path") or "the config's model (no --ckpt_path)"
        headline = self._headline([metrics]) or metrics
        for name, note in self._printed(headline):
            print(f"held-out {name}: {headline[name]:.4f}" + (f"\n  {note}" if note else ""))
        print(f"weights: {weights}")

    def _write_curves(self) -> str | None:
        """Draw the run's ``metrics.csv`` into ``<run dir>/curves.png`` (call on rank 0 only) and return its path.
        ``None`` without a run CSV logger or metrics; a failure to draw is one warning, never the run's failure."""
        loggers = getattr(self.trainer, "loggers", None) or []
        if not loggers or not isinstance(loggers[0], CSVLogger):
            return None
        try:
            from align.cli.plots import CURVES, METRICS, plot_runs

            directory = Path(loggers[0].log_dir)
            if not directory.is_dir():  # a run that failed before writing: its empty folder was removed
                return None
            loggers[0].save()  # rows still buffered since the last flush
            if not (directory / METRICS).is_file():
                return None
            return str(plot_runs([directory], directory / CURVES).path)
        except Exception as err:  # noqa: BLE001  (a picture is never worth a failed run)
            reason = (str(err).strip().splitlines() or [""])[0]
            log.warning("curves: not written: %s: %s", type(err).__name__, reason)
            return None

    def _final_metrics(self) -> dict[str, float]:
        """The held-out metrics of the final weights: those of the last in-training validation when it ran after
        the final step (validating again would repeat it), otherwise a fresh validation."""
        done = self.record.last_validation
        if done is not None and done[0] == self.trainer.global_step:
            reused = (
                self._headline([done[1]])
                if getattr(self.model, "headline_metrics", ())
                else {k: v for k, v in done[1].items() if k.startswith("val")}
            )
            if reused:
                return reused
        return self._validate("after training")


def _accuracy_stand_in(model) -> tuple[str, str] | None:
    """When no held-out completion of an RL run reached ``evaluation.accuracy_threshold`` (its accuracy reward's
    highest value, ``accuracy_reward_highest``, stayed below it), ``val/accuracy`` is 0 by construction and says
    nothing: the metric to print instead (the accuracy reward's mean) and why; else None."""
    highest = getattr(model, "accuracy_reward_highest", None)
    threshold = getattr(model, "accuracy_threshold", None)
    name = getattr(model, "accuracy_reward", None)
    if highest is None or threshold is None or not isinstance(name, str) or highest >= threshold:
        return None
    return f"val/reward/{name}", (
        f"val/accuracy is 0 by construction: no held-out completion reached {name} >= "
        f"{threshold:g} (highest {highest:.4f}; model.evaluation.accuracy_threshold sets "
        f"it); read val/reward/{name}, the reward's mean, instead"
    )


def _into_run_folder(logger: Logger, run_logger: CSVLogger) -> Logger:
    """A TensorBoardLogger whose ``save_dir`` is ``align:run`` writes into the run's own folder,
    ``<root>/version_N/``, next to ``metrics.csv`` (``tensorboard --logdir <root>`` then lists the runs by
    folder). Other loggers, and a TensorBoardLogger given a real ``save_dir``, are left as they are."""
    if isinstance(logger, TensorBoardLogger) and logger.save_dir == RUN_FOLDER:
        # TensorBoardLogger has no setter for its folder; these are the attributes its constructor fills.
        logger._root_dir, logger._name, logger._version = run_logger.save_dir, "", run_logger.version
    return logger


def _require_tensorboard(loggers) -> None:
    """One line naming the extra when a TensorBoardLogger is configured without tensorboard installed, instead
    of Lightning's multi-line error from inside the config's instantiation."""
    import importlib.util

    from jsonargparse import Namespace

    entries = loggers if isinstance(loggers, (list, tuple)) else [loggers]
    wanted = any(
        isinstance(e, (Namespace, dict)) and str(e.get("class_path", "")).endswith("TensorBoardLogger") for e in entries
    )
    if wanted and not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
        raise AlignConfigError(
            f"trainer.logger: TensorBoardLogger needs the tensorboard package, which is not "
            f"installed; install it with {TENSORBOARD_EXTRA}"
        )


SETUP_FILES = frozenset({"config.yaml", "hparams.yaml"})
"""What a fresh run writes into its folder before its first step (its config, its module's arguments)."""


def _remove_if_empty(directory: str | None, its_setup_files: bool = False) -> None:
    """A run that failed before writing anything (bad data, a reward or an environment that fails on the first
    rollout) leaves no ``version_N`` behind, so the next run takes its number. With ``its_setup_files`` (a fresh
    run: the folder is its own), a folder holding only the :data:`SETUP_FILES` the run wrote at its start goes too;
    a folder with anything else in it (metrics, checkpoints, a file of the user's) is kept whole."""
    if not directory:
        return
    folder = Path(directory)
    try:
        if its_setup_files:
            names = {p.name for p in folder.iterdir()}
            if names and names <= SETUP_FILES and all((folder / n).is_file() for n in names):
                for name in names:
                    (folder / name).unlink()
        folder.rmdir()
    except OSError:
        pass


def _continuing_a_run() -> None:
    # Writing into the run's own non-empty checkpoint folder is the point of continuing it.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


@rank_zero_only
def _say(message: str) -> None:
    print(message)


def _last_checkpoint_path(trainer) -> str | None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint):
            path = cb.last_model_path or cb.best_model_path
            if path:
                return path
    return None


def _configured_callbacks(config: dict) -> list:
    """The trainer config's ``callbacks`` as a new list (the setting may be null, one callback or a list)."""
    configured = config.get("callbacks")
    return [] if configured is None else list(configured) if isinstance(configured, (list, tuple)) else [configured]


def _checkpoint_defaults(config: dict, callbacks: list) -> None:
    """Without a configured checkpoint callback, an :class:`~align.trainer.checkpointing.AlignCheckpoint` saves
    ``last.ckpt`` at the end of every epoch. Checkpoint callbacks without a ``dirpath`` write to the run's own
    ``version_N/checkpoints`` (Lightning derives it from the run's logger and broadcasts rank 0's choice)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from align.trainer.checkpointing import AlignCheckpoint

    configured = _configured_callbacks(config)
    checkpoints = [cb for cb in [*configured, *callbacks] if isinstance(cb, ModelCheckpoint)]
    if checkpoints and config.get("enable_checkpointing") is False:
        names = ", ".join(sorted({type(cb).__name__ for cb in checkpoints}))
        raise AlignConfigError(
            f"trainer.enable_checkpointing: false, but trainer.callbacks holds {names}; remove "
            "the checkpoint callback or set enable_checkpointing true"
        )
    if not checkpoints and config.get("enable_checkpointing") is not False:
        configured.append(AlignCheckpoint())
        config["callbacks"] = configured


def _progress_bar_default(config: dict, callbacks: list) -> None:
    """Unless ``enable_progress_bar`` is false or a progress bar is configured, the run shows an
    :class:`~align.trainer.progress.AlignProgressBar` (drawn only in a terminal outside CI)."""
    from lightning.pytorch.callbacks.progress import ProgressBar

    from align.trainer.progress import AlignProgressBar

    configured = _configured_callbacks(config)
    if config.get("enable_progress_bar") is False or any(
        isinstance(cb, ProgressBar) for cb in [*configured, *callbacks]
    ):
        return
    callbacks.append(AlignProgressBar())
