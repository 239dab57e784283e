"""The python tool's jail: which one is chosen (required, auto, off; bubblewrap, then the kernel's namespaces) and
bubblewrap's command line; then hostile code in it: each snippet tries one way out (host files, writes outside its
folder, signals, other processes' /proc, a process left behind, many processes, a fork bomb, symlinks, ctypes, a full
disk, the network, the environment, privileges, inherited descriptors), and each is contained: asserted on what the
snippet printed and on the host afterwards. Every snippet runs in every jail that works here."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import string
import subprocess
import sys
import sysconfig
import threading
import time
import uuid

import pytest

from align.jail import namespaces as jails
from align.jail.sandbox import PythonSandbox

SNIPPETS = {
    # Every file it can see that is not its Python (the interpreter, the standard library without site-packages, a
    # shared library, the C.UTF-8 locale), in its working folder, /proc or /dev; and the host files it tries by name.
    "files": """
import json, os
seen, stray = 0, []
for top, dirs, files in os.walk('/'):
    if top in ('/proc', '/dev'):
        dirs[:] = []
        continue
    for name in files:
        path = os.path.join(top, name)
        seen += 1
        python = path.startswith($stdlib + '/') and '/site-packages/' not in path
        if not (python or '.so' in name or os.path.realpath(path) in $python_files or path.startswith(os.getcwd() + '/')
                or path.startswith('/usr/lib/locale/C.utf8/')):
            stray.append(path)
tried = {}
for path in ('/etc/passwd', '/etc/shadow', '/etc/hostname', $secret, os.path.expanduser('~/.bashrc')):
    try:
        tried[path] = open(path).read()[:40]
    except OSError as err:
        tried[path] = type(err).__name__
listed = {}
for path in ('/root', '/home', '/work', '/tmp'):
    try:
        listed[path] = sorted(os.listdir(path))
    except OSError as err:
        listed[path] = type(err).__name__
print(json.dumps({'seen': seen, 'stray': stray[:20], 'tried': tried, 'listed': listed}))
""",
    "write": """
import json
result = {}
for path in $targets:
    try:
        with open(path, 'w') as f:
            f.write('escaped')
        result[path] = 'written'
    except OSError as err:
        result[path] = type(err).__name__
open('inside.txt', 'w').write('fine')
result['inside.txt'] = open('inside.txt').read()
print(json.dumps(result))
""",
    "signals": """
import json, os, signal
result = {'ppid': os.getppid()}
for name, pid, sig in (('parent', os.getppid(), signal.SIGUSR1), ('trainer', $trainer, signal.SIGUSR1),
                       ('victim', $victim, signal.SIGKILL)):
    try:
        os.kill(pid, sig)
        result[name] = 'sent'
    except OSError as err:
        result[name] = type(err).__name__
if $everyone:
    try:
        os.kill(-1, signal.SIGKILL)
        result['everyone'] = 'sent'
    except OSError as err:
        result['everyone'] = type(err).__name__
print(json.dumps(result))
""",
    "proc": """
import json, os
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
found, texts = [], {}
for pid in pids:
    for part in ('cmdline', 'environ'):
        try:
            text = open(f'/proc/{pid}/{part}', 'rb').read().decode('utf-8', 'replace')
        except OSError as err:
            text = type(err).__name__
        texts[f'{pid}/{part}'] = text[:200]
        if $marker in text or $secret in text:
            found.append(f'{pid}/{part}')
print(json.dumps({'pids': pids, 'found': found, 'pid1': texts.get('1/cmdline', ''),
                  'trainer': os.path.exists('/proc/$trainer')}))
""",
    "daemon": """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, '-c', 'import signal, time\\n'
                 'signal.signal(signal.SIGTERM, signal.SIG_IGN)\\nsignal.signal(signal.SIGHUP, signal.SIG_IGN)\\n'
                 'time.sleep(120)', $marker])
    os._exit(0)
for _ in range(1500):
    running = [p for p in os.listdir('/proc')
               if p.isdigit() and $marker.encode() in open(f'/proc/{p}/cmdline', 'rb').read()]
    if running:
        print('daemon running', len(running))
        break
    time.sleep(0.01)
""",
    "processes": """
import os, time
started, failure = 0, 'none'
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        started += 1
    except OSError as err:
        failure = type(err).__name__
        break
print(started, failure)
""",
    "fork_bomb": """
import os, sys
os.execv(sys.executable, [sys.executable, '-c', 'import os\\nwhile True:\\n    try:\\n        os.fork()\\n'
         '    except OSError:\\n        pass', $marker])
""",
    "symlinks": """
