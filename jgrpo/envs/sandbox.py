"""The `python` tool: the model's code run in a resource-limited subprocess.

Each call runs `python -I` (isolated: no user site, no PYTHON* variables) in a fresh temporary directory with an
empty environment, under RLIMIT_CPU / RLIMIT_AS / RLIMIT_FSIZE / RLIMIT_NPROC (`env.sandbox_*`), in its own
process group (killed whole at the wall-clock limit), with its output cut at `env.sandbox_output_chars`. Network:
where `unshare -rn` works the code runs in a new network namespace with no interfaces; elsewhere an audit hook
refuses socket creation (logged once).

This is a resource limit, not a security boundary: it stops a model's runaway loop, allocation, fork bomb or
huge file from hurting the run, not a determined attacker (run untrusted code in a container or VM).
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

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


def _limits(config, processes_now: int):
    def apply():
        os.setsid()
        cpu = int(config.sandbox_cpu_s)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        memory = int(config.sandbox_memory_mb) << 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        size = int(config.sandbox_file_mb) << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        nproc = processes_now + int(config.sandbox_processes) + 1
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _user_processes() -> int:
    uid = os.getuid()
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                count += os.stat(f"/proc/{pid}").st_uid == uid
            except OSError:
                pass
    return count


class PythonTool(Tool):
    name = "python"
    description = "Run a Python program and return what it prints (stdout and stderr). No network, no input."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                  "required": ["code"]}
    example = {"code": "print(2 ** 10)"}

    def __init__(self, config):
        self.config = config

    def call(self, arguments):
        code = self.checked_arguments(arguments)["code"]
        if not isinstance(code, str):
            raise ToolError("python: code must be a string")
        c = self.config
        with tempfile.TemporaryDirectory(prefix="jgrpo-python-") as work:
            with open(os.path.join(work, "main.py"), "w") as f:
                f.write(code)
            command = [sys.executable, "-I", "main.py"]
            if _network_namespace():
                command = ["unshare", "-rn", *command]
            else:
                _warn_no_namespace()
                command = [sys.executable, "-I", "-c", _NO_SOCKETS]
            proc = subprocess.Popen(command, cwd=work, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, preexec_fn=_limits(c, _user_processes()))
            try:
                output, _ = proc.communicate(timeout=c.sandbox_timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise ToolError(f"python: no result after {c.sandbox_timeout_s:g} s", kind="tool_limits") from None
            finally:
                _kill_group(proc)
        text = output.decode("utf-8", "replace")
        if proc.returncode and proc.returncode < 0:
            why = {signal.SIGXCPU: f"used more than {c.sandbox_cpu_s} s of CPU",
                   signal.SIGKILL: "was killed (CPU or memory limit)",
                   signal.SIGXFSZ: f"wrote a file over {c.sandbox_file_mb} MB"}.get(-proc.returncode,
                                                                                   f"died of signal {-proc.returncode}")
            text = f"{text[:c.sandbox_output_chars]}\n[the program {why}]"
        elif len(text) > c.sandbox_output_chars:
            text = text[:c.sandbox_output_chars] + "\n[truncated]"
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
