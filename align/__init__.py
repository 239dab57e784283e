"""align: a Lightning-native toolkit for aligning language models."""

__version__ = "0.1.0"
