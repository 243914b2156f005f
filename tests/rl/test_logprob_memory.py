"""The learner's memory options change how the log-probs are computed, not what they are.

``vocab_chunk``: the log-softmax a vocabulary chunk at a time equals numpy's full log-softmax (and its
gradient equals the full one's), and the compiled gradient no longer holds ``[B, T, V]`` logits.
``remat``: the same values and gradients, and each block recomputed in the backward pass.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl_jax import config as config_lib, models
from asyncrl_jax.models import Forward
from asyncrl_jax.rl.logprobs import chunked_logsoftmax, token_logprobs
from tests.fixtures.helpers import sharp_params

CFG = models.ModelConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, max_seq_len=64)


def _numpy_logsoftmax(logits):
  logits = logits.astype(np.float64)
  lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
  logp = logits - lse[..., None]
  return logp, -np.sum(np.exp(logp) * logp, -1)


@pytest.mark.parametrize("chunk", [1000, 128, 333, 4096])  # whole, padded last chunk, uneven, one big chunk
def test_chunked_logsoftmax_equals_the_full_one(chunk):
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(2, 5, 16)).astype(np.float32)
  head = (0.5 * rng.normal(size=(16, 1000))).astype(np.float32)
  targets = rng.integers(0, 1000, (2, 5))
  targets[0, 0] = 999  # the last column, in the padded chunk when chunk does not divide 1000
  logp, entropy = chunked_logsoftmax(jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(targets),
                                     chunk=chunk, temperature=0.7)
  want_logp, want_entropy = _numpy_logsoftmax(hidden @ head / 0.7)
  np.testing.assert_allclose(np.asarray(logp), np.take_along_axis(want_logp, targets[..., None], -1)[..., 0],
                             rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(entropy), want_entropy, rtol=1e-4, atol=1e-4)
  assert np.isfinite(np.asarray(logp)).all() and want_entropy.min() > 0.1


def test_chunked_logsoftmax_gradient_equals_the_full_ones():
  rng = np.random.default_rng(1)
  hidden = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(16, 1000)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 1000, (2, 5)))
  weights = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)

  def full(h, w):
    logp = jax.nn.log_softmax(h @ w, axis=-1)
    return jnp.sum(weights * jnp.take_along_axis(logp, targets[..., None], -1)[..., 0])

  chunked = lambda h, w: jnp.sum(weights * chunked_logsoftmax(h, w, targets, chunk=300)[0])
  for got, want in zip(jax.grad(chunked, (0, 1))(hidden, head), jax.grad(full, (0, 1))(hidden, head)):
    assert np.abs(np.asarray(want)).max() > 1e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def _batch(rows=3, width=24):
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (rows, width)), jnp.int32)
  segments = np.ones((rows, width), np.int32)
  segments[0, 10:] = 2  # two sequences packed in row 0
  segments[2, 20:] = 0  # padding at the end of row 2
  positions = np.concatenate([np.arange(10), np.arange(width - 10)])[None].repeat(rows, 0)
  positions[1:] = np.arange(width)
  return tokens, jnp.asarray(positions, jnp.int32), jnp.asarray(segments)


@pytest.mark.slow(20)
@pytest.mark.parametrize("remat,chunk", [(False, 256), (True, 999)])  # chunks alone; both
def test_token_logprobs_and_their_gradients_do_not_depend_on_the_memory_options(remat, chunk):
  params = sharp_params(CFG, 3)
  tokens, positions, segments = _batch()

  def loss(p, **options):
    logp, entropy = token_logprobs(CFG, p, tokens, positions, segments, temperature=0.8,
                                   with_entropy=True, **options)
    return jnp.sum(logp) + 0.1 * jnp.sum(entropy), (logp, entropy)

  both = jax.jit(lambda p: (jax.value_and_grad(loss, has_aux=True)(p), jax.value_and_grad(
      functools.partial(loss, forward=Forward(remat=remat), vocab_chunk=chunk), has_aux=True)(p)))  # one compile
  ((_, want), want_grad), ((_, got), got_grad) = both(params)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)
  assert np.asarray(want[0])[0, 10] == 0.0 and np.asarray(want[0])[2, 20:].sum() == 0.0  # no context
  for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-5)


def _grad_temp_bytes(cfg, rows, width, **options):
  params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  ints = jax.ShapeDtypeStruct((rows, width), jnp.int32)
  loss = lambda p, t, pos, s: jnp.sum(token_logprobs(cfg, p, t, pos, s, **options))
  compiled = jax.jit(jax.grad(loss)).lower(params, ints, ints, ints).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_vocab_chunks_drop_the_full_logits_from_the_gradient():
  cfg = models.ModelConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_layers=1,
                           num_heads=4, num_kv_heads=2, max_seq_len=128)
  logits_bytes = 4 * 128 * cfg.vocab_size * 4  # [B, T, V] float32: 16 MiB
  full = _grad_temp_bytes(cfg, 4, 128)
  chunked = _grad_temp_bytes(cfg, 4, 128, vocab_chunk=1024)
  assert full >= logits_bytes  # the control holds them (and more: softmax, its gradient)
  assert chunked < full - 1.5 * logits_bytes


def test_remat_recomputes_each_block_in_the_backward_pass():
  """What remat asks XLA for, read from the lowered program: one rematerialised region (an
  optimization barrier) per block and the blocks' forward matmuls again in the backward pass.

  Its memory saving cannot be measured here: XLA's CPU pipeline removes optimization barriers and
  merges the recomputation back into the forward pass (a 6-layer tanh MLP under ``jax.checkpoint``
  compiles to the same temp size as without it, on jax 0.10.2). On TPU and GPU the barriers stay.
  """
  cfg = models.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_layers=3,
                           num_heads=4, num_kv_heads=2, max_seq_len=64)
  params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  ints = jax.ShapeDtypeStruct((2, 32), jnp.int32)

  def lowered(remat):
    loss = lambda p, t, pos, s: jnp.sum(token_logprobs(cfg, p, t, pos, s, forward=Forward(remat=remat)))
    return jax.jit(jax.grad(loss)).lower(params, ints, ints, ints).as_text()

  plain, remat = lowered(False), lowered(True)
  assert plain.count("optimization_barrier") == 0
  assert remat.count("optimization_barrier") == cfg.num_layers
  forward = jax.jit(lambda p, t, pos, s: token_logprobs(cfg, p, t, pos, s)).lower(
      params, ints, ints, ints).as_text()
  per_block = (forward.count("dot_general") - 1) // cfg.num_layers  # all but the output head
  assert per_block >= 7, forward.count("dot_general")
  recomputed = remat.count("dot_general") - plain.count("dot_general")
  # every matmul of every block but its last (the down projection's output is not needed backwards)
  assert recomputed == (per_block - 1) * cfg.num_layers


def test_the_memory_options_are_validated():
  config = config_lib.base_config()  # (ml_collections itself refuses a float or a non-bool here)
  config.learner.vocab_chunk = -1
  with pytest.raises(config_lib.ConfigError, match=r"learner\.vocab_chunk=-1"):
    config_lib.validate(config)


@pytest.mark.parametrize("chunk", [7])  # does not divide the width: padded queries in the last block
def test_blockwise_attention_gives_the_same_logprobs_and_gradients(chunk):
  params = sharp_params(CFG, 3)
  tokens, positions, segments = _batch()  # two sequences packed in a row, padding at a row's end

  def loss(p, **options):
    logp = token_logprobs(CFG, p, tokens, positions, segments, **options)
    return jnp.sum(logp * jnp.arange(logp.shape[1])), logp

  both = jax.jit(lambda p: (jax.value_and_grad(loss, has_aux=True)(p), jax.value_and_grad(
      functools.partial(loss, forward=Forward(attention_chunk=chunk, remat=True)), has_aux=True)(p)))  # one compile
  ((_, want), want_grad), ((_, got), got_grad) = both(params)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
  for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-5)


def test_blockwise_attention_holds_one_block_of_scores():
  cfg = models.ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=8, num_kv_heads=2, max_seq_len=1024)
  scores = 2 * cfg.num_heads * 1024 * 1024 * 4  # [rows, heads, T, T] float32, one copy: 64 MiB
  dense = _grad_temp_bytes(cfg, 2, 1024)
  blockwise = _grad_temp_bytes(cfg, 2, 1024, forward=Forward(attention_chunk=128))
  block = scores * 128 // 1024  # one block of 128 queries
  assert dense >= 2 * scores  # the control holds several copies per layer
  assert blockwise < dense / 4 and blockwise < 6 * block  # a few copies of one block, per pass


@pytest.mark.slow(55)
@pytest.mark.parametrize("remat", [False, True])
def test_scanned_layers_give_the_unrolled_values_and_gradients(remat):
  """``scan_layers``: the blocks as one loop over their stacked parameters compute what the unrolled
  blocks do (3 layers, so a wrong layer order or a layer applied twice shows), and the compiled
  program holds one copy of the block, not three."""
  cfg = CFG.replace(num_layers=3, vocab_size=64)
  params = sharp_params(cfg, seed=3)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 16)), jnp.int32)
  positions = jnp.tile(jnp.arange(16), (2, 1))
  segments = jnp.asarray([[1] * 9 + [2] * 7, [1] * 16], jnp.int32)

  def loss(p, scan):
    logp = token_logprobs(cfg, p, tokens, positions, segments, vocab_chunk=16,
                          forward=Forward(remat=remat, scan_layers=scan, attention_chunk=8))
    return jnp.sum(logp * jnp.arange(16.0))

  want, want_grads = jax.value_and_grad(loss)(params, False)
  got, got_grads = jax.value_and_grad(loss)(params, True)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  # negative control: reordering the layers changes the value, so the comparison can fail
  swapped = dict(params, layer_0=params["layer_2"], layer_2=params["layer_0"])
  assert abs(float(loss(swapped, True)) - float(want)) > 1e-3
  count = lambda scan: jax.jit(functools.partial(loss, scan=scan)).lower(params).as_text().count(
      "dot_general")
  assert count(True) < count(False)
