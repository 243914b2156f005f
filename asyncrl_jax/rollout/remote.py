"""Decode servers in other processes, reached over the rollout gRPC service: a ``RolloutBackend``
(``rollout.backend``) that places work, watches liveness, lets servers join, and has the learner's
publisher deliver each version's weights."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from concurrent import futures
from typing import Callable, Optional, Sequence

from asyncrl_jax.rl.trajectory import RolloutRequest, Trajectory
from asyncrl_jax.rollout import protocol
from asyncrl_jax.rollout.backend import BackendReport
from asyncrl_jax.rollout.grpc_service import RolloutClient
from asyncrl_jax.rollout.stats import DecodeStats
from asyncrl_jax.weights import Publisher, TransferStats, new_uuid

log = logging.getLogger(__name__)


def eligible(server_versions: Sequence[Optional[int]], published: Optional[int]) -> list[int]:
  """The servers that get new work: those at most one version behind the newest published (None: a
  server that holds no weights yet). All of them when none is, so work is never held back for good."""
  ok = [i for i, v in enumerate(server_versions)
        if v is not None and published is not None and v >= published - 1]
  return ok or list(range(len(server_versions)))


@dataclasses.dataclass(eq=False)
class _Server:
  """The learner's view of one decode server (one registration: a restart is a new ``_Server``)."""
  server_id: str
  address: str
  client: RolloutClient
  registered_at: float = 0.0
  version: Optional[int] = None  # of the weights it holds (None: none yet)
  base_id: int = 0  # the publisher's frozen base it holds (LoRA: then adapters alone suffice)
  alive: bool = True
  draining: bool = False  # shutting down (SIGTERM): gets no new work, gives its queue back
  last_seen: float = dataclasses.field(default_factory=time.time)  # its last answer to Health
  outstanding: dict = dataclasses.field(default_factory=dict)  # request id -> request sent, not back
  stats: DecodeStats = dataclasses.field(default_factory=DecodeStats)  # its last reported counters
  pushes: dict = dataclasses.field(default_factory=dict)  # version -> future of its pull
  push_error: Optional[str] = None  # the last pull failed (and was not yet retried)
  push_failures: int = 0  # consecutive failed pulls
  pusher: futures.ThreadPoolExecutor = dataclasses.field(
      default_factory=lambda: futures.ThreadPoolExecutor(max_workers=1))


