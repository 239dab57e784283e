"""The ``python`` tool: code a policy wrote, run in a jail (:mod:`align.jail.namespaces`) with a time, memory,
process, disk and output limit (docs/environments.md, "The python tool's jail"); the tool environment that offers it
is :class:`align.rollout.envs.tools.ToolEnvironment`."""

from __future__ import annotations

import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence

from align.errors import INIT_KWARGS, AlignConfigError
from align.jail import namespaces as jails

__all__ = ["PythonSandbox", "python", "network_namespace"]

_NO_NETWORK = """
import socket as _s
def _no_network(*a, **k):
    raise OSError("network access is disabled in this sandbox")
for _n in ("socket", "create_connection", "create_server", "socketpair", "getaddrinfo", "gethostbyname"):
    setattr(_s, _n, _no_network)
del _s, _n, _no_network
"""
_NET_NAMESPACE: list[str] | None = None
_NET_LOCK = threading.Lock()


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def network_namespace() -> list[str]:
    """The ``unshare`` command line that starts a process without network here (a new network namespace), or
    ``[]`` where the machine allows none; probed once. Only unjailed code (``jail: off``) uses it: a jail has its
    own network namespace."""
    global _NET_NAMESPACE
    with _NET_LOCK:
        if _NET_NAMESPACE is None:
            found: list[str] = []
            unshare = shutil.which("unshare")
            if unshare and sys.platform.startswith("linux"):
                for flags in (["--net"], ["--user", "--map-root-user", "--net"]):
                    try:
                        ok = subprocess.run([unshare, *flags, "true"], capture_output=True, timeout=10).returncode == 0
                    except (OSError, subprocess.SubprocessError):
                        ok = False
                    if ok:
                        found = [unshare, *flags]
                        break
            _NET_NAMESPACE = found
        return _NET_NAMESPACE


