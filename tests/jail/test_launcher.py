"""The ``unshare`` jail's launcher (``align.jail.launcher``): its steps outside a namespace (a failed system call, the
mount points, the binds' sources, the id-mapping helper), and, run as the jail runs it, that it refuses a caller
other than the planner and that a step that fails is named on one line with status 125 before any code runs."""

from __future__ import annotations

import ctypes
import errno
import marshal
import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

from align.jail import launcher
from align.jail import namespaces as jails
from align.jail.sandbox import PythonSandbox


def test_a_failed_call_is_a_setup_error_naming_the_step_and_the_reason():
    launcher.call("mount /proc", 0)  # 0: done
    ctypes.set_errno(errno.EPERM)
    with pytest.raises(launcher.SetupError, match=r"^mount /proc: Operation not permitted$"):
        launcher.call("mount /proc", -1)


def test_a_mount_point_is_a_folder_or_an_empty_read_only_file(tmp_path):
    launcher.prepare(str(tmp_path / "a" / "b"), True)
    assert (tmp_path / "a" / "b").is_dir()
    launcher.prepare(str(tmp_path / "c" / "d.py"), False)
    made = tmp_path / "c" / "d.py"
    umask = os.umask(0)
    os.umask(umask)
    assert made.is_file() and made.stat().st_size == 0 and stat.S_IMODE(made.stat().st_mode) == 0o444 & ~umask
    made.chmod(0o644)
    made.write_text("kept")
    launcher.prepare(str(made), False)  # an existing file is left as it is
    assert made.read_text() == "kept"


def test_the_binds_sources_are_opened_and_nothing_else(tmp_path):
    steps = [
        ("ro", str(tmp_path), "/python"),
        ("dev", "/dev/null", "/dev/null"),
        ("symlink", "/proc/self/fd", "/dev/fd"),
        ("tmpfs", 1 << 20, 0o700, "/work"),
        ("proc", "/proc"),
    ]
    sources = launcher.open_sources({"steps": steps})
    try:
        assert sorted(sources) == sorted([str(tmp_path), "/dev/null"])
        assert stat.S_ISDIR(os.fstat(sources[str(tmp_path)]).st_mode)
        assert stat.S_ISCHR(os.fstat(sources["/dev/null"]).st_mode)
    finally:
        for fd in sources.values():
            os.close(fd)


def helper(code: int) -> tuple[int, int]:
    """A stand-in for the id-mapping helper: a child that reads the launcher's go-ahead and exits with ``code``."""
    child = subprocess.Popen(
        [sys.executable, "-c", f"import os, sys; os.read(0, 2); sys.exit({code})"], stdin=subprocess.PIPE
    )
    write = os.dup(child.stdin.fileno())
    child.stdin.close()
    return child.pid, write


def test_the_id_mapping_waits_for_the_helper_and_fails_with_it():
    launcher.map_ids({"uid": 65534}, helper(0), 0, 0)  # returns once the helper has written the map
    with pytest.raises(launcher.SetupError, match=r"^the id mapping helper failed$"):
        launcher.map_ids({"uid": 65534}, helper(1), 0, 0)


def test_a_launcher_its_planner_did_not_start_exits_before_doing_anything():
    source = jails.LAUNCHER.read_text()
    plan = marshal.dumps({"parent": os.getpid() + 1}).hex()  # not this test's process, the launcher's parent
    done = subprocess.run([sys.executable, "-I", "-S", "-c", source, plan], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (launcher.SETUP_FAILED, "", "")


def run_in_a_jail(steps):
    """The launcher as the python tool starts it, over ``steps``; its runner prints ``ran``. The new root is mounted
    on an empty folder that the sandbox's user can reach, as the python tool's is."""
    why = jails.probe("unshare", PythonSandbox._probe)
    if why is not None:
        pytest.skip(f"unshare: {why}")
    folder = tempfile.mkdtemp(prefix="align-launcher-test-")
    os.chmod(folder, 0o711)
    os.mkdir(os.path.join(folder, "root"))
    info_read, info_write = os.pipe()
    command = jails.unshare_command(
        steps, "/work", "print('ran', flush=True)", info_write, os.path.join(folder, "root")
    )
    try:
        done = subprocess.run(command, pass_fds=(info_write,), capture_output=True, text=True, timeout=60)
    finally:
        os.close(info_write)
        shutil.rmtree(folder)
    info = os.read(info_read, 4096)
    os.close(info_read)
    return done, info


@pytest.mark.parametrize(
    "step, line",
    [
        (("bogus", "/x"), "jail: unknown step 'bogus'"),
        (("ro", "/nonexistent/python", "/python"), "jail: [Errno 2] No such file or directory: '/nonexistent/python'"),
    ],
    ids=["unknown step", "missing source"],
)
def test_a_step_that_fails_is_named_on_one_line_and_no_code_runs(step, line):
    done, info = run_in_a_jail([step])
    assert done.returncode == launcher.SETUP_FAILED and done.stdout == ""
    assert done.stderr.strip().splitlines() == [line]
    assert b'"child-pid"' in info  # the jail's first process was announced before it failed
