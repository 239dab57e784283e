"""Choosing the python tool's jail (required, auto, off; bubblewrap, then the kernel's namespaces), bubblewrap's
command line, the packages shown to the code, and how a jailed call behaves as a tool: several at once, the code as
the main module, how it ended."""

from __future__ import annotations

import sys
import threading

import pytest

from align.rollout.envs import jail as jails
from align.rollout.envs.sandbox import PythonSandbox


@pytest.fixture
def fresh(monkeypatch):
    """No jail probed yet in this process, and no warning given."""
    for name in ("_FOUND", "_WHY"):
        monkeypatch.setattr(jails, name, {})
    monkeypatch.setattr(jails, "_WARNED", set())
    monkeypatch.setattr(jails.sys, "platform", "linux")


def test_required_takes_the_first_jail_that_works_and_refuses_when_none_does(fresh, monkeypatch):
    monkeypatch.setattr(jails.shutil, "which", lambda name: None)  # no bubblewrap
    assert jails.find_jail("required", lambda backend: "jailed\n") == "unshare"
    monkeypatch.setattr(jails, "_FOUND", {})
    monkeypatch.setattr(jails, "_WHY", {})

    def broken(backend):
        raise RuntimeError("the jail could not be built: jail: unshare: Operation not permitted")

    with pytest.raises(RuntimeError, match=r"jail=required, and no jail works here \(bwrap: bubblewrap is not "
                                           r"installed .*; unshare: the jail could not be built: jail: unshare: "
                                           r"Operation not permitted\)"):
        jails.find_jail("required", broken)


def test_auto_and_off_run_unjailed_and_say_so_once(fresh, monkeypatch, caplog):
    monkeypatch.setattr(jails.shutil, "which", lambda name: None)
    with caplog.at_level("WARNING"):
        assert jails.find_jail("auto", lambda backend: "no\n") is None
        assert jails.find_jail("auto", lambda backend: "no\n") is None
        assert jails.find_jail("off", lambda backend: "jailed\n") is None
        assert jails.find_jail("off", lambda backend: "jailed\n") is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all("UNJAILED" in m for m in messages)
    assert "unshare: a test call printed 'no\\n'" in messages[0]


def test_a_required_jail_that_does_not_work_stops_the_environment_being_built(fresh, monkeypatch):
    from align.errors import AlignConfigError
    from align.rollout.envs.tools import ToolEnvironment

    monkeypatch.setattr(jails.shutil, "which", lambda name: None)
    monkeypatch.setattr(PythonSandbox, "_probe", staticmethod(lambda backend: "Operation not permitted\n"))
    with pytest.raises(AlignConfigError, match="PythonSandbox: jail=unshare, and no jail works here"):
        ToolEnvironment(tools=[{"path": "align.rollout.envs.tools.PythonSandbox", "init_kwargs": {"jail": "unshare"}}])
    with pytest.raises(AlignConfigError, match="jail must be one of required, auto, bwrap, unshare, off, got 'yes'"):
        PythonSandbox(jail="yes")
    with pytest.raises(AlignConfigError, match="packages: cannot show 'no_such_package' to the code"):
        PythonSandbox(packages=["no_such_package"])


def test_bubblewrap_gets_every_step_in_order(monkeypatch):
    monkeypatch.setattr(jails.shutil, "which", lambda name: "/usr/bin/bwrap")
    steps = [("dev", "/dev/null", "/dev/null"), ("symlink", "usr/lib", "/lib"), ("ro", "/usr/lib/x", "/usr/lib/x"),
             ("tmpfs", 4096, 0o755, "/py/site-packages"), ("ro", "/py/site-packages/pkg", "/py/site-packages/pkg"),
             ("remount-ro", "/py/site-packages"), ("proc", "/proc"), ("tmpfs", 2 ** 20, 0o700, "/tmp/w"),
             ("ro", "/tmp/w/main.py", "/tmp/w/main.py")]
    assert jails.bwrap_command(steps, "/tmp/w", "print(1)", 7) == [
        "/usr/bin/bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--uid", "65534", "--gid", "65534", "--clearenv", "--info-fd", "7",
        "--dev-bind", "/dev/null", "/dev/null", "--symlink", "usr/lib", "/lib", "--ro-bind", "/usr/lib/x", "/usr/lib/x",
        "--perms", "755", "--size", "4096", "--tmpfs", "/py/site-packages",
        "--ro-bind", "/py/site-packages/pkg", "/py/site-packages/pkg", "--remount-ro", "/py/site-packages",
        "--proc", "/proc", "--perms", "700", "--size", "1048576", "--tmpfs", "/tmp/w",
        "--ro-bind", "/tmp/w/main.py", "/tmp/w/main.py", "--remount-ro", "/", "--chdir", "/tmp/w",
        "--", sys.executable, "-I", "-c", "print(1)"]


def test_installed_packages_are_hidden_unless_named(jailed):
    with pytest.raises(RuntimeError, match="ModuleNotFoundError: No module named 'packaging'"):
        jailed()("import packaging")
    code = "import packaging.version\nprint(packaging.version.Version('1.2'))"
    assert jailed(packages=["packaging"])(code) == "1.2\n"


def test_calls_from_several_threads_at_once_each_get_their_own_jail(jailed):
    sandbox, results = jailed(), {}

    def call(k):
        results[k] = sandbox(f"import os\nopen('mine', 'w').write('{k}')\n"
                             "print(open('mine').read(), sorted(os.listdir('.')))")

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
