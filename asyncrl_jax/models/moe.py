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
  weights (zero off the chosen k): ``N E`` rows of work; the faster path on the CPU twin;
* ``"megablox"``: as "ragged", each grouped matmul the megablox Pallas kernel (TPU; elsewhere in
  Pallas' interpreter, for tests only): rows padded to its 128-row tile, its own backward kernels.
  Which of "ragged" and "megablox" is faster on a TPU is for the compiled step to say
  (``python -m asyncrl_jax info --compile``).

Expert parallelism: on a mesh with an ``expert`` axis of size P > 1 (``infra.sharding``), each shard
holds E / P experts (and their gradients and AdamW moments) and its own share of the rows (the axis is
a data-parallel one everywhere else). The router runs where the tokens are; then, per shard under
``shard_map`` (``experts_parallel``): the (token, expert) slots sorted by expert, each shard's counts
shared (a tiny ``all_gather``), the rows sent to the shards holding their experts (all-to-all), each
shard's experts run on what it received (grouped or dense, as above), the results sent back by the
reverse all-to-all and combined with the routing weights where the tokens live. Dropless by default:
a shard may receive every slot of every shard (``P x N_local x k`` rows), so its receive buffer has
that size, P times what an even routing needs. ``ModelConfig.moe_capacity_factor`` c > 0 bounds the
exchange instead: a shard sends at most ``C = ceil(c x N_local x k / P)`` slots to each shard (c times
the even share), the valid tokens' slots first in token order, the padding's last; a slot past C is
dropped (that expert adds nothing to its token, the other k - 1 still do) and counted
(``aux``'s dropped fraction, the learner's ``moe_dropped_frac``). The buffers, the exchanged bytes
and the experts' rows shrink by P / c. What is dropped depends on the batch a token travels with, so
a decode server and the learner may drop different slots of one token: a mismatch routing replay
does not remove (it replays experts, not drops); keep c where ``moe_dropped_frac`` stays near 0.
``ModelConfig.moe_exchange`` picks the wire: "padded" (``all_to_all`` of the whole buffer, P x the
routed rows' bytes; what XLA:CPU runs) or "ragged" (``ragged_all_to_all``: the routed rows only;
TPU and GPU). With ``tensor`` > 1 too, each expert's width stays split over it and the expert outputs
are summed over it (``psum``) before they travel back.

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

import functools
import math
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


def _megablox(rows_rd: jax.Array, w_edf: jax.Array, sizes_e: jax.Array) -> jax.Array:
  """``ragged_dot`` by the megablox kernel: rows padded to its 128-row tile (the padding, past every
  group, comes out as whatever the kernel leaves there and is cut off)."""
  from jax.experimental.pallas.ops.tpu.megablox import ops as megablox  # pylint: disable=import-outside-toplevel
  r = rows_rd.shape[0]
  tile = 128
  padded = -(-r // tile) * tile
  x = jnp.pad(rows_rd, ((0, padded - r), (0, 0)))
  on_tpu = jax.devices()[0].platform == "tpu"
  tiling = (tile, min(512, w_edf.shape[1]), min(512, w_edf.shape[2]))
  out = megablox.gmm(x, w_edf, sizes_e, rows_rd.dtype, tiling, None, None, False, not on_tpu)
  return out[:r]


def grouped_matmul(rows_rd: jax.Array, w_edf: jax.Array, sizes_e: jax.Array, kind: str = "ragged") -> jax.Array:
  """Rows sorted by group times their group's matrix (``ragged_dot``, or the megablox kernel)."""
  if kind == "megablox":
    return _megablox(rows_rd, w_edf, sizes_e)
  return jax.lax.ragged_dot(rows_rd, w_edf, sizes_e)


def experts_grouped(x_nd: jax.Array, experts_nk: jax.Array, weights_nk: jax.Array, gate_edf: jax.Array,
                    up_edf: jax.Array, down_efd: jax.Array, kind: str = "ragged") -> jax.Array:
  """The k experts of each token, grouped by expert (``ragged_dot`` or megablox): ``[N, D]``."""
  n, k = experts_nk.shape
  num_experts = gate_edf.shape[0]
  flat_e = experts_nk.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)  # sorted slot -> (token, j) slot
  x_sorted = jnp.take(x_nd, order // k, axis=0)  # [N k, D]
  sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
  hidden = (nn.silu(grouped_matmul(x_sorted, gate_edf, sizes, kind))
            * grouped_matmul(x_sorted, up_edf, sizes, kind))
  y_sorted = grouped_matmul(hidden, down_efd, sizes, kind)  # [N k, D]
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


EXPERT_PATHS = {"ragged": experts_grouped, "dense": experts_dense,
                "megablox": functools.partial(experts_grouped, kind="megablox")}


def _local_experts(rows_rd: jax.Array, ids_r: jax.Array, gate_edf: jax.Array, up_edf: jax.Array,
                   down_efd: jax.Array, matmul: str) -> jax.Array:
  """Each row through the one local expert ``ids_r`` names (``[R, D]``); a row whose id is E (the
  number of local experts: an empty slot of the receive buffer) gives 0."""
  num_experts = gate_edf.shape[0]
  valid_r = ids_r < num_experts
  if matmul == "dense":
    select_re = jax.nn.one_hot(ids_r, num_experts, dtype=rows_rd.dtype)  # all zero for an empty slot
    hidden = (nn.silu(jnp.einsum("RD,EDF->REF", rows_rd, gate_edf))
              * jnp.einsum("RD,EDF->REF", rows_rd, up_edf))
    return jnp.einsum("REF,EFD,RE->RD", hidden, down_efd, select_re)
  order = jnp.argsort(ids_r, stable=True)  # empty slots last, outside every group
  sizes = jnp.bincount(ids_r, length=num_experts).astype(jnp.int32)
  x_sorted = jnp.take(rows_rd, order, axis=0)
  hidden = (nn.silu(grouped_matmul(x_sorted, gate_edf, sizes, matmul))
            * grouped_matmul(x_sorted, up_edf, sizes, matmul))
  y = jnp.take(grouped_matmul(hidden, down_efd, sizes, matmul), jnp.argsort(order), axis=0)
  return jnp.where(valid_r[:, None], y, jnp.zeros_like(y))


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def exchange_capacity(slots: int, shards: int, capacity_factor: float) -> int:
  """The rows one expert shard sends to each other at most (its receive buffer's rows per source):
  ``slots`` (its routing slots: local tokens x k) when ``capacity_factor`` is 0 (dropless: all of
  them may go to one shard), else ``ceil(capacity_factor x slots / shards)`` (capacity_factor times
  the even share), never more than ``slots``."""
  if not capacity_factor:
    return slots
  return max(1, min(slots, math.ceil(capacity_factor * slots / shards)))


def capacity_keep(dest_n: jax.Array, valid_n: jax.Array, capacity: int, shards: int) -> jax.Array:
  """Which routing slots fit their destination shard's ``capacity`` (bool ``[n]``): per destination,
  the valid slots first, in slot (token) order, then the padding's; the first ``capacity`` kept."""
  n = dest_n.shape[0]
  key = dest_n * 2 + (~valid_n).astype(dest_n.dtype)
  order = jnp.argsort(key, stable=True)
  starts = _exclusive_cumsum(jnp.bincount(dest_n, length=shards))
  rank_sorted = jnp.arange(n) - jnp.take(starts, jnp.take(dest_n, order))
  return jnp.zeros((n,), bool).at[order].set(rank_sorted < capacity)


def _send_out(x_sorted: jax.Array, send: jax.Array, send_offsets: jax.Array, recv: jax.Array, cap: int,
              exchange: str) -> jax.Array:
  """(Under ``shard_map``.) This shard's slots, sorted by destination (``send`` to each, from
  ``send_offsets``), to the expert shards: ``[P, cap, D]``, source s's rows in block s."""
  shards, n, d = send.shape[0], x_sorted.shape[0], x_sorted.shape[1]
  if exchange == "ragged":
    slot = jnp.full((shards,), jax.lax.axis_index("expert") * cap, jnp.int32)  # mine in every receiver
    return jax.lax.ragged_all_to_all(x_sorted, jnp.zeros((shards * cap, d), x_sorted.dtype), send_offsets,
                                     send, slot, recv, axis_name="expert").reshape(shards, cap, d)
  j = jnp.arange(cap)
  take = jnp.clip(send_offsets[:, None] + j[None, :], 0, n - 1)
  buf = jnp.where((j[None, :] < send[:, None])[..., None], jnp.take(x_sorted, take, axis=0), 0)
  return jax.lax.all_to_all(buf, "expert", 0, 0, tiled=True).reshape(shards, cap, d)


def _send_back(y: jax.Array, e_sorted: jax.Array, every: jax.Array, send: jax.Array, send_offsets: jax.Array,
               recv: jax.Array, per_shard: int, cap: int, exchange: str) -> jax.Array:
  """(Under ``shard_map``.) The experts' outputs ``y`` (``[P cap, D]``, by source) back to their
  sources, into each source's sorted slots: ``[n, D]``, 0 for a slot that was dropped (expert id E,
  sorted last)."""
  shards, n, d = send.shape[0], e_sorted.shape[0], y.shape[-1]
  if exchange == "ragged":  # straight into the sorted slots, at each source's offset for me
    me = jax.lax.axis_index("expert")
    back_at = jnp.take(_exclusive_cumsum(jnp.sum(every, axis=-1)), me, axis=1)  # where each sent mine from
    return jax.lax.ragged_all_to_all(y, jnp.zeros((n, d), y.dtype), jnp.arange(shards, dtype=jnp.int32) * cap,
                                     recv, back_at.astype(jnp.int32), send, axis_name="expert")
  back = jax.lax.all_to_all(y.reshape(shards, cap, d), "expert", 0, 0, tiled=True)  # [P, cap, D]
  sent = e_sorted < per_shard * shards
  dest = jnp.minimum(e_sorted // per_shard, shards - 1)  # each sorted slot's shard
  r = jnp.clip(jnp.arange(n) - jnp.take(send_offsets, dest), 0, cap - 1)
  return jnp.where(sent[:, None], back[dest, r], 0)


def experts_parallel(x_btd: jax.Array, experts_btk: jax.Array, weights_btk: jax.Array, gate_edf: jax.Array,
                     up_edf: jax.Array, down_efd: jax.Array, *, mesh: jax.sharding.Mesh, matmul: str,
                     exchange: str, valid_bt: Optional[jax.Array] = None,
                     capacity_factor: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """The k experts of each token with the experts split over the mesh's ``expert`` axis (the module
  docstring): ``([B, T, D], dropped)``, equal to ``experts_grouped`` / ``experts_dense`` on one
  device when nothing is dropped. ``dropped``: the number of valid tokens' routing slots (``valid_bt``,
  default all) that did not fit the exchange's capacity (``capacity_factor``; 0: none, dropless)."""
  from asyncrl_jax.infra.sharding import BATCH_AXES  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  shards = int(mesh.shape["expert"])
  num_experts = gate_edf.shape[0]
  if num_experts % shards:
    raise ValueError(f"{num_experts} experts do not split over the mesh's expert axis of size {shards}")
  per_shard = num_experts // shards
  tensor = int(mesh.shape.get("tensor", 1))
  rows = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1) or None
  width = "tensor" if tensor > 1 else None
  if valid_bt is None:
    valid_bt = jnp.ones(x_btd.shape[:2], bool)

  def local(x, experts, weights, valid, gate, up, down):
    b, t, d = x.shape
    k = experts.shape[-1]
    n = b * t * k  # this shard's routing slots
    cap = exchange_capacity(n, shards, capacity_factor)  # the most it sends to any one shard
    flat_e = experts.reshape(-1).astype(jnp.int32)
    valid_n = jnp.repeat(valid.reshape(-1).astype(bool), k)
    if cap < n:
      keep = capacity_keep(flat_e // per_shard, valid_n, cap, shards)
      flat_e = jnp.where(keep, flat_e, num_experts)  # a dropped slot: expert E, sorted last, sent nowhere
      dropped = jnp.sum(valid_n & ~keep)
    else:
      dropped = jnp.zeros((), jnp.int32)
    order = jnp.argsort(flat_e, stable=True)  # slots sorted by expert, so by destination shard
    x_sorted = jnp.take(x.reshape(b * t, d), order // k, axis=0)  # [n, D]
    counts = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32).reshape(shards, per_shard)
    every = jax.lax.all_gather(counts, "expert")  # [source, destination, local expert]
    me = jax.lax.axis_index("expert")
    send = jnp.sum(counts, axis=-1)  # [P] slots to each shard (<= cap)
    send_offsets = _exclusive_cumsum(send)
    received = jnp.take(every, me, axis=1)  # [P, per_shard]: what each source sends me, by expert
    recv = jnp.sum(received, axis=-1)
    got = _send_out(x_sorted, send, send_offsets, recv, cap, exchange)  # [P, cap, D]
    # row j from source s is for my local expert e when it falls in e's part of s's rows
    j = jnp.arange(cap)
    ends = jnp.cumsum(received, axis=-1)  # [P, per_shard]
    ids = jnp.sum(j[None, :, None] >= ends[:, None, :], axis=-1)  # == per_shard past the last one
    y = _local_experts(got.reshape(shards * cap, d), ids.reshape(-1), gate, up, down, matmul)
    if width is not None:
      y = jax.lax.psum(y, "tensor")  # each expert's width was split over tensor
    y_sorted = _send_back(y, jnp.take(flat_e, order), every, send, send_offsets, recv, per_shard, cap,
                          exchange)  # [n, D]
    y_slots = jnp.take(y_sorted, jnp.argsort(order), axis=0).reshape(b * t, k, d)
    out = jnp.einsum("NKD,NK->ND", y_slots, weights.reshape(b * t, k).astype(y_slots.dtype))
    if rows is not None:
      dropped = jax.lax.psum(dropped, rows)
    return out.reshape(b, t, d), dropped

  spec_rows = P(rows, None, None)
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(spec_rows, spec_rows, spec_rows, P(rows, None), P("expert", None, width),
                                 P("expert", None, width), P("expert", width, None)),
                       out_specs=(spec_rows, P()),
                       check_vma=False,  # (the megablox kernel's outputs carry no varying-axes types)
                       )(x_btd, experts_btk, weights_btk, valid_bt, gate_edf, up_edf, down_efd)


def expert_shards(mesh: Optional[jax.sharding.Mesh]) -> int:
  """The size of ``mesh``'s ``expert`` axis (1 without a mesh or the axis)."""
  return 1 if mesh is None else int(dict(mesh.shape).get("expert", 1))


class MoE(nn.Module):
  """``MoE(cfg, mesh)(x_btd, valid_bt, routes_btk=None) -> [B, T, D]``; sows ``routes`` ([B, T, k]
  int16) and ``aux`` ((load-balancing loss, load [E], own top k [B, T, k] int16, the fraction of
  valid tokens' routing slots dropped by the exchange's capacity)) into the ``"moe"`` collection. With a ``mesh`` whose ``expert`` axis is > 1, the experts run expert-parallel."""

  cfg: ModelConfig
  mesh: Optional[jax.sharding.Mesh] = None

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
    if expert_shards(self.mesh) > 1:
      y_btd, dropped = experts_parallel(
          x, experts_nk.reshape(b, t, k), weights_nk.reshape(b, t, k), gate.astype(dt), up.astype(dt),
          down.astype(dt), mesh=self.mesh, matmul=cfg.moe_matmul, exchange=cfg.moe_exchange,
          valid_bt=valid_bt, capacity_factor=cfg.moe_capacity_factor)
      y_nd = y_btd.reshape(b * t, d)
    else:
      dropped = jnp.zeros((), jnp.int32)
      y_nd = EXPERT_PATHS[cfg.moe_matmul](x.reshape(b * t, d), experts_nk, weights_nk, gate.astype(dt),
                                          up.astype(dt), down.astype(dt))
    if self.is_mutable_collection("moe"):
      loss, load_e = load_balancing_loss(probs_ne, experts_nk, valid_bt.reshape(-1))
      self.sow("moe", "routes", experts_nk.reshape(b, t, k).astype(ROUTE_DTYPE))
      # the router's own top k, which replay overrides (for the routing mismatch it measures)
      own = experts_nk if routes_btk is None else jax.lax.top_k(probs_ne, k)[1]
      slots = jnp.maximum(jnp.sum(valid_bt.astype(jnp.float32)) * k, 1.0)
      self.sow("moe", "aux", (loss, load_e, own.reshape(b, t, k).astype(ROUTE_DTYPE),
                              dropped.astype(jnp.float32) / slots))
    return y_nd.reshape(b, t, d)


def route_mismatch(a_btlk: jax.Array, b_btlk: jax.Array, valid_bt: jax.Array) -> jax.Array:
  """The fraction of (valid token, MoE layer) pairs whose two expert sets differ (order ignored):
  how often the learner's router would route a token elsewhere than the decode server did."""
  a, b = jnp.sort(a_btlk.astype(jnp.int32), axis=-1), jnp.sort(b_btlk.astype(jnp.int32), axis=-1)
  differ = jnp.any(a != b, axis=-1).astype(jnp.float32)  # [B, T, L]
  valid = valid_bt.astype(jnp.float32)[..., None] * jnp.ones_like(differ)
  return jnp.sum(differ * valid) / jnp.maximum(jnp.sum(valid), 1.0)
