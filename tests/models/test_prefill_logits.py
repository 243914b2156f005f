"""A prefill computes next-token logits at one position per row, equal to the full forward's there,
and never materialises the ``[B, T, V]`` logits."""

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl_jax import models
from tests.helpers import sharp_params

CFG = models.ModelConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=128)


def _prefill(params, tokens, at):
  b, p = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  return models.apply_decode(CFG, params, tokens, positions, models.init_cache(CFG, b, p), logits_at_b=at)


def test_logits_at_one_position_equal_the_full_forwards_there():
  params = sharp_params(CFG, 3)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (3, 20)), jnp.int32)
  at = jnp.asarray([19, 4, 11], jnp.int32)
  picked, cache = _prefill(params, tokens, at)
  full, full_cache = _prefill(params, tokens, None)
  assert picked.shape == (3, 1, CFG.vocab_size) and full.shape == (3, 20, CFG.vocab_size)
  want = np.asarray(full)[np.arange(3), np.asarray(at)]
  assert np.abs(want).max() > 1.0
  np.testing.assert_allclose(np.asarray(picked)[:, 0], want, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(full_cache)):  # the cache is the same
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_prefill_never_holds_the_full_logits():
  params = sharp_params(CFG, 3)
  tokens = jax.ShapeDtypeStruct((8, 64), jnp.int32)
  full_bytes = 8 * 64 * CFG.vocab_size * 4  # [B, T, V] float32: 8 MiB
  picked = jax.jit(_prefill).lower(params, tokens, jax.ShapeDtypeStruct((8,), jnp.int32)).compile()
  full = jax.jit(lambda p, t: _prefill(p, t, None)).lower(params, tokens).compile()
  used = lambda c: c.memory_analysis().temp_size_in_bytes + c.memory_analysis().output_size_in_bytes
  assert used(full) >= full_bytes  # the control: the full forward does hold them
  assert used(picked) < used(full) - 0.9 * full_bytes
