"""Qwen2 / Llama-family decoder in Flax linen.

One module serves training and decoding:

* training / scoring: ``Transformer(tokens_bt, positions_bt, segment_ids_bt)``; packed sequences share a
  row and are kept apart by segment ids (attention only within a segment, causal by index);
* decoding: ``Transformer(tokens_bt, positions_bt, cache=cache)`` writes the new keys/values into a KV cache
  at ``positions_bt`` and attends to cache entries ``s <= position``. Prefill is a call with the prompt,
  each decode step a call with one token per row. Rows may sit at different positions (continuous
  batching), and entries beyond a row's position are never read, so stale cache contents are harmless.
* prefill into slots: ``Transformer(tokens_bt, positions_bt, cache=cache, cache_rows_b=rows)`` prefills
  rows that start at position 0 and writes their keys/values straight into cache rows ``rows`` (out of
  range: dropped). Attention runs over the new tokens only, so no second cache of the batch is built.
* ``attention_chunk=C`` computes training and prefill attention C queries at a time, each block's mask
  built from the segment ids, so no ``[B, T, T]`` mask or scores exist (decode steps are unchanged).
* training with ``remat=True`` keeps only each block's input for the backward pass and recomputes the
  rest; ``scan_layers=True`` runs the blocks as one ``lax.scan`` over a stacked copy of their
  parameters (training and scoring only; the parameters keep their per-layer layout), so the program
  holds one block, not ``num_layers`` copies of it; ``hidden_only=True`` returns the final hidden states and the output projection instead of the
  logits, for a log-softmax that never holds ``[B, T, V]`` (``rl.logprobs``).

Parameters carry logical axis names (see ``asyncrl_jax.infra.sharding``); outside this module they are a plain
nested dict of arrays.
"""

from __future__ import annotations

from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from asyncrl_jax.models.config import ModelConfig

# A KV cache: one (keys [B, S, K, H], values [B, S, K, H]) pair per layer.
KVCache = tuple[tuple[jax.Array, jax.Array], ...]

_NEG_INF = -1e30  # finite, so fully masked rows (padding) give uniform weights, not NaN


def _dtype(name: str):
  return jnp.dtype(name)


def _param(module: nn.Module, name: str, init, shape: Sequence[int], axes: Sequence[Optional[str]],
           cfg: ModelConfig):
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape),
                      _dtype(cfg.param_dtype))


def _constrain(x, axes, mesh):
  if mesh is None:
    return x
  return nn.with_logical_constraint(x, axes, mesh=mesh)


class RMSNorm(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), ("norm",), self.cfg)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.cfg.rms_norm_eps)
    return (scale.astype(jnp.float32) * x32).astype(_dtype(self.cfg.dtype))