import json, os
result = {}
for name, target in (('passwd', '/etc/passwd'), ('secret', $secret), ('root', '/'), ('up', '../../../../etc/passwd'),
                     ('init_root', '/proc/1/root/etc/passwd'), ('cwd', '/proc/self/cwd/../../../etc/passwd')):
    os.symlink(target, name)
    try:
        result[name] = sorted(os.listdir(name)) if os.path.isdir(name) else open(name).read()[:40]
    except OSError as err:
        result[name] = type(err).__name__
os.symlink($secret, 'planted')  # left for whoever reads the folder afterwards
print(json.dumps(result))
""",
    "ctypes": """
import ctypes, errno, json
libc = ctypes.CDLL('libc.so.6', use_errno=True)
def attempt(name, result):
    return name, ('ok' if result >= 0 else errno.errorcode[ctypes.get_errno()])
print(json.dumps(dict([
    attempt('open', libc.open(b'/etc/passwd', 0)),
    attempt('kill', libc.kill($victim, 9)),
    attempt('unshare_user', libc.unshare(0x10000000)),
    attempt('unshare_mount', libc.unshare(0x20000)),
    attempt('mount', libc.mount(b'none', b'/', b'tmpfs', 0, None)),
    attempt('remount_rw', libc.mount(None, $stdlib.encode(), None, 32 | 4096, None)),
    attempt('chroot', libc.chroot(b'/')),
    attempt('setuid', libc.setuid(0)),
    attempt('ptrace', libc.ptrace(16, $victim, 0, 0)),
])))
""",
    "disk": """
import os
total, failure = 0, 'none'
for k in range(100000):
    try:
        with open(f'fill{k}', 'wb') as f:
            f.write(b'x' * 8192)
        total += 8192
    except OSError as err:
        failure = type(err).__name__ + ' ' + str(err.errno)
        break
    if total >= $limit:
        break
print(total, failure)
""",
    "network": """
import json, socket
result = {}
try:
    socket.create_connection(('127.0.0.1', $port), timeout=2)
    result['tcp'] = 'connected'
except OSError as err:
    result['tcp'] = err.errno
s = socket.socket(socket.AF_UNIX)
try:
    s.connect($abstract)
    result['unix'] = 'connected'
except OSError as err:
    result['unix'] = err.errno
try:
    socket.getaddrinfo('example.com', 80)
    result['dns'] = 'resolved'
except OSError as err:
    result['dns'] = type(err).__name__
result['interfaces'] = [name for _, name in socket.if_nameindex()]
print(json.dumps(result))
""",
    "environment": """
import json, os
result = {'environ': dict(os.environ)}
for pid in ('self', '1', str(os.getppid())):
    try:
        result[pid] = open(f'/proc/{pid}/environ', 'rb').read().decode()
    except OSError as err:
        result[pid] = type(err).__name__
print(json.dumps(result))
""",
    "identity": """
import json, os, sys
status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())
print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'groups': os.getgroups(),
                  'fds': sorted(os.listdir('/proc/self/fd')),
                  **{k: status[k].strip() for k in ('CapEff', 'CapPrm', 'CapAmb', 'NoNewPrivs')}}), flush=True)
os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(1)', $marker])  # seen from the host
""",
}


def snippet(name: str, **values) -> str:
    """The snippet ``name`` with its ``$placeholders`` filled in as Python literals."""
    return string.Template(SNIPPETS[name]).substitute({k: repr(v) for k, v in values.items()})


def host_processes_with(marker: str) -> list[int]:
    """Host processes whose command line holds ``marker``."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture
