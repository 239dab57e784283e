"""The python tool: code in a separate interpreter, in a jail, with its limits (time, memory, output, network), how a
call ends, the packages shown to the code, several calls at once, and a required jail that does not work stopping the
tool environment being built."""

from __future__ import annotations

import threading
import time

import pytest

from align.jail import namespaces as jails
from align.jail.sandbox import PythonSandbox, network_namespace


def test_python_sandbox_runs_code_in_a_fresh_folder_with_an_empty_environment():
    sandbox = PythonSandbox(timeout=5)
    out = sandbox(
        "import os, sys\nprint(6 * 7)\nprint(sorted(os.environ) == ['LC_CTYPE'] or dict(os.environ))\n"
        "print(os.getcwd().split('/')[-1].startswith('align-python-'))"
    )
    assert out.split() == ["42", "True", "True"]


def test_python_sandbox_timeout_is_contained_and_reported():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="ran longer than 1 s"):
        PythonSandbox(timeout=1)("while True:\n    pass")
    assert time.monotonic() - started < 4


def test_python_sandbox_exception_and_memory_limit_are_reported():
    with pytest.raises(RuntimeError, match="ZeroDivisionError: division by zero"):
        PythonSandbox()("print(1)\n1 / 0")
    with pytest.raises(RuntimeError, match="MemoryError"):
        PythonSandbox(memory_mb=200)("x = bytearray(400 * 2 ** 20)")


def test_python_sandbox_huge_output_is_cut_off_at_the_file_size_limit():
    with pytest.raises(RuntimeError, match="the output exceeded the limit of 100 characters; it began: xxx"):
        PythonSandbox(max_output_chars=100)("import sys\nwhile True:\n    sys.stdout.write('x' * 1000)")
    # Longer than the limit but within the file cap: the first max_output_chars come back, and say so.
    out = PythonSandbox(max_output_chars=100)("print('z' * 300)")
    assert out == "z" * 100 + "\n... [cut: 301 bytes of output in all]"


def test_python_sandbox_has_no_network():
    out = PythonSandbox()(
        "import socket\ntry:\n    socket.create_connection(('10.255.255.1', 80), timeout=1)\n"
        "    print('connected')\nexcept OSError as err:\n    print('refused', err)"
    )
    assert out.startswith("refused"), out
    if network_namespace():  # the namespace has no interface up: nothing is routable
        assert "unreachable" in out.lower() or "errno 101" in out.lower(), out


def test_a_required_jail_that_does_not_work_stops_the_environment_being_built(fresh, monkeypatch):
    from align.errors import AlignConfigError
    from align.rollout.envs.tools import ToolEnvironment

    monkeypatch.setattr(jails.shutil, "which", lambda name: None)
    monkeypatch.setattr(PythonSandbox, "_probe", staticmethod(lambda backend: "Operation not permitted\n"))
    with pytest.raises(
        AlignConfigError,
        match=r"^init_kwargs\.tools\[0\]\.init_kwargs\.jail: PythonSandbox: "
        r"jail=unshare, and no jail works here",
    ):
        ToolEnvironment(tools=[{"path": "align.rollout.envs.tools.PythonSandbox", "init_kwargs": {"jail": "unshare"}}])
    with pytest.raises(
        AlignConfigError,
        match=r"^init_kwargs\.jail: expected one of required, auto, bwrap, unshare, "
        r"off, got 'yes'$",
    ):
        PythonSandbox(jail="yes")
    with pytest.raises(
        AlignConfigError,
        match=r"^init_kwargs\.packages: expected installed packages to show the code, "
        r"got 'no_such_package', which cannot be shown: ",
    ):
        PythonSandbox(packages=["no_such_package"])
    for settings, message in (
        (dict(timeout=0), "timeout: expected a number of seconds > 0, got 0"),
        (dict(max_processes=1), "max_processes: expected >= 2, got 1"),
        (dict(disk_mb=0), "disk_mb: expected >= 1, got 0"),
    ):
        with pytest.raises(AlignConfigError, match=rf"^init_kwargs\.{message}$"):
            PythonSandbox(**settings)


def test_installed_packages_are_hidden_unless_named(jailed):
    with pytest.raises(RuntimeError, match="ModuleNotFoundError: No module named 'packaging'"):
        jailed()("import packaging")
    code = "import packaging.version\nprint(packaging.version.Version('1.2'))"
    assert jailed(packages=["packaging"])(code) == "1.2\n"


def test_calls_from_several_threads_at_once_each_get_their_own_jail(jailed):
    sandbox, results = jailed(), {}

    def call(k):
        results[k] = sandbox(
            f"import os\nopen('mine', 'w').write('{k}')\nprint(open('mine').read(), sorted(os.listdir('.')))"
        )

    threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {k: f"{k} ['main.py', 'mine']\n" for k in range(4)}


def test_the_code_is_the_main_module(jailed):
    code = "import pickle\ndef double(x):\n    return 2 * x\nprint(__name__, pickle.loads(pickle.dumps(double))(21))"
    assert jailed()(code) == "__main__ 42\n"  # pickle finds its functions, as multiprocessing needs


def test_how_the_code_ended_comes_back_as_it_was(jailed):
    sandbox = jailed()
    with pytest.raises(RuntimeError, match="the code was stopped: it used too much CPU time; output before: hi"):
        sandbox("import os, signal\nprint('hi', flush=True)\nos.kill(os.getpid(), signal.SIGXCPU)")
    with pytest.raises(RuntimeError, match="^the code was stopped: it was killed$"):
        sandbox("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(RuntimeError, match="^exit status 7$"):
        sandbox("import sys\nsys.exit(7)")
