"""RemoteRollout's weight publishing and work spreading, against fake decode-server clients: the
learner does not wait for a slow pull, holds at most 2 versions, and a lagging server gets no work."""

import threading
import time
import types

from asyncrl_jax.rl.trajectory import RolloutRequest
from tests.fixtures.fakes import FakePublisher
from asyncrl_jax.rollout import protocol
from asyncrl_jax.rollout.remote import RemoteRollout
from asyncrl_jax.rollout.stats import DecodeStats


class FakeClient:
  """Records submits; ``update_weights`` blocks until ``release(version)`` when ``slow``."""

  def __init__(self, address: str, slow: bool = False):
    self.address, self.slow = address, slow
    self.submitted, self.pulled, self.incarnations, self.notices = [], [], [], []
    self.status, self.incarnation = "serving", 0
    self._released: dict[int, threading.Event] = {}

  def wait_ready(self, timeout):
    del timeout

  def release(self, version: int) -> None:
    self._released.setdefault(version, threading.Event()).set()

  def update_weights(self, version, sources, timeout, incarnation=0, base_id=0, partial=False):
    del sources
    self.incarnations.append(incarnation)
    self.notices.append((version, base_id, partial))
    if self.slow and not self._released.setdefault(version, threading.Event()).wait(timeout):
      raise TimeoutError(f"fake pull of v{version} never released")
    self.pulled.append(version)
    return types.SimpleNamespace(seconds=0.01, source_bytes=[100], bytes=100)

  def submit(self, requests):
    self.submitted += [r.request_id for r in requests]

  def health(self, timeout):
    del timeout
    return types.SimpleNamespace(status=self.status, error="", incarnation=self.incarnation,
                                 stats=protocol.stats_to_pb(DecodeStats()))

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
  publisher = FakePublisher()
  backend = RemoteRollout(["fast", "slow"], publisher, push_timeout=30, client=clients.__getitem__)
  clients["slow"].release(0)
  backend.update_weights(None, 0)
  backend.wait_for_pulls(0)
  return backend, clients, publisher.offered


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


def test_a_request_never_goes_to_a_server_older_than_the_version_it_was_admitted_at():
  """The soak's staleness violation: admission counted with v2 (the only server that got work held
  v2), then the lagging server's pull of v1 made it eligible again (one behind v2) and round-robin
  sent it requests admitted at v2, so their tokens were sampled at v1."""
  backend, clients, _ = _backend()
  try:
    backend.update_weights(None, 1)
    backend.update_weights(None, 2)
    _until(lambda: clients["fast"].pulled == [0, 1, 2])
    assert backend.version == 2  # the slow server (v0) gets no work
    clients["slow"].release(1)
    _until(lambda: backend.server_versions == [2, 1])
    admitted_at_2 = [RolloutRequest(prompt_tokens=[1, 2], max_new_tokens=4, request_id=f"a{i}",
                                    min_version=2) for i in range(4)]
    backend.submit(*admitted_at_2)
    assert clients["slow"].submitted == [] and len(clients["fast"].submitted) == 4
    older = [RolloutRequest(prompt_tokens=[1, 2], max_new_tokens=4, request_id=f"b{i}", min_version=1)
             for i in range(4)]
    backend.submit(*older)  # admitted at v1: either server may take them
    assert len(clients["slow"].submitted) == 2
  finally:
    clients["slow"].release(2)
    backend.stop()


def test_requests_of_a_lost_server_wait_until_a_server_holds_their_version():
  backend, clients, _ = _backend()
  try:
    backend.update_weights(None, 1)
    clients["slow"].release(1)
    backend.update_weights(None, 2)
    _until(lambda: backend.server_versions == [2, 1])
    admitted_at_2 = [RolloutRequest(prompt_tokens=[1, 2], max_new_tokens=4, request_id=f"r{i}",
                                    min_version=2) for i in range(2)]
    backend.submit(*admitted_at_2)
    assert clients["fast"].submitted == ["r0", "r1"]
    backend._drop(backend._servers[0], "lost in a test")  # pylint: disable=protected-access
    assert clients["slow"].submitted == [] and backend.locate(["r0"]) == {"r0": "unplaced"}
    clients["slow"].release(2)  # its pull of v2 finishes: the waiting requests go to it
    _until(lambda: sorted(clients["slow"].submitted) == ["r0", "r1"])
  finally:
    backend.stop()


