import sys
from pathlib import Path

# _gym.py is imported by its plain name: a test file that names its own environments by file path
# (``/abs/path/tests/gym/test_x.py:Env``) is imported again outside the package, where a relative import fails.
sys.path.insert(0, str(Path(__file__).parent))
