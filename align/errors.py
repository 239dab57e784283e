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
