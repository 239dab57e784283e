"""The command line's arguments before jsonargparse reads them: ``--config align:<algorithm>/<name>.yaml`` names a
config shipped inside the package (``align/configs``), so an installed ``align`` runs them without a checkout; a
nested setting set to null becomes the block form jsonargparse reads; a TensorBoardLogger added on the command line
writes into the run's own folder; a config file that is not valid YAML fails naming the file, line and column.
"""

from __future__ import annotations

import json
from pathlib import Path

from align.errors import AlignConfigError

# The shipped configs live in the package, so a wheel has them; a checkout's ``configs`` links here.
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
SHIPPED = "align:"
# ``save_dir`` of a TensorBoardLogger meaning "the run's own folder"; filled in when the command line gives none.
RUN_FOLDER = "align:run"


def resolve_config_args(args: list[str]) -> list[str]:
    """``--config align:<algorithm>/<name>.yaml`` -> the shipped file's path (jsonargparse reads plain paths), a
    nested setting set to null from the command line in the block form that jsonargparse reads (see
    :func:`_nested_null`), and a TensorBoardLogger added on the command line gets ``save_dir`` ``align:run`` (the
    run's folder) unless a later ``--trainer.logger.save_dir`` sets it."""
    out = []
    for i, arg in enumerate(args):
        if _names_tensorboard(args, i):
            out.extend([arg, f"--trainer.logger.save_dir={RUN_FOLDER}"])
            continue
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
        if eq and key == "--config":
            check_yaml_file(arg.partition("=")[2])
        elif i > 0 and args[i - 1] == "--config":
            check_yaml_file(arg)
        out.append(arg)
    return out


def check_yaml_file(value: str) -> None:
    """A ``--config`` file that is not valid YAML fails on one line naming the file, line and column (jsonargparse
    names ``<unicode string>``). A value that is no file (YAML text given inline) is left to jsonargparse."""
    import yaml

    path = Path(value).expanduser()
    try:
        if not path.is_file():
            return
        text = path.read_text()
    except (OSError, ValueError):  # a YAML text too long for a file name, an unreadable file: jsonargparse says so
        return
    try:
        yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context = getattr(err, "context", None)
        raise AlignConfigError(
            f"--config: '{value}'{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")
        ) from None


def _names_tensorboard(args: list[str], i: int) -> bool:
    """Whether ``args[i]`` is the class path of a TensorBoardLogger given to ``--trainer.logger`` (``+=`` or
    ``=``, in one word or two)."""
    key, eq, value = args[i].partition("=")
    if not eq or key not in ("--trainer.logger", "--trainer.logger+"):
        key, value = (args[i - 1] if i > 0 else ""), args[i]
        if key not in ("--trainer.logger", "--trainer.logger+"):
            return False
    return value.rsplit(".", 1)[-1] == "TensorBoardLogger"


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
