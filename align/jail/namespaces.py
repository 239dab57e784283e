"""The jail the python tool (:mod:`align.jail.sandbox`) runs code in: new kernel namespaces around one interpreter
(docs/environments.md, "The python tool's jail").

A jailed call sees a new root holding only

- the Python it runs, read-only and at the host's paths: the interpreter, its standard library (without its
  ``site-packages``), the shared libraries they load (found with ``ldd``), and the packages named in ``packages``;
- ``/dev/null``, ``zero``, ``full``, ``random`` and ``urandom``, and a ``/proc`` of its own PID namespace;
- its working folder: a tmpfs of ``disk_mb`` holding ``main.py`` (read-only);

in its own PID namespace (it sees and signals only its own processes; when its first process exits the kernel
kills the rest), network namespace (no interface but its own loopback), IPC and UTS namespaces, as an
unprivileged user without capabilities: user 65534 inside, mapped to the caller's own user, or to ``nobody`` on
the host when the caller is root. Two ways to build it:

- ``bwrap``: bubblewrap (``apt-get install bubblewrap``), run as that unprivileged user; preferred where it works;
- ``unshare``: the same namespaces made by :mod:`align.jail.launcher` with the ``unshare(2)`` system
  call, where user namespaces work (Linux, ``kernel.unprivileged_userns_clone`` or root).

:func:`find_jail` probes them once per process, in that order.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import marshal
import os
import pathlib
import re
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

INSIDE_ID = 65534
"""The sandbox's user and group id inside the jail (``nobody``); also its host id when the caller is root."""
UTF8_LOCALES = ("/usr/lib/locale/C.utf8", "/usr/lib/locale/C.UTF-8")
"""Where glibc finds the C.UTF-8 locale, which Python switches an empty environment to (``LC_CTYPE``)."""
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
BACKENDS = ("bwrap", "unshare")
MODES = ("required", "auto", "bwrap", "unshare", "off")
LAUNCHER = pathlib.Path(__file__).with_name("launcher.py")

Step = tuple  # ("ro", src, dest) | ("dev", src, dest) | ("symlink", target, path) | ("tmpfs", size, mode, path)
#               | ("remount-ro", path) | ("proc", path) | ("dir", path): what the new root is built from, in order


# ------------------------------------------------------------------------------------------------ the view


def _ldd(files: Sequence[str]) -> set[str]:
    """The shared libraries ``files`` load, as ``ldd`` resolves them here."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise RuntimeError("ldd is not installed (it lists the shared libraries the interpreter needs)")
    found: set[str] = set()
    for k in range(0, len(files), 64):
        out = subprocess.run([ldd, *files[k : k + 64]], capture_output=True, text=True, timeout=60).stdout
        for line in out.splitlines():
            words = line.replace("=>", " ").split()
            found.update(w for w in words if w.startswith("/") and os.path.exists(w))
    return found


def _symlinks_to(path: str, steps: list[Step], made: set[str]) -> str:
    """Adds a symlink step for every link on the way to ``path`` (``/lib -> usr/lib``); returns the real path."""
    parts, current = pathlib.PurePosixPath(os.path.abspath(path)).parts[1:], "/"
    for depth, part in enumerate(parts):
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            target = os.readlink(candidate)
            if candidate not in made:
                made.add(candidate)
                steps.append(("symlink", target, candidate))
            rest = os.path.join(os.path.dirname(candidate), target, *parts[depth + 1 :])
            return _symlinks_to(os.path.normpath(rest), steps, made)
        current = candidate
    return current


def _covered(path: str, dirs: Sequence[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def package_paths(name: str) -> list[str]:
    """What importing ``name`` reads from its site-packages: the package (or module file) and its wheel's
    vendored libraries (``<name>.libs``)."""
    spec = importlib.util.find_spec(name)
    if spec is None or (spec.origin is None and not spec.submodule_search_locations):
        raise ModuleNotFoundError(f"no installed package '{name}'")
    if spec.submodule_search_locations:
        paths = [str(p) for p in spec.submodule_search_locations]
    else:
        assert spec.origin is not None  # checked above: no search locations means an origin
        paths = [spec.origin]
    parent = os.path.dirname(paths[0].rstrip("/"))
    vendored = os.path.join(parent, f"{name}.libs")
    return paths + ([vendored] if os.path.isdir(vendored) else [])


def python_view(packages: Sequence[str] = ()) -> list[Step]:
    """The read-only steps that show this interpreter (and ``packages``) inside the jail."""
    steps: list[Step] = []
    made: set[str] = set()
    paths = sysconfig.get_paths()
    stdlib = sorted({os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"])})
    extensions = [
        os.path.join(d, f)
        for d in sys.path
        if d.endswith("lib-dynload") and os.path.isdir(d)
        for f in sorted(os.listdir(d))
        if f.endswith(".so") and not f.startswith("_tkinter")
    ]
    package_files = [p for name in packages for p in package_paths(name)]
    native = [
        os.path.join(d, f)
        for p in package_files
        if os.path.isdir(p)
        for d, _, fs in os.walk(p)
        for f in fs
        if ".so" in f
    ]
    wanted = [
        sys.executable,
        os.path.join(sys.prefix, "pyvenv.cfg"),
        *stdlib,
        *UTF8_LOCALES,
        *sorted(_ldd([os.path.realpath(sys.executable), *extensions, *native])),
    ]
    bound: list[str] = []
    for path in wanted:
        if not os.path.exists(path):
            continue
        real = _symlinks_to(path, steps, made)
        if not _covered(real, bound):
            bound.append(real)
            steps.append(("ro", real, real))
    hidden = sorted(
        {
            os.path.realpath(p)
            for p in (paths["purelib"], paths["platlib"], *_site_dirs(stdlib))
            if os.path.isdir(p) and _covered(os.path.realpath(p), bound)
        }
    )
    steps += [("tmpfs", 4096, 0o755, h) for h in hidden]
    for path in package_files:
        real = _symlinks_to(path, steps, made)
        if _covered(real, hidden) or not _covered(real, bound):
            steps.append(("ro", real, real))
    steps += [("remount-ro", h) for h in hidden]
    return steps


def _site_dirs(stdlib: Sequence[str]) -> list[str]:
    return [os.path.join(d, n) for d in stdlib for n in ("site-packages", "dist-packages")]


def call_steps(view: Sequence[Step], workdir: str, code_file: str, disk_bytes: int) -> list[Step]:
    """Every step of one call's root: devices, the Python, ``/proc``, and the working folder with the code."""
    devices = [("dev", d, d) for d in DEVICES if os.path.exists(d)]
    return [
        *devices,
        ("symlink", "/proc/self/fd", "/dev/fd"),
        *view,
        ("proc", "/proc"),
        ("tmpfs", disk_bytes, 0o700, workdir),
        ("ro", code_file, os.path.join(workdir, "main.py")),
    ]


