"""The `python` tool: the model's code run in a sandbox, under resource limits.

`env.sandbox` says where: `bwrap` (each call inside bubblewrap: its own namespaces, read-only binds of only the
interpreter and the offered packages, a fresh size-bounded /tmp as its working directory, an unprivileged uid;
`jgrpo.envs.bubblewrap` says what exactly); `auto` (the default) is bwrap where it runs and otherwise refuses the
tool at start, naming what to install; `process` is a plain subprocess (logged once: a resource limit, not a
security boundary). In every mode each call runs `python -I main.py` with an empty environment, under
RLIMIT_CPU / AS / FSIZE / NPROC (`env.sandbox_*`), in its own session killed whole at the wall-clock limit, its
output cut at `env.sandbox_output_chars`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

from jgrpo.config import EnvConfig
from jgrpo.config.errors import ConfigError
from jgrpo.envs.bubblewrap import Bubblewrap, SandboxUnavailable
from jgrpo.envs.tools import Tool, ToolError

log = logging.getLogger("jgrpo.envs")

# Runs before the model's code where there is no network namespace: refuses sockets through an audit hook.
_NO_SOCKETS = """import sys
def _refuse(event, args):
    if event in ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo"):
        raise PermissionError("the python tool has no network")
sys.addaudithook(_refuse)
del _refuse, sys
with open("main.py") as f:
    _code = f.read()
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__"})
"""


@functools.cache
def _network_namespace() -> bool:
    """Whether `unshare -rn` can run a process here (user and network namespaces allowed)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limits(config, processes_now: int, enter=None, own: int = 1):
    """The child's set-up before it execs: its own session, (as root under bwrap) nobody's uid, the RLIMITs.
    `own` is what the call itself runs before the model's code forks: the program, and under bwrap its monitor
    and the pid namespace's init too."""
    def apply():
        os.setsid()
        if enter is not None:
            enter()  # bwrap as root: the staged binds, then nobody's uid (RLIMIT_NPROC counts per uid)
        cpu = int(config.sandbox_cpu_s)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        memory = int(config.sandbox_memory_mb) << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        size = int(config.sandbox_file_mb) << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        nproc = processes_now + own + int(config.sandbox_processes)
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _processes_of(uid: int) -> int:
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                count += os.stat(f"/proc/{pid}").st_uid == uid
            except OSError:
                pass
    return count


OWN = 3  # bwrap's processes of a call: its monitor, the pid namespace's init, the program (measured: tests/envs)

_INSTALL = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora/RHEL: dnf install bubblewrap) "
            "and allow unprivileged user namespaces where the trainer does not run as root (e.g. Ubuntu 24.04: "
            "sysctl kernel.apparmor_restrict_unprivileged_userns=0), or set env.sandbox=process to run the "
            "model's code as a plain subprocess with resource limits only (not a security boundary)")


@functools.cache
def python_sandbox(config) -> Bubblewrap | None:
    """The sandbox of `env.sandbox` (one per process and config; None: `process`), or ConfigError saying why
    bubblewrap does not run here and what to do. bwrap is tried once, on `print(1)`, before it is trusted."""
    if config.sandbox == "process":
        log.warning("env.sandbox=process: the python tool runs the model's code as a plain subprocess: resource "
                    "limits, not a security boundary (the code can read and write what the trainer's user can)")
        return None
    try:
        sandbox = Bubblewrap(config)
        problem = _probe(config)
    except SandboxUnavailable as e:
        problem = str(e)
    if problem:
        raise ConfigError(f"env.sandbox={config.sandbox}: the python tool runs the model's code inside bubblewrap, "
                          f"which does not run here ({problem[:400]}): {_INSTALL}")
    return sandbox


def _probe(config) -> str | None:
    """Why `print(1)` does not run in the sandbox (None: it does). Tried in a fresh process (this module's main):
    the caller may be a trainer with threads, where a fork that runs Python before its exec is unsafe."""
    settings = json.dumps(dataclasses.asdict(config))
    out = subprocess.run([sys.executable, "-m", "jgrpo.envs.sandbox", settings], capture_output=True, text=True,
                         timeout=120)
    return None if out.returncode == 0 else (out.stdout + out.stderr).strip() or f"exit status {out.returncode}"


