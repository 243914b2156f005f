"""Moving new weights from the learner to decode servers.

One interface, two implementations:

* in one process (learner and rollout meshes on the same host): ``local_transfer``, a ``jax.device_put``
  onto the rollout sharding;
* between processes / slices: ``WeightSender`` (learner) offers a version under a uuid with
  ``jax.experimental.transfer``'s ``await_pull``; each ``WeightReceiver`` (decode server) pulls it and
  places it on its own sharding. The control message (version, sender address, uuid) travels
  separately, over the rollout gRPC service.

The transfer maps source shards to destination shards one to one (jax 0.10.2: a pull whose destination
has more shards per array than the source fails with "Buffer id ... out of range", or hangs). Both ends
therefore stage through one device: the sender gathers each array onto its first local device, the
receiver pulls onto its first local device and then broadcasts onto its mesh with ``device_put``.
That costs a gather on the learner and a local broadcast on the decode server; moving shard to shard
between matching layouts is the faster path to build when the two meshes are known to agree.

Every transfer reports its wall time and bytes moved.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
from jax.experimental import transfer as jax_transfer


@dataclasses.dataclass(frozen=True)
class TransferStats:
  seconds: float
  bytes: int

  @property
  def gbytes_per_s(self) -> float:
    return self.bytes / max(self.seconds, 1e-9) / 1e9


def tree_bytes(tree: Any) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def local_transfer(params: Any, shardings: Any) -> tuple[Any, TransferStats]:
  """Copies ``params`` onto ``shardings`` (e.g. the rollout mesh) and waits for the copy.

  Always a copy, even where source and destination shardings coincide (colocated roles, one device):
  the learner donates its parameter buffers to the next update, and the copy must outlive that.
  """
  t = time.perf_counter()
  out = jax.block_until_ready(jax.device_put(params, shardings, may_alias=False))
  return out, TransferStats(time.perf_counter() - t, tree_bytes(params))


# Bulk-transport sockets per server. Both ends must use the same number: a sender with more bulk
# sockets than its receiver crashes the receiver's transport (seen with jax 0.10.2 on CPU).
NUM_BULK_TRANSPORTS = 2


def _start_server(address: str):
  host = address.rsplit(":", 1)[0]
  client = jax.local_devices()[0].client
  return jax_transfer.start_transfer_server(client, address, [f"{host}:0"] * NUM_BULK_TRANSPORTS)


class WeightSender:
  """Learner side: offers parameter versions for remote pulls. Binds 127.0.0.1 unless told otherwise."""

  def __init__(self, address: str = "127.0.0.1:0"):
    self._server = _start_server(address)

  @property
  def address(self) -> str:
    return self._server.address()

  def offer(self, params: Any, *uuids: int) -> None:
    """Makes ``params`` pullable once under each ``uuid`` (one per receiver and version); the staging
    copy onto one device is made once for all of them (a copy even where the learner's buffers are
    already there: those are donated to the next update while a pull may still be pending)."""
    staged = jax.device_put(params, jax.local_devices()[0], may_alias=False)
    for uuid in uuids:
      self._server.await_pull(int(uuid), staged)


class WeightReceiver:
  """Decode-server side: pulls offered parameters into the local sharding given by ``like``."""

  def __init__(self, address: str = "127.0.0.1:0"):
    self._server = _start_server(address)
    self._connections: dict[str, Any] = {}

  def pull(self, sender_address: str, uuid: int, like: Any) -> tuple[Any, TransferStats]:
    """``like``: a pytree of ``jax.ShapeDtypeStruct`` with shardings (or arrays to mimic)."""
    staging = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=staging), like)
    if sender_address not in self._connections:
      self._connections[sender_address] = self._server.connect(sender_address)
    t = time.perf_counter()
    pulled = self._connections[sender_address].pull(int(uuid), spec)
    out = jax.block_until_ready(jax.device_put(pulled, jax.tree.map(lambda x: x.sharding, like)))
    return out, TransferStats(time.perf_counter() - t, tree_bytes(out))


def uuid_for(version: int, receiver: int) -> int:
  """A distinct uuid per (version, receiver)."""
  return version * 4096 + receiver + 1
