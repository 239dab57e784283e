"""``align.trainer.strategies.collectives``: the default process group released at exit, whatever its backend, after
the callbacks that need it."""

import pytest

RELEASE_CHILD = """
import atexit, os, sys
import torch.distributed as dist
from align.trainer.strategies import release_process_group_at_exit

assert release_process_group_at_exit() is False  # no group yet: nothing to release
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
# atexit runs handlers last-in first-out: this one runs after the release registered below.
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
assert release_process_group_at_exit() is True
assert release_process_group_at_exit() is True  # registered once
"""


@pytest.mark.slow
def test_a_gloo_process_group_is_destroyed_when_the_process_exits():
    # Lightning destroys the default group at exit for NCCL only; a gloo group left to the interpreter's teardown
    # sometimes aborted a finished 2-process CPU job (SIGABRT, "terminate called without an active exception").
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", RELEASE_CHILD, str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "initialized at exit: False"


ORDER_CHILD = """
import atexit, os, sys
import torch.distributed as dist
from align.trainer.strategies import before_process_group_release, release_process_group_at_exit

def engine_shutdown():
    print("callback; group initialized:", dist.is_initialized(), flush=True)

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
before_process_group_release(engine_shutdown)
before_process_group_release(engine_shutdown)  # given twice: run once
atexit.register(lambda: print("after the release; group initialized:", dist.is_initialized(), flush=True))
assert release_process_group_at_exit() is True
"""


@pytest.mark.slow
def test_callbacks_run_once_at_exit_while_the_group_still_exists():
    # What holds groups of its own over the default one (an in-process vLLM engine) shuts down first, once.
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", ORDER_CHILD, str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == [
        "callback; group initialized: True",
        "after the release; group initialized: False",
    ]
