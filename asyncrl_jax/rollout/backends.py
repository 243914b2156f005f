"""Where the controller's rollouts run: decode servers in this process, or in other processes.

Both backends offer the same narrow interface to the main loop:
``submit(*requests)``, ``update_weights(learner_params, version) -> TransferStats`` (its ``seconds``:
how long the learner was blocked publishing), ``transfer_seconds`` (of the newest version fully
delivered), ``num_servers``, ``version``,
``start(on_trajectory)``, ``stop()``, ``error``, ``wait_until_warm()`` and ``decode_stats()`` (the
decode servers' cumulative counters, summed: a ``DecodeStats``). A backend is built first, the
controller on top of it (``submit``), and ``start`` then names where finished trajectories go: no
construction cycle. ``version`` is the version of the weights last handed to the decode servers: it
lags the learner's while a push is under way, and admission counts with it, so a rollout admitted
"at version v" never starts under older weights.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from concurrent import futures
from typing import Callable, Optional, Sequence

from asyncrl_jax.rollout.engine import Engine
from asyncrl_jax.rollout.server import DecodeServer
from asyncrl_jax.rollout import protocol
from asyncrl_jax.rollout.service import RolloutClient
from asyncrl_jax.rollout.stats import DecodeStats
from asyncrl_jax.rollout.trajectory import RolloutRequest, Trajectory
from asyncrl_jax.transfer import TransferStats, local_transfer

log = logging.getLogger(__name__)


class LocalRollout:
  """One decode server on this process's rollout mesh; weights move with ``jax.device_put``."""

  def __init__(self, engine: Engine, learner_params, version: int, *,
               on_weight_update: str = "recompute"):
    self.engine = engine
    params, _ = local_transfer(learner_params, engine.param_shardings)
    self.server = DecodeServer(engine, params, version=version, server_id="decode-0",
                               on_weight_update=on_weight_update)
    self.rollout_params = params
    self.version = version  # of the weights last handed to the decode server (lags the learner's)
    self.transfer_seconds = 0.0
    self.num_servers = 1

  def submit(self, *requests: RolloutRequest) -> None:
    self.server.submit(*requests)

  def update_weights(self, learner_params, version: int) -> TransferStats:
    self.rollout_params, stats = local_transfer(learner_params, self.engine.param_shardings)
    self.server.update_weights(self.rollout_params, version)
    self.version = version
    self.transfer_seconds = stats.seconds
    return stats

  @property
  def error(self):
    return self.server.error

  def wait_until_warm(self, timeout: float = 600.0) -> None:
    """Waits until the engine compiles nothing in the background (``rollout.warm_up``)."""
    if not self.engine.wait_for_compiles(timeout):  # not fatal: calls compile what they still lack
      log.warning("the decode server is still compiling after %.0fs; starting anyway", timeout)

  def decode_stats(self) -> DecodeStats:
    return self.server.stats.copy()  # a snapshot: the decode loop's thread keeps counting

  def start(self, on_trajectory: Callable[[Trajectory], None]) -> None:
    self.server.stream_to(on_trajectory)
    self.server.start()

  def stop(self) -> None:
    self.server.stop()


def eligible(server_versions: Sequence[Optional[int]], published: Optional[int]) -> list[int]:
  """The servers that get new work: those at most one version behind the newest published (None: a
  server that holds no weights yet). All of them when none is, so work is never held back for good."""
  ok = [i for i, v in enumerate(server_versions)
        if v is not None and published is not None and v >= published - 1]
  return ok or list(range(len(server_versions)))


