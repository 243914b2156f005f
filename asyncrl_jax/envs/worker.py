"""CPU-bound tools in worker processes: a tool call that computes holds no lock of the decode
server's process (the GIL above all), so it cannot stall the decode loop however long it runs.

``ToolWorkers(path, function)`` keeps up to ``workers`` processes, each running
``python -I -S <this file> <path> <function>``: the interpreter alone (no site-packages, no
environment variables read, nothing of the project imported but the file at ``path``, which must need
only the standard library), answering one JSON line per call on its stdin and stdout. ``call(text)``
takes an idle process (or starts one, about 20 ms), sends ``text``, and waits at most ``timeout``
seconds: a process that runs over is killed (its call raises ``TimeoutError``) and a later call starts
another. The function's own exception comes back as ``ToolError`` with its message. Processes are
started with ``subprocess`` (no ``fork`` of the many-threaded server) and killed at ``close()`` and
when this process exits.

This is isolation for time, not a security boundary: the worker runs with this process's user and
rights. Model-written code belongs in ``envs.sandbox``.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref


class ToolError(ValueError):
  """The tool function raised (the message is its own)."""


class ToolWorkers:
  """Worker processes running ``function`` of the file ``path`` (see the module's docstring)."""

  def __init__(self, path: str, function: str, workers: int = 4, timeout: float = 5.0):
    if workers < 1 or not timeout > 0:
      raise ValueError(f"tool workers need workers >= 1 and timeout > 0 (got {workers}, {timeout})")
    if not os.path.isfile(path):
      raise ValueError(f"tool file {path!r} does not exist")
    self.path, self.function, self.workers, self.timeout = path, function, workers, timeout
    self._idle: list = []
    self._count = 0
    self._cond = threading.Condition()
    self._closed = False
    _ALL.add(self)

  def _start(self) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), self.path, self.function],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={}, close_fds=True, text=True, bufsize=1)

  def _take(self) -> subprocess.Popen:
    with self._cond:
      while True:
        if self._closed:
          raise RuntimeError("the tool workers are closed")
        while self._idle:
          p = self._idle.pop()
          if p.poll() is None:
            return p
          self._count -= 1
        if self._count < self.workers:
          self._count += 1
          break
        self._cond.wait()
    try:
      return self._start()
    except BaseException:
      with self._cond:
        self._count -= 1
        self._cond.notify()
      raise

  def _give_back(self, p: subprocess.Popen, healthy: bool) -> None:
    if not healthy:
      _kill(p)
    with self._cond:
      if healthy and not self._closed:
        self._idle.append(p)
      else:
        self._count -= 1
        if healthy:
          _kill(p)
      self._cond.notify()

  def call(self, text: str) -> str:
    """``function(text)`` in a worker: its result (a string), or ``ToolError`` / ``TimeoutError``."""
    p = self._take()
    healthy = False
    try:
      p.stdin.write(json.dumps(text) + "\n")
      p.stdin.flush()
      line = _read_line(p, self.timeout)
      if line is None:
        raise TimeoutError(f"the tool ran longer than {self.timeout:g}s")
      if not line:
        raise ToolError("the tool's worker process died")
      reply = json.loads(line)
      healthy = True
    except TimeoutError:
      raise
    except (OSError, json.JSONDecodeError) as e:  # (a broken pipe: the process died)
      raise ToolError(f"the tool's worker process failed: {e}") from None
    finally:
      self._give_back(p, healthy)
    if "error" in reply:
      raise ToolError(reply["error"])
    return reply["result"]

  def close(self) -> None:
    with self._cond:
      self._closed = True
      idle, self._idle = self._idle, []
      self._count -= len(idle)
      self._cond.notify_all()
    for p in idle:
      _kill(p)


def _read_line(p: subprocess.Popen, timeout: float):
  """A line of ``p``'s stdout within ``timeout`` seconds ("" at its end), or None."""
  deadline = time.monotonic() + timeout
  with selectors.DefaultSelector() as sel:
    sel.register(p.stdout, selectors.EVENT_READ)
    while True:
      left = deadline - time.monotonic()
      if left <= 0 or not sel.select(left):
        return None
      return p.stdout.readline()


def _kill(p: subprocess.Popen) -> None:
  try:
    p.kill()
    p.wait(timeout=5)
  except (OSError, subprocess.TimeoutExpired):
    pass


_ALL: "weakref.WeakSet[ToolWorkers]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
  for workers in list(_ALL):
    workers.close()


def _serve(path: str, function: str) -> None:
  """The worker: loads ``function`` from the file ``path`` and answers one JSON line per line."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("_tool", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  fn = getattr(module, function)
  for line in sys.stdin:
    try:
      reply = {"result": str(fn(json.loads(line)))}
    except Exception as e:  # pylint: disable=broad-except  (the caller sees it as ToolError)
      reply = {"error": str(e)[:500]}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
  _serve(sys.argv[1], sys.argv[2])
