"""Joining the processes of one learner: ``jax.distributed`` from arguments, the environment, or (on
Cloud TPU VMs) nothing at all.

Off TPU a learner over P processes needs three facts in every process: the coordinator's address
(process 0's host and a free port), P, and the process's own id. They come from the arguments or from
``ASYNCRL_COORDINATOR``, ``ASYNCRL_NUM_PROCESSES`` and ``ASYNCRL_PROCESS_ID``. On Cloud TPU VMs JAX
finds them itself. CPU processes run their collectives over gloo.

**A process that dies stops the others.** Every process sends the coordination service (in process 0)
a heartbeat; one that misses ``ASYNCRL_HEARTBEAT_SECONDS`` (default 15, JAX's own default is 100) of
them is declared dead, and every other process is then terminated by JAX ("the JAX distributed service
detected fatal errors"), so no collective waits on a dead peer for longer than that. A collective
whose peer is gone may fail sooner (gloo: "Connection reset by peer"). The next start resumes from
the newest complete checkpoint.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

ENV = ("ASYNCRL_COORDINATOR", "ASYNCRL_NUM_PROCESSES", "ASYNCRL_PROCESS_ID")


def settings(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
             process_id: Optional[int] = None) -> Optional[dict]:
  """The ``jax.distributed.initialize`` arguments from the arguments, else the environment; None
  when neither names a multi-process run. Raises ValueError, naming the value, on a partial or bad
  set."""
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
           "process_id": process_id}
  for key, env in zip(given, ENV):
    if given[key] is None and os.environ.get(env, "") != "":
      given[key] = os.environ[env]
  if all(v is None for v in given.values()):
    return None
  missing = [env for key, env in zip(given, ENV) if given[key] is None]
  if missing:
    raise ValueError(f"a multi-process learner needs all of {', '.join(ENV)}; missing {', '.join(missing)}")
  try:
    n, pid = int(given["num_processes"]), int(given["process_id"])
  except ValueError as e:
    raise ValueError(f"ASYNCRL_NUM_PROCESSES={given['num_processes']!r} and ASYNCRL_PROCESS_ID="
                     f"{given['process_id']!r} must be integers") from e
  if n < 1 or not 0 <= pid < n:
    raise ValueError(f"process id {pid} must lie in [0, {n}) (number of processes {n})")
  host, _, port = str(given["coordinator_address"]).rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"coordinator address {given['coordinator_address']!r} must be HOST:PORT")
  return {"coordinator_address": given["coordinator_address"], "num_processes": n, "process_id": pid}


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, on_tpu: Optional[bool] = None) -> bool:
  """Joins the learner's processes; returns whether this is a multi-process run. Call before any
  other JAX call. With nothing given: on a Cloud TPU VM ``jax.distributed.initialize()`` discovers
  the slice; elsewhere this is a single-process run."""
  args = settings(coordinator_address, num_processes, process_id)
  if on_tpu is None:
    on_tpu = os.environ.get("TPU_WORKER_HOSTNAMES") is not None or os.path.exists("/dev/accel0")
  if args is None and not on_tpu:
    return False
  if args is not None and args["num_processes"] == 1:
    return False
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes; ignored on TPU
  jax.distributed.initialize(**(args or {}), heartbeat_timeout_seconds=heartbeat_seconds())
  return True


def heartbeat_seconds() -> int:
  """Seconds without a heartbeat after which a learner process counts as dead
  (``ASYNCRL_HEARTBEAT_SECONDS``, default 15)."""
  raw = os.environ.get("ASYNCRL_HEARTBEAT_SECONDS", "15")
  if not raw.isdigit() or int(raw) < 1:
    raise ValueError(f"ASYNCRL_HEARTBEAT_SECONDS={raw!r} must be a whole number of seconds >= 1")
  return int(raw)