def _run_in(sandbox: Bubblewrap, c, code: str) -> tuple[bytes, int]:
    """(output, exit code) of `code` run in `sandbox`; ToolError past the wall clock; RuntimeError if the sandbox
    did not start (a broken setup: the episode fails, the model is not told)."""
    code_fd = os.memfd_create("main.py")
    status_read, status_write = os.pipe()
    try:
        with open(code_fd, "wb", closefd=False) as f:
            f.write(code.encode("utf-8", "surrogatepass"))
        os.lseek(code_fd, 0, os.SEEK_SET)
        proc = subprocess.Popen(sandbox.command(code_fd, status_write), env={}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(code_fd, status_write),
                                preexec_fn=_limits(c, _processes_of(sandbox.uid), sandbox.enter, own=OWN))
    finally:
        os.close(code_fd)
        os.close(status_write)
    try:
        output = _communicate(proc, c)
        os.set_blocking(status_read, False)
        try:
            status = os.read(status_read, 1 << 16).decode()
        except BlockingIOError:
            status = ""
    finally:
        os.close(status_read)
    exits = [json.loads(line)["exit-code"] for line in status.splitlines() if '"exit-code"' in line]
    if not exits:
        raise RuntimeError(f"the python tool's sandbox did not start: {output.decode('utf-8', 'replace')[:1000]}")
    return output, exits[0]


def _communicate(proc, c) -> bytes:
    try:
        output, _ = proc.communicate(timeout=c.sandbox_timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ToolError(f"python: no result after {c.sandbox_timeout_s:g} s", kind="tool_limits") from None
    finally:
        _kill_group(proc)
    return output


class PythonTool(Tool):
    name = "python"
    description = "Run a Python program and return what it prints (stdout and stderr). No network, no input."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                  "required": ["code"]}
    example = {"code": "print(2 ** 10)"}

    def __init__(self, config):
        self.config = config
        self.sandbox = python_sandbox(config)

    def call(self, arguments):
        code = self.checked_arguments(arguments)["code"]
        if not isinstance(code, str):
            raise ToolError("python: code must be a string")
        if self.sandbox is not None:
            output, exit_code = _run_in(self.sandbox, self.config, code)
            died_of = exit_code - 128 if exit_code > 128 else 0  # bwrap reports a signal as 128 + its number
        else:
            output, returncode = self._run_process(code)
            died_of = -returncode if returncode < 0 else 0
        return self._answer(output.decode("utf-8", "replace"), died_of)

    def _run_process(self, code: str) -> tuple[bytes, int]:
        """`env.sandbox: process`: a subprocess in a temporary directory; no network where `unshare -rn` runs."""
        with tempfile.TemporaryDirectory(prefix="jgrpo-python-") as work:
            with open(os.path.join(work, "main.py"), "w") as f:
                f.write(code)
            command = [sys.executable, "-I", "main.py"]
            if _network_namespace():
                command = ["unshare", "-rn", *command]
            else:
                _warn_no_namespace()
                command = [sys.executable, "-I", "-c", _NO_SOCKETS]
            limits = _limits(self.config, _processes_of(os.getuid()))
            proc = subprocess.Popen(command, cwd=work, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, preexec_fn=limits)
            return _communicate(proc, self.config), proc.returncode

    def _answer(self, text: str, died_of: int) -> str:
        c = self.config
        if died_of:
            why = {signal.SIGXCPU: f"used more than {c.sandbox_cpu_s} s of CPU",
                   signal.SIGKILL: "was killed (CPU or memory limit)",
                   signal.SIGXFSZ: f"wrote a file over {c.sandbox_file_mb} MB"}.get(died_of,
                                                                                   f"died of signal {died_of}")
            return f"{text[:c.sandbox_output_chars]}\n[the program {why}]"
        if len(text) > c.sandbox_output_chars:
            return text[:c.sandbox_output_chars] + "\n[truncated]"
        return text


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


@functools.cache
def _warn_no_namespace() -> None:
    log.warning("the python tool: `unshare -rn` is not available here, so sockets are refused by an audit hook "
                "instead of a network namespace")


def main() -> int:
    """`python -m jgrpo.envs.sandbox SETTINGS`: runs `print(1)` in the sandbox of the `env` settings (JSON);
    exit 0 when it printed 1, else 1 with what went wrong (what `_probe` reads)."""
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[1]).items()}
    config = EnvConfig(**settings)
    try:
        output, exit_code = _run_in(Bubblewrap(config), config, "print(1)")
    except (SandboxUnavailable, OSError, subprocess.SubprocessError, RuntimeError, ToolError) as e:
        print(e)
        return 1
    if (output, exit_code) != (b"1\n", 0):
        print(output.decode("utf-8", "replace").strip() or f"print(1) exited with status {exit_code}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
