"""The decoder of every supported family (Qwen2, Llama 2 / 3.x, Qwen3, Qwen3-MoE) in Flax linen.

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
* ``forward`` (``models.forward.Forward``) says how a training, scoring or prefill pass runs: the
  attention implementation (``models.attention``: the XLA reference, whole-row or ``attention_chunk``
  queries at a time, or the splash TPU kernel), the remat policy (what each block keeps for the
  backward pass), and ``scan_layers`` (the blocks as one ``lax.scan`` over a stacked copy of their
  parameters: the program holds one block, not ``num_layers`` copies; the parameters keep their
  per-layer layout). None of them changes the values. ``hidden_only=True`` returns the final hidden
  states and the output projection instead of the
  logits, for a log-softmax that never holds ``[B, T, V]`` (``rl.logprobs``).

Parameters carry logical axis names (see ``asyncrl_jax.infra.sharding``); outside this module they are a plain
nested dict of arrays.
"""

from __future__ import annotations

from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from asyncrl_jax.models import attention as attention_lib
from asyncrl_jax.models import layers, moe as moe_lib, rope as rope_lib
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.models.forward import Forward

# A KV cache, one entry per layer in one of two layouts (``api.init_cache``'s ``layout``):
# * "paged": one array [B, S, 2K, H], each kv head's key and value side by side (key of head i at
#   2i, value at 2i + 1): the layout of paged attention's pages, so that a slot's rows are its pages
#   (``models.attention.ragged_decode``, the TPU decode kernel);
# * "split": a pair (keys [B, S, K, H], values [B, S, K, H]): XLA's masked decode attention reads
#   each directly (on CPU, slicing keys and values out of the paged layout costs a copy of the whole
#   cache per layer and step: 1.5x the decode step's time at the default config).
KVCache = tuple  # of [B, S, 2K, H] arrays, or of (keys, values) pairs
CACHE_LAYOUTS = ("split", "paged")


def interleave_kv(key_btkh: jax.Array, val_btkh: jax.Array) -> jax.Array:
  """Keys and values ``[B, T, K, H]`` as one ``[B, T, 2K, H]`` array, key and value of a head side by
  side."""
  b, t, k, h = key_btkh.shape
  return jnp.stack([key_btkh, val_btkh], axis=3).reshape(b, t, 2 * k, h)


