"""The python tool's sandbox (`env.sandbox: bwrap`): each call runs `python -I` inside bubblewrap.

What the model's code gets, per call, and nothing else:
- every namespace of its own (user, pid, network, ipc, uts, cgroup): it sees no process of the host, has no
  network but its own empty loopback, cannot create further user namespaces (`--disable-userns`); its pid
  namespace dies with its first process, so nothing it starts outlives the call;
- a filesystem of read-only binds: the system's libraries (/usr and the /bin, /lib* beside it), the interpreter
  (its binary, libpython, the standard library) and the packages `env.sandbox_packages` offers (with what they
  require), plus `env.sandbox_read_only`; every site-packages directory is an empty, read-only mount, so jgrpo
  and the packages the trainer runs on are not there, nor a home directory, the checkout or the run directory
  (each is hidden where a bind would have shown it); its own /proc; /dev/null, /dev/zero and /dev/urandom;
- one writable area, a tmpfs of `env.sandbox_disk_mb`, as its working directory and /tmp, empty but for main.py;
- an unprivileged uid: as root the sandbox runs as nobody (65534) outside too, so RLIMIT_NPROC binds. (bwrap's
  own `--uid` only renames root inside; the kernel exempts uid 0 from RLIMIT_NPROC.) A root process may
  reach paths nobody cannot (/root/.pyenv): those binds are mounted first, in a private mount namespace of the
  call's own, on mount points in a directory nobody can enter, and bwrap binds them from there.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import weakref
from importlib import metadata
from pathlib import Path

from jgrpo.config.errors import ConfigError

NOBODY = 65534
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20000, 4096, 16384, 1 << 18


class SandboxUnavailable(RuntimeError):
    """bwrap is missing, or does not run here: the message says which, with its own words."""


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


@functools.cache
def _interpreter() -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(binary, what it reads at start up: stdlib, lib-dynload, libpython; its site directories), asked of the
    base interpreter itself (a venv's python is the base's with a site directory on top)."""
    binary = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    probe = ("import json, site, sys, sysconfig; v = sysconfig.get_config_var; "
             "lib = [v('LIBDIR') + '/' + v('INSTSONAME')] if v('Py_ENABLE_SHARED') else []; "
             "print(json.dumps([sys.path[1:] + lib, site.getsitepackages()]))")
    out = subprocess.run([binary, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    paths, site_dirs = json.loads(out.stdout)
    return binary, tuple(p for p in paths if os.path.exists(p)), tuple(site_dirs)


def _requirements(dist: metadata.Distribution) -> list[str]:
    """The distributions `dist` needs (not its extras)."""
    names = []
    for requirement in dist.requires or ():
        name, _, marker = requirement.partition(";")
        if "extra" not in marker:
            names.append(re.split(r"[\s\[<>=!~(]", name.strip(), maxsplit=1)[0])
    return names


def package_entries(names) -> list[Path]:
    """The top-level files and directories of the distributions `names` and of what they require, in the
    directory each is installed in (e.g. numpy/, numpy.libs/, numpy-2.1.dist-info/)."""
    entries, seen, todo = set(), set(), list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        if key == "jgrpo":
            raise ConfigError("env.sandbox_packages names jgrpo: the sandbox never offers jgrpo itself (the reward "
                              "code and the trainer are what it keeps the model's code away from)")
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if name in names:
                raise ConfigError(f"env.sandbox_packages names {name!r}, which is not installed in this Python "
                                  f"({sys.executable}): pip install {name}, or take it out of the list") from None
            continue  # a requirement that is not installed is the package's business, as outside the sandbox
        root = Path(dist.locate_file("")).resolve()
        for file in dist.files or ():
            top = file.parts[0]
            if top not in ("..", "__pycache__") and not top.endswith(".pth"):
                entries.add(root / top)
        todo.extend(_requirements(dist))
    return sorted(e for e in entries if e.exists())


def _hidden() -> list[str]:
    """What no bind may show: jgrpo's checkout (or installed package), the working directory, the home directory."""
    package = Path(__file__).resolve().parents[1]
    return [str(p) for p in (package.parent if (package.parent / "pyproject.toml").exists() else package,
                             Path.cwd().resolve(), Path.home().resolve())]


class Bubblewrap:
    """The bwrap command of one call; built once per tool (the binds are resolved at construction)."""

    def __init__(self, config):
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxUnavailable("bwrap is not installed")
        self.config = config
        binary, startup, site_dirs = _interpreter()
        self.python = binary
        system = [d for d in SYSTEM_DIRS if os.path.lexists(d)]
        self.system = [d for d in system if not os.path.islink(d)]
        self.links = [(os.readlink(d), d) for d in system if os.path.islink(d)]
        own = [binary, *startup]
        shown = [*self.system, *own]
        self.site_dirs = [d for d in site_dirs if os.path.isdir(d) and any(_within(d, s) for s in shown)]
        packages = package_entries(config.sandbox_packages)
        if packages and not self.site_dirs:
            raise ConfigError(f"env.sandbox_packages: the interpreter {binary} has no site directory to offer "
                              "them in; leave env.sandbox_packages empty")
        read_only = [str(Path(p).resolve()) for p in config.sandbox_read_only]
        for path in read_only:
            if _within(_hidden()[0], path):
                raise ConfigError(f"env.sandbox_read_only lists {path}, which holds jgrpo's own code: name the data "
                                  "directory the model's code should read, not one above the checkout")
            if not os.path.exists(path):
                raise ConfigError(f"env.sandbox_read_only lists {path}, which does not exist")
            mode = os.stat(path).st_mode
            if os.geteuid() == 0 and mode & (0o005 if os.path.isdir(path) else 0o004) != (
                    0o005 if os.path.isdir(path) else 0o004):
                raise ConfigError(f"env.sandbox_read_only lists {path} (mode {mode & 0o777:o}), which others cannot "
                                  f"read: as root the sandbox runs the model's code as nobody; chmod -R o+rX {path}")
        # (source, destination) of each bind outside the system directories: the interpreter's, then the offered
        # packages' (inside the emptied site directory), then the task's read-only data.
        self.binds = [(p, p) for p in own if not any(_within(p, s) for s in [*self.system, *own] if s != p)]
        self.packages = [(str(e), f"{self.site_dirs[0]}/{e.name}") for e in packages]
        self.data = [(p, p) for p in read_only]
        every = self.binds + self.packages + self.data
        destinations = [*own, *(d for _, d in every)]
        self.masks = [h for h in _hidden() if any(_within(h, s) and h != s for s in [*self.system, *destinations])
                      and not any(_within(d, h) for d in destinations)]
        self.as_root = os.geteuid() == 0
        self.stage = _Stage([s for s, _ in every]) if self.as_root else None

    def command(self, code_fd: int, status_fd: int) -> list[str]:
        """bwrap's arguments: the sandbox, then `python -I main.py` in it (main.py copied from `code_fd`);
        bwrap writes the program's exit code to `status_fd` (nothing there: the sandbox did not start)."""
        c = self.config
        args = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(NOBODY),
                "--gid", str(NOBODY), "--die-with-parent", "--new-session", "--hostname", "sandbox",
                "--json-status-fd", str(status_fd)]
        for d in self.system:
            args += ["--ro-bind", d, d]
        for target, link in self.links:
            args += ["--symlink", target, link]
        binds, packages, data = ([(self.stage.point(s) if self.stage else s, d) for s, d in group]
                                 for group in (self.binds, self.packages, self.data))
        emptied = [*self.site_dirs, *self.masks]  # where jgrpo, the trainer's packages or a home would show
        for source, dest in binds:
            args += ["--ro-bind", source, dest]
        for path in emptied:
            args += ["--tmpfs", path]
        for source, dest in packages:
            args += ["--ro-bind", source, dest]
        for path in emptied:
            args += ["--remount-ro", path]
        args += ["--proc", "/proc"]
        for device in DEVICES:
            args += ["--dev-bind", device, device]
        args += ["--size", str(int(c.sandbox_disk_mb) << 20), "--tmpfs", "/tmp",
                 "--perms", "0644", "--file", str(code_fd), "/tmp/main.py"]
        for source, dest in data:  # last: a data directory under /tmp shows inside the fresh /tmp
            args += ["--ro-bind", source, dest]
        args += ["--remount-ro", "/", "--chdir", "/tmp", self.python, "-I", "main.py"]
        return args

    def enter(self) -> None:
        """Run in the child before bwrap starts (root only): the staged binds in a private mount namespace,
        then nobody's uid and gid, with no supplementary groups."""
        if not self.stage:
            return
        self.stage.mount()
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)

    @property
    def uid(self) -> int:
        """The uid the sandbox's processes count against (RLIMIT_NPROC)."""
        return NOBODY if self.as_root else os.getuid()


class _Stage:
    """Mount points, in a directory only root can enter, for binds nobody could not reach by their own path.

    The mounts happen in each call's child, in a private mount namespace, so the host only ever sees the empty
    mount points (removed when the tool goes)."""

    def __init__(self, sources: list[str]):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.directory = tempfile.mkdtemp(prefix="jgrpo-sandbox-")
        os.chmod(self.directory, 0o711)  # nobody passes through to the mount points, cannot list or write
        self.sources, self.points = sources, []
        for i, source in enumerate(sources):
            point = os.path.join(self.directory, str(i))
            os.mkdir(point) if os.path.isdir(source) else Path(point).touch()
            self.points.append(point)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.directory, True)

    def point(self, source: str) -> str:
        return self.points[self.sources.index(source)]

    def mount(self) -> None:
        def call(result, what):
            if result != 0:
                raise OSError(ctypes.get_errno(), f"the sandbox's stage: {what}")
        call(self.libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        call(self.libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
        for source, point in zip(self.sources, self.points, strict=True):
            call(self.libc.mount(source.encode(), point.encode(), None, _MS_BIND | _MS_REC, None), f"bind {source}")
