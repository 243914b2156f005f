"""The attention implementations agree: the splash TPU kernel (run in Pallas' interpret mode here)
and the XLA blockwise path give the dense reference's values and gradients on packed rows of mixed
lengths, alone, through the whole model, and split over a mesh; without the segment ids they do not
(the comparison can fail)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from asyncrl_jax import models
from asyncrl_jax.infra import sharding
from asyncrl_jax.models import Forward, attention
from asyncrl_jax.rl.logprobs import token_logprobs
from tests.fixtures.helpers import sharp_params

B, T, K, G, H = 2, 200, 2, 2, 16  # T is not a multiple of 128: the kernel's rows are padded

# packed rows of mixed lengths, padding (segment 0) at the ends
_LENGTHS = ([70, 3, 97], [1, 150, 30, 19])


def _segments(lengths=_LENGTHS, width=T):
  seg = np.zeros((len(lengths), width), np.int32)
  for r, row in enumerate(lengths):
    start = 0
    for i, n in enumerate(row):
      seg[r, start:start + n] = i + 1
      start += n
  return jnp.asarray(seg)


def _qkv(dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, T, K, G, H)), dtype)
  k = jnp.asarray(rng.normal(size=(B, T, K, H)), dtype)
  v = jnp.asarray(rng.normal(size=(B, T, K, H)), dtype)
  return q, k, v


def _reference(q, k, v, seg):
  return attention.dense(q, k, v, attention.training_mask(seg))


def _valid(seg):
  return (seg > 0)[:, :, None, None, None]


@pytest.mark.parametrize("kind", ["splash", "blockwise"])
def test_kernels_equal_the_reference_in_values_and_gradients(kind):
  q, k, v = _qkv()
  seg = _segments()
  run = {"splash": lambda q, k, v, s: attention.splash(q, k, v, s),
         "blockwise": lambda q, k, v, s: attention.blockwise(q, k, v, s, 64)}[kind]
  weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

  def loss(fn, q, k, v):  # a weighted sum over real tokens (padding's outputs are never used)
    return jnp.sum(jnp.where(_valid(seg), fn(q, k, v, seg), 0.0) * weights)

  want = _reference(q, k, v, seg)
  got = jax.jit(run)(q, k, v, seg)
  np.testing.assert_allclose(np.where(_valid(seg), got, 0), np.where(_valid(seg), want, 0),
                             rtol=1e-5, atol=1e-5)
  want_grads = jax.grad(functools.partial(loss, _reference), argnums=(0, 1, 2))(q, k, v)
  got_grads = jax.jit(jax.grad(functools.partial(loss, run), argnums=(0, 1, 2)))(q, k, v)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)
  # negative control: one segment per row (no packing) changes the values the check compares
  whole = jax.jit(run)(q, k, v, jnp.where(seg > 0, 1, 0))
  assert float(jnp.max(jnp.abs(jnp.where(_valid(seg), whole - want, 0)))) > 1e-2


def test_splash_in_bfloat16_is_within_bfloat16_rounding_of_the_float32_reference():
  q, k, v = _qkv(jnp.bfloat16, seed=2)
  seg = _segments()
  want = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), seg)
  got = jax.jit(attention.splash)(q, k, v, seg).astype(jnp.float32)
  err = jnp.where(_valid(seg), jnp.abs(got - want), 0.0)
  assert float(jnp.max(err)) < 0.05 and float(jnp.mean(err)) < 5e-3


def _model_batch(cfg):
  seg = _segments(([30, 2, 60], [1, 50, 41]), width=96)
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, seg.shape), jnp.int32) * (seg > 0)
  positions = np.zeros(seg.shape, np.int32)
  for r in range(seg.shape[0]):
    for s in np.unique(np.asarray(seg[r])):
      idx = np.flatnonzero(np.asarray(seg[r]) == s)
      positions[r, idx] = np.arange(len(idx))
  return tokens, jnp.asarray(positions), seg


CFG = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_seq_len=128)


@pytest.mark.parametrize("remat", ["none", "full", "minimal", "dots_saveable"])
def test_the_model_gives_the_same_logprobs_and_gradients_with_splash_and_any_remat_policy(remat):
  params = sharp_params(CFG, 3)
  tokens, positions, seg = _model_batch(CFG)

  def loss(p, forward):
    logp = token_logprobs(CFG, p, tokens, positions, seg, forward=forward)
    return jnp.sum(logp * jnp.arange(logp.shape[1])), logp

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (_, want), want_grads = grad(params, Forward())
  (_, got), got_grads = grad(params, Forward(attention="splash", remat=remat))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-5)


def test_splash_split_over_a_mesh_equals_one_device():
  """Rows split over data x fsdp and heads over tensor (shard_map), against the unsplit kernel."""
  mesh = sharding.make_mesh(jax.devices()[:8], dict(data=2, fsdp=2, tensor=2))
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.normal(size=(4, T, K, G, H)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(4, T, K, H)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(4, T, K, H)), jnp.float32)
  seg = jnp.concatenate([_segments(), _segments()[::-1]])
  rows = NamedSharding(mesh, P(("data", "fsdp")))
  heads = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
  args = [jax.device_put(q, heads), jax.device_put(k, heads), jax.device_put(v, heads),
          jax.device_put(seg, rows)]
  got = jax.jit(functools.partial(attention.splash, mesh=mesh))(*args)
  want = _reference(q, k, v, seg)
  valid = (seg > 0)[:, :, None, None, None]
  np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), rtol=1e-5, atol=1e-5)


def test_forward_options_are_checked():
  assert Forward(remat=True).remat == "full" and Forward(remat=False).remat == "none"
  with pytest.raises(models.ForwardError, match="attention='flash'"):
    Forward(attention="flash")
  with pytest.raises(models.ForwardError, match="remat='some'"):
    Forward(remat="some")


def test_splash_skips_exactly_the_block_pairs_that_share_no_segment():
  """Blocks of 128 over a 512-token row holding segments [0, 100), [100, 300), [300, 480) and
  padding: query block 3 (384-511: segment 3 and padding) shares nothing with key blocks 0 and 1
  (segments 1-2), so the kernel visits 8 of the 10 causal pairs. Skipping a pair that is needed
  changes the values (the tables are really used), and the skipping itself does not."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
  seg = np.zeros(512, np.int32)
  seg[:100], seg[100:300], seg[300:480] = 1, 2, 3
  seg = jnp.asarray(seg)
  overlap = np.asarray(attention.segment_block_overlap(seg, 128))
  causal = np.tril(np.ones((4, 4), bool))
  assert (overlap & causal).sum() == 8 and not overlap[3, 0] and not overlap[3, 1] and overlap[3, 2]
  rng = np.random.default_rng(7)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 512, 16)), jnp.float32) for _ in range(3))
  kernel = attention._splash_kernel(2, 512, True, block=128)  # pylint: disable=protected-access
  skipping = attention._skip_cross_segment_blocks(kernel, seg, 128)  # pylint: disable=protected-access
  ids = kernel_lib.SegmentIds(q=seg, kv=seg)
  valid = (seg > 0)[None, :, None]
  full, skipped = kernel(q, k, v, segment_ids=ids), skipping(q, k, v, segment_ids=ids)
  np.testing.assert_allclose(np.where(valid, skipped, 0), np.where(valid, full, 0), atol=1e-6)
  # negative control: also skipping pair (2, 1), which segment 2 needs, changes query block 2
  info = skipping.fwd_mask_info
  broken = kernel_lib.SplashAttentionKernel(
      info._replace(block_mask=info.block_mask.at[:, 2, 1].set(0)), None, skipping.dkv_mask_info,
      **skipping.kwargs)
  wrong = broken(q, k, v, segment_ids=ids)
  assert float(jnp.max(jnp.abs(wrong[:, 256:300] - full[:, 256:300]))) > 1e-3