def victim():
    """A host process that no jailed code may signal."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"victim-{uuid.uuid4().hex}"])
    yield process
    process.kill()
    process.wait()


def test_required_takes_the_first_jail_that_works_and_refuses_when_none_does(fresh, monkeypatch):
    monkeypatch.setattr(jails.shutil, "which", lambda name: None)  # no bubblewrap
    assert jails.find_jail("required", lambda backend: "jailed\n") == "unshare"
    monkeypatch.setattr(jails, "_FOUND", {})
    monkeypatch.setattr(jails, "_WHY", {})

    def broken(backend):
        raise RuntimeError("the jail could not be built: jail: unshare: Operation not permitted")

    with pytest.raises(
        RuntimeError,
        match=r"jail=required, and no jail works here \(bwrap: bubblewrap is not "
        r"installed .*; unshare: the jail could not be built: jail: unshare: "
        r"Operation not permitted\)",
    ):
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


def test_bubblewrap_gets_every_step_in_order(monkeypatch):
    monkeypatch.setattr(jails.shutil, "which", lambda name: "/usr/bin/bwrap")
    steps = [
        ("dev", "/dev/null", "/dev/null"),
        ("symlink", "usr/lib", "/lib"),
        ("ro", "/usr/lib/x", "/usr/lib/x"),
        ("tmpfs", 4096, 0o755, "/py/site-packages"),
        ("ro", "/py/site-packages/pkg", "/py/site-packages/pkg"),
        ("remount-ro", "/py/site-packages"),
        ("proc", "/proc"),
        ("tmpfs", 2**20, 0o700, "/tmp/w"),
        ("ro", "/tmp/w/main.py", "/tmp/w/main.py"),
    ]
    assert jails.bwrap_command(steps, "/tmp/w", "print(1)", 7) == [
        "/usr/bin/bwrap",
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--uid",
        "65534",
        "--gid",
        "65534",
        "--clearenv",
        "--info-fd",
        "7",
        "--dev-bind",
        "/dev/null",
        "/dev/null",
        "--symlink",
        "usr/lib",
        "/lib",
        "--ro-bind",
        "/usr/lib/x",
        "/usr/lib/x",
        "--perms",
        "755",
        "--size",
        "4096",
        "--tmpfs",
        "/py/site-packages",
        "--ro-bind",
        "/py/site-packages/pkg",
        "/py/site-packages/pkg",
        "--remount-ro",
        "/py/site-packages",
        "--proc",
        "/proc",
        "--perms",
        "700",
        "--size",
        "1048576",
        "--tmpfs",
        "/tmp/w",
        "--ro-bind",
        "/tmp/w/main.py",
        "/tmp/w/main.py",
        "--remount-ro",
        "/",
        "--chdir",
        "/tmp/w",
        "--",
        sys.executable,
        "-I",
        "-c",
        "print(1)",
    ]


def test_some_jail_works_on_this_linux_machine():
    if not sys.platform.startswith("linux"):
        pytest.skip("namespaces are Linux's")
    assert jails.find_jail("required", PythonSandbox._probe) in jails.BACKENDS


def test_host_files_are_not_there(jailed, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the trainer's secret")
    python_files = [os.path.realpath(sys.executable), os.path.join(sys.prefix, "pyvenv.cfg")]
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    out = json.loads(jailed(timeout=60)(snippet("files", stdlib=stdlib, python_files=python_files, secret=str(secret))))
    assert out["seen"] > 100 and out["stray"] == []  # the walk saw the standard library, and nothing else
    assert out["tried"] == {
        "/etc/passwd": "FileNotFoundError",
        "/etc/shadow": "FileNotFoundError",
        "/etc/hostname": "FileNotFoundError",
        str(secret): "FileNotFoundError",
        "~/.bashrc": "FileNotFoundError",
    }  # no HOME, no /etc/passwd: '~' stays '~'
    for top in ("/root", "/home", "/work", "/tmp"):  # only the way to its Python and to its own folder
        python = {p.split("/")[2] for p in (sys.base_prefix, sys.prefix, sys.executable) if p.startswith(top + "/")}
        expected = sorted(python) or "FileNotFoundError"
        if top == "/tmp":
            expected = sorted({*python, *(n for n in out["listed"]["/tmp"] if n.startswith("align-python-"))})
        assert out["listed"][top] == expected, top


def test_writes_outside_the_working_folder_fail(jailed, tmp_path):
    name = f"align-jail-{uuid.uuid4().hex}"
    stdlib = sysconfig.get_paths()["stdlib"]
    targets = [
        f"/tmp/{name}",
        str(tmp_path / name),
        f"/{name}",
        f"{stdlib}/{name}.py",
        f"/dev/{name}",
        f"{sys.prefix}/{name}",
    ]
    out = json.loads(jailed()(snippet("write", targets=targets)))
    assert out.pop("inside.txt") == "fine"
    assert set(out.values()) <= {"OSError", "FileNotFoundError", "PermissionError"} and set(out) == set(targets)
    assert [t for t in targets if os.path.exists(t)] == []


def test_signals_reach_only_the_jail(jailed, victim):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    try:
        out = json.loads(jailed()(snippet("signals", trainer=os.getpid(), victim=victim.pid, everyone=True)))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert out["ppid"] == 1  # its parent is the jail's own first process
    assert received == [] and victim.poll() is None  # nothing reached the trainer or the host process
    assert out["everyone"] == "ProcessLookupError"  # kill(-1): no process it may signal but itself and PID 1
    assert (out["parent"], out["trainer"], out["victim"]) == ("sent", "ProcessLookupError", "ProcessLookupError")


def test_other_processes_are_invisible_in_proc(jailed, victim, monkeypatch):
    token = uuid.uuid4().hex
    monkeypatch.setenv("ALIGN_JAIL_SECRET", token)
    marker = victim.args[-1]
    out = json.loads(jailed()(snippet("proc", marker=marker, secret=token, trainer=os.getpid())))
    assert out["pids"] == [1, 2] and out["found"] == [] and out["trainer"] is False
    with open("/proc/1/cmdline", "rb") as f:
        assert out["pid1"] != f.read().decode("utf-8", "replace")[:200]  # its PID 1 is not the host's


def test_nothing_keeps_running_after_the_call(jailed):
    marker = f"daemon-{uuid.uuid4().hex}"
    assert jailed()(snippet("daemon", marker=marker)) == "daemon running 1\n"
    assert host_processes_with(marker) == []


def test_the_process_count_is_limited(jailed):
    started, failure = jailed(max_processes=8)(snippet("processes")).split()
    assert failure == "BlockingIOError" and 4 <= int(started) <= 6  # 8 minus the jail's own 2 or 3 processes


def test_a_fork_bomb_is_contained_and_the_call_returns(jailed):
    marker = f"bomb-{uuid.uuid4().hex}"
    with pytest.raises(TimeoutError, match="ran longer than 1.5 s"):
        jailed(max_processes=12, timeout=1.5)(snippet("fork_bomb", marker=marker))
    assert host_processes_with(marker) == []


def test_symlinks_lead_back_into_the_jail(jailed, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the trainer's secret")
    out = json.loads(jailed()(snippet("symlinks", secret=str(secret))))
    root = out.pop("root")
    assert "etc" not in root and "home" not in root and "proc" in root
    assert set(out.values()) <= {"FileNotFoundError", "PermissionError"}, out
    assert secret.read_text() == "the trainer's secret"


def test_ctypes_reaches_no_further(jailed, victim):
    stdlib = sysconfig.get_paths()["stdlib"]
    out = json.loads(jailed()(snippet("ctypes", victim=victim.pid, stdlib=stdlib)))
    assert (out.pop("open"), out.pop("kill"), out.pop("ptrace")) == ("ENOENT", "ESRCH", "ESRCH")
    assert out.pop("setuid") == "EINVAL"  # uid 0 does not exist in its user namespace
    assert out.pop("unshare_user") in ("ENOSPC", "EPERM")  # no user namespace of its own
    assert set(out.values()) <= {"EPERM"}, out
    assert victim.poll() is None


def test_the_working_folder_is_bounded(jailed):
    total, failure, code = jailed(disk_mb=2)(snippet("disk", limit=64 * 2**20)).split()
    assert (failure, int(code)) == ("OSError", errno.ENOSPC)
    assert 1.5 * 2**20 <= int(total) <= 2 * 2**20


def test_there_is_no_network(jailed):
    server = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    abstract = f"\0align-jail-{uuid.uuid4().hex}"
    unix.bind(abstract)
    unix.listen()
    accepted = []
    for listener in (server, unix):
        listener.settimeout(4)
        threading.Thread(target=lambda s=listener: accepted.append(_accept(s)), daemon=True).start()
    try:
        out = json.loads(jailed()(snippet("network", port=server.getsockname()[1], abstract=abstract)))
    finally:
        server.close()
        unix.close()
    assert out["tcp"] in (errno.ENETUNREACH, errno.ECONNREFUSED)  # no interface up, or a loopback of its own
    assert out["unix"] == errno.ECONNREFUSED and out["dns"] == "gaierror"
    assert set(out["interfaces"]) <= {"lo"} and not any(accepted)


def _accept(listener: socket.socket) -> bool:
    try:
        listener.accept()
        return True
    except OSError:
        return False


def test_the_environment_is_empty(jailed, monkeypatch):
    token = uuid.uuid4().hex
    monkeypatch.setenv("ALIGN_JAIL_SECRET", token)
    text = jailed()(snippet("environment"))
    out = json.loads(text)
    assert token not in text and set(out["environ"]) <= {"LC_CTYPE"}


def test_the_code_runs_unprivileged_with_nothing_inherited(jailed):
    marker = f"identity-{uuid.uuid4().hex}"
    seen, result = {}, {}
    call = threading.Thread(target=lambda: result.update(out=jailed()(snippet("identity", marker=marker))))
    call.start()
    while call.is_alive() and not seen:  # the host's view of the jailed process: its real user and group
        for pid in host_processes_with(marker):
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines())
            seen.update(uid=fields["Uid"].split(), gid=fields["Gid"].split())
        time.sleep(0.005)
    call.join()
    out = json.loads(result["out"])
    host = str(65534 if os.geteuid() == 0 else os.getuid())
    assert (out["uid"], out["gid"]) == (65534, 65534)
    # No supplementary group as root; a user's own stay (an unprivileged namespace cannot drop them), unmapped.
    assert out["groups"] == [] if os.geteuid() == 0 else set(out["groups"]) <= {65534}
    assert seen == {"uid": [host] * 4, "gid": [str(65534 if os.geteuid() == 0 else os.getgid())] * 4}
    assert (out["CapEff"], out["CapPrm"], out["CapAmb"], out["NoNewPrivs"]) == ("0" * 16, "0" * 16, "0" * 16, "1")
    assert out["fds"] == ["0", "1", "2", "3"]  # stdin, the output twice, and the listing's own
