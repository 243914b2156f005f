"""int8 serving weights (``models.quant``): per-output-channel scales against numpy, the rounding
bound, which leaves are quantized, shardings kept, and a decode step on the quantized weights equal
to one on their dequantized copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.models import quant

CFG = models.ModelConfig(vocab_size=18, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64, tie_embeddings=False)


def test_a_kernel_is_scaled_per_output_channel_as_numpy_does_it():
  w = np.random.default_rng(0).normal(size=(6, 2, 3)).astype(np.float32)  # [in, N, H] like q
  w[:, 1, 2] = 0.0  # an all-zero channel: scale 1, values 0 (not NaN)
  q, scale = quant.quantize_kernel(jnp.asarray(w), 1)
  amax = np.abs(w).max(axis=0)
  want_scale = np.where(amax > 0, amax / 127, 1.0).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(scale), want_scale)
  s32 = want_scale.astype(np.float32)
  np.testing.assert_array_equal(np.asarray(q), np.clip(np.round(w / s32), -127, 127).astype(np.int8))
  assert q.dtype == jnp.int8 and scale.shape == (2, 3)
  assert np.abs(np.asarray(q)).max() <= 127 and np.all(np.asarray(q)[:, 1, 2] == 0)
  q2, scale2 = quant.quantize_kernel(jnp.asarray(w.reshape(3, 4, 3)), 2)  # two input axes (like o)
  assert scale2.shape == (3,)


def test_only_the_projection_kernels_are_quantized_within_half_a_step():
  params = models.init_params(CFG, jax.random.key(0))
  qp = quant.quantize(params)
  flat = traverse_util.flatten_dict(qp["weights"])
  kernels = {k for k in flat if str(k[-1]) in quant.INPUT_AXES}
  assert {str(k[-1]) for k in kernels} == set(quant.INPUT_AXES)  # lm_head too: it is untied here
  assert len(qp["scales"]) == len(kernels) == 7 * CFG.num_layers + 1
  for k, v in flat.items():
    assert (v.dtype == jnp.int8) == (k in kernels), k
  assert quant.max_error(params, qp) <= 0.51
  assert quant.nbytes(qp) < 0.3 * quant.nbytes(params)  # float32 -> int8 kernels (+ the embedding)
  with pytest.raises(ValueError, match="rollout.weight_dtype='fp8'"):
    quant.check_weight_dtype("fp8")


def test_quantized_weights_keep_their_kernels_shardings_and_decode_as_their_dequantized_copy():
  mesh = sharding.make_mesh(jax.devices()[:4], dict(data=1, fsdp=2, tensor=2))
  params = models.init_params(CFG, jax.random.key(1), mesh=mesh)
  shardings = quant.shardings(models.param_shardings(CFG, mesh), models.abstract_params(CFG))
  qp = jax.jit(quant.quantize, out_shardings=shardings)(params)
  for (path, a), b in zip(traverse_util.flatten_dict(params).items(),
                          jax.tree.leaves(qp["weights"])):
    assert b.sharding.is_equivalent_to(a.sharding, a.ndim), path
  q_sharding = qp["scales"]["layer_0/attn/q"].sharding  # [N, H]: as q's output axes
  assert q_sharding.spec == jax.sharding.PartitionSpec(*tuple(params["layer_0"]["attn"]["q"].sharding.spec)[1:])
  tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9)).astype(np.int32)
  positions = np.tile(np.arange(9, dtype=np.int32), (2, 1))
  step = jax.jit(lambda p: models.apply_decode(CFG, p, tokens, positions, models.init_cache(CFG, 2, 16))[0])
  got = np.asarray(step(qp))
  want = np.asarray(step(quant.dequantize(qp, jnp.float32)))
  np.testing.assert_array_equal(got, want)
  full = np.asarray(step(params))
  assert 1e-4 < np.abs(full - got).max() < 0.5  # (int8 changes the logits, a little)
