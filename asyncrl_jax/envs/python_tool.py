"""The Python tool: model-written code run in a separate interpreter with limits.

What it does: the code runs in a fresh ``python -I`` (no ``PYTHON*`` variables, no user site
directory) in a new session and an empty temporary working directory that is deleted afterwards,
with no inherited environment (only ``PATH``), no stdin, and these limits: wall-clock
``seconds`` (the whole process group is killed), CPU seconds, address space, size of any file it
writes (its stdout and stderr are files, so their size is capped too; the rest is cut and the cut
is reported), open files, and, where the kernel allows an unprivileged or root process to do it, a
network namespace of its own with no interfaces (``network_isolated`` in the result says whether it
had one).

What it does not stop: reading any file the user running the job can read; writing files elsewhere
that user can write (within the size limit); using the network where the namespace is refused;
spending its CPU and memory allowance; importing any installed package. It is a guard against
mistakes and runaway code, not a boundary against an adversary: run untrusted agents in a container
or VM of their own.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

CLONE_NEWNET = 0x40000000


@dataclasses.dataclass(frozen=True)
class Limits:
  seconds: float = 10.0  # wall clock
  cpu_seconds: int = 10
  memory_bytes: int = 1 << 30  # address space
  output_bytes: int = 1 << 16  # of stdout and of stderr each (and of any file written)
  open_files: int = 64

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
  network_isolated: bool
  seconds: float


def _unshare_network() -> bool:
  try:
    return ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) == 0
  except (OSError, AttributeError):
    return False


@functools.lru_cache(maxsize=1)
def network_isolation_available() -> bool:
  """Whether a child of this process may have a network namespace of its own (tried once, in a
  fresh interpreter: forking a process that runs threads, such as a decode server, to try it here
  would be fragile)."""
  if not sys.platform.startswith("linux"):
    return False
  probe = ("import ctypes, sys; "
           f"sys.exit(0 if ctypes.CDLL(None, use_errno=True).unshare({CLONE_NEWNET}) == 0 else 1)")
  try:
    return subprocess.run([sys.executable, "-I", "-c", probe], env={}, timeout=30,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


def _limit(limits: Limits, isolate: bool) -> None:  # runs in the child, before exec
  os.setsid()
  resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
  resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
  resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_bytes, limits.output_bytes))
  resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
  if isolate and not _unshare_network():
    os._exit(126)  # pylint: disable=protected-access  (promised isolation failed: run nothing)


def _read(path: str, limit: int) -> tuple[str, bool]:
  with open(path, "rb") as f:
    data = f.read(limit + 1)
  return data[:limit].decode("utf-8", "replace"), len(data) >= limit


def run_python(code: str, limits: Limits = Limits()) -> RunResult:
  """Runs ``code`` under ``limits``; never raises for what the code does."""
  isolate = network_isolation_available()
  t = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="asyncrl-python-tool-") as cwd:
    out_path, err_path = os.path.join(cwd, ".stdout"), os.path.join(cwd, ".stderr")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
      proc = subprocess.Popen(  # pylint: disable=subprocess-popen-preexec-fn
          [sys.executable, "-I", "-c", code], cwd=cwd, env={"PATH": "/usr/bin:/bin"},
          stdin=subprocess.DEVNULL, stdout=out, stderr=err,
          preexec_fn=functools.partial(_limit, limits, isolate))
      try:
        exit_code, timed_out = proc.wait(timeout=limits.seconds), False
      except subprocess.TimeoutExpired:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        proc.wait()
        exit_code, timed_out = None, True
    stdout, cut_out = _read(out_path, limits.output_bytes)
    stderr, cut_err = _read(err_path, limits.output_bytes)
  return RunResult(stdout, stderr, exit_code, timed_out, cut_out or cut_err, isolate,
                   time.perf_counter() - t)
