"""A prefill computes next-token logits at one position per row, equal to the full forward's there,
and never materialises the ``[B, T, V]`` logits; a prefill into decode slots writes straight into the
slots' cache rows, equal to prefilling a fresh cache and copying it in, without that second cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl_jax import models
from tests.fixtures.helpers import sharp_params

CFG = models.ModelConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, max_seq_len=128)


def _prefill(params, tokens, at):
  b, p = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  return models.apply_decode(CFG, params, tokens, positions, models.init_cache(CFG, b, p), logits_at_b=at)


@pytest.mark.slow(17)
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


def test_generation_never_holds_the_prompts_full_logits():
  """``generate`` (held-out evaluation, RFT, the eval CLI) prefills its prompts at one position per
  row too: its program holds far less than the ``[B, P, V]`` logits of its prompts."""
  from asyncrl_jax.models.generate import generate  # pylint: disable=import-outside-toplevel
  params = sharp_params(CFG, 3)
  prompts, lengths = jax.ShapeDtypeStruct((8, 64), jnp.int32), jax.ShapeDtypeStruct((8,), jnp.int32)
  full_bytes = 8 * 64 * CFG.vocab_size * 4  # 8 MiB
  compiled = generate.lower(CFG, params, prompts, lengths, max_new_tokens=4, eos_id=1).compile()
  analysis = compiled.memory_analysis()
  assert analysis.temp_size_in_bytes + analysis.output_size_in_bytes < 0.25 * full_bytes


# Deep and narrow-vocabulary, so that a second cache of the prefilled rows dominates prefill memory.
DEEP = models.ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_layers=8, num_heads=4,
                          num_kv_heads=2, max_seq_len=128)


def _old_style_slot_prefill(params, cache, tokens, slots, cfg=CFG):
  """The reference: prefill into a fresh cache of the rows, then scatter those rows into the slots."""
  n, p = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
  logits, small = models.apply_decode(cfg, params, tokens, positions, models.init_cache(cfg, n, p),
                                      logits_at_b=jnp.full((n,), p - 1))
  rows, cols = slots[:, None], jnp.arange(p)[None, :]
  return logits, jax.tree.map(lambda big, s: big.at[rows, cols].set(s, mode="drop"), cache, small)


def _slot_prefill(params, cache, tokens, slots, cfg=CFG):
  n, p = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
  return models.apply_decode(cfg, params, tokens, positions, cache, logits_at_b=jnp.full((n,), p - 1),
                             cache_rows_b=slots)


def test_a_slot_prefill_writes_its_rows_of_the_cache_and_nothing_else():
  params = sharp_params(CFG, 3)
  rng = np.random.default_rng(1)
  cache = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), models.init_cache(CFG, 6, 40))
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 16)), jnp.int32)
  slots = jnp.asarray([4, 1, 6], jnp.int32)  # slot 6 does not exist: a padding row, dropped
  logits, got = _slot_prefill(params, cache, tokens, slots)
  want_logits, want = _old_style_slot_prefill(params, cache, tokens, slots)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
  for g, w, before in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(cache)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(g)[[0, 2, 3, 5]], np.asarray(before)[[0, 2, 3, 5]])
    np.testing.assert_array_equal(np.asarray(g)[[1, 4], 16:], np.asarray(before)[[1, 4], 16:])
    assert not np.array_equal(np.asarray(g)[[1, 4], :16], np.asarray(before)[[1, 4], :16])


@pytest.mark.slow(25)
def test_a_slot_prefill_builds_no_second_cache():
  params = sharp_params(DEEP, 3)
  cache = jax.eval_shape(lambda: models.init_cache(DEEP, 16, 128))
  tokens = jax.ShapeDtypeStruct((8, 64), jnp.int32)
  slots = jax.ShapeDtypeStruct((8,), jnp.int32)
  second = 8 * 64 * DEEP.num_kv_heads * DEEP.head_dim * 4 * 2 * DEEP.num_layers  # [N, P] keys+values, f32
  compile_ = lambda f: jax.jit(functools.partial(f, cfg=DEEP), donate_argnums=(1,)).lower(
      params, cache, tokens, slots).compile()
  temp = lambda f: compile_(f).memory_analysis().temp_size_in_bytes
  assert temp(_old_style_slot_prefill) >= second  # the control holds it
  assert temp(_slot_prefill) < temp(_old_style_slot_prefill) - 0.9 * second


def test_a_blockwise_slot_prefill_equals_the_dense_one():
  params = sharp_params(CFG, 3)
  rng = np.random.default_rng(3)
  cache = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), models.init_cache(CFG, 4, 40))
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 21)), jnp.int32)
  slots, n, p = jnp.asarray([2, 0, 4], jnp.int32), 3, 21
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
  at = jnp.asarray([20, 9, 14], jnp.int32)
  want = models.apply_decode(CFG, params, tokens, positions, cache, logits_at_b=at, cache_rows_b=slots)
  got = models.apply_decode(CFG, params, tokens, positions, cache, logits_at_b=at, cache_rows_b=slots,
                            attention_chunk=8)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
