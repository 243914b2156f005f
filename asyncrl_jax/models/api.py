"""Functional model API: params are a plain nested dict of arrays at every boundary.

* ``init_params(config, rng, mesh=None)``: random parameters, created already sharded when a mesh is given.
* ``logits(config, params, tokens, positions=None, segment_ids=None, mesh=None)``: float32 ``[B, T, V]``.
* ``init_cache`` / ``decode``: KV-cache prefill and one-token decode steps.
* ``serving_dtypes`` / ``serving_params``: the dtypes a decode server holds the parameters in, and the
  cast to them.

Jitted functions are cached per (config, mesh), so repeated calls with the same shapes do not retrace.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from asyncrl_jax.infra import sharding as sharding_lib
from asyncrl_jax.models.config import ModelConfig
from asyncrl_jax.models import quant
from asyncrl_jax.models.forward import Forward
from asyncrl_jax.models.transformer import CACHE_LAYOUTS, KVCache, Transformer

Params = dict


def _module(config: ModelConfig, mesh: Optional[Mesh], forward: Forward = Forward()) -> Transformer:
  return Transformer(config, mesh, forward)


def _boxed_init(config: ModelConfig, mesh: Optional[Mesh]):
  model = _module(config, mesh)

  def init_fn(rng):
    tokens = jnp.zeros((1, 1), jnp.int32)
    with nn.logical_axis_rules(sharding_lib.LOGICAL_RULES):
      return model.init(rng, tokens, tokens)["params"]

  return init_fn


@functools.lru_cache(maxsize=64)
def _abstract_params(config: ModelConfig) -> Params:
  return nn.unbox(jax.eval_shape(_boxed_init(config, None), jax.random.key(0)))


def abstract_params(config: ModelConfig) -> Params:
  """Shapes and dtypes of the parameters (``jax.ShapeDtypeStruct`` leaves), computed without FLOPs
  (once per config: tracing makes a key on the device, which a decode loop under
  ``jax.transfer_guard("disallow")`` must not)."""
  return jax.tree.map(lambda x: x, _abstract_params(config))  # a fresh tree: callers may edit it


def param_shardings(config: ModelConfig, mesh: Mesh, rules=sharding_lib.LOGICAL_RULES) -> Params:
  """NamedShardings of every parameter on ``mesh`` under the logical axis ``rules``."""
  boxed = jax.eval_shape(_boxed_init(config, None), jax.random.key(0))
  shardings = sharding_lib.mesh_shardings(nn.get_partition_spec(boxed), mesh, rules)
  sharding_lib.check_divisible(nn.unbox(boxed), shardings)
  return shardings


# Leaves the model applies in float32 whatever the compute dtype (RMSNorm's scale): served as stored.
_KEPT_AS_STORED = ("scale",)


def serving_dtypes(config: ModelConfig) -> Params:
  """The dtype a decode server holds each parameter in (a pytree of ``numpy.dtype``).

  The model casts every kernel, embedding and bias to the compute dtype (``config.dtype``) before
  using it, so holding those in the compute dtype (when it is narrower than ``param_dtype``) gives
  the same logits bit for bit, with half the bytes to store and to read per decode step at bfloat16.
  The norm scales are applied in float32 and keep ``param_dtype``: rounding them would change the
  behaviour policy.
  """
  compute, stored = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
  narrow = compute if compute.itemsize < stored.itemsize else stored

  def one(path, leaf):
    name = getattr(path[-1], "key", None)
    return jnp.dtype(leaf.dtype) if name in _KEPT_AS_STORED else narrow

  return jax.tree_util.tree_map_with_path(one, abstract_params(config))


def serving_params(config: ModelConfig, params: Params) -> Params:
  """``params`` cast to ``serving_dtypes`` (each leaf where it lies; leaves already in their serving
  dtype are returned as they are)."""
  return jax.tree.map(lambda x, dt: x if x.dtype == dt else x.astype(dt), params,
                      serving_dtypes(config))


def init_fn(config: ModelConfig, mesh: Optional[Mesh] = None):
  """The (traceable) function from a key to random parameters of ``config``."""
  boxed = _boxed_init(config, mesh)
  return lambda r: nn.unbox(boxed(r))


def init_params(config: ModelConfig, rng: jax.Array, mesh: Optional[Mesh] = None) -> Params:
  """Random parameters; with a mesh they are created in place, already sharded (no host round trip)."""
  unboxed_init = init_fn(config, mesh)
  if mesh is None:
    return jax.jit(unboxed_init)(rng)
  return jax.jit(unboxed_init, out_shardings=param_shardings(config, mesh))(rng)


@functools.lru_cache(maxsize=None)
def _jitted_logits(config: ModelConfig, mesh: Optional[Mesh]):
  model = _module(config, mesh)

  def fn(params, tokens_bt, positions_bt, segment_ids_bt):
    with nn.logical_axis_rules(sharding_lib.LOGICAL_RULES):
      return model.apply({"params": params}, tokens_bt, positions_bt, segment_ids_bt)

  return jax.jit(fn)


def _apply(config, params, tokens_bt, positions_bt, segment_ids_bt, mesh, forward, routes_btlk,
           with_moe, **kwargs):
  module = _module(config, mesh, forward)
  args = ({"params": params}, tokens_bt, positions_bt, segment_ids_bt)
  with nn.logical_axis_rules(sharding_lib.LOGICAL_RULES):
    if not with_moe:
      return module.apply(*args, routes_btlk=routes_btlk, **kwargs)
    out, state = module.apply(*args, routes_btlk=routes_btlk, mutable=["moe"], **kwargs)
  return out, moe_outputs(config, state)


def apply_logits(config: ModelConfig, params: Params, tokens_bt, positions_bt, segment_ids_bt,
                 mesh: Optional[Mesh] = None, *, forward: Forward = Forward(), routes_btlk=None,
                 with_moe: bool = False):
  """Traceable forward (use inside other jitted functions, e.g. a loss); ``forward`` changes how,
  not what, it computes (``models.forward``). A mixture-of-experts model: ``routes_btlk`` replays
  those experts; ``with_moe`` returns ``(logits, MoEOutputs)``."""
  return _apply(config, params, tokens_bt, positions_bt, segment_ids_bt, mesh, forward, routes_btlk,
                with_moe)


def apply_hidden(config: ModelConfig, params: Params, tokens_bt, positions_bt, segment_ids_bt,
                 mesh: Optional[Mesh] = None, *, forward: Forward = Forward(), routes_btlk=None,
                 with_moe: bool = False):
  """Traceable forward up to the output projection: (final hidden states ``[B, T, D]``, head ``[D,
  V]``); ``hidden @ head`` are the logits. For a log-softmax computed a vocabulary chunk at a time.
  ``routes_btlk`` / ``with_moe`` as ``apply_logits`` (``((hidden, head), MoEOutputs)``)."""
  return _apply(config, params, tokens_bt, positions_bt, segment_ids_bt, mesh, forward, routes_btlk,
                with_moe, hidden_only=True)


def _check_tokens(config: ModelConfig, tokens, name: str = "tokens") -> None:
  shape = getattr(tokens, "shape", None)
  if shape is None or len(shape) != 2:
    raise ValueError(f"{name} must be a 2-D integer array [B, T], got shape {shape}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got dtype {tokens.dtype}")
  if isinstance(tokens, (np.ndarray, jax.Array)) and not isinstance(tokens, jax.core.Tracer):
    if tokens.size:
      lo, hi = int(np.min(tokens)), int(np.max(tokens))
      if lo < 0 or hi >= config.vocab_size:
        raise ValueError(f"{name} contains ids outside [0, {config.vocab_size}): min {lo}, max {hi}")


def default_positions(tokens_bt) -> jax.Array:
  b, t = tokens_bt.shape
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def logits(config: ModelConfig, params: Params, tokens, *, positions=None, segment_ids=None,
           mesh: Optional[Mesh] = None) -> jax.Array:
  """Float32 logits ``[B, T, V]`` for int tokens ``[B, T]``.

  Args:
    config: the model configuration.
    params: parameter pytree (as returned by ``init_params`` or ``load_hf``).
    tokens: int ``[B, T]`` token ids.
    positions: int ``[B, T]`` RoPE positions; default ``0..T-1`` in every row.
    segment_ids: int ``[B, T]``; tokens attend only to earlier tokens with the same id (packing).
    mesh: when given, activations are constrained to the learner layout on this mesh.
  """
  _check_tokens(config, tokens)
  tokens = jnp.asarray(tokens, jnp.int32)
  positions = default_positions(tokens) if positions is None else jnp.asarray(positions, jnp.int32)
  segment_ids = jnp.ones_like(tokens) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
    if arr.shape != tokens.shape:
      raise ValueError(f"{name} has shape {arr.shape}, expected the tokens' shape {tokens.shape}")
  return _jitted_logits(config, mesh)(params, tokens, positions, segment_ids)


class MoEOutputs(NamedTuple):
  """What a mixture-of-experts forward pass reports besides its output."""
  routes: jax.Array  # [B, T, L_moe, k] int16: the experts used (the replayed ones under replay)
  aux_loss: jax.Array  # the load-balancing loss, averaged over the MoE layers
  load: jax.Array  # [L_moe, E]: the fraction of routing slots each expert took
  own_routes: jax.Array  # [B, T, L_moe, k] int16: the router's own top k (= routes without replay)
  dropped: jax.Array  # the fraction of valid routing slots the exchange's capacity dropped, mean over layers


def moe_outputs(config: ModelConfig, state: dict) -> MoEOutputs:
  """What a mixture-of-experts model's layers sowed into the ``"moe"`` collection (an apply with
  ``mutable=["moe"]``; unrolled or scanned layers alike)."""
  moe = state.get("moe", {})
  if "scanned_routes" in moe:
    loss_l, load_le, own_lbtk, dropped_l = moe["scanned_aux"][0]
    return MoEOutputs(jnp.moveaxis(moe["scanned_routes"][0], 0, 2), jnp.mean(loss_l), load_le,
                      jnp.moveaxis(own_lbtk, 0, 2), jnp.mean(dropped_l))
  layers = [moe[f"layer_{i}"]["mlp"] for i in config.moe_layers]
  return MoEOutputs(routes=jnp.stack([layer["routes"][0] for layer in layers], axis=2),
                    aux_loss=jnp.mean(jnp.stack([layer["aux"][0][0] for layer in layers])),
                    load=jnp.stack([layer["aux"][0][1] for layer in layers]),
                    own_routes=jnp.stack([layer["aux"][0][2] for layer in layers], axis=2),
                    dropped=jnp.mean(jnp.stack([layer["aux"][0][3] for layer in layers])))


@functools.lru_cache(maxsize=None)
def _jitted_logits_and_routes(config: ModelConfig, mesh: Optional[Mesh], forward: Forward):
  model = _module(config, mesh, forward)

  def fn(params, tokens_bt, positions_bt, segment_ids_bt, routes_btlk):
    with nn.logical_axis_rules(sharding_lib.LOGICAL_RULES):
      out, state = model.apply({"params": params}, tokens_bt, positions_bt, segment_ids_bt,
                               routes_btlk=routes_btlk, mutable=["moe"])
    return (out, *moe_outputs(config, state)[:3])

  return jax.jit(fn)


def logits_and_routes(config: ModelConfig, params: Params, tokens, *, positions=None, segment_ids=None,
                      routes=None, mesh: Optional[Mesh] = None, forward: Forward = Forward()):
  """A mixture-of-experts model's ``logits``, with the experts each token was routed to: ``(logits
  [B, T, V], routes [B, T, L_moe, k] int16, load-balancing loss, load [L_moe, E])``. ``routes``
  (``[B, T, L_moe, k]``) replays those experts instead of the router's top k (routing replay)."""
  if not config.moe:
    raise ValueError("logits_and_routes needs a mixture-of-experts model (model.num_experts > 0)")
  _check_tokens(config, tokens)
  tokens = jnp.asarray(tokens, jnp.int32)
  positions = default_positions(tokens) if positions is None else jnp.asarray(positions, jnp.int32)
  segment_ids = jnp.ones_like(tokens) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
  if routes is not None:
    routes = jnp.asarray(routes)
    if routes.shape[:2] != tokens.shape:
      raise ValueError(f"routes has shape {routes.shape}; expected the tokens' {tokens.shape} first")
  return _jitted_logits_and_routes(config, mesh, forward)(params, tokens, positions, segment_ids, routes)


