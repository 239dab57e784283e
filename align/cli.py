"""Command line: ``align fit|validate --config ...`` (LightningCLI), ``align export``, and ``align generate``,
``align evaluate`` and ``align chat`` (argparse; :mod:`align.generation`, docs/generation.md).

Every run is one folder, ``<default_root_dir>/version_N/``, holding its ``config.yaml``, ``metrics.csv`` and
``checkpoints/`` (``align.runs``); other loggers (for example ``align.observability.OTLPLogger``) are added
alongside. ``--resume auto`` continues the newest run of the root in its own folder. Before and after ``fit``
the held-out set is evaluated and the module's headline metrics are printed, so a run shows what it learned.

``--config align:<algorithm>/<name>.yaml`` names a config shipped inside the package (``align/configs``), so an
installed ``align`` runs them without a checkout.
"""

from __future__ import annotations

import json

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
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.model_helpers import is_overridden

import align.strategies  # noqa: F401  (registers the short names: --trainer.strategy fsdp2 / zero1..3 / zero3_offload)
from align.errors import AlignConfigError, AlignError
from align.runs import RunLogger, RunRecord, latest_run, next_version, run_of_checkpoint

log = logging.getLogger(__name__)
# The shipped configs live in the package, so a wheel has them; a checkout's ``configs`` links here.
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
SHIPPED = "align:"
SUBCOMMANDS = ("fit", "validate")
REMOVED_SUBCOMMANDS = ("test", "predict")
"""LightningCLI subcommands ``align`` does not offer: the modules have no ``test_step``/``predict_step``;
``align evaluate`` and ``align generate`` do that work."""
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

    def init_parser(self, **kwargs):
        kwargs.setdefault("description", "Train with a config (fit), or evaluate its held-out set (validate). Other "
                          "commands: align export (a Hugging Face model from a checkpoint), align generate "
                          "(completions of a prompt file), align evaluate (rewards, accuracy, pass@k, win rate) and "
                          "align chat; each takes --help.")
        return super().init_parser(**kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit`` and ``validate`` only (:data:`REMOVED_SUBCOMMANDS`)."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k in SUBCOMMANDS}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--eval_before_after", type=bool, default=True,
                            help="Evaluate the held-out set before and after fit and print the headline metrics.")
        parser.add_argument("--resume", type=Literal["never", "auto"], default="never",
                            help="auto: fit continues the newest run under <default_root_dir> (version_N/checkpoints/"
                                 "last.ckpt, same as --ckpt_path last) in its own folder, or starts version_0 when "
                                 "there is none; never: only an explicit --ckpt_path resumes.")

    def _instantiate_trainer(self, config, callbacks):
        config = dict(config)
        root = str(config.get("default_root_dir") or "runs")
        version = self._choose_run(root)
        self.record = RunRecord()
        callbacks = [self.record, *callbacks]
        _checkpoint_defaults(config, callbacks)
        logger = config.get("logger")
        if logger is not False:
            loggers: list[Logger] = [] if logger in (None, True) else list(logger) if isinstance(logger, (list, tuple)) else [logger]
            csv_loggers = [lg for lg in loggers if isinstance(lg, CSVLogger)]
            if not csv_loggers:
                csv_loggers = [RunLogger(root, version=version, append=version is not None)]
            # Lightning names the checkpoint folder after the first logger's version: the run's CSV logger.
            config["logger"] = [csv_loggers[0], *(lg for lg in loggers if lg is not csv_loggers[0])]
        return super()._instantiate_trainer(config, callbacks)

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
            _remove_if_empty(loggers[0].log_dir if loggers and isinstance(loggers[0], CSVLogger) else None)
            raise

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if subcommand == "fit":
            # "last" is resolved here: Lightning would look for it in the new run's (empty) checkpoint folder.
            kwargs["ckpt_path"] = self._ckpt_path
        return kwargs

    def _headline(self, results: list[dict]) -> dict[str, float]:
        merged = {k: float(v) for r in results for k, v in r.items()}
        names = getattr(self.model, "headline_metrics", ()) or tuple(sorted(merged))
        return {k: merged[k] for k in names if k in merged}

    def _wants_eval(self) -> bool:
        """Evaluate before and after fit unless switched off or there is nothing to evaluate on (no data module,
        or one without validation data: it returns no loader, or an empty one)."""
        return bool(self.config[self.subcommand].get("eval_before_after", True)) and self.datamodule is not None \
            and is_overridden("val_dataloader", self.datamodule) and is_overridden("validation_step", self.model)

    def _validate(self) -> dict[str, float]:
        return self._headline(self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False) or [])

    def before_fit(self) -> None:
        # A continued run takes its "before" from the checkpoint (RunRecord): its starting weights are trained.
        if self._wants_eval() and self._ckpt_path is None:
            self.record.before = self._validate()

    def after_fit(self) -> None:
        if self.trainer.interrupted:
            return
        after = self._final_metrics() if self._wants_eval() else {}
        log_dir = self.trainer.log_dir  # a broadcast under several processes: every rank asks
        if not self.trainer.is_global_zero:
            return
        before = self.record.before
        for name, value in after.items():
            if before is not None and name in before:
                print(f"held-out {name}: {before[name]:.4f} -> {value:.4f}")
            elif self._ckpt_path is not None:
                print(f"held-out {name}: {value:.4f} (resumed from {self._ckpt_path}, which holds no earlier value)")
            else:
                print(f"held-out {name}: {value:.4f}")
        if log_dir is not None:
            print(f"run directory: {log_dir}")
        last = _last_checkpoint_path(self.trainer)
        if last:
            print(f"last checkpoint: {last}")

    def _final_metrics(self) -> dict[str, float]:
        """The held-out metrics of the final weights: those of the last in-training validation when it ran after
        the final step (validating again would repeat it), otherwise a fresh validation."""
        done = self.record.last_validation
        if done is not None and done[0] == self.trainer.global_step:
            names = getattr(self.model, "headline_metrics", ()) or [k for k in done[1] if k.startswith("val")]
            reused = {k: done[1][k] for k in names if k in done[1]}
            if reused:
                return reused
        return self._validate()


