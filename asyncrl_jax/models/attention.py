"""Attention over packed rows: one contract, two implementations (``Forward.attention``).

Training, scoring and prefill attention is causal within segments: query ``t`` of a row sees key
``s`` iff ``s <= t`` and both carry the same segment id (sequences packed into one row never see each
other; padding has segment 0 and sees only padding). Queries are grouped by the kv head they share:
``q [B, T, K, G, H]``, keys and values ``[B, T, K, H]``, output ``[B, T, K, G, H]``.

* ``dense`` / ``blockwise`` (``"xla"``, the reference): float32 scores through HBM, the whole row at
  once or ``chunk`` queries at a time (each block rematerialised).
* ``splash`` (``"splash"``): the Pallas TPU kernel that ships with jax
  (``jax.experimental.pallas.ops.tpu.splash_attention``): scores live in VMEM one block at a time
  (online softmax), blocks entirely above the diagonal are skipped and so are blocks whose queries
  and keys share no segment (packed sequences never see each other: each row's block tables are
  built from its segment ids), the segment ids mask inside a block, and its fused custom backward
  pass keeps only the output and the log-sum-exp. It runs per device
  under ``jax.shard_map`` (Mosaic kernels are not partitioned automatically): rows split like the
  activations' batch, heads like the projections' (``tensor``). Off a TPU it runs in Pallas'
  interpret mode (exact, slow: tests only). On a TPU with bfloat16 inputs it needs the default
  matmul precision: Mosaic refuses float32 contract precision on bfloat16 operands ("Bad lhs
  type"), which ``jax_default_matmul_precision="highest"`` would ask of its products.

Decode steps (one query per row against a KV cache) use ``dense`` with the cache mask, or
``ragged_decode``: the Pallas ragged paged attention kernel over the cache viewed as pages, reading
each row only up to its position (``Forward.decode``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from asyncrl_jax.infra.sharding import BATCH_AXES

_NEG_INF = -1e30  # finite, so fully masked rows (padding) give uniform weights, not NaN

# The splash kernel's blocks: this many queries and keys (a multiple of 128 lanes). 512 is what
# MaxText uses by default for its splash attention on v5p / v6e.
SPLASH_BLOCK = 512
_LANES = 128


def training_mask(segment_ids_bt: jax.Array) -> jax.Array:
  """[B, T, T] mask: same segment and key index <= query index."""
  t = segment_ids_bt.shape[1]
  causal = jnp.tril(jnp.ones((t, t), dtype=bool))
  same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
  return same & causal[None]


def dense(q_btkgh, key_bskh, val_bskh, mask_bts):
  """Softmax attention of grouped queries over every key, ``mask_bts`` saying which are visible."""
  h = q_btkgh.shape[-1]
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", q_btkgh, key_bskh).astype(jnp.float32) / jnp.sqrt(jnp.float32(h))
  scores = jnp.where(mask_bts[:, None, None, :, :], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(q_btkgh.dtype)
  return jnp.einsum("BKGTS,BSKH->BTKGH", probs, val_bskh)


def blockwise(q_btkgh, key_btkh, val_btkh, segment_ids_bt, chunk: int):
  """Causal attention within segments, ``chunk`` queries at a time (training and prefill).

  Equal to ``dense`` with ``training_mask(segment_ids_bt)``, but the mask is built per block from
  the segment ids and each block is rematerialised, so neither pass holds more than one ``[B,
  heads, chunk, T]`` block of scores, nor the ``[B, T, T]`` mask.
  """
  b, t = q_btkgh.shape[:2]
  n = -(-t // chunk)
  pad = n * chunk - t  # padded queries get segment 0 (padding) and are cut off at the end
  q = jnp.pad(q_btkgh, ((0, 0), (0, pad)) + ((0, 0),) * 3)
  seg_q = jnp.pad(segment_ids_bt, ((0, 0), (0, pad)))
  blocks = (q.reshape((b, n, chunk) + q.shape[2:]).swapaxes(0, 1), seg_q.reshape(b, n, chunk).swapaxes(0, 1),
            jnp.arange(n * chunk).reshape(n, chunk))

  @jax.checkpoint
  def block(xs):
    q_b, seg_b, idx_b = xs
    mask = (seg_b[:, :, None] == segment_ids_bt[:, None, :]) & (idx_b[None, :, None] >= jnp.arange(t))
    return dense(q_b, key_btkh, val_btkh, mask)

  out = jax.lax.map(block, blocks)  # [n, B, chunk, K, G, H]
  return out.swapaxes(0, 1).reshape((b, n * chunk) + out.shape[3:])[:, :t]


def splash_width(t: int) -> int:
  """The row width the splash kernel runs at: ``t`` rounded up to whole blocks (``splash_block``)."""
  return -(-t // splash_block(t)) * splash_block(t)


def splash_block(t: int) -> int:
  """Queries (and keys) per kernel block for rows of ``t`` tokens: ``SPLASH_BLOCK``, or the row
  rounded up to 128 lanes when it is shorter."""
  return min(SPLASH_BLOCK, -(-t // _LANES) * _LANES)


def _splash_kernel(heads: int, width: int, interpret: bool, block: int = 0):
  """A causal splash kernel for ``heads`` query heads over rows of ``width`` tokens, with the fused
  backward pass (one kernel for dq, dk and dv: 5 block products per pair instead of 7). Built
  inside the trace that uses it (its block tables become that program's values; a kernel kept from
  another trace would leak that trace's values)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=import-outside-toplevel
      splash_attention_kernel as kernel_lib, splash_attention_mask as mask_lib)
  block = block or splash_block(width)
  sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                                block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                                use_fused_bwd_kernel=True)
  mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((width, width)) for _ in range(heads)])
  return kernel_lib.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                                    interpret=interpret)