class RemoteRollout:
  """Decode servers in other processes (registered with the learner), reached over the rollout gRPC
  service.

  Requests are spread round-robin over the servers that are at most one version behind; one streaming
  thread per server delivers trajectories (and reconnects if a stream breaks). New weights: every
  learner process offers its blocks (``LearnerGroup.offer``), then each server is told, on its own
  thread and in version order, and pulls at its own pace: the learner's next step does not wait for
  the slowest pull. At most 2 versions are held: publishing ``v`` first waits (up to
  ``push_timeout`` seconds) for every pull of ``v - 2``. ``version`` is the oldest version among the
  servers that get work, so a rollout admitted "at version v" never starts under older weights.
  """

  def __init__(self, addresses: Sequence[str], group, *, push_timeout: float = 300.0,
               connect_timeout: float = 120.0, client: Callable[[str], RolloutClient] = RolloutClient):
    if not addresses:
      raise ValueError("RemoteRollout needs at least one decode server address")
    self.clients = [client(a) for a in addresses]
    for c in self.clients:
      c.wait_ready(connect_timeout)
    self.group = group
    self.push_timeout = push_timeout
    self._on_trajectory: Optional[Callable[[Trajectory], None]] = None
    self._turn = itertools.count()
    self._stop = threading.Event()
    self._pool = futures.ThreadPoolExecutor(max_workers=len(self.clients))
    self._pushers = [futures.ThreadPoolExecutor(max_workers=1) for _ in self.clients]
    self._pending: dict[int, list[futures.Future]] = {}
    self._lock = threading.Lock()
    self.server_versions: list[Optional[int]] = [None] * len(self.clients)
    self.published: Optional[int] = None
    self.bytes_by_source = [0] * group.processes  # pulled from each learner process, all versions
    self.transfer_seconds = 0.0  # the slowest server's pull of the newest version fully pulled
    self._pull_seconds: dict[int, list[float]] = {}
    self.error: Optional[BaseException] = None
    self.registry_server = None  # the learner's registry (gRPC server), stopped with the backend

  @property
  def num_servers(self) -> int:
    return len(self.clients)

  def _eligible(self) -> list[int]:
    with self._lock:
      return eligible(self.server_versions, self.published)

  @property
  def version(self) -> Optional[int]:
    """The oldest version held by a server that gets work (None before the first push lands)."""
    held = [self.server_versions[i] for i in self._eligible()]
    return None if any(v is None for v in held) else min(held)

  def submit(self, *requests: RolloutRequest) -> None:
    servers = self._eligible()
    by_server = collections.defaultdict(list)
    for r in requests:
      by_server[servers[next(self._turn) % len(servers)]].append(r)
    for i, rs in by_server.items():
      self.clients[i].submit(rs)

  def _push(self, i: int, version: int) -> None:
    try:
      reply = self.clients[i].update_weights(version, self.group.sources(version, i),
                                             timeout=self.push_timeout)
    except Exception as e:  # pylint: disable=broad-except
      self.error = RuntimeError(f"decode server {self.clients[i].address} failed to take weights "
                                f"v{version}: {e!r}")
      raise
    with self._lock:
      self.server_versions[i] = version  # (notices to one server go in version order)
      for p, n in enumerate(reply.source_bytes):
        self.bytes_by_source[p] += n
      pulls = self._pull_seconds.setdefault(version, [])
      pulls.append(reply.seconds)
      if len(pulls) == len(self.clients):
        self.transfer_seconds = max(pulls)
        del self._pull_seconds[version]

  def _wait(self, version: int) -> None:
    for f in self._pending.pop(version, []):
      try:
        f.result(timeout=self.push_timeout)
      except futures.TimeoutError as e:
        raise TimeoutError(f"a decode server did not pull weights v{version} within "
                           f"{self.push_timeout:.0f}s") from e

  def update_weights(self, learner_params, version: int) -> TransferStats:
    """Publishes ``version``; returns how long the learner was blocked (``seconds``)."""
    del learner_params  # every learner process offers its own blocks of them
    t = time.perf_counter()
    for old in [v for v in self._pending if v <= version - 2]:
      self._wait(old)
    self.group.offer(version, list(range(len(self.clients))))
    self._pending[version] = [self._pushers[i].submit(self._push, i, version)
                              for i in range(len(self.clients))]
    self.published = version
    return TransferStats(time.perf_counter() - t, 0)

  def wait_for_pulls(self, version: int) -> None:
    """Blocks until every server holds ``version`` (raises if one failed or timed out)."""
    self._wait(version)

  def wait_until_warm(self, timeout: float = 600.0) -> None:
    """Waits until no decode server is compiling (``rollout.warm_up``), so that RL starts on warm servers."""
    deadline = time.time() + timeout
    while any(c.health(timeout=30).status == "warming_up" for c in self.clients):
      if time.time() > deadline:  # not fatal: RL starts, and calls compile what they still lack
        log.warning("decode servers still compiling after %.0fs; starting anyway", timeout)
        return
      time.sleep(0.2)

  def decode_stats(self) -> DecodeStats:
    """Every decode server's counters (one ``Health`` call each), summed (``servers`` counts them;
    ``idle_seconds`` is summed too)."""
    replies = self._pool.map(lambda c: c.health(timeout=30), self.clients)
    return sum((protocol.stats_from_pb(r.stats) for r in replies), DecodeStats(servers=0))

  def _stream(self, client: RolloutClient) -> None:
    while not self._stop.is_set():
      try:
        for t in client.stream(timeout=None):
          self._on_trajectory(t)
          if self._stop.is_set():
            return
      except Exception as e:  # pylint: disable=broad-except
        if self._stop.is_set():
          return
        log.warning("stream from %s broke (%r); reconnecting", client.address, e)
        try:
          if client.health(timeout=10).status == "error":
            raise RuntimeError(f"decode server {client.address} reports an error")
        except Exception as health_error:  # pylint: disable=broad-except
          self.error = health_error
          return
        time.sleep(0.5)

  def start(self, on_trajectory: Callable[[Trajectory], None]) -> None:
    self._on_trajectory = on_trajectory
    for c in self.clients:
      th = threading.Thread(target=self._stream, args=(c,), daemon=True, name=f"stream-{c.address}")
      th.start()

  def stop(self) -> None:
    self._stop.set()
    for v in sorted(self._pending):  # let pulls under way finish: the senders must outlive them
      try:
        self._wait(v)
      except Exception as e:  # pylint: disable=broad-except
        log.warning("pull of weights v%d did not finish: %r", v, e)
    for c in self.clients:
      c.close()
    if self.registry_server is not None:
      self.registry_server.stop(grace=0)
    self._pool.shutdown(wait=False)
    for p in self._pushers:
      p.shutdown(wait=False)