def init_cache(config: ModelConfig, batch: int, length: int, dtype=None, *,
               layout: str = "split") -> KVCache:
  """An empty KV cache of ``length`` positions per row, per layer: with ``layout="split"`` a pair
  (keys, values), each ``[batch, length, num_kv_heads, head_dim]``; with ``"paged"`` one ``[batch,
  length, 2 x num_kv_heads, head_dim]`` array, each kv head's key and value side by side
  (``transformer.interleave_kv``), which the ragged decode kernel needs (``cache_layout``)."""
  if length > config.max_seq_len:
    raise ValueError(f"cache length {length} exceeds model.max_seq_len={config.max_seq_len}")
  if layout not in CACHE_LAYOUTS:
    raise ValueError(f"unknown KV cache layout {layout!r}; expected one of {CACHE_LAYOUTS}")
  dtype = jnp.dtype(dtype or config.dtype)
  if layout == "paged":
    shape = (batch, length, 2 * config.num_kv_heads, config.head_dim)
    return tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
  shape = (batch, length, config.num_kv_heads, config.head_dim)
  return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_layers))


def cache_layout(decode: str) -> str:
  """The KV cache layout a decode attention implementation reads (``Forward.decode``): "paged" for
  the ragged kernel, "split" for XLA's masked attention."""
  return "paged" if decode == "ragged" else "split"