class RemoteRollout:
  """Decode servers in other processes (registered with the learner), reached over the rollout gRPC
  service; servers may die, stall, and join or rejoin while the run goes on.

  * **Work.** Requests are spread round-robin over the live servers at most one version behind,
    each only to a server that holds at least the version it was admitted at (``min_version``); the
    backend remembers which server holds which request until its trajectory comes back. One streaming
    thread per server delivers trajectories (and reconnects if a stream breaks).
  * **Liveness.** A monitor thread asks every live server for ``Health`` every ``heartbeat`` seconds.
    A server that has not answered for ``deadline`` seconds (killed, stalled, unreachable) or that
    reports an error is dropped: its outstanding requests go to the remaining servers under the same
    request ids (a late duplicate from it is dropped by the controller), and the run goes on at
    reduced capacity. Requests with no live server to go to wait for one; after ``orphan_timeout``
    seconds without any live server the backend fails (``error``).
  * **Joining.** With a ``registry``, a server that registers (again, perhaps at another address)
    becomes a new server: it gets the current weights (``maintain``, from the main loop) before it
    gets work. A dropped server is forgotten by the registry, so one that comes back (a stall that
    ends) registers anew. A server that says it is draining gets no new work, and is dropped once
    nothing of it is outstanding.
  * **Incarnation.** Requests and weight notices carry ``incarnation`` (this learner's start): a
    server that outlived a previous learner drops that one's work when it gets this one's weights,
    of whatever version; trajectories of another incarnation are dropped here (counted). A server
    that reports a newer incarnation than this one serves another learner: that is an error.
  * **Weights.** Every learner process offers its blocks under a fresh random uuid per server and
    version (``LearnerGroup.offer``); each server is told on its own thread, in version order, and
    pulls at its own pace, so the learner's next step does not wait for the slowest pull. At most 2
    versions are held: publishing ``v`` first waits for every live server's pull of ``v - 2``, at most
    ``push_timeout`` seconds (then the server is dropped), and never for a dead one. A failed pull is
    retried with the newest version under a new uuid (a uuid can be pulled once: retrying it hangs),
    up to ``push_retries`` times, then the server is dropped. A server swaps in a version only once
    all of it arrived.
  * ``version`` is the oldest version among the servers that get work, so a rollout admitted "at
    version v" never starts under older weights.
  """

  def __init__(self, servers: Sequence, publisher: Publisher, *, push_timeout: float = 300.0,
               connect_timeout: float = 120.0, deadline: float = 30.0, heartbeat: float = 1.0,
               push_retries: int = 2, orphan_timeout: float = 600.0, registry=None,
               client: Callable[[str], RolloutClient] = RolloutClient, incarnation: int = 0,
               registry_server=None):
    if not servers:
      raise ValueError("RemoteRollout needs at least one decode server")
    self.publisher = publisher
    self.push_timeout, self.deadline, self.heartbeat = push_timeout, deadline, heartbeat
    self.push_retries, self.orphan_timeout = push_retries, orphan_timeout
    self.registry = registry
    self.incarnation = incarnation
    self._client = client
    self._on_trajectory: Optional[Callable[[Trajectory], None]] = None
    self._turn = itertools.count()
    self._stop = threading.Event()
    self._lock = threading.RLock()
    self._servers: list[_Server] = []  # every registration seen, dead ones included, in join order
    self._unplaced: list[RolloutRequest] = []  # requests waiting for a live server
    self._no_server_since: Optional[float] = None
    self.published: Optional[int] = None
    self.bytes_by_source = [0] * publisher.processes  # pulled from each learner process, all versions
    # pulls completed and their bytes, full weights and partial ones (LoRA adapters alone)
    self.publishes = {"full": 0, "partial": 0}
    self.publish_bytes = {"full": 0, "partial": 0}
    self.transfer_seconds = 0.0  # the slowest pull so far of the newest version pulled
    self._transfer_version = -1
    self._retired = DecodeStats(servers=0)  # last counters of servers that are gone
    self.faults = collections.Counter()  # servers_lost, servers_joined, requests_reassigned, ...
    self.events: list[dict] = []  # what happened to which server, when
    self.error: Optional[BaseException] = None
    self.registry_server = registry_server  # the learner's registry (gRPC server), stopped with us
    self._pool = futures.ThreadPoolExecutor(max_workers=8)
    for s in servers:
      server_id, address = (s, s) if isinstance(s, str) else (s.server_id, s.address)
      self._servers.append(self._connect(server_id, address, getattr(s, "registered_at", 0.0),
                                         connect_timeout))
    self._monitor_thread: Optional[threading.Thread] = None

  def _connect(self, server_id: str, address: str, registered_at: float, timeout: float) -> _Server:
    client = self._client(address)
    client.wait_ready(timeout)
    return _Server(server_id, address, client, registered_at)

  # ------------------------------------------------------------------ the table of servers

  def _live(self) -> list[_Server]:
    with self._lock:
      return [s for s in self._servers if s.alive]

  @property
  def num_servers(self) -> int:
    """Live decode servers."""
    return len(self._live())

  @property
  def server_versions(self) -> list[Optional[int]]:
    return [s.version for s in self._live()]

  def _eligible(self) -> list[_Server]:
    with self._lock:
      live = [s for s in self._live() if not s.draining]
      held = [s for s in live if s.version is not None]
      return [held[i] for i in eligible([s.version for s in held], self.published)] if held else live

  @property
  def version(self) -> Optional[int]:
    """The oldest version held by a server that gets work (the newest published when none holds
    any yet, or none is live: requests then wait for a server holding it)."""
    held = [s.version for s in self._eligible() if s.version is not None]
    return min(held) if held else self.published

  def _event(self, kind: str, s: _Server, detail: str = "") -> None:
    self.faults[kind] += 1
    self.events.append({"event": kind, "server_id": s.server_id, "address": s.address,
                        "time": time.time(), "detail": detail})

  def _drop(self, s: _Server, reason: str, kind: str = "servers_lost") -> None:
    """Server ``s`` is gone: its outstanding requests go to the others under the same ids."""
    with self._lock:
      if not s.alive:
        return
      s.alive = False
      orphans = list(s.outstanding.values())
      s.outstanding.clear()
      self._retired = self._retired + dataclasses.replace(s.stats, servers=0)
      self._event(kind, s, reason)
      self.faults["requests_reassigned"] += len(orphans)
    if self.registry is not None:  # if it comes back, it registers anew
      self.registry.forget(s.server_id, s.address)
    log.warning("decode server %s at %s dropped (%s); %d requests go to the remaining %d servers",
                s.server_id, s.address, reason, len(orphans), self.num_servers)
    try:
      s.client.close()
    except Exception:  # pylint: disable=broad-except
      pass
    self._place(orphans)

  def _join(self, entry) -> None:
    """A registration the backend has not seen: a new server (after dropping the one it replaces)."""
    with self._lock:
      old = [s for s in self._servers if s.server_id == entry.server_id and s.alive]
    for s in old:
      self._drop(s, f"registered again at {entry.address}")
    try:
      s = self._connect(entry.server_id, entry.address, entry.registered_at, self.deadline)
    except Exception as e:  # pylint: disable=broad-except
      log.warning("decode server %s registered at %s but cannot be reached: %r", entry.server_id,
                  entry.address, e)
      return
    with self._lock:
      self._servers.append(s)
      self._event("servers_joined", s)
    log.warning("decode server %s joined at %s; it gets the current weights before work",
                s.server_id, s.address)
    if self._on_trajectory is not None:
      self._start_stream(s)

  # ------------------------------------------------------------------ work

  def submit(self, *requests: RolloutRequest) -> None:
    self._place([dataclasses.replace(r, incarnation=self.incarnation) for r in requests])

  def _place(self, requests: list, *, avoid: Optional[_Server] = None) -> None:
    """Sends each request to a server that gets work and holds at least its ``min_version``
    (round-robin); a request no such server can take waits in ``_unplaced`` for the next pull to
    finish or the monitor's next turn. The version filter is what keeps the staleness bound: the
    set of servers that get work changes between admission and placement (a lagging server's pull
    brings it back within one version of the newest, a server is lost and the rest are older)."""
    if not requests:
      return
    servers = [s for s in self._eligible() if s is not avoid and s.version is not None]
    by_server = collections.defaultdict(list)
    with self._lock:
      for r in requests:
        able = [s for s in servers if s.version >= r.min_version]
        if not able:
          self._unplaced.append(r)
          continue
        s = able[next(self._turn) % len(able)]
        s.outstanding[r.request_id] = r
        by_server[s].append(r)
    for s, rs in by_server.items():
      try:
        s.client.submit(rs)
      except Exception as e:  # pylint: disable=broad-except
        log.warning("submit to %s failed (%r); placing its %d requests elsewhere", s.address, e, len(rs))
        with self._lock:
          for r in rs:
            s.outstanding.pop(r.request_id, None)
        self._place(rs, avoid=s)

  def locate(self, ids) -> dict:
    """Where each request id is, as far as the backend knows: a server id (sent, not back), "unplaced"
    (waiting for a live server) or "nowhere" (back, or never submitted)."""
    with self._lock:
      where = {r.request_id: "unplaced" for r in self._unplaced}
      for s in self._servers:
        for i in s.outstanding:
          where[i] = f"{s.server_id}{'' if s.alive else ' (dropped)'}"
    return {i: where.get(i, "nowhere") for i in ids}

  def _arrived(self, t: Trajectory) -> None:
    if t.incarnation != self.incarnation:  # a previous learner's work, under the same ids as ours
      self.faults["trajectories_of_other_learners"] += 1
      return
    with self._lock:
      holders = [s for s in self._servers if s.outstanding.pop(t.trajectory_id, None) is not None]
    self._on_trajectory(t)
    for s in holders:
      self._drop_if_drained(s)

  def _drop_if_drained(self, s: _Server) -> None:
    """A draining server is dropped once nothing of it is outstanding (it has given everything back
    or delivered it, and exits)."""
    with self._lock:
      drained = s.alive and s.draining and not s.outstanding
    if drained:
      self._drop(s, "drained (shut down)", kind="servers_drained")

  def _stream(self, s: _Server) -> None:
    while not self._stop.is_set() and s.alive:
      try:
        for t in s.client.stream(timeout=None):
          self._arrived(t)
          if self._stop.is_set():
            return
      except Exception as e:  # pylint: disable=broad-except
        if self._stop.is_set() or not s.alive:
          return
        log.info("stream from %s broke (%r); reconnecting", s.address, e)
        time.sleep(0.5)

  def _start_stream(self, s: _Server) -> None:
    threading.Thread(target=self._stream, args=(s,), daemon=True, name=f"stream-{s.address}").start()

  # ------------------------------------------------------------------ liveness

  def _check(self, s: _Server) -> None:
    try:
      reply = s.client.health(timeout=max(min(self.deadline / 2, 10.0), 0.1))
    except Exception:  # pylint: disable=broad-except
      self._drop_if_drained(s)  # (it gave everything back, then exited)
      if s.alive and time.time() - s.last_seen > self.deadline:
        self._drop(s, f"no answer for {self.deadline:g}s")
      return
    self._observe(s, reply)
    if reply.status == "error":
      self._drop(s, f"it reports an error: {reply.error}")
    elif reply.incarnation > self.incarnation:
      self.error = RuntimeError(
          f"decode server {s.server_id} at {s.address} serves a newer learner (incarnation "
          f"{reply.incarnation}, this one {self.incarnation}): another learner took over this run")
    else:
      self._drop_if_drained(s)

  def _observe(self, s: _Server, reply) -> None:
    """What any ``Health`` answer tells: the server is there, its counters, whether it drains (a
    server waits for one answered "draining" before it exits, whichever call that was)."""
    s.last_seen = time.time()
    s.stats = protocol.stats_from_pb(reply.stats)
    if reply.status == "draining" and not s.draining:
      log.warning("decode server %s at %s is draining (shutting down)", s.server_id, s.address)
      s.draining = True

  def _place_unplaced(self) -> None:
    with self._lock:
      unplaced, self._unplaced = self._unplaced, []
    self._place(unplaced)

  def _monitor(self) -> None:
    while not self._stop.wait(self.heartbeat):
      try:
        if self.registry is not None:
          seen = {(s.server_id, s.address, s.registered_at) for s in self._servers}
          for entry in self.registry.servers():
            if (entry.server_id, entry.address, entry.registered_at) not in seen:
              self._join(entry)
        checks = [self._pool.submit(self._check, s) for s in self._live()]
        futures.wait(checks)
        self._place_unplaced()
        if self._live():
          self._no_server_since = None
        elif self._no_server_since is None:
          self._no_server_since = time.time()
        elif time.time() - self._no_server_since > self.orphan_timeout:
          self.error = RuntimeError(f"no live decode server for {self.orphan_timeout:g}s")
      except Exception as e:  # pylint: disable=broad-except
        log.exception("decode-server monitor failed")
        self.error = e
        return

  # ------------------------------------------------------------------ weights

  def _push(self, s: _Server, version: int, uuid: int, partial: bool = False) -> None:
    base_id = self.publisher.base_id
    try:
      reply = s.client.update_weights(version, self.publisher.sources(uuid, partial),
                                      timeout=self.push_timeout, incarnation=self.incarnation,
                                      base_id=base_id, partial=partial)
    except Exception as e:  # pylint: disable=broad-except
      with self._lock:
        s.push_error = f"pull of v{version} failed: {e!r}"[:500]
        s.push_failures += 1
        s.base_id = 0  # (whatever it holds now, the retry sends everything)
      if s.alive:
        log.warning("decode server %s: %s", s.address, s.push_error)
      return
    with self._lock:
      s.version = version  # (notices to one server go in version order)
      s.base_id = base_id
      s.push_failures = 0
      self.publishes["partial" if partial else "full"] += 1
      self.publish_bytes["partial" if partial else "full"] += reply.bytes
      for p, n in enumerate(reply.source_bytes):
        self.bytes_by_source[p] += n
      if version > self._transfer_version:
        self._transfer_version, self.transfer_seconds = version, reply.seconds
      elif version == self._transfer_version:
        self.transfer_seconds = max(self.transfer_seconds, reply.seconds)
    self._place_unplaced()  # requests waiting for a server that holds their version

  def _send(self, version: int, servers: Sequence[_Server]) -> None:
    """Offers ``version`` to ``servers`` (every learner process, a fresh uuid each) and tells them."""
    if not servers:
      return
    uuids = [new_uuid() for _ in servers]
    base_id = self.publisher.base_id
    partial = [bool(base_id) and s.base_id == base_id for s in servers]  # holds the frozen base
    self.publisher.offer(version, uuids, partial)
    for s, uuid, part in zip(servers, uuids, partial):
      s.push_error = None
      s.pushes[version] = s.pusher.submit(self._push, s, version, uuid, part)

  def _wait(self, version: int, timeout: Optional[float] = None) -> None:
    """Waits for every live server's pull of ``version`` (dropping one that takes longer than
    ``timeout``, default ``push_timeout``); never waits for a dead server."""
    t, timeout = time.time(), self.push_timeout if timeout is None else timeout
    for s in list(self._servers):
      f = s.pushes.pop(version, None)
      while f is not None and s.alive and not f.done():
        if time.time() - t > timeout:
          self._drop(s, f"did not pull weights v{version} within {timeout:.0f}s")
          break
        try:
          f.result(timeout=0.1)
        except futures.TimeoutError:
          pass

  def maintain(self) -> None:
    """From the main loop, whenever the learner's weights are those of ``published``: servers that
    joined get them; a failed pull is retried (up to ``push_retries`` times, then the server is
    dropped)."""
    if self.published is None:
      return
    todo = []
    with self._lock:
      for s in self._live():
        if s.draining:  # shutting down: it finishes what it holds with the weights it has
          continue
        busy = any(not f.done() for f in s.pushes.values())
        if busy:
          continue
        if s.push_error is not None:
          if s.push_failures > self.push_retries:
            failed = s.push_error
            self._pool.submit(self._drop, s, f"{s.push_failures} failed pulls; last: {failed}")
            continue
          todo.append(s)
          self.faults["push_retries"] += 1
        elif s.version is None or s.version < self.published - 1:
          todo.append(s)
    self._send(self.published, todo)

  def update_weights(self, learner_params, version: int) -> TransferStats:
    """Publishes ``version``; returns how long the learner was blocked (``seconds``)."""
    del learner_params  # every learner process offers its own blocks of them
    t = time.perf_counter()
    for old in sorted({v for s in self._servers for v in s.pushes if v <= version - 2}):
      self._wait(old)
    self._send(version, [s for s in self._live() if not s.draining])
    self.published = version
    return TransferStats(time.perf_counter() - t, 0)

  def wait_for_pulls(self, version: int) -> None:
    """Blocks until every live server holds ``version`` (retrying failed pulls); raises if no server
    does within ``push_timeout`` seconds."""
    deadline = time.time() + self.push_timeout
    while True:
      live = self._live()
      if live and all(s.version is not None and s.version >= version for s in live):
        return
      if time.time() > deadline or not live:
        states = ", ".join(f"{s.server_id}: v{s.version} {s.push_error or ''}" for s in self._servers)
        raise TimeoutError(f"decode servers did not pull weights v{version} within "
                           f"{self.push_timeout:.0f}s ({states})")
      self.maintain()
      time.sleep(0.05)

  # ------------------------------------------------------------------ the rest of the interface

  def wait_until_warm(self, timeout: float = 600.0) -> None:
    """Waits until no decode server is compiling (``rollout.warm_up``), so that RL starts on warm servers."""
    deadline = time.time() + timeout

    def warming(s):
      try:
        reply = s.client.health(timeout=30)
        self._observe(s, reply)
        return reply.status == "warming_up"
      except Exception:  # pylint: disable=broad-except
        return False  # (the monitor decides whether it is gone)

    while any(warming(s) for s in self._live()):
      if time.time() > deadline:  # not fatal: RL starts, and calls compile what they still lack
        log.warning("decode servers still compiling after %.0fs; starting anyway", timeout)
        return
      time.sleep(0.2)

  def decode_stats(self) -> DecodeStats:
    """Every decode server's counters, summed (``servers`` counts the live ones; ``idle_seconds`` is
    summed too): one ``Health`` call per live server (its last reported counters if it does not
    answer), plus the last counters of servers that are gone."""
    def one(s):
      try:
        self._observe(s, s.client.health(timeout=10))
      except Exception:  # pylint: disable=broad-except
        pass
      return dataclasses.replace(s.stats, servers=1)
    return sum(self._pool.map(one, self._live()), self._retired)

  def local_params(self):
    """(None: the decode servers are other processes.)"""
    return None

  def report(self) -> BackendReport:
    with self._lock:
      publishes = dict(self.publishes) | {f"{k}_bytes": v for k, v in self.publish_bytes.items()}
      report = BackendReport(dict(self.faults), list(self.events), list(self.bytes_by_source), publishes)
    if self.registry is None:
      return report
    sandboxes = {s.server_id: s.sandbox for s in self.registry.servers() if s.sandbox}
    return dataclasses.replace(report, sandboxes=sandboxes)

  def start(self, on_trajectory: Callable[[Trajectory], None]) -> None:
    self._on_trajectory = on_trajectory
    for s in self._live():
      self._start_stream(s)
    self._monitor_thread = threading.Thread(target=self._monitor, daemon=True, name="rollout-monitor")
    self._monitor_thread.start()

  def stop(self) -> None:
    self._stop.set()
    for v in sorted({v for s in self._servers for v in s.pushes}):  # senders must outlive pulls
      self._wait(v, timeout=self.deadline)
    for s in self._servers:
      try:
        s.client.close()
      except Exception:  # pylint: disable=broad-except
        pass
      s.pusher.shutdown(wait=False)
    if self.registry_server is not None:
      self.registry_server.stop(grace=0)
    self._pool.shutdown(wait=False)
