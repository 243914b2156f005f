"""The rollout backend's interface: where the controller's rollouts run and how the main loop drives
them. Two implementations, both complete: ``rollout.local.LocalRollout`` (one decode server in this
process, weights by ``jax.device_put``) and ``rollout.remote.RemoteRollout`` (decode servers in other
processes, weights pulled shard to shard from the learner's publisher).

A backend is built first, the controller on top of it (``submit``), and ``start`` then names where
finished trajectories go: no construction cycle. ``version`` is the version of the weights last
handed to the decode servers: it lags the learner's while a push is under way, and admission counts
with it, so a rollout admitted "at version v" never starts under older weights.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, runtime_checkable

from asyncrl_jax.rl.trajectory import RolloutRequest, Trajectory
from asyncrl_jax.rollout.stats import DecodeStats
from asyncrl_jax.weights import TransferStats


@dataclasses.dataclass(frozen=True)
class BackendReport:
  """What happened to the decode servers over a run, for ``summary.json``.

  ``faults``: counts by kind (``servers_lost``, ``servers_joined``, ``requests_reassigned``,
  ``push_retries``...); ``events``: one record per server event (``event``, ``server_id``,
  ``address``, ``time``, ``detail``); ``bytes_by_source``: weight bytes pulled from each learner
  process over the run (empty where weights do not cross processes); ``publishes``: the completed
  pulls and their bytes, of the full weights and of partial ones (LoRA adapters alone):
  ``{"full": n, "partial": n, "full_bytes": b, "partial_bytes": b}`` (empty where weights do not
  cross processes); ``sandboxes``: per decode server process that runs model-written code, how
  (``envs.sandbox_status`` as it registered: ``sandboxed``, ``why``; empty in one process, where the
  run's own ``python_tool_sandbox`` says it)."""
  faults: dict = dataclasses.field(default_factory=dict)
  events: list = dataclasses.field(default_factory=list)
  bytes_by_source: list = dataclasses.field(default_factory=list)
  publishes: dict = dataclasses.field(default_factory=dict)
  sandboxes: dict = dataclasses.field(default_factory=dict)


@runtime_checkable
class RolloutBackend(Protocol):
  """What the main loop calls on the decode servers, and nothing more."""

  @property
  def version(self) -> Optional[int]:
    """The weights' version last handed to the decode servers (None: none yet)."""

  @property
  def num_servers(self) -> int:
    """Decode servers that take work now."""

  @property
  def transfer_seconds(self) -> float:
    """Wall time of the newest version's slowest delivery to a decode server."""

  @property
  def error(self) -> Optional[BaseException]:
    """Set when the backend can go on no longer (the main loop stops the run with it)."""

  def submit(self, *requests: RolloutRequest) -> None:
    """Queues requests; their trajectories come back through ``start``'s callback."""

  def locate(self, ids) -> dict:
    """Request id -> the server that holds it (for messages about late rollouts)."""

  def maintain(self) -> None:
    """From the main loop between versions: servers that joined get the current weights, failed
    deliveries are retried."""

  def update_weights(self, learner_params, version: int) -> TransferStats:
    """Publishes ``version``; ``seconds``: how long the learner was blocked."""

  def wait_until_warm(self, timeout: float = 600.0) -> None:
    """Waits until no decode server is compiling in the background."""

  def decode_stats(self) -> DecodeStats:
    """The decode servers' cumulative counters, summed."""

  def report(self) -> BackendReport:
    """Faults, events and bytes per learner process so far."""

  def local_params(self):
    """The decode server's copy of the current weights when it is in this process (the held-out
    evaluation decodes with it instead of making another), else None."""

  def start(self, on_trajectory: Callable[[Trajectory], None]) -> None:
    """Starts delivering finished trajectories to ``on_trajectory``."""

  def stop(self) -> None:
    """Stops the servers' work and what the backend owns (threads, clients, the registry)."""
