"""The python tool's escape table: one row per thing a model's code might try, each checked from outside the call.

Every row holds under `env.sandbox: bwrap` (what `auto` picks where bubblewrap runs). The same table under
`process` (a plain subprocess with resource limits) documents which rows do not hold there: those are strict
expected failures, so the table stays honest both ways. The rows skip only where bwrap cannot run, with the reason;
as root with bwrap installed (CI's machine: `.ci/install` installs it) that is a failure, not a skip.
"""

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

import jgrpo
from jgrpo.config import ConfigError, EnvConfig
from jgrpo.envs.sandbox import PythonTool, python_sandbox
from jgrpo.envs.tools import ToolError

LIMITS = dict(sandbox_cpu_s=1, sandbox_timeout_s=3, sandbox_output_chars=4000, sandbox_disk_mb=16,
              sandbox_file_mb=8, sandbox_processes=4)


def _bwrap_problem() -> str | None:
    try:
        python_sandbox(EnvConfig(sandbox="bwrap", **LIMITS))
    except ConfigError as e:
        return str(e)
    return None


def bwrap_problem_or_skip() -> None:
    """Skip where bubblewrap cannot run, with the reason; fail where it must (root with bwrap installed: CI)."""
    problem = _bwrap_problem()
    if problem:
        if os.geteuid() == 0 and shutil.which("bwrap"):
            pytest.fail(f"bwrap is installed and this is root (CI's machine), yet the sandbox does not run: "
                        f"{problem}")
        pytest.skip(f"bubblewrap cannot run here: {problem}")


@pytest.fixture(scope="module")
def bwrap_tool():
    bwrap_problem_or_skip()
    return PythonTool(EnvConfig(sandbox="bwrap", **LIMITS))


@pytest.fixture(scope="module")
def process_tool():
    return PythonTool(EnvConfig(sandbox="process", **LIMITS))


class Listener:
    """A TCP server on the host's loopback: counts the connections it accepted."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port, self.accepted, self.running = self.server.getsockname()[1], 0, True
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while self.running:
            try:
                self.server.accept()[0].close()
                self.accepted += 1
            except TimeoutError:
                pass

    def close(self):
        self.running = False
        self.thread.join()
        self.server.close()


@pytest.fixture
def host(tmp_path, monkeypatch):
    """What the code aims at, on the host: a run directory, a private file, a process, a loopback server, a
    secret in the trainer's environment, a file name next to jgrpo's package and in the host's /tmp."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    secret = f"secret-{uuid.uuid4().hex}"
    (tmp_path / "private.txt").write_text(secret)
    monkeypatch.setenv("JGRPO_TEST_SECRET", secret)
    victim = subprocess.Popen(["sleep", "60"])
    listener = Listener()
    marker = f"0.{uuid.uuid4().int % 10 ** 15:015d}"  # a sleep's extra seconds: what marks its command line
    name = uuid.uuid4().hex
    h = dict(run_dir=run_dir, secret=secret, private=tmp_path / "private.txt", victim=victim, listener=listener,
             marker=marker, tmp_file=Path("/tmp") / f"jgrpo-escape-{name}",
             package_file=Path(jgrpo.__file__).parent / f"escape_{name}.py", spill=tmp_path / "spill",
             trainer=os.getpid())
    yield h
    victim.kill()
    victim.wait()
    listener.close()
    for path in (h["tmp_file"], h["package_file"]):
        path.unlink(missing_ok=True)
    _kill_marked(marker)