# ------------------------------------------------------------------------------------------------ the commands


def host_user() -> tuple[int, int] | None:
    """The (uid, gid) a jail's processes have on the host when the caller is root (None: the caller's own)."""
    return (INSIDE_ID, INSIDE_ID) if os.geteuid() == 0 else None


def bwrap_command(steps: Sequence[Step], workdir: str, runner: str, info_fd: int) -> list[str]:
    """bubblewrap's command line for ``steps``: it runs ``runner`` in a new interpreter as :func:`host_user` (an
    unprivileged bwrap) and writes ``{"child-pid": ...}`` (the jail's first process) to ``info_fd``."""
    words = [
        shutil.which("bwrap") or "bwrap",
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--uid",
        str(INSIDE_ID),
        "--gid",
        str(INSIDE_ID),
        "--clearenv",
        "--info-fd",
        str(info_fd),
    ]
    for step in steps:
        kind = step[0]
        if kind == "ro":
            words += ["--ro-bind", step[1], step[2]]
        elif kind == "dev":
            words += ["--dev-bind", step[1], step[2]]
        elif kind == "symlink":
            words += ["--symlink", step[1], step[2]]
        elif kind == "tmpfs":
            words += ["--perms", f"{step[2]:o}", "--size", str(step[1]), "--tmpfs", step[3]]
        elif kind == "remount-ro":
            words += ["--remount-ro", step[1]]
        elif kind == "proc":
            words += ["--proc", step[1]]
        elif kind == "dir":
            words += ["--dir", step[1]]
    return [*words, "--remount-ro", "/", "--chdir", workdir, "--", sys.executable, "-I", "-c", runner]


def unshare_command(steps: Sequence[Step], workdir: str, runner: str, info_fd: int, root: str) -> list[str]:
    """The launcher's command line (the same ``info_fd``); it builds the new root on a tmpfs mounted at ``root`` (an
    empty host folder), and its interpreter goes on to run ``runner`` in the jail."""
    plan = {
        "uid": INSIDE_ID,
        "host_uid": INSIDE_ID,
        "parent": os.getpid(),
        "root": root,
        "workdir": workdir,
        "runner": runner,
        "steps": [list(s) for s in steps],
        "info_fd": info_fd,
    }
    return [sys.executable, "-I", "-S", "-c", _launcher_source(), marshal.dumps(plan).hex()]


@functools.lru_cache(maxsize=1)
def _launcher_source() -> str:
    return LAUNCHER.read_text()