class FaultyClient(FakeClient):
  """A fake server that can die (every call raises), stall (health hangs past its deadline) or fail
  its next ``fail_pulls`` pulls."""

  def __init__(self, address: str):
    super().__init__(address)
    self.dead = self.stalled = False
    self.fail_pulls = 0
    self.uuids = []

  def _check(self):
    if self.dead:
      raise ConnectionError(f"{self.address} is gone")

  def health(self, timeout):
    self._check()
    if self.stalled:
      time.sleep(timeout)
      raise TimeoutError("deadline exceeded")
    return super().health(timeout)

  def submit(self, requests):
    self._check()
    super().submit(requests)

  def update_weights(self, version, sources, timeout, incarnation=0, base_id=0, partial=False):
    self.uuids.append(sources[0])
    self._check()
    while self.stalled:  # a stopped process: the pull neither finishes nor fails
      time.sleep(0.05)
    if self.fail_pulls:
      self.fail_pulls -= 1
      raise RuntimeError("Connection closed")
    return super().update_weights(version, sources, timeout, incarnation, base_id, partial)


def _faulty(names, registry=None, **kw):
  clients = {n: FaultyClient(n) for n in names}
  offered = []
  group = types.SimpleNamespace(processes=1, base_id=0,
                                offer=lambda v, uuids, partial=(): offered.append((v, list(uuids))),
                                sources=lambda uuid, partial=False: [uuid])
  kw = dict(dict(push_timeout=60, deadline=0.5, heartbeat=0.05), **kw)
  backend = RemoteRollout(names, group, client=clients.__getitem__, registry=registry, **kw)
  got = []
  backend.start(got.append)
  backend.update_weights(None, 0)
  backend.wait_for_pulls(0)
  return backend, clients, offered, got


def _requests(n):
  return [RolloutRequest(prompt_tokens=[1, 2], max_new_tokens=4, request_id=f"r{i}") for i in range(n)]


def test_a_dead_server_is_dropped_and_its_requests_go_to_the_others_under_the_same_ids():
  backend, clients, _, _ = _faulty(["a", "b", "c"])
  try:
    backend.submit(*_requests(6))
    held = list(clients["b"].submitted)
    assert len(held) == 2
    clients["b"].dead = True
    t = time.time()
    _until(lambda: backend.num_servers == 2, timeout=10)
    assert time.time() - t < 10
    _until(lambda: len(clients["a"].submitted) + len(clients["c"].submitted) == 6)
    again = sorted(set(clients["a"].submitted + clients["c"].submitted) & set(held))
    assert again == sorted(held)  # the same request ids, on the remaining servers
    assert backend.faults["servers_lost"] == 1 and backend.faults["requests_reassigned"] == 2
    assert "no answer for" in backend.events[0]["detail"] and backend.events[0]["server_id"] == "b"
    # the run goes on at reduced capacity: new work and new weights skip the dead server
    backend.submit(*_requests(4))
    assert len(clients["b"].submitted) == 2
    backend.update_weights(None, 1)
    _until(lambda: clients["a"].pulled == [0, 1] and clients["c"].pulled == [0, 1])
    assert backend.version == 1 and backend.error is None
  finally:
    backend.stop()


def test_a_stalled_server_never_holds_the_learner_past_the_deadline():
  backend, clients, offered, _ = _faulty(["a", "b"], push_timeout=600)
  try:
    clients["b"].stalled = True  # (SIGSTOP: its pulls and health checks hang)
    backend.update_weights(None, 1)
    t = time.time()
    backend.update_weights(None, 2)
    backend.update_weights(None, 3)  # waits for pulls of v1: b's never comes, and b is dropped
    assert time.time() - t < 30  # bounded by the server deadline, not push_timeout=600
    assert backend.num_servers == 1 and backend.events[0]["server_id"] == "b"
    _until(lambda: clients["a"].pulled == [0, 1, 2, 3])
    # every offer has its own random uuid: none derived from the version, none reused
    uuids = [u for _, us in offered for u in us]
    assert len(set(uuids)) == len(uuids) >= 2 + 2 + 1 + 1
  finally:
    clients["b"].stalled = False
    backend.stop()


