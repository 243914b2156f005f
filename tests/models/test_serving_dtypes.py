"""Decode servers hold the weights in their serving dtypes (``models.serving_dtypes``): kernels,
embeddings and biases in the compute dtype, the norm scales as stored. The model casts the former
before use, so the served copy gives the learner's logits bit for bit, prefill and decode alike."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fixtures.helpers import sharp_params
from asyncrl_jax import models

CFG = models.ModelConfig(vocab_size=33, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=64, qkv_bias=True, dtype="bfloat16",
                         param_dtype="float32")


@pytest.fixture(scope="module")
def params():
  p = sharp_params(CFG, 0, scale=2.0)
  # norm scales that bfloat16 cannot hold exactly, so that rounding them would show in the logits
  noise = lambda path, x: (x * (1.0 + 0.01 * jax.random.normal(jax.random.key(len(str(path))), x.shape))
                           if getattr(path[-1], "key", None) == "scale" else x)
  return jax.tree_util.tree_map_with_path(noise, p)


def _tokens():
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 20)), jnp.int32)


def test_kernels_are_served_in_the_compute_dtype_and_norm_scales_as_stored():
  dtypes = jax.tree_util.tree_flatten_with_path(models.serving_dtypes(CFG))[0]
  kept = {jax.tree_util.keystr(p) for p, dt in dtypes if dt == jnp.float32}
  assert kept == {"['final_norm']['scale']"} | {f"['layer_{i}']['{n}']['scale']" for i in range(2)
                                                  for n in ("attn_norm", "mlp_norm")}
  assert all(dt == jnp.bfloat16 for p, dt in dtypes if jax.tree_util.keystr(p) not in kept)
  # stored in the compute dtype already, or computing in float32: served as stored
  for dtype, param_dtype, want in (("float32", "float32", jnp.float32), ("bfloat16", "bfloat16", jnp.bfloat16),
                                   ("float32", "bfloat16", jnp.bfloat16)):
    leaves = jax.tree.leaves(models.serving_dtypes(CFG.replace(dtype=dtype, param_dtype=param_dtype)))
    assert set(leaves) == {jnp.dtype(want)}


@pytest.mark.slow(22)
def test_the_served_weights_give_the_learners_logits_bit_for_bit(params):
  served = models.serving_params(CFG, params)
  stored = sum(x.nbytes for x in jax.tree.leaves(params))
  assert sum(x.nbytes for x in jax.tree.leaves(served)) < 0.51 * stored
  tokens = _tokens()
  want = np.asarray(models.logits(CFG, params, tokens))
  np.testing.assert_array_equal(np.asarray(models.logits(CFG, served, tokens)), want)
  # a decode step from a prefilled cache, too
  positions = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (3, 20))
  outs = []
  for p in (params, served):
    cache = models.init_cache(CFG, 3, 32)
    _, cache = models.decode(CFG, p, tokens, positions, cache)
    outs.append(np.asarray(models.decode(CFG, p, tokens[:, :1], positions[:, :1] + 20, cache)[0]))
  np.testing.assert_array_equal(outs[1], outs[0])
  # negative control: rounding the norm scales as well changes the logits
  everything = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  assert np.max(np.abs(np.asarray(models.logits(CFG, everything, tokens)) - want)) > 1e-3


def test_float32_weights_are_returned_as_they_are():
  config = CFG.replace(dtype="float32")
  params = models.init_params(config, jax.random.key(1))
  served = models.serving_params(config, params)
  assert all(a is b for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(params)))
