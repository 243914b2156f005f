"""The staleness bound: the closed form against AReaL's inequality, and a simulated async run."""

import itertools
import math

import numpy as np
import pytest

from asyncrl_jax.rl.staleness import StalenessManager, rollout_capacity, within_bound


def brute_capacity(version, accepted, running, batch, eta, max_concurrent):
  """Admit one at a time while floor((N_r - 1) / B) <= i + eta, N_r counting the new rollout."""
  n = 0
  while running + n < max_concurrent:
    n_r = accepted + running + n + 1
    if math.floor((n_r - 1) / batch) > version + eta:
      break
    n += 1
  return n


def test_capacity_equals_areal_inequality():
  for version, accepted, running, batch, eta in itertools.product(
      range(4), range(0, 40, 3), range(0, 20, 4), (1, 4, 8), (0, 1, 2, 4)):
    got = rollout_capacity(version=version, accepted=accepted, running=running, batch_size=batch,
                           max_staleness=eta, max_concurrent=64)
    assert got == brute_capacity(version, accepted, running, batch, eta, 64)
    assert got >= 0


def test_capacity_hand_examples():
  # Version 0, eta 0, B 8: one batch worth may be in flight or done.
  assert rollout_capacity(version=0, accepted=0, running=0, batch_size=8, max_staleness=0,
                          max_concurrent=100) == 8
  assert rollout_capacity(version=0, accepted=3, running=5, batch_size=8, max_staleness=0,
                          max_concurrent=100) == 0
  assert rollout_capacity(version=1, accepted=8, running=0, batch_size=8, max_staleness=2,
                          max_concurrent=100) == 24
  assert rollout_capacity(version=1, accepted=8, running=0, batch_size=8, max_staleness=2,
                          max_concurrent=5) == 5
  with pytest.raises(ValueError):
    rollout_capacity(version=0, accepted=0, running=0, batch_size=0, max_staleness=0, max_concurrent=1)


def test_count_bound_alone_does_not_bound_stragglers():
  """The manager's count bound alone, with completions in random order (stragglers included) and
  batches taken oldest-first from whatever finished: some trained trajectory is older than eta. This is
  why batches form in admission order and the controller checks every batch (the controller's own
  test drives the real controller through random stragglers and finds none)."""
  eta, batch, slots = 1, 4, 10
  rng = np.random.default_rng(0)
  mgr = StalenessManager(batch_size=batch, max_staleness=eta, max_concurrent=slots)
  running, finished, version, seen = [], [], 0, []
  for _ in range(600):
    running += [version] * mgr.try_submit(slots, version)
    assert len(running) <= slots
    if running and rng.uniform() < 0.7:
      finished.append(running.pop(int(rng.integers(len(running)))))
      mgr.accept()
    if len(finished) >= batch:
      finished.sort()
      trained, finished = finished[:batch], finished[batch:]
      seen += [version - v for v in trained]
      version += 1
  assert version > 30 and max(seen) > eta


def test_manager_accounting_and_restore():
  mgr = StalenessManager(batch_size=4, max_staleness=1, max_concurrent=100)
  assert mgr.try_submit(100, 0) == 8
  mgr.accept(3)
  mgr.reject(1)  # aborted: frees its place without counting toward a batch
  assert mgr.capacity(0) == 1
  with pytest.raises(ValueError, match="only 4 were running"):
    mgr.accept(5)
  assert mgr.capacity(1) == 5  # one more version: one more batch of places
  mgr.restore(3)  # resume: in-flight work is gone; capacity restarts from the restored version
  assert mgr.state_dict() == {"accepted": 12, "running": 0}
  assert mgr.capacity(3) == (1 + 3 + 1) * 4 - 12


def test_within_bound_by_hand():
  assert within_bound(version=5, oldest_token_version=3, max_staleness=2)
  assert not within_bound(version=5, oldest_token_version=3, max_staleness=1)
  assert within_bound(version=0, oldest_token_version=0, max_staleness=0)  # synchronous: on-policy


def test_exhausted_only_once_every_rollout_the_bound_admits_has_finished():
  """Pinned staleness publishes version p + 1 at this moment: with B = 4 and eta = 1, version 0
  admits 8 rollouts (batches 0 and 1); exhausted only when all 8 are admitted and finished."""
  m = StalenessManager(batch_size=4, max_staleness=1, max_concurrent=3)
  assert not m.exhausted(0)
  finished = 0
  while finished < 8:
    assert not m.exhausted(0)
    n = m.try_submit(3, 0)
    assert not m.exhausted(0)  # (running: in flight)
    m.accept(n)
    finished += n
    assert m.exhausted(0) == (finished == 8)
  assert m.try_submit(1, 0) == 0  # nothing more under version 0
  assert not m.exhausted(1) and m.try_submit(4, 1) == 3  # version 1 admits batch 2
  m.accept(3)
  assert not m.exhausted(1)  # (one more of batch 2 to go)
  m.reject(m.try_submit(1, 1))  # a rejected rollout does not count as finished work
  assert not m.exhausted(1)
  m.accept(m.try_submit(1, 1))
  assert m.exhausted(1)