def test_a_failed_pull_is_retried_under_a_new_uuid_then_the_server_is_dropped():
  backend, clients, offered, _ = _faulty(["a", "b"], push_retries=2)
  try:
    clients["b"].fail_pulls = 1
    backend.update_weights(None, 1)
    _until(lambda: clients["b"].uuids and len(clients["b"].uuids) == 2)  # v0, then v1 failed
    assert backend.server_versions == [1, 0] or clients["a"].pulled[-1] == 1
    backend.maintain()  # the main loop's call: the retry
    _until(lambda: clients["b"].pulled == [0, 1])
    assert len(set(clients["b"].uuids)) == 3 and backend.faults["push_retries"] == 1
    clients["b"].fail_pulls = 10
    backend.update_weights(None, 2)
    for _ in range(3):  # the push of v2, then 2 retries, all failing
      _until(lambda: not any(not f.done() for f in backend._servers[1].pushes.values()))  # pylint: disable=protected-access
      backend.maintain()
    _until(lambda: backend.num_servers == 1)
    assert "3 failed pulls" in backend.events[-1]["detail"]
  finally:
    backend.stop()


def test_a_server_that_registers_again_gets_the_current_weights_before_work():
  entries = [types.SimpleNamespace(server_id="decode-0", address="a", registered_at=1.0),
             types.SimpleNamespace(server_id="decode-1", address="b", registered_at=1.0)]
  forgotten = []
  registry = types.SimpleNamespace(servers=lambda: list(entries),
                                   forget=lambda *entry: forgotten.append(entry))
  clients = {n: FaultyClient(n) for n in ("a", "b", "b2")}
  offered = []
  group = types.SimpleNamespace(processes=1, base_id=0, offer=lambda v, uuids, partial=(): offered.append(v),
                                sources=lambda uuid, partial=False: [uuid])
  backend = RemoteRollout(entries, group, client=clients.__getitem__, registry=registry, deadline=0.5,
                          heartbeat=0.05)
  backend.start(lambda t: None)
  try:
    backend.update_weights(None, 0)
    backend.wait_for_pulls(0)
    clients["b"].dead = True  # decode-1 dies and restarts at another address
    _until(lambda: backend.num_servers == 1)
    assert forgotten == [("decode-1", "b")]  # if it comes back there, it is a new registration
    backend.update_weights(None, 1)
    entries[1] = types.SimpleNamespace(server_id="decode-1", address="b2", registered_at=2.0)
    _until(lambda: backend.faults["servers_joined"] == 1)
    backend.submit(*_requests(2))  # the joiner holds no weights yet: no work for it
    assert clients["b2"].submitted == [] and len(clients["a"].submitted) == 2
    backend.maintain()
    _until(lambda: clients["b2"].pulled == [1])
    backend.submit(*_requests(2))
    assert len(clients["b2"].submitted) == 1 and backend.num_servers == 2
  finally:
    backend.stop()


def test_requests_wait_for_a_server_and_the_backend_fails_when_none_comes():
  backend, clients, _, _ = _faulty(["a"], orphan_timeout=1.0)
  try:
    clients["a"].dead = True
    _until(lambda: backend.num_servers == 0)
    backend.submit(*_requests(2))  # nowhere to go: held, not lost
    assert len(backend._unplaced) == 2  # pylint: disable=protected-access
    _until(lambda: backend.error is not None)
    assert "no live decode server for 1s" in str(backend.error)
  finally:
    backend.stop()


def _trajectory(request_id: str, incarnation: int):
  import numpy as np  # pylint: disable=import-outside-toplevel
  from asyncrl_jax.rl.trajectory import Trajectory  # pylint: disable=import-outside-toplevel
  return Trajectory(trajectory_id=request_id, prompt_id="", group_id=0, prompt_tokens=np.asarray([1, 2]),
                    completion_tokens=np.asarray([3]), logprobs=np.asarray([-0.5]), versions=np.asarray([0]),
                    finish_reason="eos", logprob_source="sampling", sampling={}, tokenizer_id="t",
                    incarnation=incarnation)


