"""Appending tokens to contexts the engine already holds: JetStream's ``prefill(existing_prefix=...)``
for one prompt, ``extend`` for decode slots (an episode's observation after its action), and
``park`` (a slot that waits for its environment stops decoding but keeps its cache).

``ContextExtension`` is a part of ``engine.Engine``: it reads the engine's config, mesh, slots,
shardings and cache length.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from asyncrl_jax import models
from asyncrl_jax.infra.bucketing import PREFILL_BUCKETS, bounded_traces, bucket


def function(method):
  """A bound method as a plain function (what ``bounded_traces`` wraps)."""
  def call(*args, **kwargs):
    return method(*args, **kwargs)
  return call


@struct.dataclass
class Prefix:
  """A prefilled prompt: its KV cache ``[1, P, K, H]`` per layer and next-token logits ``[1, V]``."""
  cache: Any
  logits: jax.Array
  length: jax.Array  # int32 scalar: true prompt length


class ContextExtension:
  """``extend``, ``park`` and the prefix prefill of ``engine.Engine``."""

  def _set_up_extension(self, batch_ways: int, state) -> None:
    self._batch_ways = batch_ways
    widths = {bucket(n, PREFILL_BUCKETS, cap=self.max_target_length)
              for n in range(1, self.max_target_length + 1)}
    self._jit_extend = jax.jit(bounded_traces(
        function(self._extend_impl), "extend", len(self._extend_rows()) * len(widths)),
        donate_argnums=(1,), in_shardings=(self.served_shardings, state) + (self._replicated,) * 5,
        out_shardings=state)
    self._jit_park = jax.jit(lambda state, mask: state.replace(budget=jnp.where(mask, 0, state.budget)),
                             donate_argnums=(0,), in_shardings=(state, self._replicated),
                             out_shardings=state)
    self._jit_prefill_more = jax.jit(self._prefill_more_impl, static_argnums=(3,))

  def _extend_rows(self) -> list:
    """Row counts an ``extend`` call is padded to: the mesh's batch ways times powers of two, and
    every slot."""
    rows, n = [], self._batch_ways
    while n < self.num_slots:
      rows.append(n)
      n *= 2
    return rows + [self.num_slots]

  def extend(self, params, decode_state: Any, rows: Sequence[Sequence[int]],
             slots: Sequence[int], starts: Sequence[int], budgets: Sequence[int]) -> Any:
    """Appends ``rows[i]`` to slot ``slots[i]``'s context, which holds ``starts[i]`` tokens: their keys
    and values are computed attending to the slot's cache (nothing before ``starts[i]`` is
    recomputed), the slot's next-token logits become those after the last new token, and it may then
    generate ``budgets[i]`` tokens (0: it stays parked). Cache entries at and beyond ``starts[i]``
    (tokens decoded past the end of an action) are overwritten or never read again."""
    if not rows or not len(rows) == len(slots) == len(starts) == len(budgets):
      raise ValueError("extend needs one slot, start and budget per row, and at least one row")
    n = len(rows)
    for i, (row, slot, start, budget) in enumerate(zip(rows, slots, starts, budgets)):
      if not 0 <= slot < self.num_slots:
        raise ValueError(f"slot {slot} outside [0, {self.num_slots})")
      if not len(row) or start < 1:
        raise ValueError(f"row {i}: needs tokens and a context (start={start} >= 1) to extend")
      if start + len(row) + budget > self.max_target_length or budget < 0:
        raise ValueError(f"row {i}: {start} tokens + {len(row)} new + budget {budget} exceed the "
                         f"cache length {self.max_target_length}")
    width = bucket(max(len(r) for r in rows), PREFILL_BUCKETS, cap=self.max_target_length)
    padded = next(r for r in self._extend_rows() if r >= n)
    tokens = np.zeros((padded, width), np.int32)
    lengths = np.ones(padded, np.int32)
    starts_n = np.ones(padded, np.int32)
    slot_ids = np.full(padded, self.num_slots, np.int32)  # padding rows: dropped by the scatter
    budget_n = np.zeros(padded, np.int32)
    for i, (row, slot, start, budget) in enumerate(zip(rows, slots, starts, budgets)):
      tokens[i, :len(row)] = row
      lengths[i], starts_n[i], slot_ids[i], budget_n[i] = len(row), start, slot, budget
    host = jax.device_put((tokens, starts_n, lengths, slot_ids, budget_n), self._replicated)
    return self._jit_extend(params, decode_state, *host)

  def park(self, decode_state: Any, slots: Sequence[int]) -> Any:
    """Stops ``slots`` from generating (budget 0) while they keep their cache and position."""
    mask = np.zeros(self.num_slots, bool)
    mask[list(slots)] = True
    return self._jit_park(decode_state, jax.device_put(mask, self._replicated))

  def _prefill_more_impl(self, params, prefix: Prefix, tokens_1p, true_length: int) -> Prefix:
    held, p = models.cache_length(prefix.cache), tokens_1p.shape[1]
    cache = jax.tree.map(
        lambda c: jnp.zeros((1, held + p) + c.shape[2:], c.dtype).at[:, :held].set(c), prefix.cache)
    j = jnp.arange(p, dtype=jnp.int32)[None]
    positions = jnp.where(j < true_length, prefix.length + j, held + p)  # padding: writes dropped
    logits, cache = models.apply_decode(self.config, params, tokens_1p, positions, cache,
                                        logits_at_b=jnp.full((1,), true_length - 1, jnp.int32))
    return Prefix(cache=cache, logits=logits[:, 0],
                  length=(prefix.length + true_length).astype(jnp.int32))

  def _extend_impl(self, params, state: Any, tokens_nw, starts_n, lengths_n, slots_n,
                   budgets_n) -> Any:
    # the slots' caches gathered (a padding row reads the last slot and writes nothing back), the new
    # tokens decoded at their positions against them, written back into the slots
    sub = jax.tree.map(lambda c: jnp.take(c, slots_n, axis=0, mode="clip"), state.cache)
    j = jnp.arange(tokens_nw.shape[1], dtype=jnp.int32)[None]
    positions = jnp.where(j < lengths_n[:, None], starts_n[:, None] + j, self.max_target_length)
    logits, sub, routes = self._forward(params, tokens_nw, positions, sub, logits_at_b=lengths_n - 1)
    cache = jax.tree.map(lambda c, s: c.at[slots_n].set(s, mode="drop"), state.cache, sub)
    if routes is not None:  # padding columns sit past the cache and padding rows past the slots: dropped
      state = state.replace(routes=state.routes.at[slots_n[:, None], positions].set(routes, mode="drop"))
    return state.replace(cache=cache,
                         logits=state.logits.at[slots_n].set(logits[:, 0], mode="drop"),
                         positions=state.positions.at[slots_n].set(starts_n + lengths_n, mode="drop"),
                         budget=state.budget.at[slots_n].set(budgets_n, mode="drop"),
                         min_left=state.min_left.at[slots_n].set(0, mode="drop"))
