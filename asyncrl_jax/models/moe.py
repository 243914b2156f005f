"""The mixture-of-experts MLP (Qwen3-MoE): dropless token-choice top-k routing.

Per token ``x`` [D]: router logits ``x W_r`` [E] (``router`` [D, E]), probabilities ``softmax`` over
all E experts in float32, the top k experts, their probabilities as weights (renormalised to sum 1
when ``norm_topk_prob``), and the output ``sum_j w_j down_e(silu(gate_e x) * up_e x)`` over the k
experts ``e`` chosen. Every token reaches its k experts: no capacity, nothing dropped.

Two ways to run the experts (``ModelConfig.moe_matmul``), one result:

* ``"ragged"``: the ``N k`` (token, expert) pairs sorted by expert and each expert's matmuls run on
  its contiguous group with ``jax.lax.ragged_dot``: ``N k`` rows of work where it lowers to a
  grouped matmul (TPU, GPU). XLA's CPU lowering instead masks every routing slot against every
  expert, ``N k E`` rows: on the CPU it is slower than "dense" (``benchmarks/moe_layer.py``);
* ``"dense"``: the reference: every expert on every token, the outputs combined with the routing
  weights (zero off the chosen k): ``N E`` rows of work; the faster path on the CPU twin.

Routing replay: given ``routes_btk`` (the experts a decode server chose for each token, recorded with
the trajectory), the layer uses those experts instead of its own top k; the weights are still its own
router's probabilities at those experts (renormalised alike), so the router keeps its gradient. The
chosen experts leave through the ``"moe"`` collection (``routes``), beside the layer's router
statistics (``aux``: the load-balancing loss, the per-expert load, and the router's own top k, which
differs from ``routes`` where replay overrode it) when the caller asks for them (``mutable=["moe"]``).

Parameters (logical axes for ``infra.sharding``): ``router`` [D, E] (``embed``, ``expert_router``),
``experts_gate`` / ``experts_up`` [E, D, F] (``expert``, ``embed``, ``moe_mlp``), ``experts_down``
[E, F, D] (``expert``, ``moe_mlp``, ``embed``).
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from asyncrl_jax.models import layers
from asyncrl_jax.models.config import ModelConfig

ROUTE_DTYPE = jnp.int16  # the experts' ids as they travel with a trajectory


def route(logits_ne: jax.Array, k: int, *, norm_topk_prob: bool,
          routes_nk: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Top-k routing of ``N`` tokens over ``E`` experts.

  Args:
    logits_ne: router logits ``[N, E]``.
    k: experts per token.
    norm_topk_prob: renormalise the k weights to sum 1.
    routes_nk: replayed experts ``[N, k]`` (any integer dtype): used instead of the top k.

  Returns:
    ``(experts_nk int32, weights_nk float32, probs_ne float32)``: the chosen experts, their weights
    and the full softmax (for the load-balancing loss).
  """
  probs_ne = jax.nn.softmax(logits_ne.astype(jnp.float32), axis=-1)
  if routes_nk is None:
    weights_nk, experts_nk = jax.lax.top_k(probs_ne, k)
  else:
    experts_nk = routes_nk.astype(jnp.int32)
    weights_nk = jnp.take_along_axis(probs_ne, experts_nk, axis=-1)
  if norm_topk_prob:
    weights_nk = weights_nk / jnp.sum(weights_nk, axis=-1, keepdims=True)
  return experts_nk.astype(jnp.int32), weights_nk, probs_ne


def load_balancing_loss(probs_ne: jax.Array, experts_nk: jax.Array, valid_n: jax.Array) -> tuple[
    jax.Array, jax.Array]:
  """Switch-style auxiliary loss ``E sum_e f_e P_e`` over the valid tokens (``valid_n`` [N] in {0,
  1}): ``f_e`` the fraction of the ``N k`` routing slots that chose expert e, ``P_e`` the mean
  router probability of e (1 when routing is uniform, up to E when one expert takes everything).
  Returns ``(loss, load_e)`` with ``load_e = f_e`` (sums to 1)."""
  e = probs_ne.shape[-1]
  k = experts_nk.shape[-1]
  valid = valid_n.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(valid), 1.0)
  hits_e = jnp.sum(jax.nn.one_hot(experts_nk, e, dtype=jnp.float32) * valid[:, None, None], axis=(0, 1))
  load_e = hits_e / (count * k)
  mean_prob_e = jnp.sum(probs_ne * valid[:, None], axis=0) / count
  return e * jnp.sum(load_e * mean_prob_e), load_e