def segment_block_overlap(segment_ids_t: jax.Array, block: int) -> jax.Array:
  """``[n, n]`` bool: query block i and key block j hold a common segment (``n = T / block``).

  Segments are contiguous runs in a packed row, padding (0) only at its end: numbered as one more
  segment after the last, ids never decrease along the row, so two blocks share a segment iff their
  id ranges overlap. Every block overlaps itself: a query always sees at least its own block."""
  n = segment_ids_t.shape[0] // block
  seg = jnp.where(segment_ids_t > 0, segment_ids_t, jnp.max(segment_ids_t) + 1).reshape(n, block)
  lo, hi = seg.min(axis=1), seg.max(axis=1)
  return (lo[:, None] <= hi[None, :]) & (lo[None, :] <= hi[:, None])


def _skip_cross_segment_blocks(kernel, segment_ids_t: jax.Array, block: int):
  """``kernel`` with its block tables restricted to block pairs that share a segment: the causal
  kernel computes every block on or below the diagonal, most of which, in a row of packed
  sequences, pair two sequences that never see each other (their scores are masked to nothing).

  The tables (splash's ``MaskInfo``: ``block_mask[h, i, j]`` for query block i and key block j, 0 =
  skip; ``data_next``: the block each grid step fetches) become values of this row's segment ids. A
  skipped step fetches a block that a neighbouring visited step fetches anyway, so it moves no HBM
  bytes: the forward's row i visits key blocks ``first_i .. i`` (``first_i``: the first that
  overlaps), the fused backward's row j visits query blocks ``j .. last_j``."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=import-outside-toplevel
      splash_attention_kernel as kernel_lib)
  overlap = segment_block_overlap(segment_ids_t, block)
  n = overlap.shape[0]
  idx = jnp.arange(n)
  first = jnp.argmax(overlap, axis=1)  # [i]: first key block query block i sees
  last = n - 1 - jnp.argmax(overlap[::-1, :], axis=0)  # [j]: last query block that sees key block j
  nxt = lambda a: jnp.concatenate([a[1:], a[-1:]])  # the next row's start (prefetched early)
  # forward: row i, step j fetches key block j where visited; before, the first; after, the next
  # row's first
  fwd_next = jnp.where(idx[None, :] < first[:, None], first[:, None],
                       jnp.where(idx[None, :] > idx[:, None], nxt(first)[:, None], idx[None, :]))
  # backward (key-block rows): row j, step i fetches query block i where visited; before j, j;
  # after last_j, the next row's first (j + 1)
  bwd_next = jnp.where(idx[None, :] < idx[:, None], idx[:, None],
                       jnp.where(idx[None, :] > last[:, None], nxt(idx)[:, None], idx[None, :]))

  def restrict(info, data_next):
    if info is None:
      return None
    keep = overlap[None] & (info.block_mask > 0)
    return info._replace(block_mask=jnp.where(keep, info.block_mask, 0).astype(info.block_mask.dtype),
                         data_next=jnp.broadcast_to(data_next, info.data_next.shape).astype(
                             info.data_next.dtype))

  return kernel_lib.SplashAttentionKernel(restrict(kernel.fwd_mask_info, fwd_next), None,
                                          restrict(kernel.dkv_mask_info, bwd_next), **kernel.kwargs)


def _on_tpu(mesh: Optional[jax.sharding.Mesh]) -> bool:
  devices = mesh.devices.flat if mesh is not None else jax.devices()
  return next(iter(devices)).platform == "tpu"


def splash(q_btkgh, key_btkh, val_btkh, segment_ids_bt, *, mesh: Optional[jax.sharding.Mesh] = None,
           batch_axes=BATCH_AXES, head_axis: Optional[str] = "tensor", skip_blocks: bool = True):
  """Causal attention within segments by the splash kernel (the module docstring); same values as
  ``dense`` with ``training_mask``.

  With ``mesh``, the kernel runs per device under ``shard_map``: rows split over ``batch_axes``,
  query and kv heads over ``head_axis`` (both must divide). Rows are padded to whole kernel blocks
  with segment 0, which no real token sees. ``skip_blocks``: each row skips the block pairs that
  share no segment (``_skip_cross_segment_blocks``; the values are the same either way).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=import-outside-toplevel
      splash_attention_kernel as kernel_lib)
  b, t, k, g, h = q_btkgh.shape
  width = splash_width(t)
  pad = width - t
  # the kernel does not scale the scores: scale the queries (in float32, then the compute dtype)
  q = (q_btkgh.astype(jnp.float32) / np.sqrt(h)).astype(q_btkgh.dtype)
  q = jnp.pad(q.reshape(b, t, k * g, h), ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  key = jnp.pad(key_btkh, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  val = jnp.pad(val_btkh, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  seg = jnp.pad(segment_ids_bt.astype(jnp.int32), ((0, 0), (0, pad)))
  interpret = not _on_tpu(mesh)
  shards = 1 if mesh is None or head_axis is None else mesh.shape[head_axis]
  if k % shards:
    raise ValueError(f"splash attention: {k} kv heads do not split over mesh axis "
                     f"{head_axis}={shards}")

  def local(q_bnth, k_bkth, v_bkth, seg_bt):
    kernel = _splash_kernel(q_bnth.shape[1], width, interpret)

    def one(q1, k1, v1, s1):  # one row: its own block tables, from its segments
      row_kernel = _skip_cross_segment_blocks(kernel, s1, splash_block(width)) if skip_blocks else kernel
      return row_kernel(q1, k1, v1, segment_ids=kernel_lib.SegmentIds(q=s1, kv=s1))

    return jax.vmap(one)(q_bnth, k_bkth, v_bkth, seg_bt)

  if mesh is None:
    out = local(q, key, val, seg)
  else:
    spec = jax.sharding.PartitionSpec
    rows = tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1) or None
    heads = head_axis if shards > 1 else None
    out = jax.shard_map(local, mesh=mesh, in_specs=(spec(rows, heads), spec(rows, heads),
                                                    spec(rows, heads), spec(rows)),
                        out_specs=spec(rows, heads), check_vma=False)(q, key, val, seg)
  return out.transpose(0, 2, 1, 3)[:, :t].reshape(b, t, k, g, h)


def segment_attention(q_btkgh, key_btkh, val_btkh, segment_ids_bt, *, kind: str, chunk: int,
                      mesh: Optional[jax.sharding.Mesh] = None):
  """Causal attention within segments by ``kind`` (``Forward.attention``): ``"splash"``, or the XLA
  reference (``chunk`` queries at a time when ``chunk`` > 0, else the whole row)."""
  if kind == "splash":
    return splash(q_btkgh, key_btkh, val_btkh, segment_ids_bt, mesh=mesh)
  if chunk:
    return blockwise(q_btkgh, key_btkh, val_btkh, segment_ids_bt, chunk)
  return dense(q_btkgh, key_btkh, val_btkh, training_mask(segment_ids_bt))


# Tokens per page of the paged view of a KV cache (the largest of these that divides its length).
PAGE_SIZES = (128, 64, 32, 16)
# The ragged paged attention kernel's blocks (passed, so that its lowering never reads the device
# table of the machine it compiles on): pages per key block, queries per block, VMEM it may use.
RAGGED_PAGES_PER_BLOCK = 8
RAGGED_QUERIES_PER_BLOCK = 8
RAGGED_VMEM_BYTES = 64 * 2**20


def page_size(cache_len: int) -> int:
  """Tokens per page for a cache of ``cache_len`` positions (``PAGE_SIZES``)."""
  for size in PAGE_SIZES:
    if cache_len % size == 0:
      return size
  raise ValueError(f"a paged decode needs a cache length divisible by one of {PAGE_SIZES}; "
                   f"got {cache_len} (rollout.decode_attention='ragged')")


def check_decode_attention(kind: str, *, head_dim: int, platform: str, cache_len: int) -> None:
  """Raises ValueError, naming ``rollout.decode_attention``, when ``kind`` cannot run: the paged view
  needs a cache length that whole pages divide, and the TPU kernel ``head_dim`` a multiple of 128
  (off a TPU its XLA stand-in runs, for tests)."""
  from asyncrl_jax.models.forward import DECODE_KINDS  # pylint: disable=import-outside-toplevel
  if kind not in DECODE_KINDS:
    raise ValueError(f"rollout.decode_attention={kind!r}: must be one of {DECODE_KINDS}")
  if kind != "ragged":
    return
  if platform == "tpu" and head_dim % 128:
    raise ValueError(f"rollout.decode_attention='ragged' needs model.head_dim a multiple of 128; got "
                     f"{head_dim}")
  page_size(cache_len)


def paged_view(kv_bs2kh: jax.Array, positions_b: jax.Array) -> dict:
  """A decode step's cache ``[B, S, 2K, H]`` (one layer; the step's token already written at
  ``positions_b``) as the ragged paged attention kernel reads it: ``pages [B * S / P, P, 2K, H]`` (a
  reshape: row b's positions are its pages ``b * S / P ...``), ``page_indices [B, S / P]`` (that
  identity table), ``kv_lens`` = position + 1 (the kernel reads no page past it), one query per row
  (``cu_q_lens`` = 0, 1, ..., B) and ``num_seqs`` = [B]."""
  b, s = kv_bs2kh.shape[:2]
  p = page_size(s)
  return dict(kv_pages=kv_bs2kh.reshape((b * s // p, p) + kv_bs2kh.shape[2:]),
              kv_lens=(positions_b + 1).astype(jnp.int32),
              page_indices=jnp.arange(b * s // p, dtype=jnp.int32).reshape(b, s // p),
              cu_q_lens=jnp.arange(b + 1, dtype=jnp.int32), num_seqs=jnp.asarray([b], jnp.int32))


def ragged_decode(q_b1kgh, kv_bs2kh, positions_b, *, mesh: Optional[jax.sharding.Mesh] = None,
                  batch_axes=BATCH_AXES, head_axis: Optional[str] = "tensor"):
  """One decode step's attention by the ragged paged attention TPU kernel
  (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``): each row reads its cache's pages
  only up to its position, so a step moves the live keys and values, not the whole cache. Same
  values as ``dense`` with ``cache_mask``. ``q [B, 1, K, G, H]``, the layer's cache ``[B, S, 2K,
  H]`` (``transformer.interleave_kv`` layout) with this step's keys and values written. Under
  ``mesh`` it runs per device (rows over ``batch_axes``, heads over ``head_axis``).

  Off a TPU the kernel's Pallas interpret mode does not run it (jax 0.10.2), so ``paged_reference``
  stands in: the kernel's contract (the same page view, table and lengths) in XLA, gathering every
  page: exact and no faster than ``"xla"``, for tests on the CPU."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (  # pylint: disable=import-outside-toplevel
      kernel as ragged)
  b, _, k, g, h = q_b1kgh.shape
  on_tpu = _on_tpu(mesh)

  def local(q_bnh, kv, pos):
    view = paged_view(kv, pos)
    if not on_tpu:
      return paged_reference(q_bnh, **view, sm_scale=1.0 / float(np.sqrt(h)))
    return ragged.ragged_paged_attention(
        q_bnh, view["kv_pages"], view["kv_lens"], view["page_indices"], view["cu_q_lens"],
        view["num_seqs"], sm_scale=1.0 / float(np.sqrt(h)),
        num_kv_pages_per_block=min(RAGGED_PAGES_PER_BLOCK, kv.shape[1] // page_size(kv.shape[1])),
        num_queries_per_block=RAGGED_QUERIES_PER_BLOCK, vmem_limit_bytes=RAGGED_VMEM_BYTES)

  q = q_b1kgh.reshape(b, k * g, h)
  if mesh is None:
    out = local(q, kv_bs2kh, positions_b)
  else:
    spec = jax.sharding.PartitionSpec
    rows = tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1) or None
    heads = head_axis if head_axis is not None and mesh.shape.get(head_axis, 1) > 1 else None
    out = jax.shard_map(local, mesh=mesh, in_specs=(spec(rows, heads), spec(rows, None, heads),
                                                    spec(rows)),
                        out_specs=spec(rows, heads), check_vma=False)(q, kv_bs2kh, positions_b)
  return out.reshape(b, 1, k, g, h)


def paged_reference(q_bnh, *, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale: float):
  """The ragged paged attention kernel's result for one query per row (a decode step), in XLA:
  each row's pages gathered through ``page_indices``, positions at or past ``kv_lens`` masked.
  ``cu_q_lens`` and ``num_seqs`` must say one query per row (checked by shape only)."""
  b, n, h = q_bnh.shape
  if cu_q_lens.shape != (b + 1,) or num_seqs.shape != (1,):
    raise ValueError("paged_reference takes one query per row")
  pages = kv_pages[page_indices]  # [B, pages per row, P, 2K, H]
  kv = pages.reshape((b, -1) + kv_pages.shape[2:])
  key, val = kv[:, :, 0::2], kv[:, :, 1::2]
  k = key.shape[2]
  q = q_bnh.reshape(b, k, n // k, h)
  scores = jnp.einsum("BKGH,BSKH->BKGS", q, key).astype(jnp.float32) * sm_scale
  visible = jnp.arange(kv.shape[1])[None, :] < kv_lens[:, None]
  scores = jnp.where(visible[:, None, None, :], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(q_bnh.dtype)
  return jnp.einsum("BKGS,BSKH->BKGH", probs, val).reshape(b, n, h)
