"""User-facing errors.

Every error a user can fix by changing their data, config or paths derives from :class:`AlignError`.
The command line prints these as one clear message and exits non-zero, without a deep traceback.
"""

from __future__ import annotations


class AlignError(Exception):
    """An error in the user's input: data, config, model path or reward."""


class NoLearningSignalError(AlignError, RuntimeError):
    """Training sampled batch after batch without taking an update (every reward tied), so ``trainer.max_steps``,
    which counts updates, would never be reached."""


class AlignConfigError(AlignError, ValueError):
    """A setting is missing, unknown, of the wrong type or points at something that does not exist."""


INIT_KWARGS = "init_kwargs"
"""Where the classes a config builds from ``init_kwargs`` (judge and remote rewards, the reward-model scorer, the
tool, OpenEnv and verifiers environments, the Python sandbox) say their settings are: they raise
``AlignConfigError("init_kwargs.<setting>: expected ..., got ...")``, and what builds them places that under its
own setting (:func:`placed`)."""


def placed(err: AlignConfigError, where: str) -> AlignConfigError:
    """``err`` with a setting named relative to a class's ``init_kwargs`` (``init_kwargs.timeout: ...``) placed under
    the setting ``where`` that holds those ``init_kwargs`` (``model.rewards[0].init_kwargs.timeout: ...``); any other
    error is returned as it is."""
    message = str(err)
    if not message.startswith(f"{INIT_KWARGS}.") and not message.startswith(f"{INIT_KWARGS}:"):
        return err
    moved = AlignConfigError(f"{where}.{message}")
    moved.__cause__ = err.__cause__
    return moved


class AlignEnvError(AlignError, RuntimeError):
    """An environment broke its contract while running: an observation outside its declared space, a step that
    raised. The message names the environment and, where it matters, the space."""


class AlignDataError(AlignError, ValueError):
    """A dataset row is malformed. The message names the file, the row and the field."""

    def __init__(self, source: str, row: int | None, field: str | None, expected: str, got: object = None):
        self.source, self.row, self.field, self.expected, self.got = source, row, field, expected, got
        where = str(source)
        if row is not None:
            where += f": row {row}"
        if field is not None:
            where += f": field '{field}'"
        message = f"{where}: expected {expected}"
        if got is not None:
            message += f", got {_preview(got)}"
        super().__init__(message)


def _preview(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
