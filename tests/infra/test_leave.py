"""Leaving at once (``infra.leave.now``): a spawned pool's worker must not outlive the process and
hold its stdout open, which hung a test's ``subprocess.run`` after the train job had finished."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = """
import concurrent.futures as cf, multiprocessing, os, sys
from asyncrl_jax.infra import leave
if __name__ == "__main__":
  pool = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
  pool.submit(abs, -1).result()  # the worker is up, waiting for work
  print("worker pid", next(iter(pool._processes)), flush=True)
  if sys.argv[1] == "leave":
    leave.now(3)
  os._exit(3)
"""


def _run(tmp_path, how):
  script = tmp_path / "job.py"
  script.write_text(SCRIPT)
  return subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, cwd=ROOT,
                        timeout=20)


def test_leaving_kills_the_pool_worker_so_readers_see_the_end(tmp_path):
  out = _run(tmp_path, "leave")
  assert out.returncode == 3 and "worker pid" in out.stdout


def test_control_a_bare_exit_leaves_the_worker_holding_stdout(tmp_path):
  with pytest.raises(subprocess.TimeoutExpired) as caught:
    _run(tmp_path, "bare")
  pid = int(caught.value.stdout.decode().split()[-1])
  subprocess.run(["kill", "-9", str(pid)], check=False)