def test_the_paged_view_read_as_the_kernel_reads_it_equals_the_cached_decode():
  """A decode step's cache viewed as pages (``paged_view``: identity page table, lengths = position +
  1) gives, through the ragged kernel's own reference implementation, what the masked decode over the
  whole cache gives; so does our jittable stand-in. Off by one in the lengths, it does not."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as ragged
  from asyncrl_jax.models.transformer import split_kv
  b, s, k, g, h = 4, 64, 2, 2, 32
  rng = np.random.default_rng(11)
  kv = jnp.asarray(rng.normal(size=(b, s, 2 * k, h)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(b, 1, k, g, h)), jnp.float32)
  positions = jnp.asarray([0, 15, 16, 63], jnp.int32)  # a page's first and last positions, the end
  key, val = split_kv(kv)
  from asyncrl_jax.models.transformer import cache_mask
  want = attention.dense(q, key, val, cache_mask(positions[:, None], s)).reshape(b, k * g, h)
  view = attention.paged_view(kv, positions)
  assert view["kv_pages"].shape == (b * s // 64, 64, 2 * k, h)  # pages of 64: the largest that divides
  scale = 1 / np.sqrt(h)
  reference = ragged.ref_ragged_paged_attention(q.reshape(b, k * g, h), **view, sm_scale=scale)
  np.testing.assert_allclose(np.asarray(reference), np.asarray(want), rtol=1e-5, atol=1e-5)
  ours = jax.jit(functools.partial(attention.paged_reference, sm_scale=scale))(q.reshape(b, k * g, h), **view)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(want), rtol=1e-5, atol=1e-5)
  short = dict(view, kv_lens=view["kv_lens"] - 1)
  wrong = ragged.ref_ragged_paged_attention(q.reshape(b, k * g, h), **dict(short, kv_lens=jnp.maximum(
      short["kv_lens"], 1)), sm_scale=scale)
  assert float(jnp.max(jnp.abs(wrong - want))) > 1e-3
  with pytest.raises(ValueError, match="divisible by one of"):
    attention.page_size(100)


def test_a_paged_decode_that_cannot_run_is_refused_naming_the_field():
  attention.check_decode_attention("xla", head_dim=32, platform="cpu", cache_len=100)  # no pages needed
  attention.check_decode_attention("ragged", head_dim=32, platform="cpu", cache_len=128)  # the stand-in
  with pytest.raises(ValueError, match=r"rollout\.decode_attention='ragged' needs model\.head_dim"):
    attention.check_decode_attention("ragged", head_dim=64, platform="tpu", cache_len=128)
  with pytest.raises(ValueError, match=r"rollout\.decode_attention='ragged'\)"):
    attention.check_decode_attention("ragged", head_dim=128, platform="tpu", cache_len=100)
  with pytest.raises(ValueError, match=r"rollout\.decode_attention='paged'"):
    attention.check_decode_attention("paged", head_dim=128, platform="tpu", cache_len=128)
