"""RemoteRollout's weight publishing and work spreading, against fake decode-server clients: the
learner does not wait for a slow pull, holds at most 2 versions, and a lagging server gets no work."""

import threading
import time
import types

from asyncrl_jax.rollout.backends import RemoteRollout
from asyncrl_jax.rollout.trajectory import RolloutRequest


class FakeClient:
  """Records submits; ``update_weights`` blocks until ``release(version)`` when ``slow``."""

  def __init__(self, address: str, slow: bool = False):
    self.address, self.slow = address, slow
    self.submitted, self.pulled = [], []
    self._released: dict[int, threading.Event] = {}

  def wait_ready(self, timeout):
    del timeout

  def release(self, version: int) -> None:
    self._released.setdefault(version, threading.Event()).set()

  def update_weights(self, version, sources, timeout):
    del sources
    if self.slow and not self._released.setdefault(version, threading.Event()).wait(timeout):
      raise TimeoutError(f"fake pull of v{version} never released")
    self.pulled.append(version)
    return types.SimpleNamespace(seconds=0.01, source_bytes=[100], bytes=100)

  def submit(self, requests):
    self.submitted += [r.request_id for r in requests]

  def close(self):
    pass


def _until(condition, timeout: float = 30.0) -> None:
  deadline = time.time() + timeout
  while not condition():
    assert time.time() < deadline, "condition not reached"
    time.sleep(0.01)


def _backend():
  """Two fake servers, a fast one and a slow one, both holding version 0 (as after the main job's
  first push)."""
  clients = {"fast": FakeClient("fast"), "slow": FakeClient("slow", slow=True)}
  offered = []
  group = types.SimpleNamespace(processes=1, offer=lambda v, receivers: offered.append(v),
                                sources=lambda v, i: [])
  backend = RemoteRollout(["fast", "slow"], group, push_timeout=30, client=clients.__getitem__)
  clients["slow"].release(0)
  backend.update_weights(None, 0)
  backend.wait_for_pulls(0)
  return backend, clients, offered


def test_publishing_does_not_wait_for_a_slow_pull_but_holds_at_most_two_versions():
  backend, clients, offered = _backend()
  try:
    assert backend.version == 0
    backend.update_weights(None, 1)  # returns although the slow server has not pulled v1
    backend.update_weights(None, 2)
    assert offered == [0, 1, 2] and clients["slow"].pulled == [0]
    third = threading.Thread(target=backend.update_weights, args=(None, 3))
    third.start()
    third.join(1.0)
    assert third.is_alive() and offered == [0, 1, 2]  # v3 waits: v1 is still being pulled
    clients["slow"].release(1)
    third.join(30)
    assert not third.is_alive() and offered == [0, 1, 2, 3]
    assert clients["slow"].pulled == [0, 1]
  finally:
    for v in (2, 3):
      clients["slow"].release(v)
    backend.stop()


def test_a_server_more_than_one_version_behind_gets_no_work_and_admission_counts_with_the_oldest():
  backend, clients, _ = _backend()
  try:
    backend.update_weights(None, 1)
    _until(lambda: clients["fast"].pulled == [0, 1])
    # one behind: still gets work; admission counts with the oldest server that gets work
    assert backend.version == 0
    backend.submit(*[RolloutRequest(prompt_tokens=[1, 2], max_new_tokens=4) for _ in range(4)])
    assert len(clients["fast"].submitted) == len(clients["slow"].submitted) == 2
    backend.update_weights(None, 2)
    _until(lambda: clients["fast"].pulled == [0, 1, 2])
    # two behind: no new work until it catches up
    assert backend.version == 2
    backend.submit(*[RolloutRequest(prompt_tokens=[1, 2], max_new_tokens=4) for _ in range(4)])
    assert len(clients["fast"].submitted) == 6 and len(clients["slow"].submitted) == 2
    clients["slow"].release(1)
    clients["slow"].release(2)
    backend.wait_for_pulls(2)
    assert backend.server_versions == [2, 2] and backend.bytes_by_source == [600]
  finally:
    backend.stop()