def command(
    backend: str, steps: Sequence[Step], workdir: str, runner: str, info_fd: int, root: str
) -> tuple[list[str], dict]:
    """The command line that runs the Python source ``runner`` in ``backend``'s jail built from ``steps``, and the
    extra options of its ``Popen``. As root, bubblewrap is started as ``nobody`` through ``setpriv`` (util-linux),
    which, unlike ``Popen(user=...)``, lets the trainer start it without copying its own memory (``vfork``)."""
    options: dict = {"pass_fds": (info_fd,)}
    if backend != "bwrap":
        return unshare_command(steps, workdir, runner, info_fd, root), options
    words = bwrap_command(steps, workdir, runner, info_fd)
    user = host_user()
    if user is not None:
        setpriv = shutil.which("setpriv")
        if setpriv:
            words = [setpriv, f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups", "--", *words]
        else:
            options.update(user=user[0], group=user[1], extra_groups=[])
    return words, options


def first_process(info_fd: int) -> int | None:
    """A pidfd of the jail's first process, whose pid the jail writes to ``info_fd`` as it starts (None: it wrote
    none, having failed before)."""
    text = b""
    while select.select([info_fd], [], [], 10.0)[0]:
        chunk = os.read(info_fd, 4096)
        if not chunk:
            break
        text += chunk
    match = re.search(rb'"child-pid":\s*(\d+)', text)
    try:
        return os.pidfd_open(int(match.group(1))) if match else None
    except OSError:  # it has already ended
        return None


def end(first: int | None) -> None:
    """Returns once nothing of a jail is left: its first process is killed (it ends the jail as the code ends,
    except under bubblewrap, whose own first process may outlive bubblewrap by a moment when the code left
    processes behind), and the kernel empties its PID namespace before that process is gone."""
    if first is None:
        return
    try:
        signal.pidfd_send_signal(first, signal.SIGKILL)
    except OSError:
        pass
    try:
        select.select([first], [], [], 10.0)
    finally:
        os.close(first)


def stop(process: subprocess.Popen, first: int | None) -> None:
    """Kills a jail that outlived its time limit, and returns once nothing of it is left."""
    end(first)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


# ------------------------------------------------------------------------------------------------ the probe

_FOUND: dict[str, str | None] = {}
_WHY: dict[str, str] = {}
_VIEWS: dict[tuple, list[Step]] = {}
_LOCK = threading.Lock()


def view(packages: Sequence[str] = ()) -> list[Step]:
    """:func:`python_view`, computed once per process and package list."""
    key = tuple(packages)
    with _LOCK:
        if key not in _VIEWS:
            _VIEWS[key] = python_view(key)
        return _VIEWS[key]


def probe(backend: str, run) -> str | None:
    """Why ``backend`` cannot jail code here (None: it can), tried once per process: ``run(backend)`` runs a
    ``print`` in it and returns the output, or raises."""
    with _LOCK:
        if backend in _WHY:
            return _WHY[backend] or None
    if backend == "bwrap" and shutil.which("bwrap") is None:
        why = "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    elif not sys.platform.startswith("linux"):
        why = f"namespaces are Linux's, this is {sys.platform}"
    else:
        try:
            out = run(backend)
            why = "" if out == "jailed\n" else f"a test call printed {out[-300:]!r}"
        except Exception as err:  # noqa: BLE001 - the reason is the message
            why = " ".join(str(err).split())[-400:] or type(err).__name__
            if backend == "bwrap" and host_user() and "Permission denied" in why:
                why += f" (bubblewrap runs as nobody, uid {INSIDE_ID}, when the trainer is root)"
    with _LOCK:
        _WHY[backend] = why
    return why or None


def find_jail(mode: str, run) -> str | None:
    """The backend a sandbox with ``jail: mode`` uses (None: it runs code unjailed, said once in the log); raises
    ``RuntimeError`` naming every reason when ``mode`` requires a jail that cannot be built here."""
    if mode == "off":
        _warn_once(
            "off",
            "PythonSandbox: jail=off: the code a policy writes runs UNJAILED, with the trainer's user "
            "and files (only rlimits and an empty environment around it)",
        )
        return None
    with _LOCK:
        if mode in _FOUND:
            return _FOUND[mode]
    wanted = BACKENDS if mode in ("required", "auto") else (mode,)
    reasons = []
    found = None
    for backend in wanted:
        why = probe(backend, run)
        if why is None:
            found = backend
            break
        reasons.append(f"{backend}: {why}")
    if found is None and mode != "auto":
        raise RuntimeError(
            f"PythonSandbox: jail={mode}, and no jail works here ({'; '.join(reasons)}). Install "
            "bubblewrap or allow user namespaces (docs/environments.md), or set jail: auto to run "
            "code unjailed when none works"
        )
    if found is None:
        _warn_once(
            "auto",
            f"PythonSandbox: jail=auto found no jail ({'; '.join(reasons)}): the code a policy writes "
            "runs UNJAILED, with the trainer's user and files",
        )
    with _LOCK:
        _FOUND[mode] = found
    return found


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    with _LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    log.warning(message)
