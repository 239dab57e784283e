"""This folder on ``sys.path``: the module tests (and tests elsewhere that put this folder on ``sys.path``) import
their shared helpers as ``_helpers``, although the folder is a package."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
