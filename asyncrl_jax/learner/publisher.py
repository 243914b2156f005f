"""The learner's side of publishing weights to decode servers in other processes.

``WeightPublisher`` owns the block plan (which learner process offers which block of each parameter,
in the decode servers' serving dtypes: ``models.serving_dtypes``), this process's ``WeightSender``,
every learner process's sender address, and the offers: ``offer(version, uuids)`` has every learner
process offer its blocks of the current weights once per receiver (through the learner group's op,
so that all processes do it together), and ``sources(uuid)`` tells a receiver where to pull them. A
rollout backend sees only this interface (``weights.Publisher``): it asks for a version to be
offered to some servers and learns from each server that it now holds that version.

With LoRA (``model.lora``) the base weights are frozen, so a server that already holds them needs
only the adapters: an offer may be *partial* (the adapter blocks alone, ``partial_plan``), told to
the server with ``base_id``, this publisher's name for the base it sent in full. A server holding
another base (or none) refuses a partial notice, and gets the full weights.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax

from asyncrl_jax import models
from asyncrl_jax.models import lora
from asyncrl_jax.weights import new_uuid, shards
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
    # LoRA: the adapters' blocks alone, and the id of the frozen base (0: every leaf trains, no
    # partial offers). A new publisher (a new learner incarnation) names its base anew, so servers
    # get the full weights once from it.
    self.partial_leaves = adapter_leaves(learner.params) if learner.model_config.lora else frozenset()
    self.base_id = new_uuid() if self.partial_leaves else 0
    self.partial_plan = [(b, d) for b, d in self.planned if b.leaf in self.partial_leaves]
    self.partial_blocks = shards.blocks_by_process(self.partial_plan)
    self.sender = WeightSender(f"{transfer_host}:0")
    self.addresses = gather(self.sender.address)
    self._offer_op = offer_op

  def sources(self, uuid: int, partial: bool = False) -> list[Source]:
    """Where the receiver of offer ``uuid`` pulls from: one source per learner process that offers
    blocks (of the adapters alone when ``partial``)."""
    blocks = self.partial_blocks if partial else self.blocks
    return [Source(self.addresses[p], uuid, tuple(b)) for p, b in sorted(blocks.items())]

  def offer(self, version: int, uuids: Sequence[int], partial: Sequence[bool] = ()) -> None:
    """Every learner process offers its blocks of the weights of ``version`` (the current ones) once
    under each uuid (one per receiver: random, drawn by the caller, so that only a receiver told the
    uuid can pull); ``partial[i]``: uuid ``i`` gets the adapters alone. Returns once all have."""
    self._offer_op(version, uuids, self._flags(uuids, partial))

  def _flags(self, uuids: Sequence[int], partial: Sequence[bool]) -> list[bool]:
    flags = [bool(x) for x in partial] if len(partial) else [False] * len(uuids)
    if len(flags) != len(uuids):
      raise ValueError(f"{len(partial)} partial flags for {len(uuids)} uuids")
    if any(flags) and not self.base_id:
      raise ValueError("a partial (adapters-only) offer needs a LoRA model (model.lora.rank > 0)")
    return flags

  def offer_here(self, version: int, uuids: Sequence[int], partial: Sequence[bool] = ()) -> None:
    """This process's part of ``offer``."""
    if uuids:
      flags = self._flags(uuids, partial)
      self.learner.check_version(version, "the weight offer")
      full = [u for u, f in zip(uuids, flags) if not f]
      part = [u for u, f in zip(uuids, flags) if f]
      if full:
        self.sender.offer(self.learner.params, self.planned, *full)
      if part:
        self.sender.offer(self.learner.params, self.partial_plan, *part)


def adapter_leaves(params) -> frozenset:
  """Indices (in ``jax.tree.leaves`` order) of the LoRA adapter leaves of ``params``."""
  paths = [tuple(getattr(k, "key", k) for k in path)
           for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  return frozenset(i for i, path in enumerate(paths) if lora.is_adapter(path))