def cache_length(cache: KVCache) -> int:
  """Positions per row of a KV cache."""
  return jax.tree.leaves(cache)[0].shape[1]


def apply_decode(config: ModelConfig, params: Params, tokens_bt, positions_bt, cache: KVCache,
                 mesh: Optional[Mesh] = None, *, logits_at_b=None, cache_rows_b=None,
                 attention_chunk: int = 0, decode: str = "xla", with_routes: bool = False):
  """Traceable cached forward: writes keys/values at ``positions_bt``; returns (logits [B,T,V], cache),
  or (logits [B,1,V] at ``logits_at_b`` only, cache) when a position per row is given (a prefill).

  ``cache_rows_b``: the rows are prefills from position 0 written into these cache rows (a cache with
  more rows than the batch, e.g. the decode slots); ids out of range are dropped (padding rows).
  ``attention_chunk``: such a prefill attends that many queries at a time. ``decode``: how a decode
  step (one token per row) attends to the cache (``Forward.decode``). ``with_routes`` (a
  mixture-of-experts model): also return the experts each token was routed to, ``(logits, cache,
  routes [B, T, L_moe, k] int16)``.
  """
  if quant.is_quantized(params):  # int8 serving weights (``models.quant``): dequantized as read
    params = quant.dequantize(params, jnp.dtype(config.dtype))
  module = _module(config, mesh, Forward(attention_chunk=attention_chunk, decode=decode))
  args = ({"params": params}, tokens_bt, positions_bt, None, cache, logits_at_b, cache_rows_b)
  with nn.logical_axis_rules(sharding_lib.LOGICAL_RULES):
    if not with_routes:
      return module.apply(*args)
    (logits, new_cache), state = module.apply(*args, mutable=["moe"])
  return logits, new_cache, moe_outputs(config, state).routes


