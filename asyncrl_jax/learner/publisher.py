"""The learner's side of publishing weights to decode servers in other processes.

``WeightPublisher`` owns the block plan (which learner process offers which block of each parameter,
in the decode servers' serving dtypes: ``models.serving_dtypes``), this process's ``WeightSender``,
every learner process's sender address, and the offers: ``offer(version, uuids)`` has every learner
process offer its blocks of the current weights once per receiver (through the learner group's op,
so that all processes do it together), and ``sources(uuid)`` tells a receiver where to pull them. A
rollout backend sees only this interface (``weights.Publisher``): it asks for a version to be
offered to some servers and learns from each server that it now holds that version.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax

from asyncrl_jax import models
from asyncrl_jax.weights import shards
from asyncrl_jax.weights.remote import Source, WeightSender


class WeightPublisher:
  """``offer_op(version, uuids)``: runs ``offer_here`` on every learner process (the group's op);
  ``gather(address) -> addresses``: every process's sender address, in process order."""

  def __init__(self, learner, transfer_host: str, *, processes: int,
               gather: Callable[[str], list], offer_op: Callable[[int, Sequence[int]], None]):
    self.learner = learner
    self.processes = processes
    leaves = jax.tree.leaves(learner.params)
    # decode servers hold the weights in their serving dtypes (bfloat16 kernels): the cast is the
    # sender's, so half the bytes cross
    dtypes = jax.tree.leaves(models.serving_dtypes(learner.model_config))
    self.planned = shards.plan(leaves, [x.sharding for x in leaves], dtypes)
    self.blocks = shards.blocks_by_process(self.planned)
    self.sender = WeightSender(f"{transfer_host}:0")
    self.addresses = gather(self.sender.address)
    self._offer_op = offer_op

  def sources(self, uuid: int) -> list[Source]:
    """Where the receiver of offer ``uuid`` pulls from: one source per learner process that offers
    blocks."""
    return [Source(self.addresses[p], uuid, tuple(b)) for p, b in sorted(self.blocks.items())]

  def offer(self, version: int, uuids: Sequence[int]) -> None:
    """Every learner process offers its blocks of the weights of ``version`` (the current ones) once
    under each uuid (one per receiver: random, drawn by the caller, so that only a receiver told the
    uuid can pull); returns once all have."""
    self._offer_op(version, uuids)

  def offer_here(self, version: int, uuids: Sequence[int]) -> None:
    """This process's part of ``offer``."""
    if uuids:
      self.learner.check_version(version, "the weight offer")
      self.sender.offer(self.learner.params, self.planned, *uuids)