def _wait(process: subprocess.Popen, timeout: float) -> int:
    """``process.wait(timeout)``, woken when the process exits (a pidfd) rather than by ``Popen.wait``'s polling,
    whose growing sleeps would add up to 30 ms to a call."""
    try:
        fd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3
        return process.wait(timeout=timeout)
    try:
        if not select.select([fd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(process.args, timeout)
    finally:
        os.close(fd)
    return process.wait()


class PythonSandbox:
    """``python``: runs code in a separate Python interpreter, in a jail, and returns what it printed.

    The jail (``jail``; :mod:`align.jail.namespaces`): its own root holding a read-only view of this Python and a
    working folder of ``disk_mb`` (a tmpfs, gone afterwards), its own PID, network, IPC and UTS namespaces (the
    whole PID namespace is killed when the call ends), an unprivileged user without capabilities. Inside it, the
    interpreter runs in isolated mode (``-I``) with an empty environment and sets its own ``RLIMIT_AS``
    (memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (its output goes to a file, so printing without end stops at the
    cap), ``RLIMIT_NOFILE`` and ``RLIMIT_NPROC`` (``max_processes``) before the code runs. The wall-clock limit
    kills the whole call.
    """

    def __init__(
        self,
        timeout: float = 5.0,
        memory_mb: int = 512,
        max_output_chars: int = 2000,
        jail: str = "required",
        max_processes: int = 32,
        disk_mb: int = 16,
        packages: Sequence[str] = (),
    ):
        """
        Args:
            timeout: Seconds of wall-clock time a call may run.
            memory_mb: Address space of each of its processes (``RLIMIT_AS``).
            max_output_chars: Characters of output returned; more is cut, and a lot more stops the code.
            jail: ``required`` (bubblewrap, else the kernel's namespaces through ``unshare``; refuse to run when
                neither works), ``auto`` (the same, but run unjailed with a warning when neither works), ``bwrap``
                or ``unshare`` (only that one), ``off`` (no jail, with a warning: only the limits).
            max_processes: Processes and threads a call may have at once (``RLIMIT_NPROC`` inside its jail).
            disk_mb: Size of its working folder (the only place it can write).
            packages: Installed packages the code may import besides the standard library (``numpy``, ``sympy``),
                shown read-only; none by default.
        """
        for key, value, ok, expected in (
            ("timeout", timeout, _number(timeout) and timeout > 0, "a number of seconds > 0"),
            ("memory_mb", memory_mb, _number(memory_mb) and memory_mb >= 32, ">= 32"),
            ("max_output_chars", max_output_chars, _number(max_output_chars) and max_output_chars >= 1, ">= 1"),
            ("max_processes", max_processes, _number(max_processes) and max_processes >= 2, ">= 2"),
            ("disk_mb", disk_mb, _number(disk_mb) and disk_mb >= 1, ">= 1"),
        ):
            if not ok:
                raise AlignConfigError(f"{INIT_KWARGS}.{key}: expected {expected}, got {value!r}")
        if jail not in jails.MODES:
            raise AlignConfigError(f"{INIT_KWARGS}.jail: expected one of {', '.join(jails.MODES)}, got {jail!r}")
        for name in packages:
            try:
                jails.package_paths(name)
            except (ImportError, ValueError) as err:
                raise AlignConfigError(
                    f"{INIT_KWARGS}.packages: expected installed packages to show the code, got "
                    f"'{name}', which cannot be shown: {err}"
                ) from None
        self.timeout, self.memory_mb, self.max_output_chars = timeout, memory_mb, max_output_chars
        self.jail, self.max_processes, self.disk_mb, self.packages = jail, max_processes, disk_mb, tuple(packages)
        self.__name__ = "python"

    def prepare(self) -> str | None:
        """Finds the jail now (not inside the first call's time limit) and returns its backend (None: unjailed);
        raises ``AlignConfigError`` when ``jail`` requires one that does not work here."""
        try:
            backend = jails.find_jail(self.jail, self._probe)
        except RuntimeError as err:
            raise AlignConfigError(f"{INIT_KWARGS}.jail: {err}") from None
        if backend is None:
            network_namespace()
        else:
            jails.view(self.packages)
        return backend

    @staticmethod
    def _probe(backend: str) -> str:
        return PythonSandbox(timeout=10)._run("print('jailed')", backend)

    def _runner(self, network_guard: bool, jailed: bool) -> str:
        """The child's first lines: its limits (set by the child itself, so no code runs between fork and exec in
        this threaded process), the socket guard where unjailed code has no network namespace, then ``main.py``."""
        memory, cpu, cap = self.memory_mb * 2**20, int(math.ceil(self.timeout)) + 1, self.output_cap_bytes
        clear_pwd = "import os\nos.environ.pop('PWD', None)\ndel os\n"  # bubblewrap sets it
        nproc = f"resource.setrlimit(resource.RLIMIT_NPROC, ({self.max_processes}, {self.max_processes}))\n"
        return (
            "import resource\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))\n"
            f"resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({cap}, {cap}))\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
            f"{nproc if jailed else ''}"
            f"{_NO_NETWORK if network_guard else ''}\n"
            f"{clear_pwd if jailed else ''}"
            "import sys, types\nsys.argv = ['main.py']\ndel resource\n"
            "_main = sys.modules['__main__'] = types.ModuleType('__main__')  # for pickle and multiprocessing\n"
            "_main.__file__ = 'main.py'\n"
            "with open('main.py', 'rb') as _f:\n    _code = compile(_f.read(), 'main.py', 'exec')\n"
            "del _f, sys, types\nexec(_code, _main.__dict__)\n"
        )

    @property
    def output_cap_bytes(self) -> int:
        """Bytes the child may write (RLIMIT_FSIZE): room for ``max_output_chars`` of UTF-8 text and a traceback;
        output that reaches it was stopped there."""
        return 4 * self.max_output_chars + 4096

    def __call__(self, code: str) -> str:
        """Runs Python code in a sandbox and returns its printed output (print what you want to see).

        Args:
            code: The Python source to run.
        """
        return self._run(str(code), self.prepare())

    def _run(self, code: str, backend: str | None) -> str:
        folder = tempfile.mkdtemp(prefix="align-python-")
        info_read, info_write = os.pipe() if backend else (-1, -1)
        try:
            code_file = os.path.join(folder, "main.py")
            with open(code_file, "w") as f:
                f.write(code)
            options: dict = {}
            if backend is None:
                prefix = network_namespace()
                argv = [*prefix, sys.executable, "-I", "-c", self._runner(not prefix, jailed=False)]
            else:
                os.chmod(folder, 0o711)  # bubblewrap runs as an unprivileged user and reads main.py itself
                os.chmod(code_file, 0o644)
                root = os.path.join(folder, "root")
                os.mkdir(root)
                steps = jails.call_steps(jails.view(self.packages), folder, code_file, self.disk_mb * 2**20)
                argv, options = jails.command(
                    backend, steps, folder, self._runner(False, jailed=True), info_write, root
                )
            with open(os.open(os.path.join(folder, "out"), os.O_WRONLY | os.O_CREAT, 0o600), "wb") as out:
                process = subprocess.Popen(
                    argv,
                    cwd=folder,
                    env={},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    **options,
                )
                first = None
                if backend:
                    os.close(info_write)
                    info_write = -1
                    first = jails.first_process(info_read)
                try:
                    status = _wait(process, self.timeout)
                except subprocess.TimeoutExpired:
                    if backend:
                        jails.stop(process, first)
                    else:
                        os.killpg(process.pid, signal.SIGKILL)
                        process.wait()
                    raise TimeoutError(f"the code ran longer than {self.timeout:g} s") from None
                jails.end(first)
            return self._reply(os.path.join(folder, "out"), status, backend)
        finally:
            for fd in (info_read, info_write):
                if fd >= 0:
                    os.close(fd)
            shutil.rmtree(folder, ignore_errors=True)

    def _reply(self, out: str, status: int, backend: str | None) -> str:
        """The call's output, or the error it ended with."""
        size = os.path.getsize(out)
        with open(out, "rb") as f:
            text = f.read(4 * self.max_output_chars).decode("utf-8", errors="replace")
        if size >= self.output_cap_bytes:  # RLIMIT_FSIZE stopped its writes
            raise RuntimeError(
                f"the output exceeded the limit of {self.max_output_chars} characters; it began: {text[:200]}"
            )
        if backend == "bwrap" and 128 < status < 128 + signal.NSIG:  # bubblewrap reports a signal as 128 + N
            status = 128 - status
        if backend == "unshare" and status == 125 and text.startswith("jail: "):
            raise RuntimeError(f"the jail could not be built: {text.strip()[:300]}")
        if status < 0:
            name = signal.Signals(-status).name if -status in signal.valid_signals() else f"signal {-status}"
            why = {"SIGXCPU": "it used too much CPU time", "SIGKILL": "it was killed"}.get(name, name)
            raise RuntimeError(f"the code was stopped: {why}" + (f"; output before: {text[-200:]}" if text else ""))
        if status != 0:
            last = [line for line in text.strip().splitlines() if line.strip()][-3:]
            raise RuntimeError("\n".join(last) or f"exit status {status}")
        if len(text) > self.max_output_chars:
            return text[: self.max_output_chars] + f"\n... [cut: {size} bytes of output in all]"
        return text


python = PythonSandbox()
"""The ``python`` tool with the default limits (5 s, 512 MB, 2,000 characters, 32 processes, 16 MB of disk, a
required jail)."""
