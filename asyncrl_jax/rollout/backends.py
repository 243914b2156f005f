"""Where the controller's rollouts run: decode servers in this process, or in other processes.

Both backends offer the same narrow interface to the main loop:
``submit(*requests)``, ``update_weights(learner_params, version) -> TransferStats``, ``version``,
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
from asyncrl_jax.transfer import TransferStats, WeightSender, local_transfer, uuid_for

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

  def submit(self, *requests: RolloutRequest) -> None:
    self.server.submit(*requests)

  def update_weights(self, learner_params, version: int) -> TransferStats:
    self.rollout_params, stats = local_transfer(learner_params, self.engine.param_shardings)
    self.server.update_weights(self.rollout_params, version)
    self.version = version
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


class RemoteRollout:
  """Decode servers in other processes, reached over the rollout gRPC service.

  Requests are spread round-robin; one streaming thread per server delivers trajectories (and
  reconnects if a stream breaks); new weights are offered once per server on this process's transfer
  server and pulled by each server in parallel.
  """

  def __init__(self, addresses: Sequence[str], *, transfer_host: str = "127.0.0.1", connect_timeout: float = 120.0):
    if not addresses:
      raise ValueError("RemoteRollout needs at least one decode server address")
    self.clients = [RolloutClient(a) for a in addresses]
    for c in self.clients:
      c.wait_ready(connect_timeout)
    self.sender = WeightSender(f"{transfer_host}:0")
    self._on_trajectory: Optional[Callable[[Trajectory], None]] = None
    self._next = itertools.cycle(range(len(self.clients)))
    self._stop = threading.Event()
    self._pool = futures.ThreadPoolExecutor(max_workers=len(self.clients))
    self.error: Optional[BaseException] = None
    self.version: Optional[int] = None  # of the weights last pushed to every server (None: none yet)

  def submit(self, *requests: RolloutRequest) -> None:
    by_server = collections.defaultdict(list)
    for r in requests:
      by_server[next(self._next)].append(r)
    for i, rs in by_server.items():
      self.clients[i].submit(rs)

  def update_weights(self, learner_params, version: int) -> TransferStats:
    t = time.perf_counter()
    uuids = [uuid_for(version, i) for i in range(len(self.clients))]
    self.sender.offer(learner_params, *uuids)
    replies = list(self._pool.map(
        lambda cu: cu[0].update_weights(version, self.sender.address, cu[1]), zip(self.clients, uuids)))
    self.version = version
    return TransferStats(time.perf_counter() - t, sum(r.bytes for r in replies))

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
    for c in self.clients:
      c.close()
    self._pool.shutdown(wait=False)
