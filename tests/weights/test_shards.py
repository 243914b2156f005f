"""Shard-to-shard planning and reassembly in one process (8 virtual devices): every distinct block is
offered once, and any layout reassembles into any other bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from asyncrl_jax import models

from asyncrl_jax.infra import sharding
from asyncrl_jax.weights import shards
from tests.fixtures.helpers import sharp_params

CFG = models.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64)


def _mesh(devices, **shape):
  return sharding.make_mesh(devices, {"data": 1, "fsdp": 1, "tensor": 1, **shape})


def _move(params, target_mesh):
  """What a decode server does with the blocks of ``plan``: each pulled onto its landing device,
  then assembled onto the server's shardings."""
  leaves, treedef = jax.tree.flatten(params)
  targets = jax.tree.leaves(models.param_shardings(CFG, target_mesh))
  planned = shards.plan(leaves, [x.sharding for x in leaves])
  pieces = {}
  for block, device in planned:
    shard = next(s for s in leaves[block.leaf].addressable_shards if s.device == device)
    assert shard.data.shape == block.shape  # every offered buffer is one shard
    landed = jax.device_put(shard.data, shards.landing_device(block, leaves[block.leaf].shape,
                                                             targets[block.leaf]))
    pieces.setdefault(block.leaf, []).append((block.index, landed))
  return planned, treedef.unflatten([shards.assemble(pieces[i], x.shape, t)
                                     for i, (x, t) in enumerate(zip(leaves, targets))])


@pytest.mark.slow(47)
@pytest.mark.parametrize("source,target", [
    (dict(fsdp=4), dict(tensor=2)),  # more source blocks than target devices
    (dict(fsdp=2), dict(tensor=2)),  # the twin's unlike layouts
    (dict(fsdp=2, tensor=2), dict(fsdp=4)),
    (dict(tensor=2), dict(fsdp=2, tensor=2)),  # fewer source blocks: some are split on arrival
])
def test_any_layout_reassembles_into_any_other_bit_for_bit(source, target):
  devices = jax.devices()
  src_mesh = _mesh(devices[:int(np.prod(list(source.values())))], **source)
  params = sharp_params(CFG, 3, mesh=src_mesh)
  dst_mesh = _mesh(devices[4:4 + int(np.prod(list(target.values())))], **target)
  planned, moved = _move(params, dst_mesh)
  for x, y, t in zip(jax.tree.leaves(params), jax.tree.leaves(moved),
                     jax.tree.leaves(models.param_shardings(CFG, dst_mesh))):
    assert y.sharding == t
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  # each distinct block once: the offered elements add up to the model, not to a multiple of it
  assert sum(int(np.prod(b.shape)) for b, _ in planned) == sum(x.size for x in jax.tree.leaves(params))


def test_a_replicated_leaf_is_offered_once_and_replicas_spread_over_devices():
  mesh = _mesh(jax.devices()[:4], data=4)
  leaves = [jax.device_put(jnp.arange(6.0 * k), NamedSharding(mesh, P())) for k in range(1, 5)]
  planned = shards.plan(leaves, [x.sharding for x in leaves])
  assert [b.leaf for b, _ in planned] == [0, 1, 2, 3]
  assert [b.index for b, _ in planned] == [((0, 6 * k),) for k in range(1, 5)]
  assert len({d for _, d in planned}) == 4  # leaf i from replica i % 4, not all from the first device


def test_a_missing_block_is_named_not_filled():
  mesh = _mesh(jax.devices()[:2], fsdp=2)
  x = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("fsdp")))
  (b0, d0), _ = shards.plan([x], [x.sharding])
  target = NamedSharding(_mesh(jax.devices()[2:3]), P())
  half = next(s.data for s in x.addressable_shards if s.device == d0)
  with pytest.raises(ValueError, match=r"cover 4 of the 8 elements"):
    shards.assemble([(b0.index, half)], x.shape, target)


def test_blocks_round_trip_through_json_and_bad_text_is_named():
  blocks = [shards.Block(3, ((0, 4), (2, 6))), shards.Block(0, ()), shards.Block(1, ((0, 2),), "bfloat16")]
  assert shards.blocks_from_json(shards.blocks_to_json(blocks)) == blocks
  assert shards.blocks_from_json('[[1, [[0, 2]]]]') == [shards.Block(1, ((0, 2),))]  # no dtype: as is
  with pytest.raises(ValueError, match="extra fields"):
    shards.blocks_from_json('[[1, [[0, 2]], "bfloat16", 3]]')
  with pytest.raises(ValueError, match="malformed block list"):
    shards.blocks_from_json('[[1, "x"]]')
