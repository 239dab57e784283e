"""Data modules and collators for SFT, preference and RL-prompt data."""

from align.data.sft import SFTBatch, SFTDataModule

__all__ = ["SFTBatch", "SFTDataModule"]