def split_kv(kv_bt2kh: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``interleave_kv``'s inverse: (keys, values), each ``[B, T, K, H]``."""
  return kv_bt2kh[:, :, 0::2], kv_bt2kh[:, :, 1::2]


_dtype = layers.dtype_of
_param = layers.param
_adapter = layers.adapter
_plus = layers.plus
_constrain = layers.constrain
RMSNorm = layers.RMSNorm


class Attention(nn.Module):
  """``mask`` is a boolean ``[B, T, S]`` (which keys each query sees), or the ``[B, T]`` segment ids
  of a training row or prefill (causal within segments, as ``forward`` says: ``models.attention``)."""

  cfg: ModelConfig
  mesh: Optional[jax.sharding.Mesh] = None
  forward: Forward = Forward()

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
    q = _plus(jnp.einsum("BTD,DNH->BTNH", x, wq.astype(dt)),
              _adapter(self, "q", x, (d,), ("embed",), (n, h), ("heads", "head_dim"), cfg))
    key = _plus(jnp.einsum("BTD,DKH->BTKH", x, wk.astype(dt)),
                _adapter(self, "k", x, (d,), ("embed",), (k, h), ("kv_heads", "head_dim"), cfg))
    val = _plus(jnp.einsum("BTD,DKH->BTKH", x, wv.astype(dt)),
                _adapter(self, "v", x, (d,), ("embed",), (k, h), ("kv_heads", "head_dim"), cfg))
    if cfg.qkv_bias:
      zeros = nn.initializers.zeros
      q = q + _param(self, "q_bias", zeros, (n, h), ("heads", "head_dim"), cfg).astype(dt)
      key = key + _param(self, "k_bias", zeros, (k, h), ("kv_heads", "head_dim"), cfg).astype(dt)
      val = val + _param(self, "v_bias", zeros, (k, h), ("kv_heads", "head_dim"), cfg).astype(dt)
    if cfg.qk_norm:  # Qwen3: RMSNorm over head_dim on each query and key head, before RoPE
      q = RMSNorm(cfg, name="q_norm")(q)
      key = RMSNorm(cfg, name="k_norm")(key)
    inv_freq, attention_factor = rope_lib.frequencies(cfg)
    q = rope_lib.apply(q, positions_bt, inv_freq, attention_factor)
    key = rope_lib.apply(key, positions_bt, inv_freq, attention_factor)

    b, t = q.shape[:2]
    q = q.reshape(b, t, k, n // k, h)  # group query heads by the kv head they share
    new_cache = None
    if cache is not None:
      rows = (jnp.arange(x.shape[0]) if cache_rows_b is None else cache_rows_b)[:, None]
      paged = not isinstance(cache, tuple)
      if paged:
        new_cache = cache.at[rows, positions_bt].set(interleave_kv(key, val).astype(cache.dtype),
                                                     mode="drop")
      else:
        new_cache = tuple(c.at[rows, positions_bt].set(v.astype(c.dtype), mode="drop")
                          for c, v in zip(cache, (key, val)))
      if cache_rows_b is None and t == 1 and self.forward.decode == "ragged":
        if not paged:
          raise ValueError('decode attention "ragged" needs the KV cache in the "paged" layout '
                           '(init_cache(..., layout="paged")); this one is "split"')
        out = attention_lib.ragged_decode(q, new_cache, positions_bt[:, 0], mesh=self.mesh)
        out = self._out(out.reshape(b, t, n, h), wo)
        return _constrain(out, ("activation_batch", "activation_length", "activation_embed"),
                          self.mesh), new_cache
      if cache_rows_b is None:  # decoding: attend to the whole cache; a slot prefill, to its own tokens
        key, val = (x.astype(dt) for x in (split_kv(new_cache) if paged else new_cache))

    if mask.ndim == 2:
      out = attention_lib.segment_attention(q, key, val, mask, kind=self.forward.attention,
                                            chunk=self.forward.attention_chunk, mesh=self.mesh)
    else:
      out = attention_lib.dense(q, key, val, mask)
    out = self._out(out.reshape(b, t, n, h), wo)
    return _constrain(out, ("activation_batch", "activation_length", "activation_embed"),
                      self.mesh), new_cache


  def _out(self, out_btnh, wo):
    """The output projection (and its adapter) of the heads' outputs."""
    cfg = self.cfg
    return _plus(jnp.einsum("BTNH,NHD->BTD", out_btnh, wo.astype(_dtype(cfg.dtype))),
                 _adapter(self, "o", out_btnh, (cfg.num_heads, cfg.head_dim), ("heads", "head_dim"),
                          (cfg.hidden_size,), ("embed",), cfg))


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
    d, f = (cfg.hidden_size,), (cfg.intermediate_size,)
    hidden = (nn.silu(_plus(x @ gate.astype(dt), _adapter(self, "gate", x, d, ("embed",), f, ("mlp",), cfg)))
              * _plus(x @ up.astype(dt), _adapter(self, "up", x, d, ("embed",), f, ("mlp",), cfg)))
    return _plus(hidden @ down.astype(dt), _adapter(self, "down", hidden, f, ("mlp",), d, ("embed",), cfg))


class Block(nn.Module):
  """One decoder layer; ``moe``: its MLP is a mixture of experts (``models.moe``), which takes the
  layer's replayed experts ``routes_btk`` when given."""

  cfg: ModelConfig
  mesh: Optional[jax.sharding.Mesh] = None
  forward: Forward = Forward()
  moe: bool = False

  @nn.compact
  def __call__(self, x_btd, positions_bt, mask, cache=None, cache_rows_b=None, routes_btk=None):
    attn, new_cache = Attention(self.cfg, self.mesh, self.forward, name="attn")(
        RMSNorm(self.cfg, name="attn_norm")(x_btd), positions_bt, mask, cache, cache_rows_b)
    x_btd = x_btd + attn
    h_btd = RMSNorm(self.cfg, name="mlp_norm")(x_btd)
    if self.moe:
      # the tokens the router statistics count: a training row's padding (segment 0) is not one
      valid_bt = mask != 0 if mask.ndim == 2 else jnp.ones(x_btd.shape[:2], bool)
      x_btd = x_btd + moe_lib.MoE(self.cfg, self.mesh, name="mlp")(h_btd, valid_bt, routes_btk)
    else:
      x_btd = x_btd + MLP(self.cfg, name="mlp")(h_btd)
    return x_btd, new_cache


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
  # how training, scoring and prefill passes run (attention kind and chunk, remat policy, layer
  # scan: ``models.forward``); decode steps ignore all but the chunk of a prefill's attention
  forward: Forward = Forward()

  @nn.compact
  def __call__(self, tokens_bt, positions_bt, segment_ids_bt=None, cache: Optional[KVCache] = None,
               logits_at_b: Optional[jax.Array] = None, cache_rows_b: Optional[jax.Array] = None,
               hidden_only: bool = False, routes_btlk: Optional[jax.Array] = None):
    cfg = self.cfg
    moe_index = {layer: j for j, layer in enumerate(cfg.moe_layers)}
    if routes_btlk is not None and tuple(routes_btlk.shape[2:]) != cfg.route_shape:
      raise ValueError(f"routes_btlk has shape {routes_btlk.shape}; this model replays [B, T, "
                       f"{cfg.route_shape[0]} MoE layers, {cfg.route_shape[1]} experts]")
    embed = _param(self, "embed", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.hidden_size),
                   ("vocab", "embed"), cfg)
    x = jnp.take(embed, tokens_bt, axis=0).astype(_dtype(cfg.dtype))
    x = _constrain(x, ("activation_batch", "activation_length", "activation_embed"), self.mesh)
    if cache is None or cache_rows_b is not None:
      if segment_ids_bt is None:
        segment_ids_bt = jnp.ones_like(tokens_bt)
      # blockwise: each attention block builds its own part of the mask from the segment ids
      mask = segment_ids_bt
    else:
      mask = cache_mask(positions_bt, jax.tree.leaves(cache[0])[0].shape[1])
    remat = self.forward.rematerialises and cache is None
    block = nn.remat(Block, policy=self.forward.checkpoint_policy()) if remat else Block
    new_cache = []
    if self.forward.scan_layers and cache is None and not self.is_initializing():
      x = self._scanned_blocks(x, positions_bt, mask, routes_btlk)
    else:
      for i in range(cfg.num_layers):
        layer = block(cfg, self.mesh, self.forward, moe=i in moe_index, name=f"layer_{i}")
        routes = None if routes_btlk is None or i not in moe_index else routes_btlk[:, :, moe_index[i]]
        if cache is None:
          x, layer_cache = layer(x, positions_bt, mask, None, None, routes)
        else:
          x, layer_cache = layer(x, positions_bt, mask, cache[i], cache_rows_b, routes)
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

  def _scanned_blocks(self, x, positions_bt, mask, routes_btlk=None):
    """The blocks as one ``lax.scan`` over their parameters stacked along a new leading axis (each
    step all-gathers one layer's FSDP shards), rematerialised per layer with ``remat``; the same
    computation as the unrolled loop. A mixture-of-experts model's routes and router statistics
    leave stacked over the layers (``scanned_routes`` [L, B, T, k], ``scanned_aux``) in the
    ``"moe"`` collection."""
    cfg = self.cfg
    moe = bool(cfg.moe_layers)
    if moe and len(cfg.moe_layers) != cfg.num_layers:
      raise ValueError("learner.scan_layers=True needs identical layers; this model mixes dense and "
                       f"mixture-of-experts layers (model.mlp_only_layers={list(cfg.mlp_only_layers)}, "
                       f"decoder_sparse_step={cfg.decoder_sparse_step})")
    params = self.variables["params"]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs),
                           *[params[f"layer_{i}"] for i in range(cfg.num_layers)])
    block = Block(cfg, self.mesh, self.forward, moe=moe, parent=None)
    collect = moe and self.is_mutable_collection("moe")

    def step(x, layer):
      layer_params, routes_btk = layer
      if not collect:
        y, _ = block.apply({"params": layer_params}, x, positions_bt, mask, routes_btk=routes_btk)
        return y, None
      (y, _), state = block.apply({"params": layer_params}, x, positions_bt, mask,
                                  routes_btk=routes_btk, mutable=["moe"])
      out = state["moe"]["mlp"]
      return y, (out["routes"][0], out["aux"][0])

    if self.forward.rematerialises:
      step = jax.checkpoint(step, policy=self.forward.checkpoint_policy())
    routes = None if routes_btlk is None else jnp.moveaxis(routes_btlk, 2, 0)
    x, outs = jax.lax.scan(step, x, (stacked, routes))
    if collect:
      self.sow("moe", "scanned_routes", outs[0])
      self.sow("moe", "scanned_aux", outs[1])
    return x
