"""One LightningModule per algorithm."""

from align.modules.base import AlignModule
from align.modules.sft import SFTModule

__all__ = ["AlignModule", "SFTModule"]