def _remove_if_empty(directory: str | None) -> None:
    """A run that failed before writing anything (bad data, a reward that cannot be called) leaves no empty
    ``version_N`` behind, so the next run takes its number. A folder with anything in it is kept."""
    if directory:
        try:
            os.rmdir(directory)
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


def _checkpoint_defaults(config: dict, callbacks: list) -> None:
    """Without a configured checkpoint callback, an :class:`~align.checkpointing.AlignCheckpoint` saves
    ``last.ckpt`` at the end of every epoch. Checkpoint callbacks without a ``dirpath`` write to the run's own
    ``version_N/checkpoints`` (Lightning derives it from the run's logger and broadcasts rank 0's choice)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from align.checkpointing import AlignCheckpoint

    configured = config.get("callbacks")
    configured = [] if configured is None else list(configured) if isinstance(configured, (list, tuple)) else [configured]
    checkpoints = [cb for cb in [*configured, *callbacks] if isinstance(cb, ModelCheckpoint)]
    if checkpoints and config.get("enable_checkpointing") is False:
        names = ", ".join(sorted({type(cb).__name__ for cb in checkpoints}))
        raise AlignConfigError(f"trainer.enable_checkpointing: false, but trainer.callbacks holds {names}; remove "
                               "the checkpoint callback or set enable_checkpointing true")
    if not checkpoints and config.get("enable_checkpointing") is not False:
        configured.append(AlignCheckpoint())
        config["callbacks"] = configured


def resolve_config_args(args: list[str]) -> list[str]:
    """``--config align:<algorithm>/<name>.yaml`` -> the shipped file's path (jsonargparse reads plain paths), and
    a nested setting set to null from the command line in the block form that jsonargparse reads (see
    :func:`_nested_null`)."""
    out = []
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if eq and key == "--config" and value.startswith(SHIPPED):
            arg = f"--config={shipped_config(value)}"
        elif i > 0 and args[i - 1] == "--config" and arg.startswith(SHIPPED):
            arg = str(shipped_config(arg))
        elif eq and value == "null" and (block := _nested_null(key)):
            out.extend(block)
            continue
        elif arg == "null" and i > 0 and out and out[-1] == args[i - 1] and (block := _nested_null(args[i - 1])):
            out[-1:] = block
            continue
        out.append(arg)
    return out


def _nested_null(key: str) -> list[str] | None:
    """``--model.kl.estimator null`` -> ``["--model.kl", '{"estimator": null}']``, or None for other keys.

    jsonargparse 4 reads ``null`` for a field of a nested block (an option group, the policy's settings) as the
    text ``'None'`` or refuses it; the same value given as a one-field block is read as null, and the block
    changes only that field."""
    if not key.startswith(("--model.", "--data.")):
        return None
    *parent, field = key[2:].split(".")
    if parent and parent[-1] == "init_args":
        parent = parent[:-1]
    if len(parent) < 2 or not field.isidentifier():
        return None
    return ["--" + ".".join(parent), json.dumps({field: None})]


def shipped_config(name: str) -> Path:
    path = CONFIG_DIR / name.removeprefix(SHIPPED)
    if not path.is_file():
        shipped = ", ".join(f"{SHIPPED}{p.relative_to(CONFIG_DIR)}" for p in sorted(CONFIG_DIR.rglob("*.yaml")))
        raise AlignConfigError(f"--config: '{name}' is not a shipped config; expected one of {shipped}")
    return path


def _with_subcommand(args: list[str]) -> list[str]:
    """Recipes run ``fit`` when no subcommand is given. A subcommand comes first: a later ``test`` is a value
    (``--data.split test``), not a subcommand."""
    if args[:1] and args[0] in (*SUBCOMMANDS, "-h", "--help"):
        return args
    return ["fit", *args]


def run_recipe(algorithm: str, model_class, datamodule_class, args: list[str] | None = None) -> AlignCLI:
    """Entry point of ``recipes/<algorithm>.py``: the shipped ``align:<algorithm>/tiny.yaml`` is the default config."""
    args = list(sys.argv[1:] if args is None else args)
    if args[:1] and args[0] in REMOVED_SUBCOMMANDS:
        _not_a_subcommand(args[0])
    args = _guarded(lambda: resolve_config_args(_with_subcommand(args)))
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


def _model_arguments(parser) -> None:
    parser.add_argument("--model", "--ckpt_path", dest="model", required=True, metavar="MODEL",
                        help="What to load: an align checkpoint (.ckpt from any run), an exported Hugging Face folder "
                             "(align export), or a model id (tiny-sort, smollm2-135m-instruct, a .gguf file, a hub "
                             "id). --ckpt_path is the same setting.")
    parser.add_argument("--device", default=None, help="Device to run on (cuda, cuda:1, mps); default cpu.")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="Weight dtype; default: the run's for a checkpoint, float32 otherwise.")


def _sampling_arguments(parser, max_new_tokens: int, several: bool = True) -> None:
    parser.add_argument("--max_new_tokens", type=int, default=max_new_tokens, help=f"Longest completion in tokens (default {max_new_tokens}).")
    parser.add_argument("--temperature", type=float, default=None,
                        help="0 is greedy. Default: greedy for one sample per prompt, 1.0 for several (--n > 1)."
                        if several else "0 is greedy (the default).")
    parser.add_argument("--top_p", type=float, default=1.0, help="Nucleus sampling (1: off).")
    parser.add_argument("--top_k", type=int, default=0, help="Sample from the k most likely tokens only (0: off).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the sampler (default 0): the same seed gives the same output.")
    if several:
        parser.add_argument("--n", type=int, default=1, help="Completions sampled per prompt (default 1).")


def _prompt_arguments(parser) -> None:
    parser.add_argument("--prompts", required=True, help="Prompt data as training reads it ({\"prompt\", ...} or "
                        "{\"messages\", ...} rows in jsonl/json/parquet/csv, align:..., a hub dataset); the "
                        "tokenizer's chat template is applied as in training.")
    parser.add_argument("--prompt_field", default=None,
                        help="The prompt column; default 'prompt', or 'messages' for rows without 'prompt'.")
    parser.add_argument("--system_prompt", default=None, help="A system message added to prompts that have none.")
    parser.add_argument("--split", default=None, help="Split to read; default 'train' for a file (its only one), "
                                                      "'validation' for a hub dataset. Slices work: 'train[:20]'.")
    parser.add_argument("--batch_size", type=int, default=8, help="Prompts per generation batch (default 8); each is sampled --n times.")


def generate_main(args: list[str]) -> None:
    """``align generate``: completions of a prompt file, one JSON line per completion."""
    import argparse

    parser = argparse.ArgumentParser(prog="align generate", description="Sample completions of a prompt file with a "
                                     "trained policy (the training rollout engine) and write them as JSON lines: "
                                     "each input row with every column kept and its completion added.")
    _model_arguments(parser)
    _prompt_arguments(parser)
    parser.add_argument("--output", required=True, help="JSON lines file to write (one line per completion).")
    parser.add_argument("--completion_field", default="completion", help="Output column of the completion (default completion).")
    _sampling_arguments(parser, max_new_tokens=64)
    ns = parser.parse_args(args)
    _guarded(lambda: _generate(ns))


def _generate(ns) -> None:
    from align.generation import (check_completion_field, completion_rows, generate_batches, load_policy,
                                  read_prompts, sampling_config)

    sampling = sampling_config(ns.max_new_tokens, ns.temperature, ns.top_p, ns.top_k, ns.n)
    policy = load_policy(ns.model, ns.device, ns.dtype)
    prompts = read_prompts(ns.prompts, policy.tokenizer, ns.prompt_field, ns.system_prompt, ns.split)
    check_completion_field(prompts, ns.completion_field)
    output = Path(ns.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    rows, tokens, seconds, start = 0, 0.0, 0.0, 0
    with open(partial, "w", encoding="utf-8") as fh:
        for batch, rollout in generate_batches(policy, prompts.examples, sampling, ns.n, ns.batch_size, ns.seed):
            for row in completion_rows(prompts, start, rollout, ns.completion_field):
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            start, rows = start + len(batch), rows + len(rollout)
            tokens += rollout.metrics["rollout/completion_tokens"]
            seconds += rollout.generation_seconds
            _progress(start, len(prompts.examples))
    os.replace(partial, output)  # a file named --output is complete
    print(f"generated {rows} completions of {len(prompts.examples)} prompts: {int(tokens)} tokens, "
          f"{tokens / max(seconds, 1e-9):.0f} tokens/s ({_sampling_words(sampling)}) -> {output}")


def _progress(done: int, total: int) -> None:
    if sys.stderr.isatty():
        print(f"\r{done}/{total} prompts", end="\n" if done >= total else "", file=sys.stderr, flush=True)


def _sampling_words(sampling) -> str:
    how = "greedy" if sampling.temperature == 0 else f"temperature {sampling.temperature:g}"
    if sampling.temperature and sampling.top_p < 1:
        how += f", top_p {sampling.top_p:g}"
    if sampling.temperature and sampling.top_k:
        how += f", top_k {sampling.top_k}"
    return f"{how}, at most {sampling.max_new_tokens} new tokens"


def evaluate_main(args: list[str]) -> None:
    """``align evaluate``: mean rewards, accuracy and pass@k of a policy on a prompt file."""
    import argparse

    parser = argparse.ArgumentParser(prog="align evaluate", description="Score a policy's completions of a prompt "
                                     "file with reward functions: each reward's mean, the accuracy (as val/accuracy "
                                     "in training) and pass@k; against a --baseline, the win rate and the KL.")
    _model_arguments(parser)
    _prompt_arguments(parser)
    parser.add_argument("--rewards", nargs="+", required=True, metavar="PATH[=WEIGHT]",
                        help="Rewards named as in a config: align.rewards.math_answer, my_rewards.py:fn, with an "
                             "optional weight (align.rewards.sort_format=0.5). reward_mean is the weighted total.")
    parser.add_argument("--accuracy_reward", default=None,
                        help="The reward that decides accuracy and pass@k (its function name); default the first.")
    parser.add_argument("--accuracy_threshold", type=float, default=1.0,
                        help="A completion is correct when the accuracy reward is at least this.")
    parser.add_argument("--k", type=int, nargs="+", default=None,
                        help="pass@k for each k (each <= --n); default 1 and n when --n > 1.")
    parser.add_argument("--baseline", default=None, help="Compare with another model (a checkpoint, folder or id), "
                        "or 'reference': the model the checkpoint's run started from. Adds the win rate and the KL.")
    parser.add_argument("--reward_model", default=None, help="Judge the win rate with this reward model (an export "
                        "folder, a reward-model .ckpt or tiny-sort-rm) instead of the rewards.")
    parser.add_argument("--output", default=None, help="Also write the report to this JSON file.")
    _sampling_arguments(parser, max_new_tokens=64)
    ns = parser.parse_args(args)
    _guarded(lambda: _evaluate(ns))


def _evaluate(ns) -> None:
    from align.generation import (REFERENCE, evaluate, load_policy, parse_reward, read_prompts, reference_policy,
                                  sampling_config)

    sampling = sampling_config(ns.max_new_tokens, ns.temperature, ns.top_p, ns.top_k, ns.n)
    ks = ns.k if ns.k is not None else sorted({1, ns.n}) if ns.n > 1 else []
    rewards = [parse_reward(r) for r in ns.rewards]
    if ns.reward_model and not ns.baseline:
        raise AlignConfigError("--reward_model judges the win rate against a --baseline; give --baseline too")
    policy = load_policy(ns.model, ns.device, ns.dtype)
    prompts = read_prompts(ns.prompts, policy.tokenizer, ns.prompt_field, ns.system_prompt, ns.split)
    baseline = None
    if ns.baseline == REFERENCE:
        baseline = reference_policy(ns.model, ns.device, ns.dtype)
    elif ns.baseline:
        baseline = load_policy(ns.baseline, ns.device, ns.dtype, what="--baseline")
    # The baseline reads the prompts through its own tokenizer and chat template.
    baseline_prompts = (read_prompts(ns.prompts, baseline.tokenizer, ns.prompt_field, ns.system_prompt, ns.split)
                        if baseline is not None else None)
    report = evaluate(policy, prompts, rewards, sampling, n=ns.n, ks=ks, batch_size=ns.batch_size, seed=ns.seed,
                      accuracy_reward=ns.accuracy_reward, accuracy_threshold=ns.accuracy_threshold,
                      baseline=baseline, reward_model=ns.reward_model, baseline_prompts=baseline_prompts,
                      model_name=ns.model, on_batch=_progress)
    print(_report_table(report, ns.baseline, sampling))
    if ns.output:
        Path(ns.output).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.output).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"report: {ns.output}")


def _report_table(report, baseline_name: str | None, sampling) -> str:
    """The report as two aligned columns."""
    samples = f"{report.samples_per_prompt} sample" + ("s" if report.samples_per_prompt > 1 else "")
    lines = [("model", report.model),
             ("prompts", f"{report.prompts} ({report.num_prompts} prompts x {samples}, {_sampling_words(sampling)})"),
             ("reward_mean", f"{report.reward_mean:.4f}")]
    lines += [(f"reward/{name}", f"{value:.4f}") for name, value in report.rewards.items()]
    lines.append(("accuracy", f"{report.accuracy:.4f} ({report.accuracy_reward} >= {report.accuracy_threshold:g})"))
    lines += [(f"pass@{k}", f"{value:.4f}") for k, value in report.pass_at_k.items()]
    lines.append(("response_length", f"{report.response_length:.2f} tokens ({report.truncated_frac:.1%} truncated, "
                                     f"{report.tokens_per_s:.0f} tokens/s)"))
    if report.baseline is not None:
        b = report.baseline
        lines.append((f"vs {baseline_name}", f"win rate {b['win_rate']:.4f} (wins {b['wins']:.1%}, ties {b['ties']:.1%}, "
                      f"losses {b['losses']:.1%}; judged by {'the reward model' if b['judge'] == 'reward_model' else 'reward_mean'})"))
        lines.append(("baseline reward_mean", f"{b['reward_mean']:.4f}"))
        if "rm_score" in b:
            lines.append(("reward model score", f"{b['rm_score']:.4f} (baseline {b['baseline_rm_score']:.4f})"))
        if b["kl"] is None:
            lines.append(("kl to baseline", "n/a (different tokenizers)"))
        elif b["kl_estimator"].startswith("k1"):
            lines.append(("kl to baseline", f"{b['kl']:.4f} nats per completion (k1, sequence-level)"))
        else:  # greedy or tempered completions: their log-ratio is no estimate of the KL
            lines.append(("log-ratio to baseline", f"{b['kl']:.4f} nats per completion (not a KL: sample with "
                                                   "--temperature 1 for one)"))
    width = max(len(name) for name, _ in lines)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in lines)


def chat_main(args: list[str], stdin=None) -> None:
    """``align chat``: talk to a policy in the terminal, with the model's chat template and the whole history."""
    import argparse

    parser = argparse.ArgumentParser(prog="align chat", description="Chat with a trained policy in the terminal. "
                                     "/reset clears the history; /exit or end of input (Ctrl-D) quits.")
    _model_arguments(parser)
    parser.add_argument("--system_prompt", default=None, help="A system message at the start of the conversation.")
    _sampling_arguments(parser, max_new_tokens=256, several=False)
    ns = parser.parse_args(args)
    try:
        _guarded(lambda: _chat(ns, stdin or sys.stdin))
    except KeyboardInterrupt:  # Ctrl-C ends a chat as /exit does
        print()


def _chat(ns, stdin) -> None:
    from align.data.chat import ChatEncoder
    from align.generation import chat_reply, load_policy, sampling_config, seeded_generator
    from align.rollout import RolloutEngine

    engine = RolloutEngine(sampling_config(ns.max_new_tokens, ns.temperature, ns.top_p, ns.top_k))
    policy = load_policy(ns.model, ns.device, ns.dtype)
    if not getattr(policy.tokenizer, "chat_template", None):
        raise AlignConfigError(f"--model: the tokenizer of '{ns.model}' has no chat template; chat needs one")
    encoder = ChatEncoder(policy.tokenizer, use_chat_template=True)
    generator = seeded_generator(ns.seed, policy)
    start = [{"role": "system", "content": ns.system_prompt}] if ns.system_prompt else []
    history = list(start)
    interactive = stdin.isatty()
    print(f"chatting with {ns.model}; /reset clears the history, /exit or Ctrl-D quits",
          file=sys.stdout if interactive else sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = stdin.readline()
        if not line:  # end of input
            if interactive:
                print()
            return
        text = line.strip()
        if text == "/exit":
            return
        if text == "/reset":
            history = list(start)
            print("(history cleared)")
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        reply, _ = chat_reply(policy, encoder, history, engine, generator)
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)


def _not_a_subcommand(name: str) -> None:
    print(f"error: 'align {name}' is not a command; use 'align evaluate' for held-out rewards and accuracy, or "
          "'align generate' for completions of a prompt file (docs/generation.md)", file=sys.stderr)
    raise SystemExit(2)


COMMANDS = {"export": export_main, "generate": generate_main, "evaluate": evaluate_main, "chat": chat_main}
"""The ``align`` commands besides LightningCLI's ``fit`` and ``validate``."""


def main(args: list[str] | None = None) -> None:
    """The ``align`` console script."""
    from_argv = args is None
    args = list(sys.argv[1:] if args is None else args)
    logging.basicConfig(level=os.environ.get("ALIGN_LOG_LEVEL", "WARNING"))
    if args[:1] and args[0] in COMMANDS:
        return COMMANDS[args[0]](args[1:])
    if args[:1] and args[0] in REMOVED_SUBCOMMANDS:
        return _not_a_subcommand(args[0])
    args = _guarded(lambda: resolve_config_args(args))
    if from_argv:  # other ranks re-run ``sys.argv``; LightningCLI reads it when given no ``args``
        sys.argv = [sys.argv[0], *args]
    _guarded(lambda: AlignCLI(args=None if from_argv else args))


if __name__ == "__main__":
    main()
