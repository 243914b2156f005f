"""Faults injected at named points, for tests and the soak benchmark: ``ASYNCRL_FAULT=point@version``.

Several are separated by commas (``ASYNCRL_FAULT=train@3,save@6``); each fires once, the first time
its point is reached at its version, in every learner process whose environment has it, or only in
process ``ASYNCRL_FAULT_PROCESS`` when that is set (its id, ``ASYNCRL_PROCESS_ID``; 0 in a
single-process run). Unset, ``at`` costs one dictionary lookup.

Points (``version``: the learner's policy version when the point is reached):

* ``train``: the batch of ``version`` was taken, its update not yet run (SIGKILL mid-step);
* ``save``: the checkpoint of ``version`` was started, its write not finished (SIGKILL mid-save);
* ``push``: the weights of ``version`` were published, the decode servers' pulls under way (SIGKILL
  mid-weight-push);
* ``sigterm``: the process sends itself SIGTERM at the top of the loop (a preemption notice);
* ``nan``: the batch of ``version`` gets a NaN advantage (a numerics fault; the run must stop).

Decode servers: ``ASYNCRL_FAULT_DUPLICATES=p`` sends each finished trajectory a second time with
probability ``p`` (duplicated deliveries; the learner must drop them).
"""

from __future__ import annotations

import os
import random
import signal
from typing import Optional

ENV = "ASYNCRL_FAULT"
PROCESS_ENV = "ASYNCRL_FAULT_PROCESS"
POINTS = ("train", "save", "push", "sigterm", "nan")

_fired: set[str] = set()


def planned(env: Optional[str] = None) -> dict[str, set[int]]:
  """The faults ``ASYNCRL_FAULT`` asks for: point -> versions. A bad entry raises ValueError naming it."""
  spec = os.environ.get(ENV, "") if env is None else env
  out: dict[str, set[int]] = {}
  for entry in filter(None, (e.strip() for e in spec.split(","))):
    point, _, version = entry.partition("@")
    if point not in POINTS or not version.lstrip("-").isdigit():
      raise ValueError(f"{ENV}: {entry!r} is not POINT@VERSION with POINT one of {POINTS}")
    out.setdefault(point, set()).add(int(version))
  return out


def at(point: str, version: int) -> bool:
  """Fires the fault planned for ``point`` at ``version``, if any: SIGKILL (``train``, ``save``,
  ``push``) or SIGTERM (``sigterm``) to this process; returns True for a fault the caller acts out
  (``nan``)."""
  if not os.environ.get(ENV):
    return False
  only = os.environ.get(PROCESS_ENV, "")
  if only and only != os.environ.get("ASYNCRL_PROCESS_ID", "0"):
    return False
  key = f"{point}@{version}"
  if key in _fired or version not in planned().get(point, ()):
    return False
  _fired.add(key)
  if point == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
    return False
  if point == "nan":
    return True
  os.kill(os.getpid(), signal.SIGKILL)
  return False  # (not reached)


def duplicate() -> bool:
  """Whether to deliver this trajectory twice (``ASYNCRL_FAULT_DUPLICATES``, a probability)."""
  p = os.environ.get("ASYNCRL_FAULT_DUPLICATES")
  return bool(p) and random.random() < float(p)