def _kill_marked(marker: str) -> list[int]:
    """Kill the host's processes whose command line carries `marker` (what outlived a call); their pids."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    return found


# Each row: (what the code does, its code from the host's facts, the check from outside that it was stopped).
CONNECT = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
           "except OSError as e:\n    print('refused', e)\n")
ROWS = {
    "write the host's /tmp": (
        lambda h: f"open({str(h['tmp_file'])!r}, 'w').write('x')",
        lambda h, out: not h["tmp_file"].exists()),
    "write next to jgrpo's package (the reward code)": (
        lambda h: f"open({str(h['package_file'])!r}, 'w').write('import os')",
        lambda h, out: not h["package_file"].exists()),
    "write into the run directory": (
        lambda h: f"open({str(h['run_dir'] / 'checkpoint')!r}, 'w').write('x')",
        lambda h, out: not (h["run_dir"] / "checkpoint").exists()),
    "read a file the trainer's user can read": (
        lambda h: f"print(open({str(h['private'])!r}).read())",
        lambda h, out: h["secret"] not in out),
    "signal a process of the host (SIGKILL)": (
        lambda h: f"import os, signal\nos.kill({h['victim'].pid}, signal.SIGKILL)",
        lambda h, out: time.sleep(0.2) or h["victim"].poll() is None),
    "a process that outlives the call (fork, setsid, fork)": (
        lambda h: "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                  f"        os.execv('/bin/sleep', ['sleep', '30', {h['marker']!r}])\n    os._exit(0)\nprint('left')",
        lambda h, out: time.sleep(0.3) or not _kill_marked(h["marker"])),
    "200 files of 1 MB outside its directory": (
        lambda h: f"import os\nos.makedirs({str(h['spill'])!r}, exist_ok=True)\n"
                  f"for i in range(200):\n    open(os.path.join({str(h['spill'])!r}, str(i)), 'wb')"
                  ".write(bytes(1 << 20))",
        lambda h, out: not h["spill"].exists() or not any(h["spill"].iterdir())),
    "connect to the host's loopback": (
        lambda h: CONNECT.format(port=h["listener"].port),
        lambda h, out: h["listener"].accepted == 0),
    "connect from a child interpreter": (
        lambda h: "import subprocess, sys\nsubprocess.run([sys.executable, '-c', "
                  f"{CONNECT.format(port=h['listener'].port)!r}])",
        lambda h, out: h["listener"].accepted == 0),
    "read the trainer's environment variables": (
        lambda h: f"import os\nprint(dict(os.environ))\nprint(open('/proc/{h['trainer']}/environ').read())",
        lambda h, out: h["secret"] not in out),
    # Today's limits, which held before the sandbox and hold in both modes.
    "allocate 4 GB": (lambda h: "x = bytearray(4 << 30)", lambda h, out: "MemoryError" in out),
    "a busy loop": (lambda h: "while True: pass", lambda h, out: "used more than 1 s of CPU" in out),
    "one file past env.sandbox_file_mb": (
        lambda h: "open('big', 'wb').write(bytes(12 << 20))", lambda h, out: "File too large" in out),
    "print 1 MB": (lambda h: "print('y' * (1 << 20))", lambda h, out: out.endswith("[truncated]")),
    "a fork bomb": (
        lambda h: f"import os, time\nfor _ in range(64):\n    try:\n        os.fork()\n    except OSError:\n"
                  f"        pass\nos.execv('/bin/sleep', ['sleep', '30', {h['marker']!r}])",
        lambda h, out: time.sleep(0.3) or not _kill_marked(h["marker"])),
    "write past env.sandbox_disk_mb in its own directory": (
        lambda h: "for i in range(40):\n    open(f'f{i}', 'wb').write(bytes(1 << 20))",
        lambda h, out: "No space left on device" in out),
}
# What a plain subprocess does not stop (found by this table; `unshare -rn` keeps the network rows there).
NOT_UNDER_PROCESS = {"write the host's /tmp", "write next to jgrpo's package (the reward code)",
                     "write into the run directory", "read a file the trainer's user can read",
                     "signal a process of the host (SIGKILL)", "a process that outlives the call (fork, setsid, fork)",
                     "200 files of 1 MB outside its directory",
                     "write past env.sandbox_disk_mb in its own directory"}

# What a plain subprocess stops only where it runs in a user and network namespace of its own (`unshare -rn`).
NEEDS_USER_NAMESPACE = {"connect to the host's loopback", "connect from a child interpreter",
                        "read the trainer's environment variables"}


# The busy loop must reach RLIMIT_CPU's 1 s before the wall clock stops it: on a loaded 2-core machine (CI's two
# workers compiling beside it) a child can get less than a third of a core, so that row alone gets a long wall clock.
SLOW_UNDER_LOAD = {"a busy loop": dict(sandbox_timeout_s=60)}


def _attempt(tool, host, row) -> bool:
    code, held = ROWS[row]
    if row in SLOW_UNDER_LOAD:
        tool = PythonTool(dataclasses.replace(tool.config, **SLOW_UNDER_LOAD[row]))
    try:
        out = tool.call({"code": code(host)})
    except ToolError as e:  # past the wall clock: the call was stopped; what it left behind is checked below
        out = str(e)
    return held(host, out)


@pytest.mark.parametrize("row", list(ROWS))
def test_bwrap_holds(bwrap_tool, host, row):
    assert _attempt(bwrap_tool, host, row), row


@pytest.mark.parametrize("row", [
    pytest.param(row, marks=pytest.mark.xfail(strict=True, reason="a plain subprocess does not stop this"))
    if row in NOT_UNDER_PROCESS else row for row in ROWS])
def test_process_table(process_tool, host, row):
    if row in NEEDS_USER_NAMESPACE and not _network_namespace_here():
        pytest.xfail("no `unshare -rn` here: the audit hook does not reach a child interpreter or /proc")
    assert _attempt(process_tool, host, row), row


def _network_namespace_here() -> bool:
    from jgrpo.envs.sandbox import _network_namespace

    return _network_namespace()


def test_each_call_starts_empty(bwrap_tool):
    assert bwrap_tool.call({"code": "open('left.txt', 'w').write('x'); import os; print(sorted(os.listdir('.')))"}) \
        == "['left.txt', 'main.py']\n"
    assert bwrap_tool.call({"code": "import os; print(sorted(os.listdir('.')), os.listdir('/tmp') == "
                                    "os.listdir('.'))"}) == "['main.py'] True\n"


def test_what_the_code_sees(bwrap_tool):
    out = bwrap_tool.call({"code": "import os, sys\nprint(os.getuid(), sorted(os.listdir('/dev')), os.getcwd())\n"
                                   "print([p for p in sys.path if 'site-packages' in p or 'dist-packages' in p])\n"
                                   "print([sorted(os.listdir(p)) for p in sys.path if os.path.isdir(p) and "
                                   "('site-packages' in p or 'dist-packages' in p)])"})
    first, _, emptied = out.splitlines()
    assert first == "65534 ['null', 'urandom', 'zero'] /tmp"
    assert set(emptied.replace("[", "").replace("]", "").replace(",", "").split()) == set(), emptied


def test_offered_packages_and_read_only_data(tmp_path):
    bwrap_problem_or_skip()
    (tmp_path / "data.txt").write_text("42")
    if os.geteuid() == 0:  # the sandbox runs as nobody: its data must be readable by others (checked at start)
        with pytest.raises(ConfigError, match="which others cannot read"):
            PythonTool(EnvConfig(sandbox="bwrap", sandbox_read_only=(str(tmp_path),)))
        tmp_path.chmod(0o755)
    tool = PythonTool(EnvConfig(sandbox="bwrap", sandbox_packages=("PyYAML",), sandbox_read_only=(str(tmp_path),)))
    data, new = str(tmp_path / "data.txt"), str(tmp_path / "new.txt")
    out = tool.call({"code": f"import yaml\nprint(yaml.safe_load('a: 1'), open({data!r}).read())\nopen({new!r}, 'w')"})
    assert out.startswith("{'a': 1} 42\n") and "Read-only file system" in out
    assert not (tmp_path / "new.txt").exists()
    assert "No module named 'numpy'" in tool.call({"code": "import numpy"})  # installed, not offered


def test_bad_sandbox_settings_are_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="'no-such-dist', which is not installed"):
        PythonTool(EnvConfig(sandbox="bwrap", sandbox_packages=("no-such-dist",)))
    with pytest.raises(ConfigError, match="never offers jgrpo"):
        PythonTool(EnvConfig(sandbox="bwrap", sandbox_packages=("jgrpo",)))
    checkout = Path(jgrpo.__file__).parents[1]
    with pytest.raises(ConfigError, match="holds jgrpo's own code"):
        PythonTool(EnvConfig(sandbox="bwrap", sandbox_read_only=(str(checkout.parent),)))
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on this PATH
    with pytest.raises(ConfigError) as error:
        PythonTool(EnvConfig(sandbox="auto", sandbox_disk_mb=17))
    assert "bwrap is not installed" in str(error.value) and "apt-get install bubblewrap" in str(error.value) \
        and "env.sandbox=process" in str(error.value)
