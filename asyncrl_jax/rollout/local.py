"""One decode server in this process: a ``RolloutBackend`` (``rollout.backend``) whose weights move
with ``jax.device_put`` (with LoRA, the adapters alone after the first copy: the base is frozen)."""

from __future__ import annotations

import logging
from typing import Callable

from flax import traverse_util

from asyncrl_jax import models
from asyncrl_jax.models import lora
from asyncrl_jax.rl.trajectory import RolloutRequest, Trajectory
from asyncrl_jax.rollout.backend import BackendReport
from asyncrl_jax.rollout.decode_loop import DecodeServer
from asyncrl_jax.rollout.engine import Engine
from asyncrl_jax.rollout.stats import DecodeStats
from asyncrl_jax.weights import TransferStats, local_transfer

log = logging.getLogger(__name__)


class LocalRollout:
  """One decode server on this process's rollout mesh; weights move with ``jax.device_put``."""

  def __init__(self, engine: Engine, learner_params, version: int, *,
               on_weight_update: str = "recompute", env_workers: int = 8, env_timeout: float = 60.0):
    self.engine = engine
    params, _ = self._transfer(learner_params)
    self.server = DecodeServer(engine, params, version=version, server_id="decode-0",
                               on_weight_update=on_weight_update, env_workers=env_workers,
                               env_timeout=env_timeout)
    self.rollout_params = params
    self.version = version  # of the weights last handed to the decode server (lags the learner's)
    self.transfer_seconds = 0.0
    self.num_servers = 1

  def _transfer(self, learner_params):
    """The learner's weights cast to the serving dtypes on the learner's mesh (a new buffer, so the
    learner may donate its own), then copied onto the rollout mesh: the bytes moved are the served
    ones."""
    return local_transfer(models.serving_params(self.engine.config, learner_params),
                          self.engine.param_shardings)

  def submit(self, *requests: RolloutRequest) -> None:
    self.server.submit(*requests)

  def locate(self, ids) -> dict:
    return {i: self.server.server_id for i in ids}

  def maintain(self) -> None:
    """(Nothing to do: one server, in this process.)"""

  def _transfer_adapters(self, learner_params):
    """LoRA: the adapters alone cast and copied onto the rollout mesh, over the frozen base this
    server already holds (its own copy, made by the first transfer)."""
    held = traverse_util.flatten_dict(self.rollout_params)
    dtypes = traverse_util.flatten_dict(models.serving_dtypes(self.engine.config))
    shardings = traverse_util.flatten_dict(self.engine.param_shardings)
    adapters = {k: v.astype(dtypes[k]) for k, v in traverse_util.flatten_dict(learner_params).items()
                if lora.is_adapter(k)}
    moved, stats = local_transfer(adapters, {k: shardings[k] for k in adapters})
    return traverse_util.unflatten_dict(held | moved), stats

  def update_weights(self, learner_params, version: int) -> TransferStats:
    if self.engine.config.lora:  # the base is frozen: only the adapters move
      self.rollout_params, stats = self._transfer_adapters(learner_params)
    else:
      self.rollout_params, stats = self._transfer(learner_params)
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

  def local_params(self):
    return self.rollout_params

  def report(self) -> BackendReport:
    """(No faults to report: the server is this process; no bytes cross processes.)"""
    return BackendReport()

  def start(self, on_trajectory: Callable[[Trajectory], None]) -> None:
    self.server.stream_to(on_trajectory)
    self.server.start()

  def stop(self) -> None:
    self.server.stop()
