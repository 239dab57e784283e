"""align: a Lightning-native toolkit for aligning language models."""

from align.moved import install as _install_moved

__version__ = "0.1.0"

_install_moved()
