"""The ``unshare`` jail's launcher: a standalone script (standard library only) that the python tool runs as
``python -I -S -c <this file> <plan>`` to put one call's code into new kernel namespaces (``plan``: a
``marshal``-ed dict in hex, as :func:`align.jail.namespaces.unshare_command` writes it; nothing is imported that
the interpreter does not start with but ``ctypes``).

It does what ``unshare(1)`` and bubblewrap do, with the ``unshare(2)``, ``mount(2)`` and ``pivot_root(2)`` system
calls through ``ctypes``:

1. the launcher (``P0``, a child of the trainer, killed with it) enters a new user, mount, PID, network, IPC, UTS and
   cgroup namespace. Its user namespace maps one id, the sandbox's (65534 inside), onto an unprivileged host id:
   the caller's own, or 65534 (``nobody``) when the caller is root, whose mapping a helper process left in the
   parent namespace writes;
2. it forks ``P1``, PID 1 of the new PID namespace, killed when ``P0`` dies. ``P1`` builds the new root on a tmpfs
   from the plan's steps (read-only binds of the Python it needs, a few device nodes, a ``/proc`` of the new PID
   namespace, the size-limited working folder), pivots into it and detaches the old root, forbids further user
   namespaces, becomes the sandbox's user with no capabilities and no new privileges, and forks ``P2``: this
   interpreter, which goes on to run the plan's runner (the code's limits, then ``main.py``) instead of
   starting another one;
3. ``P1`` reaps until ``P2`` exits and hands its wait status to ``P0``, which ends the same way. When ``P1`` exits
   the kernel kills whatever is left in the PID namespace.

A step that fails prints ``jail: <step>: <reason>`` and exits with status 125 before any code runs.
"""

import ctypes
import marshal
import os
import resource
import signal
import stat
import struct
import sys

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SETUP_FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def call(what: str, result: int) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None) -> None:
    def enc(s):
        return None if s is None else s.encode()

    call(f"mount {target}", libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)))


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def map_ids(plan: dict, helper_pipe, uid: int, gid: int) -> None:
    """The user namespace's one id: written by the helper (root) or by the launcher itself (``uid`` and ``gid``,
    its own ids from before it entered the namespace)."""
    inside = plan["uid"]
    if helper_pipe is not None:
        os.write(helper_pipe[1], b"go")
        os.close(helper_pipe[1])
        _, status = os.waitpid(helper_pipe[0], 0)
        if status != 0:
            raise SetupError("the id mapping helper failed")
        return
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"{inside} {uid} 1\n")
    write("/proc/self/gid_map", f"{inside} {gid} 1\n")


def start_helper(plan: dict):
    """As root: a child left in the parent user namespace that maps the sandbox's id onto host ``nobody`` once the
    launcher has entered its new namespace (only a process with CAP_SETUID there may write such a map)."""
    outer, inside, launcher = plan["host_uid"], plan["uid"], os.getpid()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(write_end)
            if os.read(read_end, 2) != b"go":
                os._exit(1)
            write(f"/proc/{launcher}/uid_map", f"{inside} {outer} 1\n")
            write(f"/proc/{launcher}/gid_map", f"{inside} {outer} 1\n")
            os._exit(0)
        except BaseException:  # noqa: BLE001 - the launcher reports it
            os._exit(1)
    os.close(read_end)
    return pid, write_end


def prepare(path: str, is_dir: bool) -> None:
    """A mount point at ``path`` inside the new root: a folder, or an empty file for a file's bind."""
    if is_dir:
        os.makedirs(path, exist_ok=True)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.exists(path):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o444))


def remount_read_only(target: str) -> None:
    """Read-only, keeping the flags a user namespace may not change on a mount it did not make (noexec, atime)."""
    kept = os.statvfs(target).f_flag & (MS_NOEXEC | MS_NOATIME | MS_NODIRATIME | MS_RELATIME)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)


def open_sources(plan: dict) -> dict[str, int]:
    """The sources of the binds, opened while the launcher still has the caller's id: when that is root, the
    Python may sit where ``nobody`` cannot look (``/root/.pyenv``); the binds then go through these descriptors."""
    return {step[1]: os.open(step[1], os.O_PATH | os.O_CLOEXEC) for step in plan["steps"] if step[0] in ("ro", "dev")}


