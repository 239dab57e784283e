"""The jail tests' shared fixtures."""

import pytest

from align.jail import namespaces as jails
from align.jail.sandbox import PythonSandbox


@pytest.fixture(params=jails.BACKENDS)
def jailed(request):
    """``jailed(**settings)``: a PythonSandbox in the jail of this parameter (20 s unless said: a loaded machine is
    slow, and no snippet here waits for its time limit but the fork bomb); skipped where that jail does not work."""
    why = jails.probe(request.param, PythonSandbox._probe)
    if why is not None:
        pytest.skip(f"{request.param}: {why}")
    return lambda **kw: PythonSandbox(jail=request.param, **{"timeout": 20, **kw})


@pytest.fixture
def fresh(monkeypatch):
    """No jail probed yet in this process, and no warning given."""
    for name in ("_FOUND", "_WHY"):
        monkeypatch.setattr(jails, name, {})
    monkeypatch.setattr(jails, "_WARNED", set())
    monkeypatch.setattr(jails.sys, "platform", "linux")