@functools.lru_cache(maxsize=None)
def _jitted_decode(config: ModelConfig, mesh: Optional[Mesh]):
  return jax.jit(functools.partial(apply_decode, config, mesh=mesh), donate_argnums=(3,))


def decode(config: ModelConfig, params: Params, tokens_bt, positions_bt, cache: KVCache,
           mesh: Optional[Mesh] = None) -> tuple[jax.Array, KVCache]:
  """Prefill (T > 1) or decode step (T == 1) against a KV cache; the input cache is donated."""
  return _jitted_decode(config, mesh)(params, jnp.asarray(tokens_bt, jnp.int32),
                                      jnp.asarray(positions_bt, jnp.int32), cache)


def aligned(logp_bt, entropy_bt, segment_ids_bt, with_entropy: bool):
  """Shifts next-token values ``[B, T-1]`` (predicted at ``t - 1``) to ``[B, T]`` and zeroes every
  position without context in its segment."""
  valid = (segment_ids_bt[:, 1:] == segment_ids_bt[:, :-1]) & (segment_ids_bt[:, 1:] > 0)
  pad = jnp.zeros_like(logp_bt[:, :1])
  logp = jnp.concatenate([pad, jnp.where(valid, logp_bt, 0.0)], axis=1)
  if not with_entropy:
    return logp
  return logp, jnp.concatenate([pad, jnp.where(valid, entropy_bt, 0.0)], axis=1)


def count_params(params: Any) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