def become_sandbox_user(plan: dict) -> None:
    """The sandbox's user and group. Files of a mount made in the new namespace need an owner mapped there; the
    namespace's capabilities stay (the old id was no root of this namespace) until :func:`drop_privileges`."""
    uid = plan["uid"]
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def build_root(plan: dict, sources: dict[str, int]) -> None:
    """The new root from the plan's steps, then pivot into it: the old root is detached, not merely hidden."""
    root, uid = plan["root"], plan["uid"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for step in plan["steps"]:
        kind, at = step[0], root + step[-1]
        if kind in ("ro", "dev"):
            fd = sources[step[1]]
            prepare(at, stat.S_ISDIR(os.fstat(fd).st_mode))
            mount(f"/proc/self/fd/{fd}", at, None, MS_BIND)
            if kind == "ro":
                remount_read_only(at)
        elif kind == "symlink":
            os.makedirs(os.path.dirname(at), exist_ok=True)
            os.symlink(step[1], at)
        elif kind == "tmpfs":
            prepare(at, True)
            mount("tmpfs", at, "tmpfs", MS_NOSUID | MS_NODEV, f"size={step[1]},mode={step[2]:o},uid={uid},gid={uid}")
        elif kind == "remount-ro":
            remount_read_only(at)
        elif kind == "proc":
            prepare(at, True)
            mount("proc", at, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            # No user namespace of the code's own, where it would own mounts; then /proc's knobs read-only.
            write(os.path.join(at, "sys/user/max_user_namespaces"), "0")
            for name in ("sys", "sysrq-trigger", "irq", "bus"):
                if os.path.exists(os.path.join(at, name)):
                    mount(os.path.join(at, name), os.path.join(at, name), None, MS_BIND | MS_REC)
                    remount_read_only(os.path.join(at, name))
        elif kind == "dir":
            prepare(at, True)
        else:
            raise SetupError(f"unknown step {kind!r}")
    for fd in sources.values():
        os.close(fd)
    number = PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise SetupError(f"pivot_root: unknown system call number on {os.uname().machine}")
    os.chdir(root)
    call("pivot_root", libc.syscall(ctypes.c_long(number), b".", b"."))
    call("umount the old root", libc.umount2(b".", MNT_DETACH))
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges(plan: dict) -> None:
    """No capabilities (of the namespace), no new privileges, not traceable, no core files."""
    call("no new privileges", libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    call("drop capabilities", libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), (CapData * 2)()))
    call("not dumpable", libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def init(plan: dict, status_fd: int, alive_fd: int) -> str:
    """PID 1: die with the launcher, build the jail, fork the code's process (PID 2, which gets the runner's
    source back), then reap until that process exits and pass on how it ended."""
    call("die with the launcher", libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as PID 1, a signal without a handler is ignored
    os.set_blocking(alive_fd, False)
    try:
        if os.read(alive_fd, 1) == b"":  # the launcher died before the line above
            os._exit(SETUP_FAILED)
    except BlockingIOError:
        pass
    sources = open_sources(plan)
    become_sandbox_user(plan)
    build_root(plan, sources)
    os.chdir(plan["workdir"])
    drop_privileges(plan)
    child = os.fork()
    if child == 0:
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # nothing of the launcher's is inherited
        signal.signal(signal.SIGINT, signal.default_int_handler)
        call("dumpable", libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0))  # its own /proc/self, as after an exec
        return plan["runner"]
    while True:
        pid, status = os.wait()
        if pid == child:
            os.write(status_fd, struct.pack("i", status))
            os._exit(0)


def main() -> str:
    """The launcher; returns only in the code's process, with the runner's source."""
    plan = marshal.loads(bytes.fromhex(sys.argv[1]))
    call("die with the caller", libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
    if os.getppid() != plan["parent"]:
        os._exit(SETUP_FAILED)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    helper, uid, gid = None, os.geteuid(), os.getegid()
    if uid == 0:
        os.setgroups([])
        helper = start_helper(plan)
    call(
        "unshare",
        libc.unshare(
            CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
        ),
    )
    map_ids(plan, helper, uid, gid)
    status_read, status_write = os.pipe()
    alive_read, alive_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(plan["info_fd"])
        os.close(status_read)
        os.close(alive_write)
        try:
            return init(plan, status_write, alive_read)
        except (SetupError, OSError) as err:
            print(f"jail: {err}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    os.close(status_write)
    os.write(plan["info_fd"], b'{"child-pid": %d}' % pid)  # for the caller to stop the jail by
    os.close(plan["info_fd"])
    _, status = os.waitpid(pid, 0)
    packed = os.read(status_read, 4)
    if len(packed) != 4:
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else SETUP_FAILED)
    status = struct.unpack("i", packed)[0]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else SETUP_FAILED)


if __name__ == "__main__":
    try:
        _runner = main()
    except (SetupError, OSError) as err:
        print(f"jail: {err}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    # The code's process, in the jail: this interpreter goes on as a fresh one would (site's paths and builtins,
    # then the runner), sparing a second interpreter start; an exception or exit of the code ends it as usual.
    import site

    site.main()
    del site
    exec(_runner, {"__name__": "__jail__", "__builtins__": __builtins__})
