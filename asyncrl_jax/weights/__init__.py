"""Moving new weights from the learner to decode servers.

One interface, two implementations:

* in one process (learner and rollout meshes on the same host): ``local_transfer``, a ``jax.device_put``
  onto the rollout sharding;
* between processes / slices: ``remote.WeightSender`` (one per learner process) offers its shards of a
  version under a uuid per receiver with ``jax.experimental.transfer``'s ``await_pull``; each
  ``remote.WeightReceiver`` (decode server) pulls from every learner process and assembles its own
  layout. The control message (version; per learner process its address, uuid and blocks) travels
  separately, over the rollout gRPC service.

The transfer maps source buffers to destination buffers one to one (jax 0.10.2: a pull whose
destination has more shards per array than the source fails with "Buffer id ... out of range", or
hangs). So the weights move shard by shard (``transfer.shards``): each learner process offers its own
distinct shards as single-device arrays, a decode server pulls each one onto one of its local devices
and reassembles every leaf in its own layout there. No device on either side ever holds a whole array
it does not hold in its own layout. ``transfer.remote`` keeps the older staged path (everything
gathered onto one device at each end) for the benchmark that compares the two.

Every transfer reports its wall time and bytes moved.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any, Protocol, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class TransferStats:
  seconds: float
  bytes: int
  buffers: tuple = ()  # shapes of the buffers that crossed between processes (empty: in one process)
  per_source: tuple = ()  # bytes from each sending process, in the order the sources were given

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


def new_uuid() -> int:
  """A fresh transfer uuid: random (not derived from the version), so that the transfer server,
  which has no authentication of its own, serves only a puller told the uuid by the control plane."""
  return secrets.randbits(62) + 1


class Publisher(Protocol):
  """What a rollout backend needs of the learner's weight publishing (``learner.publisher``
  implements it): the number of learner processes, an offer of the current weights (``version``)
  under one uuid per receiving server, and where the receiver of a uuid pulls from (the
  ``remote.Source`` list it is told). With a frozen base (LoRA), ``base_id`` names it (0: none) and
  an offer may be partial: the adapters alone, for a server that holds that base."""

  processes: int
  base_id: int

  def offer(self, version: int, uuids: Sequence[int], partial: Sequence[bool] = ()) -> None:
    ...

  def sources(self, uuid: int, partial: bool = False) -> list:
    ...