def test_work_and_weights_carry_the_incarnation_and_another_learners_trajectories_are_dropped():
  backend, clients, _, got = _faulty(["a"], incarnation=42)
  try:
    assert clients["a"].incarnations == [42]  # the first push names this learner
    requests = _requests(2)
    backend.submit(*requests)
    assert [r.incarnation for r in requests] == [0, 0]  # the caller's requests are not changed
    # a previous learner's trajectory under one of our ids: dropped, and ours stays outstanding
    backend._arrived(_trajectory("r0", incarnation=41))  # pylint: disable=protected-access
    assert got == [] and backend.faults["trajectories_of_other_learners"] == 1
    assert backend.locate(["r0", "r1"]) == {"r0": "a", "r1": "a"}
    backend._arrived(_trajectory("r0", incarnation=42))  # pylint: disable=protected-access
    assert [t.trajectory_id for t in got] == ["r0"] and backend.locate(["r0"]) == {"r0": "nowhere"}
    clients["a"].incarnation = 43  # a newer learner took the server over: this one must stop
    _until(lambda: backend.error is not None)
    assert "incarnation 43, this one 42" in str(backend.error)
  finally:
    backend.stop()


def test_a_draining_server_gets_no_new_work_and_is_dropped_once_nothing_of_it_is_outstanding():
  backend, clients, _, got = _faulty(["a", "b"])
  try:
    backend.submit(*_requests(4))
    held = list(clients["b"].submitted)
    assert len(held) == 2
    clients["b"].status = "draining"
    _until(lambda: backend._servers[1].draining)  # pylint: disable=protected-access
    backend.submit(*[RolloutRequest([1], 2, request_id=f"n{i}") for i in range(3)])
    assert clients["b"].submitted == held  # no new work for it
    assert backend.num_servers == 2  # two of its rollouts are still out
    for i in held:
      backend._arrived(_trajectory(i, incarnation=0))  # pylint: disable=protected-access
    _until(lambda: backend.num_servers == 1)
    assert backend.faults["servers_drained"] == 1 and backend.faults["servers_lost"] == 0
    assert backend.faults["requests_reassigned"] == 0
  finally:
    backend.stop()


def test_with_a_frozen_base_a_server_gets_the_full_weights_once_then_adapters_alone():
  """LoRA (a publisher with a ``base_id``): the first pull of each server is full, later ones are
  partial; a failed pull makes the next one full again (the server may hold anything), and so does a
  new publisher (another base) or a server that joins later."""
  clients = {n: FaultyClient(n) for n in ("a", "b")}
  offers = []
  group = types.SimpleNamespace(processes=1, base_id=77,
                                offer=lambda v, uuids, partial=(): offers.append((v, list(partial))),
                                sources=lambda uuid, partial=False: [uuid])
  backend = RemoteRollout(["a", "b"], group, push_timeout=30, client=clients.__getitem__)
  try:
    backend.update_weights(None, 0)
    backend.wait_for_pulls(0)
    backend.update_weights(None, 1)
    backend.wait_for_pulls(1)
    assert offers == [(0, [False, False]), (1, [True, True])]
    assert clients["a"].notices == [(0, 77, False), (1, 77, True)]
    clients["b"].fail_pulls = 1
    backend.update_weights(None, 2)
    _until(lambda: backend._servers[1].push_error is not None)  # pylint: disable=protected-access
    backend.wait_for_pulls(2)  # (the retry)
    assert offers[2:] == [(2, [True, True]), (2, [False])]  # b's partial pull failed: a full retry
    assert clients["b"].notices[-1] == (2, 77, False) and clients["a"].notices[-1] == (2, 77, True)
    group.base_id = 78  # another base: everyone gets it in full
    backend.update_weights(None, 3)
    backend.wait_for_pulls(3)
    assert clients["a"].notices[-1] == clients["b"].notices[-1] == (3, 78, False)
    report = backend.report().publishes
    assert report["full"] == 5 and report["partial"] == 3 and report["full_bytes"] == 500
  finally:
    backend.stop()