def rope(x_btnh: jax.Array, positions_bt: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, half-split convention (as in Hugging Face Qwen2/Llama)."""
  half = x_btnh.shape[-1] // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x_btnh.shape[-1]))
  angles_bth = positions_bt.astype(jnp.float32)[..., None] * inv_freq
  cos, sin = jnp.cos(angles_bth)[:, :, None, :], jnp.sin(angles_bth)[:, :, None, :]
  x1, x2 = x_btnh[..., :half].astype(jnp.float32), x_btnh[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_btnh.dtype)


def _dense_attention(q_btkgh, key_bskh, val_bskh, mask_bts):
  """Softmax attention of grouped queries over every key, ``mask_bts`` saying which are visible."""
  h = q_btkgh.shape[-1]
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", q_btkgh, key_bskh).astype(jnp.float32) / jnp.sqrt(jnp.float32(h))
  scores = jnp.where(mask_bts[:, None, None, :, :], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(q_btkgh.dtype)
  return jnp.einsum("BKGTS,BSKH->BTKGH", probs, val_bskh)


def _blockwise_attention(q_btkgh, key_btkh, val_btkh, segment_ids_bt, chunk: int):
  """Causal attention within segments, ``chunk`` queries at a time (training and prefill).

  Equal to ``_dense_attention`` with ``training_mask(segment_ids_bt)``, but the mask is built per
  block from the segment ids and each block is rematerialised, so neither pass holds more than one
  ``[B, heads, chunk, T]`` block of scores, nor the ``[B, T, T]`` mask.
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
    return _dense_attention(q_b, key_btkh, val_btkh, mask)

  out = jax.lax.map(block, blocks)  # [n, B, chunk, K, G, H]
  return out.swapaxes(0, 1).reshape((b, n * chunk) + out.shape[3:])[:, :t]


class Attention(nn.Module):
  """``mask`` is a boolean ``[B, T, S]`` (which keys each query sees), or, with ``attention_chunk``,
  the ``[B, T]`` segment ids of a training row or prefill (causal within segments, blockwise)."""

  cfg: ModelConfig
  mesh: Optional[jax.sharding.Mesh] = None
  attention_chunk: int = 0

  @nn.compact
  def __call__(self, x_btd, positions_bt, mask, cache=None, cache_rows_b=None):
    cfg = self.cfg
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    dt = _dtype(cfg.dtype)
    init = nn.initializers.normal(0.02)
    wq = _param(self, "q", init, (d, n, h), ("embed", "heads", "head_dim"), cfg)
    wk = _param(self, "k", init, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg)
    wv = _param(self, "v", init, (d, k, h), ("embed", "kv_heads", "head_dim"), cfg)
    wo = _param(self, "o", init, (n, h, d), ("heads", "head_dim", "embed"), cfg)
    x = x_btd.astype(dt)
    q = jnp.einsum("BTD,DNH->BTNH", x, wq.astype(dt))
    key = jnp.einsum("BTD,DKH->BTKH", x, wk.astype(dt))
    val = jnp.einsum("BTD,DKH->BTKH", x, wv.astype(dt))
    if cfg.qkv_bias:
      zeros = nn.initializers.zeros
      q = q + _param(self, "q_bias", zeros, (n, h), ("heads", "head_dim"), cfg).astype(dt)
      key = key + _param(self, "k_bias", zeros, (k, h), ("kv_heads", "head_dim"), cfg).astype(dt)
      val = val + _param(self, "v_bias", zeros, (k, h), ("kv_heads", "head_dim"), cfg).astype(dt)
    q = rope(q, positions_bt, cfg.rope_theta)
    key = rope(key, positions_bt, cfg.rope_theta)

    new_cache = None
    if cache is not None:
      cache_k, cache_v = cache
      rows = (jnp.arange(x.shape[0]) if cache_rows_b is None else cache_rows_b)[:, None]
      cache_k = cache_k.at[rows, positions_bt].set(key.astype(cache_k.dtype), mode="drop")
      cache_v = cache_v.at[rows, positions_bt].set(val.astype(cache_v.dtype), mode="drop")
      new_cache = (cache_k, cache_v)
      if cache_rows_b is None:  # decoding: attend to the whole cache; a slot prefill, to its own tokens
        key, val = cache_k.astype(dt), cache_v.astype(dt)

    b, t = q.shape[:2]
    q = q.reshape(b, t, k, n // k, h)  # group query heads by the kv head they share
    if mask.ndim == 2:
      out = _blockwise_attention(q, key, val, mask, self.attention_chunk)
    else:
      out = _dense_attention(q, key, val, mask)
    out = jnp.einsum("BTNH,NHD->BTD", out.reshape(b, t, n, h), wo.astype(dt))
    return _constrain(out, ("activation_batch", "activation_length", "activation_embed"),
                      self.mesh), new_cache


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_btd):
    cfg = self.cfg
    dt = _dtype(cfg.dtype)
    init = nn.initializers.normal(0.02)
    gate = _param(self, "gate", init, (cfg.hidden_size, cfg.intermediate_size), ("embed", "mlp"), cfg)
    up = _param(self, "up", init, (cfg.hidden_size, cfg.intermediate_size), ("embed", "mlp"), cfg)
    down = _param(self, "down", init, (cfg.intermediate_size, cfg.hidden_size), ("mlp", "embed"), cfg)
    x = x_btd.astype(dt)
    hidden = nn.silu(x @ gate.astype(dt)) * (x @ up.astype(dt))
    return hidden @ down.astype(dt)


class Block(nn.Module):
  cfg: ModelConfig
  mesh: Optional[jax.sharding.Mesh] = None
  attention_chunk: int = 0

  @nn.compact
  def __call__(self, x_btd, positions_bt, mask, cache=None, cache_rows_b=None):
    attn, new_cache = Attention(self.cfg, self.mesh, self.attention_chunk, name="attn")(
        RMSNorm(self.cfg, name="attn_norm")(x_btd), positions_bt, mask, cache, cache_rows_b)
    x_btd = x_btd + attn
    x_btd = x_btd + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg, name="mlp_norm")(x_btd))
    return x_btd, new_cache


