"""The ``gpu`` tier: correctness on CUDA (bf16 included) of what the CPU suite checks in float32. Every test here is
marked ``gpu`` and takes its device from the ``device`` fixture: ``cuda``, or what ``ALIGN_TEST_DEVICE`` names
(``ALIGN_TEST_DEVICE=cpu python -m pytest tests/gpu`` checks the tests themselves on a machine without CUDA).
Without CUDA and without that variable they are skipped (tests/conftest.py)."""

import os

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device(os.environ.get("ALIGN_TEST_DEVICE") or "cuda")


@pytest.fixture(scope="session")
def accelerator(device) -> str:
    """The Lightning accelerator of ``device``."""
    return "gpu" if device.type == "cuda" else device.type
