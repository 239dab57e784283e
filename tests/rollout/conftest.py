"""The rollout tests' shared fixtures."""

import pytest

from align.rollout.envs import jail as jails
from align.rollout.envs.sandbox import PythonSandbox


@pytest.fixture(params=jails.BACKENDS)
def jailed(request):
    """``jailed(**settings)``: a PythonSandbox in the jail of this parameter (20 s unless said: a loaded machine is
    slow, and no snippet here waits for its time limit but the fork bomb); skipped where that jail does not work."""
    why = jails.probe(request.param, PythonSandbox._probe)
    if why is not None:
        pytest.skip(f"{request.param}: {why}")
    return lambda **kw: PythonSandbox(jail=request.param, **{"timeout": 20, **kw})
