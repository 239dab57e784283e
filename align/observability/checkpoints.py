"""Knowing when a checkpoint file is written: Lightning calls ``on_save_checkpoint`` before the strategy writes the
file, and no hook after; :class:`WrittenCheckpoints` wraps the strategy's ``save_checkpoint`` of one run so that a
callback hears of each file once it is on disk (the tracing callback ends its ``checkpoint_save`` span there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["WrittenCheckpoints"]


class WrittenCheckpoints:
    """Calls ``written(path)`` after each checkpoint write of the strategy it is installed on, whether the write
    succeeded or raised."""

    def __init__(self, written: Callable[[str], None]):
        self.written = written
        self._installed: tuple[Any, Callable[..., Any]] | None = None  # (strategy, its wrapped write)

    def install(self, strategy: Any) -> None:
        """Wrap ``strategy.save_checkpoint`` (once; not over another wrapper of the instance)."""
        if self._installed is not None or "save_checkpoint" in vars(strategy):
            return
        original, written = strategy.save_checkpoint, self.written

        def save_checkpoint(checkpoint, filepath, *args, **kwargs):
            try:
                return original(checkpoint, filepath, *args, **kwargs)
            finally:
                written(filepath)

        strategy.save_checkpoint = save_checkpoint
        self._installed = (strategy, save_checkpoint)

    def remove(self) -> None:
        """Put the strategy's own ``save_checkpoint`` back (unless something else replaced it since)."""
        installed, self._installed = self._installed, None
        if installed is not None:
            strategy, wrapper = installed
            if vars(strategy).get("save_checkpoint") is wrapper:
                del strategy.save_checkpoint