def training_mask(segment_ids_bt: jax.Array) -> jax.Array:
  """[B, T, T] mask: same segment and key index <= query index."""
  t = segment_ids_bt.shape[1]
  causal = jnp.tril(jnp.ones((t, t), dtype=bool))
  same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
  return same & causal[None]


def cache_mask(positions_bt: jax.Array, cache_len: int) -> jax.Array:
  """[B, T, S] mask for cached decoding: cache entry s is visible to a query at position p iff s <= p."""
  return jnp.arange(cache_len)[None, None, :] <= positions_bt[:, :, None]


class Transformer(nn.Module):
  """Returns float32 logits ``[B, T, V]`` (and the updated cache when one is given).

  ``logits_at_b`` (int ``[B]``): compute the logits at that one position of each row only, ``[B, 1,
  V]``: a prefill needs the next-token logits after the prompt, not ``[B, T, V]`` (at a 150k
  vocabulary that buffer dominates prefill memory). ``cache_rows_b`` (int ``[B]``, with a cache):
  prefill from position 0 into those cache rows. ``hidden_only``: return ``(hidden [B, T, D], head
  [D, V])`` instead of the logits (training only).
  """

  cfg: ModelConfig
  mesh: Optional[jax.sharding.Mesh] = None
  remat: bool = False  # training: recompute each block in the backward pass
  attention_chunk: int = 0  # training and prefill: queries per attention block (0: all at once)
  scan_layers: bool = False  # training and scoring: the blocks as one loop (lax.scan)

  @nn.compact
  def __call__(self, tokens_bt, positions_bt, segment_ids_bt=None, cache: Optional[KVCache] = None,
               logits_at_b: Optional[jax.Array] = None, cache_rows_b: Optional[jax.Array] = None,
               hidden_only: bool = False):
    cfg = self.cfg
    embed = _param(self, "embed", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.hidden_size),
                   ("vocab", "embed"), cfg)
    x = jnp.take(embed, tokens_bt, axis=0).astype(_dtype(cfg.dtype))
    x = _constrain(x, ("activation_batch", "activation_length", "activation_embed"), self.mesh)
    if cache is None or cache_rows_b is not None:
      if segment_ids_bt is None:
        segment_ids_bt = jnp.ones_like(tokens_bt)
      # blockwise: each attention block builds its own part of the mask from the segment ids
      mask = segment_ids_bt if self.attention_chunk else training_mask(segment_ids_bt)
    else:
      mask = cache_mask(positions_bt, cache[0][0].shape[1])
    block = nn.remat(Block) if self.remat and cache is None else Block
    new_cache = []
    if self.scan_layers and cache is None and not self.is_initializing():
      x = self._scanned_blocks(x, positions_bt, mask)
    else:
      for i in range(cfg.num_layers):
        layer = block(cfg, self.mesh, self.attention_chunk, name=f"layer_{i}")
        if cache is None:
          x, layer_cache = layer(x, positions_bt, mask)
        else:
          x, layer_cache = layer(x, positions_bt, mask, cache[i], cache_rows_b)
        new_cache.append(layer_cache)
    if logits_at_b is not None:
      x = jnp.take_along_axis(x, logits_at_b[:, None, None], axis=1)  # [B, 1, D]
    x = RMSNorm(cfg, name="final_norm")(x)
    if cfg.tie_embeddings:
      head = embed.T
    else:
      head = _param(self, "lm_head", nn.initializers.normal(0.02), (cfg.hidden_size, cfg.vocab_size),
                    ("embed", "vocab"), cfg)
    if hidden_only:
      return x, head
    logits = jnp.einsum("BTD,DV->BTV", x, head.astype(x.dtype)).astype(jnp.float32)
    if cache is None:
      return logits
    return logits, tuple(new_cache)

  def _scanned_blocks(self, x, positions_bt, mask):
    """The blocks as one ``lax.scan`` over their parameters stacked along a new leading axis (each
    step all-gathers one layer's FSDP shards), rematerialised per layer with ``remat``; the same
    computation as the unrolled loop."""
    params = self.variables["params"]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs),
                           *[params[f"layer_{i}"] for i in range(self.cfg.num_layers)])
    block = Block(self.cfg, self.mesh, self.attention_chunk, parent=None)

    def step(x, layer_params):
      y, _ = block.apply({"params": layer_params}, x, positions_bt, mask)
      return y, None

    x, _ = jax.lax.scan(jax.checkpoint(step) if self.remat else step, x, stacked)
    return x
