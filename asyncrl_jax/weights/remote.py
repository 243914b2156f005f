"""Weights between processes over ``jax.experimental.transfer``: learner processes offer, decode servers pull.

Shard to shard (what the main job uses):

* every learner process runs a ``WeightSender`` and offers *its* blocks of the plan
  (``shards.plan``) as single-device arrays, once per receiver under that receiver's uuid;
* a decode server's ``WeightReceiver.pull`` takes one ``Source`` per learner process (its transfer
  address, the uuid and the blocks it offers), pulls each block onto the local device that needs it
  (``shards.landing_device``), and assembles every leaf in the server's own layout.

Every offered and every pulled buffer has the shape of one block, and the pulled bytes from each
learner process are what it offered: the weights are spread over the learner processes the way the
learner's layout spreads them.

``offer_staged`` / ``pull_staged`` are the older path, staged through one device on each side (a
gather on the learner, a broadcast on the server), kept for ``benchmarks/transfer.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from concurrent import futures
from typing import Any, Sequence

import jax
from jax.experimental import transfer as jax_transfer

from asyncrl_jax.weights import TransferStats, tree_bytes, shards

# Bulk-transport sockets per server. Both ends must use the same number: a sender with more bulk
# sockets than its receiver crashes the receiver's transport (seen with jax 0.10.2 on CPU).
NUM_BULK_TRANSPORTS = 2


def _start_server(address: str):
  host = address.rsplit(":", 1)[0]
  client = jax.local_devices()[0].client
  return jax_transfer.start_transfer_server(client, address, [f"{host}:0"] * NUM_BULK_TRANSPORTS)


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one learner process offers its blocks of a version for one receiver."""
  address: str
  uuid: int
  blocks: tuple[shards.Block, ...]


class WeightSender:
  """One learner process's side: offers its blocks for remote pulls. Binds 127.0.0.1 unless told
  otherwise."""

  def __init__(self, address: str = "127.0.0.1:0"):
    self._server = _start_server(address)

  @property
  def address(self) -> str:
    return self._server.address()

  def offer(self, params: Any, planned: Sequence[tuple[shards.Block, jax.Device]], *uuids: int
            ) -> tuple[int, list[tuple[int, ...]]]:
    """Offers this process's blocks of ``params`` once under each uuid (one per receiver); returns the
    bytes offered per uuid and the offered buffers' shapes. The blocks are copied once for all uuids."""
    mine = shards.local_shards(jax.tree.leaves(params), planned)
    if mine:
      for uuid in uuids:
        self._server.await_pull(int(uuid), mine)
    return sum(x.nbytes for x in mine), [tuple(x.shape) for x in mine]

  def offer_staged(self, params: Any, *uuids: int) -> None:
    """The staged path: the whole tree gathered onto this process's first device, offered whole."""
    staged = jax.device_put(params, jax.local_devices()[0], may_alias=False)
    for uuid in uuids:
      self._server.await_pull(int(uuid), staged)


def _check_blocks(sources: Sequence[Source], leaves: Sequence[Any]) -> None:
  for src in sources:
    for b in src.blocks:
      if not 0 <= b.leaf < len(leaves):
        raise ValueError(f"learner process at {src.address} offers leaf {b.leaf}, but this server's "
                         f"model has {len(leaves)} parameter arrays")
      shape = tuple(leaves[b.leaf].shape)
      if len(b.index) != len(shape) or any(not 0 <= lo < hi <= n for (lo, hi), n in zip(b.index, shape)):
        raise ValueError(f"learner process at {src.address} offers block {b.index} of leaf {b.leaf}, "
                         f"which does not fit this server's shape {shape} (do the model configs agree?)")
      if b.dtype and jax.numpy.dtype(b.dtype) != leaves[b.leaf].dtype:
        raise ValueError(f"learner process at {src.address} offers leaf {b.leaf} in {b.dtype}, but this "
                         f"server holds it in {leaves[b.leaf].dtype} (do the model configs' dtype and "
                         f"param_dtype agree?)")


