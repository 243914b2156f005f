"""The staleness bound: how many more rollouts may start now.

AReaL admits a new rollout only while ``floor((N_r - 1) / B) <= i + eta``, where ``i`` is the current
policy version, ``B`` the training batch size (trajectories per update), ``eta`` the maximum staleness
and ``N_r`` the number of trajectories admitted so far, the new one included. With
``N_r = accepted + running + 1`` this is ``accepted + running < (i + eta + 1) * B``, so

    capacity = min(max_concurrent - running, (eta + i + 1) * B - (accepted + running)),  floored at 0.

What the count bound does and does not guarantee. It stops generation from running ahead: a rollout
admitted at version ``v`` holds one of the first ``(v + eta + 1) * B`` places, so if trajectories
finished in admission order each would be trained at a version ``<= v + eta``. It does *not* bound a
straggler: a trajectory that keeps decoding while later ones finish and fill batches can reach the
trainer arbitrarily late (``tests/rl/test_staleness.py`` shows it). The hard guarantee therefore comes
from ``within_bound``, applied by the controller when a trajectory finishes (``reject`` it and re-queue
its prompt) and again when a batch is formed (``drop_accepted``): every trained token was sampled by a
policy at most ``eta`` versions old. The count bound keeps such drops rare.

``eta = 0`` is synchronous RL: a whole batch is generated under version ``i`` before any rollout for
version ``i + 1`` may start, and nothing is ever dropped.

Pinned staleness (``rl.staleness_mode="pinned"``, for ablations): the bound says how old data *may*
be; how old it *is* then depends on how fast decoding runs against the learner, which differs
between objectives and machines. Pinned, the decode servers receive version ``p + 1`` only once
every rollout the bound admits under ``p`` has finished (``StalenessManager.exhausted``), and the
learner trains version ``p + 1`` only once it is published. Batches are formed in admission order,
so batch ``k`` is admitted while the servers hold exactly ``max(0, k - eta)`` and decoded under it
alone (nothing is in flight when weights change, so nothing is interrupted): every token trained
at version ``v`` is exactly ``min(v, eta)`` versions old.
"""

from __future__ import annotations

import dataclasses
import threading


class VersionMismatch(RuntimeError):
  """Two parts of the system disagree about the policy version (a bug, never expected)."""


def rollout_capacity(*, version: int, accepted: int, running: int, batch_size: int,
                     max_staleness: int, max_concurrent: int) -> int:
  """How many more rollouts may be started now (never negative).

  Args:
    version: current policy version i (number of completed updates).
    accepted: trajectories that finished and were accepted (queued or already trained on).
    running: trajectories started and not yet finished.
    batch_size: trajectories per update, B.
    max_staleness: eta >= 0.
    max_concurrent: cap on in-flight rollouts (decode slots).
  """
  if batch_size < 1 or max_staleness < 0 or version < 0 or accepted < 0 or running < 0:
    raise ValueError(f"invalid staleness state: version={version} accepted={accepted} "
                     f"running={running} batch_size={batch_size} max_staleness={max_staleness}")
  by_staleness = (max_staleness + version + 1) * batch_size - (accepted + running)
  by_slots = max_concurrent - running
  return max(0, min(by_staleness, by_slots))


def within_bound(*, version: int, oldest_token_version: int, max_staleness: int) -> bool:
  """Whether a trajectory whose oldest token was sampled at ``oldest_token_version`` may be trained
  at policy version ``version`` (staleness ``version - oldest_token_version <= eta``)."""
  return version - oldest_token_version <= max_staleness


@dataclasses.dataclass
class StalenessState:
  accepted: int = 0
  running: int = 0


class StalenessManager:
  """Thread-safe counters around ``rollout_capacity``.

  ``try_submit`` when rollouts start, ``accept`` / ``reject`` when they finish (reject: aborted, errored,
  a duplicate or too stale, so the place is freed without counting toward a batch), ``drop_accepted``
  for accepted trajectories discarded before training. The policy version is not kept here: callers
  pass the learner's (``Learner.version``, the only count of versions). ``restore(version)`` is for
  resuming from a checkpoint: trajectories that were in flight or queued but untrained at save time
  are gone, so the counters restart from the restored version (``accepted = version * B``,
  ``running = 0``) instead of carrying counts that would throttle or over-admit generation forever
  after.
  """

  def __init__(self, *, batch_size: int, max_staleness: int, max_concurrent: int):
    self.batch_size = batch_size
    self.max_staleness = max_staleness
    self.max_concurrent = max_concurrent
    self._state = StalenessState()
    self._lock = threading.Lock()

  def capacity(self, version: int) -> int:
    """How many rollouts may start now, at policy version ``version``."""
    with self._lock:
      return self._capacity(version)

  def _capacity(self, version: int) -> int:
    s = self._state
    return rollout_capacity(version=version, accepted=s.accepted, running=s.running,
                            batch_size=self.batch_size, max_staleness=self.max_staleness,
                            max_concurrent=self.max_concurrent)

  def try_submit(self, n: int, version: int) -> int:
    """Admits up to ``n`` rollouts at policy version ``version``; returns how many were admitted."""
    with self._lock:
      k = min(n, self._capacity(version))
      self._state.running += k
      return k

  def accept(self, n: int = 1) -> None:
    with self._lock:
      self._finish(n)
      self._state.accepted += n

  def reject(self, n: int = 1) -> None:
    with self._lock:
      self._finish(n)

  def drop_accepted(self, n: int = 1) -> None:
    """Accepted trajectories that were discarded before training (too stale); their places return."""
    with self._lock:
      if n > self._state.accepted:
        raise ValueError(f"cannot drop {n} accepted trajectories, only {self._state.accepted} exist")
      self._state.accepted -= n

  def _finish(self, n: int) -> None:
    if n > self._state.running:
      raise ValueError(f"{n} rollouts finished but only {self._state.running} were running")
    self._state.running -= n

  @property
  def trained_versions(self) -> int:
    """Whole batches' worth of accepted trajectories (after ``restore(v)``: ``v``, the next batch's
    version, as long as nothing has been accepted since)."""
    with self._lock:
      return self._state.accepted // self.batch_size

  def exhausted(self, version: int) -> bool:
    """Whether every rollout the bound admits at ``version`` was admitted and has finished (none
    running): the moment pinned staleness may hand the decode servers ``version + 1``."""
    with self._lock:
      s = self._state
      return s.running == 0 and s.accepted >= (self.max_staleness + version + 1) * self.batch_size

  def restore(self, version: int) -> None:
    with self._lock:
      self._state = StalenessState(accepted=version * self.batch_size, running=0)

  @property
  def state(self) -> StalenessState:
    with self._lock:
      return dataclasses.replace(self._state)

  def state_dict(self) -> dict:
    s = self.state
    return {"accepted": s.accepted, "running": s.running}
