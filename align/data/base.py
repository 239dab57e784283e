"""What every ``align`` data module shares: its tokenizer and its chat encoder."""

from __future__ import annotations

import lightning as L

from align.data.chat import ChatEncoder
from align.errors import AlignDataError


class TokenizerDataModule(L.LightningDataModule):
    """A data module whose tokenizer is ``hparams.tokenizer`` when set, else the module's policy tokenizer.

    Subclasses call ``save_hyperparameters()`` with ``tokenizer`` and ``use_chat_template`` among their
    arguments. ``set_tokenizer`` supplies one directly (outside a trainer, or in tests).
    """

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = None

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _resolve_tokenizer(self):
        if self.tokenizer is None:
            if self.hparams.get("tokenizer") is not None:
                from align.models.loading import load_tokenizer

                self.tokenizer = load_tokenizer(self.hparams.tokenizer)
            elif self.trainer is not None and hasattr(self.trainer.lightning_module, "tokenizer"):
                self.tokenizer = self.trainer.lightning_module.tokenizer
            else:
                raise AlignDataError("data.tokenizer", None, None, "a tokenizer path, or a module with a policy")
        return self.tokenizer

    def encoder(self) -> ChatEncoder:
        return ChatEncoder(self._resolve_tokenizer(), self.hparams.get("use_chat_template"))
