"""The Python tool: model-written code run in the sandbox (``envs.sandbox``: bubblewrap namespaces
and limits; its docstring and docs/agentic.md say what it stops and what it does not).

Where the sandbox cannot run (no user namespaces, no ``bwrap``), ``run_python`` raises
``sandbox.SandboxUnavailable`` unless the caller passes ``allow_unsandboxed=True`` (the config's
``env.allow_unsandboxed``, logged at the run's start and in ``summary.json``). Then the code runs in
a fresh ``python -I -S`` with the same resource limits, in a new session and an empty temporary
directory, with no inherited environment: **not a boundary** (it reads and writes what the user
running the job can, and reaches the network). The limits are set by a launcher after ``exec``, never
by Python code between ``fork`` and ``exec`` in the (many-threaded) decode server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from asyncrl_jax.envs import sandbox
from asyncrl_jax.envs.sandbox import Limits, RunResult, SandboxUnavailable  # noqa: F401  (the tool's API)


def run_python(code: str, limits: Limits = Limits(), allow_unsandboxed: bool = False) -> RunResult:
  """Runs ``code`` under ``limits`` in the sandbox; never raises for what the code does."""
  ok, why = sandbox.available()
  if ok:
    return sandbox.run(code, limits)
  if not allow_unsandboxed:
    raise SandboxUnavailable(f"the Python tool's sandbox cannot run here ({why}); set "
                             "env.allow_unsandboxed=True to run model code with limits only")
  return _run_unsandboxed(code, limits)


def _run_unsandboxed(code: str, limits: Limits) -> RunResult:
  t = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="asyncrl-python-tool-") as cwd:
    code_path = os.path.join(cwd, ".main.py")
    out_path, err_path = os.path.join(cwd, ".stdout"), os.path.join(cwd, ".stderr")
    with open(code_path, "w", encoding="utf-8") as f:
      f.write(code)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
      proc = subprocess.Popen(
          [sys.executable, "-I", "-S", "-c", sandbox._LAUNCHER,  # pylint: disable=protected-access
           str(int(limits.cpu_seconds)), str(limits.memory_bytes), str(limits.output_bytes),
           str(limits.open_files), "-1000000", code_path],  # no process limit: it would count the host's
          cwd=cwd, env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
          start_new_session=True)
      try:
        exit_code, timed_out = proc.wait(timeout=limits.seconds), False
      except subprocess.TimeoutExpired:
        exit_code, timed_out = None, True
      finally:
        try:
          os.killpg(proc.pid, signal.SIGKILL)  # the session: what it started and did not detach
        except ProcessLookupError:
          pass
        proc.wait()
    stdout, cut_out = sandbox._read(out_path, limits.output_bytes)  # pylint: disable=protected-access
    stderr, cut_err = sandbox._read(err_path, limits.output_bytes)  # pylint: disable=protected-access
  return RunResult(stdout, stderr, exit_code, timed_out, cut_out or cut_err, False,
                   time.perf_counter() - t)
