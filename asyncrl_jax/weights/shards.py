"""Which shard of each parameter a learner process offers, and how a decode server reassembles them.

A learner sharded over P processes has no device, and no process, that holds the whole model. So the
weights travel shard by shard:

* ``plan(shapes, shardings)`` lists, for every leaf, each *distinct* block of the learner's layout once
  (a ``Block``: the leaf's index in ``jax.tree.leaves`` order and its ``[start, stop)`` per dimension)
  and the device that offers it. Where several devices hold the same block (replication), one of them
  offers it, chosen by the leaf's index so that replicated leaves spread over the processes. Every
  process computes the same plan from the global shardings, so no process needs to ask another.
* ``assemble(pieces, shape, target)`` builds one leaf in the decode server's own layout from the
  blocks it pulled, on its local devices only: each target device gets the parts of the blocks that
  overlap its own index (sliced where a block is larger, moved device to device where it landed
  elsewhere, concatenated where several blocks make up its index). Slicing and concatenation are
  exact, so the result equals the learner's array bit for bit.

Both are plain JAX in one process; ``transfer.remote`` moves the blocks between processes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

Index = tuple[tuple[int, int], ...]  # [start, stop) per dimension


@dataclasses.dataclass(frozen=True)
class Block:
  """One distinct shard of one leaf: ``leaf`` indexes ``jax.tree.leaves(params)``; ``dtype`` is the
  dtype it travels in (the decode server's serving dtype; "" for the leaf's own)."""
  leaf: int
  index: Index
  dtype: str = ""

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(b - a for a, b in self.index)


def normalize(index: Sequence[slice], shape: Sequence[int]) -> Index:
  """``(slice(None), slice(0, 4))`` -> ``((0, n0), (0, 4))``: explicit bounds per dimension."""
  out = []
  for s, n in zip(index, shape):
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f"shard index {index} has step {step}; only contiguous shards are supported")
    out.append((start, stop))
  return tuple(out)


def plan(shapes: Sequence[Any], shardings: Sequence[jax.sharding.Sharding],
         dtypes: Optional[Sequence[Any]] = None) -> list[tuple[Block, jax.Device]]:
  """Every distinct block of every leaf once, with the device that offers it.

  ``shapes``: the leaves (anything with ``.shape``), in ``jax.tree.leaves`` order; ``shardings``: their
  global shardings; ``dtypes``: the dtype each leaf travels in (None: as it is; the learner passes
  ``models.serving_dtypes`` so that a bfloat16 decode server is sent bfloat16). Deterministic: the
  same in every process.
  """
  if len(shapes) != len(shardings) or (dtypes is not None and len(dtypes) != len(shapes)):
    raise ValueError(f"{len(shapes)} leaves but {len(shardings)} shardings"
                     + ("" if dtypes is None else f" and {len(dtypes)} dtypes"))
  out = []
  for leaf, (x, sharding) in enumerate(zip(shapes, shardings)):
    dtype = "" if dtypes is None else str(jax.numpy.dtype(dtypes[leaf]))
    holders: dict[Index, list[jax.Device]] = {}
    for device, index in sharding.devices_indices_map(tuple(x.shape)).items():
      holders.setdefault(normalize(index, x.shape), []).append(device)
    for index in sorted(holders):
      devices = sorted(holders[index], key=lambda d: d.id)
      out.append((Block(leaf, index, dtype), devices[leaf % len(devices)]))
  return out


def blocks_by_process(planned: Sequence[tuple[Block, jax.Device]]) -> dict[int, list[Block]]:
  """The plan's blocks grouped by the process that offers them (in plan order)."""
  out: dict[int, list[Block]] = {}
  for block, device in planned:
    out.setdefault(device.process_index, []).append(block)
  return out


def blocks_to_json(blocks: Sequence[Block]) -> str:
  return json.dumps([[b.leaf, [list(r) for r in b.index], b.dtype] for b in blocks])


def blocks_from_json(text: str) -> list[Block]:
  try:
    out = []
    for leaf, index, *dtype in json.loads(text):
      if len(dtype) > 1 or not all(isinstance(d, str) for d in dtype):
        raise ValueError(f"block of leaf {leaf} has extra fields {dtype}")
      out.append(Block(int(leaf), tuple((int(a), int(b)) for a, b in index), *dtype))
    return out
  except (ValueError, TypeError) as e:
    raise ValueError(f"malformed block list {text[:200]!r}: {e}") from e


def local_shards(leaves: Sequence[jax.Array], planned: Sequence[tuple[Block, jax.Device]]
                 ) -> list[jax.Array]:
  """This process's blocks of ``leaves``, in plan order, as single-device copies in each block's dtype
  (the learner donates its buffers to the next update while pulls may still be pending, so the offer
  must own its own: a cast is a new buffer, and a block in its leaf's dtype is copied)."""
  out = []
  for block, device in planned:
    if device.process_index != jax.process_index():
      continue
    shard = next(s for s in leaves[block.leaf].addressable_shards if s.device == device).data
    if block.dtype and shard.dtype != jax.numpy.dtype(block.dtype):
      out.append(shard.astype(block.dtype))
    else:
      out.append(jax.device_put(shard, device, may_alias=False))
  return out


def _intersect(a: Index, b: Index):
  out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
  return None if any(lo >= hi for lo, hi in out) else out


def _tile(parts: list, dim: int = 0) -> jax.Array:
  """Concatenates parts that tile a box (a grid of ``(index, array)``) into one array."""
  if len(parts) == 1:
    return parts[0][1]
  starts = sorted({index[dim][0] for index, _ in parts})
  if len(starts) == 1:
    return _tile(parts, dim + 1)
  rows = [_tile([p for p in parts if p[0][dim][0] == s], dim + 1) for s in starts]
  return jnp.concatenate(rows, axis=dim)


def landing_device(block: Block, shape: Sequence[int], target: jax.sharding.Sharding) -> jax.Device:
  """The local device a block is best pulled onto: the first of ``target``'s devices whose index
  overlaps it (so most of it needs no further copy)."""
  for device, index in target.addressable_devices_indices_map(tuple(shape)).items():
    if _intersect(normalize(index, shape), block.index) is not None:
      return device
  raise ValueError(f"block {block.index} of leaf {block.leaf} lies outside the array's shape {tuple(shape)}")


def assemble(pieces: Sequence[tuple[Index, jax.Array]], shape: Sequence[int],
             target: jax.sharding.Sharding) -> jax.Array:
  """One leaf on ``target`` (addressable here) from blocks that together cover it exactly once.
  Each distinct target shard is built once, on its first device, and copied to its replicas."""
  shape = tuple(shape)
  built: dict[Index, jax.Array] = {}
  per_device = []
  for device, index in target.addressable_devices_indices_map(shape).items():
    want = normalize(index, shape)
    if want in built:
      per_device.append(jax.device_put(built[want], device))
      continue
    parts = []
    for have, x in pieces:
      overlap = _intersect(want, have)
      if overlap is None:
        continue
      if overlap != have:
        x = x[tuple(slice(lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(overlap, have))]
      parts.append((overlap, x if x.devices() == {device} else jax.device_put(x, device)))
    covered = sum(math.prod(hi - lo for lo, hi in o) for o, _ in parts)
    if covered != math.prod(hi - lo for lo, hi in want):
      raise ValueError(f"the pulled blocks cover {covered} of the {math.prod(hi - lo for lo, hi in want)} "
                       f"elements of shard {want} of an array of shape {shape}")
    built[want] = _tile(parts)
    per_device.append(built[want])
  return jax.make_array_from_single_device_arrays(shape, target, per_device)
