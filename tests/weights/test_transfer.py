"""Weight transfer in one process: learner mesh -> rollout mesh, values and placement preserved; the
remote path's cast to the serving dtypes (a sender and a receiver in this process)."""

import jax
import numpy as np
import pytest

from asyncrl_jax import models

from asyncrl_jax.infra import sharding
from asyncrl_jax.weights import local_transfer, tree_bytes, new_uuid, shards
from asyncrl_jax.weights.remote import Source, WeightReceiver, WeightSender

CFG = models.ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=32)


def test_local_transfer_moves_to_the_rollout_sharding():
  rollout_devices, learner_devices = sharding.split_devices(jax.devices(), 0.75)
  learner = sharding.make_mesh(learner_devices, dict(data=1, fsdp=-1, tensor=1))
  rollout = sharding.make_mesh(rollout_devices, dict(data=-1, fsdp=1, tensor=1))
  params = models.init_params(CFG, jax.random.key(0), mesh=learner)
  assert not params["layer_0"]["mlp"]["up"].sharding.is_fully_replicated  # fsdp-split on the learner
  moved, stats = local_transfer(params, models.param_shardings(CFG, rollout))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(moved)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert b.sharding.mesh == rollout and set(b.devices()) == set(rollout_devices)
  assert stats.bytes == tree_bytes(params) == 4 * models.count_params(params)
  assert stats.seconds > 0


def test_local_transfer_copies_even_onto_the_same_sharding():
  # Colocated roles: the destination sharding equals the source's. The learner donates its buffers to
  # the next update, so the transferred weights must not share them.
  mesh = sharding.make_mesh(jax.devices()[:2], dict(data=1, fsdp=-1, tensor=1))
  shardings = models.param_shardings(CFG, mesh)
  params = models.init_params(CFG, jax.random.key(0), mesh=mesh)
  want = jax.device_get(params)
  moved, _ = local_transfer(params, shardings)
  for leaf in jax.tree.leaves(params):
    leaf.delete()  # what a donating update does to the learner's copy
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(moved)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_uuids_are_random_positive_and_fit_the_wire():
  ids = [new_uuid() for _ in range(1000)]
  assert len(set(ids)) == 1000 and min(ids) > 0 and max(ids) < 2 ** 63  # (the notice's int64)
  assert max(ids) > 2 ** 55  # not small counters: drawn from 62 bits


def _offer_bf16(sender, uuid):
  """A bfloat16-compute model on an fsdp=2 learner mesh, its blocks planned in the serving dtypes and
  offered: (config, learner params, sources)."""
  cfg = CFG.replace(dtype="bfloat16")
  learner = sharding.make_mesh(jax.devices()[:2], dict(data=1, fsdp=2, tensor=1))
  params = models.init_params(cfg, jax.random.key(0), mesh=learner)
  leaves = jax.tree.leaves(params)
  planned = shards.plan(leaves, [x.sharding for x in leaves], jax.tree.leaves(models.serving_dtypes(cfg)))
  sender.offer(params, planned, uuid)
  return cfg, params, [Source(sender.address, uuid, tuple(b))
                       for _, b in sorted(shards.blocks_by_process(planned).items())]


def test_the_sender_casts_to_the_serving_dtypes_and_half_the_bytes_cross():
  sender, receiver = WeightSender(), WeightReceiver()
  cfg, params, sources = _offer_bf16(sender, 11)
  rollout = sharding.make_mesh(jax.devices()[2:4], dict(data=1, fsdp=1, tensor=2))
  like = jax.tree.map(lambda a, dt, s: jax.ShapeDtypeStruct(a.shape, dt, sharding=s),
                      models.abstract_params(cfg), models.serving_dtypes(cfg), models.param_shardings(cfg, rollout))
  pulled, stats = receiver.pull(sources, like)
  want = models.serving_params(cfg, params)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(pulled)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert stats.bytes == tree_bytes(want) < 0.51 * tree_bytes(params)


def test_a_server_expecting_other_dtypes_is_told_which_leaf_differs():
  sender, receiver = WeightSender(), WeightReceiver()
  cfg, _, sources = _offer_bf16(sender, 12)
  rollout = sharding.make_mesh(jax.devices()[2:4], dict(data=1, fsdp=1, tensor=2))
  like = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),  # float32 all
                      models.abstract_params(cfg), models.param_shardings(cfg, rollout))
  with pytest.raises(ValueError, match=r"offers leaf \d+ in bfloat16, but this server holds it in float32"):
    receiver.pull(sources, like)