def _check_kept(keep: Any, leaves: Sequence[Any], treedef, offered: set) -> dict:
  """The leaves of ``keep`` that no source offers, by index; checks that they fit ``leaves``."""
  if keep is None:
    return {}
  kept, kept_def = jax.tree.flatten(keep)
  if kept_def != treedef:
    raise ValueError("the weights kept for a partial pull are not laid out like this server's model")
  out = {}
  for i, (k, x) in enumerate(zip(kept, leaves)):
    if i in offered:
      continue
    if tuple(k.shape) != tuple(x.shape) or k.dtype != x.dtype:
      raise ValueError(f"leaf {i} kept for a partial pull is {k.dtype}{list(k.shape)}, but this server "
                       f"holds it as {x.dtype}{list(x.shape)}")
    out[i] = k
  return out


class WeightReceiver:
  """Decode-server side: pulls offered parameters into the local layout given by ``like``."""

  def __init__(self, address: str = "127.0.0.1:0"):
    self._server = _start_server(address)
    self._connections: dict[str, Any] = {}

  def _connect(self, address: str):
    if address not in self._connections:
      self._connections[address] = self._server.connect(address)
    return self._connections[address]

  def forget(self, address: str) -> None:
    """Drops the connection to ``address`` (after a failed pull: a restarted sender is a new peer)."""
    self._connections.pop(address, None)

  def pull(self, sources: Sequence[Source], like: Any, keep: Any = None) -> tuple[Any, TransferStats]:
    """Pulls every source's blocks (in parallel, one thread per learner process) and assembles them
    onto ``like``'s shardings (a pytree of ``jax.ShapeDtypeStruct`` with shardings, or arrays).

    ``keep``: arrays laid out like ``like`` (the weights held now) whose leaves stand in for the ones
    no source offers (a partial offer: LoRA adapters alone over a frozen base); without it every leaf
    must be offered."""
    leaves, treedef = jax.tree.flatten(like)
    _check_blocks(sources, leaves)
    kept = _check_kept(keep, leaves, treedef, {b.leaf for src in sources for b in src.blocks})
    t = time.perf_counter()

    def one(src: Source):
      specs = [jax.ShapeDtypeStruct(b.shape, leaves[b.leaf].dtype, sharding=jax.sharding.SingleDeviceSharding(
          shards.landing_device(b, leaves[b.leaf].shape, leaves[b.leaf].sharding))) for b in src.blocks]
      return jax.block_until_ready(self._connect(src.address).pull(int(src.uuid), specs))

    with futures.ThreadPoolExecutor(max_workers=max(len(sources), 1)) as pool:
      pulled = list(pool.map(one, sources))
    by_leaf = collections.defaultdict(list)
    for src, arrays in zip(sources, pulled):
      for b, x in zip(src.blocks, arrays):
        by_leaf[b.leaf].append((b.index, x))
    out = [kept[i] if i in kept else shards.assemble(by_leaf[i], x.shape, x.sharding)
           for i, x in enumerate(leaves)]
    out = jax.block_until_ready(treedef.unflatten(out))
    arrays = [x for group in pulled for x in group]
    return out, TransferStats(time.perf_counter() - t, sum(x.nbytes for x in arrays),
                              tuple(tuple(x.shape) for x in arrays),
                              tuple(sum(x.nbytes for x in group) for group in pulled))

  def pull_staged(self, sender_address: str, uuid: int, like: Any) -> tuple[Any, TransferStats]:
    """The staged path: the whole tree pulled onto the first local device, then placed on ``like``."""
    staging = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=staging), like)
    t = time.perf_counter()
    pulled = self._connect(sender_address).pull(int(uuid), spec)
    out = jax.block_until_ready(jax.device_put(pulled, jax.tree.map(lambda x: x.sharding, like)))
    return out, TransferStats(time.perf_counter() - t, tree_bytes(out))