def experts_grouped(x_nd: jax.Array, experts_nk: jax.Array, weights_nk: jax.Array, gate_edf: jax.Array,
                    up_edf: jax.Array, down_efd: jax.Array) -> jax.Array:
  """The k experts of each token, grouped by expert with ``ragged_dot``: ``[N, D]``."""
  n, k = experts_nk.shape
  num_experts = gate_edf.shape[0]
  flat_e = experts_nk.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)  # sorted slot -> (token, j) slot
  x_sorted = jnp.take(x_nd, order // k, axis=0)  # [N k, D]
  sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
  hidden = (nn.silu(jax.lax.ragged_dot(x_sorted, gate_edf, sizes))
            * jax.lax.ragged_dot(x_sorted, up_edf, sizes))
  y_sorted = jax.lax.ragged_dot(hidden, down_efd, sizes)  # [N k, D]
  y_nkd = jnp.take(y_sorted, jnp.argsort(order), axis=0).reshape(n, k, -1)
  return jnp.einsum("NKD,NK->ND", y_nkd, weights_nk.astype(y_nkd.dtype))


def experts_dense(x_nd: jax.Array, experts_nk: jax.Array, weights_nk: jax.Array, gate_edf: jax.Array,
                  up_edf: jax.Array, down_efd: jax.Array) -> jax.Array:
  """The reference: every expert on every token, combined with the routing weights (0 off the k
  chosen): ``[N, D]``."""
  num_experts = gate_edf.shape[0]
  combine_ne = jnp.sum(jax.nn.one_hot(experts_nk, num_experts, dtype=weights_nk.dtype)
                       * weights_nk[..., None], axis=1)
  hidden = (nn.silu(jnp.einsum("ND,EDF->NEF", x_nd, gate_edf))
            * jnp.einsum("ND,EDF->NEF", x_nd, up_edf))
  y_ned = jnp.einsum("NEF,EFD->NED", hidden, down_efd)
  return jnp.einsum("NED,NE->ND", y_ned, combine_ne.astype(y_ned.dtype))


EXPERT_PATHS = {"ragged": experts_grouped, "dense": experts_dense}


class MoE(nn.Module):
  """``MoE(cfg)(x_btd, valid_bt, routes_btk=None) -> [B, T, D]``; sows ``routes`` ([B, T, k]
  int16) and ``aux`` ((load-balancing loss, load [E], own top k [B, T, k] int16)) into the ``"moe"``
  collection."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_btd, valid_bt, routes_btk=None):
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    d, e, f, k = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    init = nn.initializers.normal(0.02)
    router = layers.param(self, "router", init, (d, e), ("embed", "expert_router"), cfg)
    gate = layers.param(self, "experts_gate", init, (e, d, f), ("expert", "embed", "moe_mlp"), cfg)
    up = layers.param(self, "experts_up", init, (e, d, f), ("expert", "embed", "moe_mlp"), cfg)
    down = layers.param(self, "experts_down", init, (e, f, d), ("expert", "moe_mlp", "embed"), cfg)
    b, t = x_btd.shape[:2]
    x = x_btd.astype(dt)
    logits = jnp.einsum("BTD,DE->BTE", x, router.astype(dt))
    lora = layers.adapter(self, "router", x, (d,), ("embed",), (e,), ("expert_router",), cfg)
    if lora is not None:
      logits = logits + lora
    experts_nk, weights_nk, probs_ne = route(
        logits.reshape(b * t, e), k, norm_topk_prob=cfg.norm_topk_prob,
        routes_nk=None if routes_btk is None else routes_btk.reshape(b * t, k))
    weights_nk = weights_nk.astype(dt)  # as the reference implementation casts them
    y_nd = EXPERT_PATHS[cfg.moe_matmul](x.reshape(b * t, d), experts_nk, weights_nk, gate.astype(dt),
                                        up.astype(dt), down.astype(dt))
    if self.is_mutable_collection("moe"):
      loss, load_e = load_balancing_loss(probs_ne, experts_nk, valid_bt.reshape(-1))
      self.sow("moe", "routes", experts_nk.reshape(b, t, k).astype(ROUTE_DTYPE))
      # the router's own top k, which replay overrides (for the routing mismatch it measures)
      own = experts_nk if routes_btk is None else jax.lax.top_k(probs_ne, k)[1]
      self.sow("moe", "aux", (loss, load_e, own.reshape(b, t, k).astype(ROUTE_DTYPE)))
    return y_nd.reshape(b, t, d)


def route_mismatch(a_btlk: jax.Array, b_btlk: jax.Array, valid_bt: jax.Array) -> jax.Array:
  """The fraction of (valid token, MoE layer) pairs whose two expert sets differ (order ignored):
  how often the learner's router would route a token elsewhere than the decode server did."""
  a, b = jnp.sort(a_btlk.astype(jnp.int32), axis=-1), jnp.sort(b_btlk.astype(jnp.int32), axis=-1)
  differ = jnp.any(a != b, axis=-1).astype(jnp.float32)  # [B, T, L]
  valid = valid_bt.astype(jnp.float32)[..., None] * jnp.ones_like(differ)
  return jnp.sum(differ * valid) / jnp.maximum(jnp.sum(valid), 1.0)
