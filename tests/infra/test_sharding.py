"""The learner's sharded forward equals the single-device forward (8 virtual CPU devices)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from asyncrl_jax import models
from asyncrl_jax.infra import sharding

CFG = models.ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=8, num_kv_heads=2, max_seq_len=64)


def test_eight_devices_available():
  assert len(jax.devices()) == 8


@pytest.mark.slow(46)
@pytest.mark.parametrize("num_devices,shape", [
    (8, dict(data=2, fsdp=2, tensor=2)),
    (8, dict(data=1, fsdp=-1, tensor=1)),  # pure FSDP over all 8
    (2, dict(data=1, fsdp=1, tensor=2)),  # a 2-device learner mesh, tensor parallel
])
def test_sharded_forward_matches_single_device(num_devices, shape):
  mesh = sharding.make_mesh(jax.devices()[:num_devices], shape)
  params = models.init_params(CFG, jax.random.key(3), mesh=mesh)
  assert params["layer_0"]["attn"]["q"].sharding.mesh == mesh
  single = models.init_params(CFG, jax.random.key(3))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # sharded init draws the same numbers
  tokens = np.random.default_rng(0).integers(0, 96, (8, 24)).astype(np.int32)
  batch = jax.device_put(tokens, sharding.batch_sharding(mesh))
  sharded = models.logits(CFG, params, batch, mesh=mesh)
  assert sharded.sharding.mesh == mesh
  ref = models.logits(CFG, single, tokens)
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_params_are_actually_split():
  mesh = sharding.make_mesh(jax.devices(), dict(data=2, fsdp=2, tensor=2))
  params = models.init_params(CFG, jax.random.key(0), mesh=mesh)
  q = params["layer_0"]["attn"]["q"]  # [D=64, N=8, H=8] -> (fsdp, tensor, None)
  assert q.sharding.spec == P("fsdp", "tensor", None)
  assert {s.data.shape for s in q.addressable_shards} == {(32, 4, 8)}
  gate = params["layer_1"]["mlp"]["gate"]  # [D, F] -> (fsdp, tensor)
  assert gate.sharding.spec == P("fsdp", "tensor")
  norm = params["final_norm"]["scale"]
  assert norm.sharding.is_fully_replicated


def test_indivisible_mesh_is_a_clear_error():
  mesh = sharding.make_mesh(jax.devices(), dict(data=1, fsdp=1, tensor=8))
  with pytest.raises(sharding.MeshError, match="kv_heads|does not divide"):
    models.init_params(CFG, jax.random.key(0), mesh=mesh)


def test_mesh_shape_errors():
  with pytest.raises(sharding.MeshError, match="needs 12 devices"):
    sharding.make_mesh(jax.devices(), dict(data=3, fsdp=4, tensor=1))
  with pytest.raises(sharding.MeshError, match="at most one mesh axis may be -1"):
    sharding.make_mesh(jax.devices(), dict(data=-1, fsdp=-1, tensor=1))
  with pytest.raises(sharding.MeshError, match="not divisible"):
    sharding.make_mesh(jax.devices(), dict(data=-1, fsdp=3, tensor=1))


def test_split_devices_three_to_one():
  rollout, learner = sharding.split_devices(jax.devices(), 0.75)
  assert len(rollout) == 6 and len(learner) == 2
  assert not set(rollout) & set(learner)
  with pytest.raises(sharding.MeshError, match="strictly between 0 and 1"):
    sharding.split_devices(jax.devices(), 1.0)
